"""Dev probe: where examples/hf_llama.py's forward time goes with pyattn against SDPA (the example's
timing read pyattn 2.23 ms against SDPA 2.01 for a (2, 2048) forward of its 2-layer model).

For each backend: the forward's wall time (10 calls, then a sync), its GPU time (CUDA events), and
the attention function's own host time per call (perf_counter around it, no sync). For pyattn also
the kernel's GPU time alone on the layer's tensors, and a cProfile of 200 calls of the layer's
attention (top functions by own time): what a call costs on the host with HF's tensors (a
transposed query view, cache-layout K/V, a torch ``out=`` view).

Usage: PYTHONPATH=. python dev/probe_hf_call.py [--seq 2048] [--batch 2]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import pyattn

TIMES = {}
CALLS = []


def main() -> None:
    arg = lambda name, default: int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default  # noqa: E731
    seq, batch = arg("--seq", 2048), arg("--batch", 2)
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM, LlamaConfig
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa_attention_forward = ALL_ATTENTION_FUNCTIONS["sdpa"]

    sys.path.insert(0, "examples")
    from hf_llama import pyattn_attention

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            TIMES.setdefault(name, []).append(time.perf_counter() - t)
            if name == "pyattn" and len(CALLS) < 1:
                CALLS.append((a, k))
            return r
        return wrapper

    AttentionInterface.register("pyattn_t", timed("pyattn", pyattn_attention))
    AttentionMaskInterface.register("pyattn_t", sdpa_mask)
    AttentionInterface.register("sdpa_t", timed("sdpa", sdpa_attention_forward))
    AttentionMaskInterface.register("sdpa_t", sdpa_mask)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    for impl in ("sdpa_t", "pyattn_t", "sdpa_t", "pyattn_t"):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            for _ in range(3):
                model(x, use_cache=False)
            torch.cuda.synchronize()
            TIMES.clear()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            a.record()
            for _ in range(10):
                model(x, use_cache=False)
            b.record()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 10 * 1e3
        host = {k: sum(v) / len(v) * 1e6 for k, v in TIMES.items()}
        print(f"{impl:9s} forward wall {wall:.3f} ms, GPU {a.elapsed_time(b) / 10:.3f} ms; attention host "
              + ", ".join(f"{k} {v:.1f} us/call" for k, v in host.items()), flush=True)
    (module, q, k, v, mask), kw = CALLS[0][0][:5], CALLS[0][1]
    print(f"layer call: q {tuple(q.shape)} strides {q.stride()}, k {tuple(k.shape)} strides {k.stride()}, "
          f"mask {None if mask is None else (tuple(mask.shape), mask.dtype)}, kwargs {sorted(kw)}", flush=True)
    with torch.inference_mode():
        call = lambda: pyattn_attention(module, q, k, v, mask, **kw)  # noqa: E731
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50):
            call()
        b.record()
        torch.cuda.synchronize()
        print(f"pyattn layer call alone: {a.elapsed_time(b) / 50 * 1e3:.1f} us GPU a call (50 back to back)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            call()
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

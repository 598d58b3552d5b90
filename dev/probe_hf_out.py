"""Dev probe: a transformers Llama's greedy decode steps with pyattn as its attention backend, the
result handed back through ``torch.from_dlpack`` (and transposed, as the example did) against
written into a torch ``out=`` in transformers' layout (``examples/hf_llama.py`` now), and torch SDPA;
alternating rounds, ms a token.

Usage: PYTHONPATH=. python dev/probe_hf_out.py [--rounds 3] [--tokens 64]
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import hf_llama  # noqa: E402  (its backend: pyattn writes into a torch out=)

import pyattn  # noqa: E402


def via_dlpack(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The example's backend as it was: a DeviceArray result, then torch.from_dlpack and a transpose."""
    import torch

    if attention_mask is None:
        causal, mask = kwargs.get("is_causal"), None
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    else:
        causal, mask = False, attention_mask[..., : key.shape[-2]]
    out = pyattn.attention(query, key, value, layout="bhsd", scale=scaling, causal=causal, mask=mask)
    return torch.from_dlpack(out).transpose(1, 2), None


def main():
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM, LlamaConfig
    from transformers.masking_utils import sdpa_mask

    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    n = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 64
    for name, fn in (("pyattn_out", hf_llama.pyattn_attention), ("pyattn_dlpack", via_dlpack)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 12), device="cuda")
    gen = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n, min_new_tokens=n,
               pad_token_id=0)
    times = {}
    for r in range(rounds + 1):
        for impl in ("sdpa", "pyattn_dlpack", "pyattn_out"):
            model.set_attn_implementation(impl)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(prompt, **gen)
            torch.cuda.synchronize()
            if r:  # round 0 warms up
                times.setdefault(impl, []).append((time.perf_counter() - t) / n * 1e3)
    for impl, ts in times.items():
        print(f"{impl:14s} ms a token: best {min(ts):.3f}, all {' '.join(f'{x:.3f}' for x in ts)}")


if __name__ == "__main__":
    main()

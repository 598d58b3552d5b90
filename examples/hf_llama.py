"""A Hugging Face transformers Llama running its attention on pyattn.

A small random bf16 Llama (2 layers, hidden 256, 8 query heads sharing 2 KV heads, head_dim 64,
vocab 1000; from a ``LlamaConfig``, nothing downloaded) gets pyattn as a registered attention
backend and is checked against the same model on torch SDPA: (a) prefill logits, also for a
left-padded batch (the mask path); (b) greedy ``generate`` of 16 tokens (decode steps: one query
over the KV cache, bottom-right causal). A forward pass is timed both ways (informative only). The
backend hands pyattn a torch ``out=`` in transformers' layout: no export, no copy.

Run (pyattn, torch and transformers >= 5 installed, a CUDA GPU): ``python examples/hf_llama.py``.
Exit status 0 on success (or ``skipped: ...``), 1 with ``FAILED: ...``.
"""

import copy
import importlib.util
import sys
import time

try:
    import pyattn
except ImportError as exc:
    sys.exit(f"error: cannot import pyattn ({exc}); run `pip install -e .` in the repository first")

SEEN = []  # (query heads, key heads) of each call: proves pyattn ran, and that GQA K/V come un-repeated


def pyattn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D) as the KV cache holds them (transformers repeats
    GQA heads only inside its own sdpa/eager functions) -> ((B, Sq, Hq, D), None)."""
    if dropout:
        raise NotImplementedError("pyattn_attention has no dropout: call model.eval()")
    SEEN.append((query.shape[1], key.shape[1]))
    if attention_mask is None:  # no padding: causal; bottom-right, so a decode step (Sq = 1) sees every key
        causal, mask = kwargs.get("is_causal"), None
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    else:  # sdpa_mask's bool (B, 1, Sq, Sk), True = attend (or an additive float mask): causality included
        causal, mask = False, attention_mask[..., : key.shape[-2]]
    # The result goes into a torch tensor in transformers' (B, Sq, Hq, D) order through its (B, Hq, Sq, D)
    # view: no export (torch.from_dlpack costs 25-35 us a call) and nothing for the reshape to copy.
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    pyattn.attention(query, key, value, layout="bhsd", scale=scaling, causal=causal, mask=mask,
                     out=out.transpose(1, 2))
    return out, None


def check(ok, what):
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok    {what}")


def main():
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"skipped: {' and '.join(missing)} not installed (pip install torch 'transformers>=5')")
        return
    if pyattn.device_count() == 0:  # before importing torch: fast, and compiles nothing
        print("skipped: no CUDA GPU (pyattn.device_count() == 0)")
        return
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM, LlamaConfig
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("pyattn", pyattn_attention)
    # Without a mask function of the same name, transformers always passes attention_mask=None to a
    # custom backend: padding would be silently ignored. sdpa_mask gives bool masks, or None if causal.
    AttentionMaskInterface.register("pyattn", sdpa_mask)

    # initializer_range 0.08 (not 0.02): scores are O(1) and the softmax is peaked, so a wrong scale,
    # mask or causal alignment would move the logits far beyond bf16 rounding noise.
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      initializer_range=0.08)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    ref = copy.deepcopy(model).float()  # the same weights in float32: the yardstick

    def logits(m, impl, ids, mask=None):
        m.set_attn_implementation(impl)
        with torch.inference_mode():
            return m(ids, attention_mask=mask, use_cache=False).logits.float()

    # (a) Tolerance: bf16 keeps 8 significant bits; the backends differ by about one rounding of each
    # attention output, carried through o_proj, residual adds, RMSNorm, MLP, 2 layers and lm_head
    # (each rounding to bf16 again): a few ulps, ~1-2% of the largest logit. 5% of it leaves margin;
    # a wrong scale, mask or head mapping moves logits by tens of percent. Second rule
    # (FlashAttention's): pyattn's model is at most 2x as far from the float32 model as SDPA's.
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    l_sd, l_32 = logits(model, "sdpa", ids), logits(ref, "eager", ids)
    l_pa = logits(model, "pyattn", ids)
    check(len(SEEN) == cfg.num_hidden_layers and SEEN[0] == (8, 2),
          f"pyattn ran in every layer, with un-repeated GQA key/value: (query, key heads) = {SEEN[:1]}")
    scale = l_sd.abs().max().item()
    tol = 5e-2 * scale
    d0, e_pa, e_sd = ((a - b).abs().max().item() for a, b in ((l_pa, l_sd), (l_pa, l_32), (l_sd, l_32)))
    check(d0 <= tol, f"prefill logits {tuple(l_pa.shape)}: max |pyattn - sdpa| {d0:.4f} <= {tol:.4f} (5% of max)")
    check(e_pa <= 2 * e_sd + scale / 256, f"vs float32: pyattn err {e_pa:.4f} <= 2 x sdpa err {e_sd:.4f} + 2^-8 scale")
    am = torch.ones_like(ids)
    am[1, :16] = 0  # row 1 left-padded: the mask path (a bool (B, 1, S, S) from sdpa_mask)
    d = (logits(model, "pyattn", ids, am) - logits(model, "sdpa", ids, am))[am.bool()].abs().max().item()
    check(d <= tol, f"left-padded batch, non-pad positions: max |pyattn - sdpa| {d:.4f} <= {tol:.4f}")

    # (b) Greedy generation: logits compared at every step while both runs share the prefix. A token
    # may differ only at a near-tie: sdpa's top-2 gap within twice the backends' noise measured on
    # the prefill (d0) or one bf16 ulp of the top logit; the continuations then legitimately differ.
    prompt, n, runs = torch.randint(0, cfg.vocab_size, (4, 12), device="cuda"), 16, {}
    for impl in ("sdpa", "pyattn"):
        model.set_attn_implementation(impl)
        g = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        runs[impl] = g.sequences[:, prompt.shape[1]:], torch.stack(g.logits, 1).float()
    (t_sd, g_sd), (t_pa, g_pa) = runs["sdpa"], runs["pyattn"]
    for b in range(prompt.shape[0]):
        diff = (t_sd[b] != t_pa[b]).nonzero()
        first = int(diff[0]) if len(diff) else n
        dmax = (g_pa[b, : first + 1] - g_sd[b, : first + 1]).abs().max().item()
        check(dmax <= tol, f"generate row {b}: first {first}/{n} tokens equal, logits max diff {dmax:.4f} <= {tol:.4f}")
        if first < n:
            top = g_sd[b, first].topk(2).values
            gap, ulp = (top[0] - top[1]).item(), 2.0 ** (torch.floor(torch.log2(top[0].abs())).item() - 7)
            check(gap <= 2 * max(d0, ulp), f"  token {first} differs at a near-tie: sdpa's top-2 gap {gap:.4f} "
                  f"<= 2 x max(prefill diff, bf16 ulp) = {2 * max(d0, ulp):.4f}")

    x = torch.randint(0, cfg.vocab_size, (2, 2048), device="cuda")  # timing (informative)
    for impl in ("sdpa", "pyattn"):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            model(x, use_cache=False)  # warm-up: the first pyattn call of a shape may compile a kernel
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                model(x, use_cache=False)
            torch.cuda.synchronize()
        print(f"time  forward (2, 2048) with {impl:6s}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

"""fp8 attention from torch: quantize q, k, v to e4m3 with per-tensor scales, run pyattn on the codes,
get bfloat16 back into torch.

1. torch makes bf16 q, k, v (a GQA layer: 32 query heads, 8 KV heads, head_dim 128), and quantizes
   each to ``torch.float8_e4m3fn`` codes with a descale factor (amax / 448), as an fp8 inference
   stack does. ``pyattn.attention(q8, k8, v8, descale_q=, descale_k=, descale_v=, causal=True)``
   reads the torch tensors in place, on torch's current stream, and returns bfloat16, which
   ``torch.from_dlpack`` takes without a copy.
2. Checks: against pyattn's float64 reference of the codes' values with the fp8 tolerance rule
   (``pyattn.reference.fp8_error_bound``: 2x a naive fp8 attention, plus a floor), and how far the
   fp8 result is from torch SDPA on the bf16 inputs before quantization (printed, for scale).

Needs an sm_90a GPU (H100 / H200) and torch. Run: ``python examples/fp8_prefill.py``.
Exit status 0 on success (or ``skipped: ...``), 1 with ``FAILED: ...``.
"""

import importlib.util
import sys

import numpy as np

try:
    import pyattn
except ImportError as exc:
    sys.exit(f"error: cannot import pyattn ({exc}); run `pip install -e .` in the repository first")

B, S, HQ, HKV, D = 1, 1024, 32, 8, 128


def check(ok, what):
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok    {what}")


def main():
    if importlib.util.find_spec("torch") is None:
        print("skipped: torch is not installed")
        return
    if pyattn.device_count() == 0:
        print("skipped: no CUDA GPU (pyattn.device_count() == 0)")
        return
    if pyattn.get_device().arch != "sm_90a":
        print(f"skipped: fp8 attention runs on sm_90a (H100 / H200), this GPU is {pyattn.get_device().arch}")
        return
    import ml_dtypes
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (HQ, HKV, HKV))
    codes, scales = [], []
    for x in (q, k, v):  # per-tensor e4m3 quantization, as an fp8 serving stack keeps its activations
        d = x.abs().amax().float().item() / 448.0
        codes.append((x.float() / d).to(torch.float8_e4m3fn))
        scales.append(d)
    out = pyattn.attention(*codes, causal=True, descale_q=scales[0], descale_k=scales[1], descale_v=scales[2])
    o = torch.from_dlpack(out)
    check(o.dtype == torch.bfloat16 and o.shape == q.shape and o.data_ptr() == out.ptr,
          f"bf16 result back in torch zero-copy, shape {tuple(o.shape)}")

    host = [c.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn) for c in codes]
    ref = pyattn.reference.attention_fp8_ref(*host, descale=scales, causal=True)
    err = np.abs(o.float().cpu().numpy() - ref).max()
    bound = pyattn.reference.fp8_error_bound(*host, descale=scales, causal=True)
    check(err <= bound, f"fp8 against the float64 reference of its values: max err {err:.2e} <= bound {bound:.2e}")
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True, enable_gqa=True).transpose(1, 2)
    diff = (o.float() - sdpa.float()).abs()
    print(f"info  fp8 against torch SDPA on the bf16 inputs (quantization included): max diff "
          f"{diff.max().item():.2e}, mean {diff.mean().item():.2e}")


if __name__ == "__main__":
    main()

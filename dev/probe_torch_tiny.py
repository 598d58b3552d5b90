"""Where the host time of a tiny attention call on torch tensors goes, on a GPU host (issue 11).

Usage: PYTHONPATH=. python dev/probe_torch_tiny.py

(1, 16, 2, 64) fp16 tensors written by torch: wall time per call of a loop with one sync, for
DeviceArray inputs, torch inputs (stream=None: torch's current stream) and torch SDPA; then the
cost of each torch attribute the call reads, and a cProfile of 5,000 torch-input calls (tottime).
"""

from __future__ import annotations

import cProfile
import pstats
import time
import timeit

import numpy as np
import torch

import pyattn


def per_call_us(fn, n=2000, reps=5) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / n * 1e6)
    return float(np.median(best))


def main() -> None:
    t = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    d = pyattn.asarray(t)
    th = t.transpose(1, 2)
    print(f"DeviceArray {per_call_us(lambda: pyattn.attention(d, d, d)):.1f} us; torch "
          f"{per_call_us(lambda: pyattn.attention(t, t, t)):.1f} us; SDPA "
          f"{per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(th, th, th)):.1f} us")
    for expr in ("t.shape", "t.dtype", "t.stride()", "t.get_device()", "t.data_ptr()", "t.is_cuda",
                 "torch._C._cuda_getCurrentRawStream(0)", "type(t)"):
        us = min(timeit.repeat(expr, globals={"t": t, "torch": torch}, number=20000, repeat=5)) / 20000 * 1e6
        print(f"  {expr:40} {us:.3f} us")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5000):
        pyattn.attention(t, t, t)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()

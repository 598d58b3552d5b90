"""Where the host time of a NumPy decode step goes on a GPU host (issue 11's NumPy decode target).

Usage: PYTHONPATH=. python dev/probe_numpy_decode.py

The decode of scripts/bench_boundary.py (one sequence, 32k bf16 tokens, Hq 32, Hkv 8, D 128, NumPy
q): wall time per call of ``pyattn.decode(numpy q)`` and of its floor (pinned H2D of q, the decode
on device q, pinned D2H, one synchronisation), 7 repeats of 50 calls, alternating; then a cProfile
of 300 NumPy calls (own time, top 25) and the same for the floor's device decode.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import ml_dtypes
import numpy as np
from cuda.bindings import driver

import pyattn


def per_call_us(fn, n=50, reps=7, sync=None) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if sync:
            sync()
        ts.append((time.perf_counter() - t) / n * 1e6)
    return float(np.median(ts))


def main() -> None:
    dev = pyattn.get_device()
    dev.activate()
    s = pyattn.Stream(dev)
    rng = np.random.default_rng(1)
    cache = pyattn.PagedKVCache(2048 + 64, 16, 8, 128, "bfloat16")
    sid = cache.add_sequence()
    kv = rng.standard_normal((1, 32768, 8, 128)).astype(ml_dtypes.bfloat16)
    cache.append([sid], kv, kv, stream=s)
    qh = rng.standard_normal((1, 1, 32, 128)).astype(ml_dtypes.bfloat16)
    pin_q, pin_o = pyattn.pinned_empty(qh.shape, qh.dtype), pyattn.pinned_empty(qh.shape, qh.dtype)
    dq = pyattn.asarray(qh, stream=s)

    def floor():
        driver.cuMemcpyHtoDAsync(dq.ptr, pin_q.__array_interface__["data"][0], qh.nbytes, s.handle)
        o = pyattn.decode(dq, cache, [sid], stream=s)
        driver.cuMemcpyDtoHAsync(pin_o.__array_interface__["data"][0], o.ptr, qh.nbytes, s.handle)
        s.synchronize()

    def numpy_call():
        pyattn.decode(qh, cache, [sid], stream=s)

    def device_only():
        pyattn.decode(dq, cache, [sid], stream=s)

    for _ in range(3):
        print(f"NumPy decode {per_call_us(numpy_call):7.1f} us/call; floor {per_call_us(floor):7.1f}; "
              f"device decode alone (one sync per 50) {per_call_us(device_only, sync=s.synchronize):7.1f}")
    for name, fn in (("NumPy decode", numpy_call), ("floor", floor)):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            fn()
        pr.disable()
        print(f"== cProfile, 300 calls of the {name} (tottime)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

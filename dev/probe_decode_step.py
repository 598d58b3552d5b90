"""A serving loop's decode step as users write it: append one token's K/V to each sequence, then
decode, on a PagedKVCache (bf16, page 16, GQA 32/8, D 128). Host time per step (wall of a loop of
steps and one sync; the GPU is far from busy at these sizes) against decode alone (tables cached)
and append alone, at B = 1, 8, 64 over 1k-token prefixes. (The step's GPU time: dev/probe_step_gpu.py;
a loop of steps timed by events here read the host's time, not the GPU's.)

Usage: PYTHONPATH=. python dev/probe_decode_step.py [--steps N] [--profile] [--micro] [--torch]
(``--micro``: first the host cost of an append's pieces: a small upload, pool allocation, events;
``--torch``: instead, a step's torch-side costs at B = 8: torch inputs against DeviceArrays, from_dlpack)
"""
import argparse
import time

import ml_dtypes
import numpy as np

import pyattn
from pyattn.runtime.stream import default_stream


def per_call_us(fn, n: int, sync, *, warmup: int = 20, host_only: bool = False) -> float:
    """Wall us per call of a loop of ``n`` calls of ``fn`` after ``warmup`` more and a ``sync()``;
    the final ``sync()`` is inside the timed span unless ``host_only`` (then the figure is the
    loop's submit time alone, with the launch queue far from full)."""
    for _ in range(warmup):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if not host_only:
        sync()
    r = (time.perf_counter() - t) / n * 1e6
    sync()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--profile", action="store_true", help="also a cProfile of B = 8 steps")
    opts = ap.parse_args()
    dev = pyattn.get_device()
    rng = np.random.default_rng(0)
    for B in (1, 8, 64):
        pages = B * (2048 + 3 * opts.steps) // 16 + 64
        cache = pyattn.PagedKVCache(pages, 16, 8, 128, "bfloat16")
        ids = [cache.add_sequence() for _ in range(B)]
        lens = rng.integers(900, 1100, B)
        for i, n in zip(ids, lens):
            kv = rng.standard_normal((1, int(n), 8, 128)).astype(ml_dtypes.bfloat16)
            cache.append([i], kv, kv)
        q = pyattn.asarray(rng.standard_normal((B, 1, 32, 128)).astype(ml_dtypes.bfloat16))
        kn = pyattn.asarray(rng.standard_normal((B, 1, 8, 128)).astype(ml_dtypes.bfloat16))

        def step():
            cache.append(ids, kn, kn)
            return pyattn.decode(q, cache, ids)

        timed = lambda fn, n: per_call_us(fn, n, dev.synchronize)  # noqa: E731

        n = opts.steps
        st = timed(step, n)
        ap_ = timed(lambda: cache.append(ids, kn, kn), n)
        de = timed(lambda: pyattn.decode(q, cache, ids), n)
        if opts.profile and B == 8:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                step()
            pr.disable()
            dev.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        print(f"B={B:3d}: append + decode step {st:7.1f} us | append alone {ap_:7.1f} | decode alone (tables cached) "
              f"{de:6.1f} us")


def micro():
    """Host cost of the pieces of an append on this host: a small upload, its parts, a launch."""
    from cuda.bindings import driver

    from pyattn.pipeline.host import upload
    from pyattn.runtime.memory import get_pool

    dev = pyattn.get_device()
    s = default_stream(dev)
    items = np.arange(48, dtype=np.int32)
    ev = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]

    us = lambda fn: per_call_us(fn, 3000, dev.synchronize, warmup=200, host_only=True)  # noqa: E731

    pool = get_pool(dev)
    print(f"upload of 192 bytes {us(lambda: upload([items], dev, s)):.2f} us | pool allocate + free "
          f"{us(lambda: pool.allocate(256, s)):.2f} | cuEventRecord {us(lambda: driver.cuEventRecord(ev, s.handle)):.2f}"
          f" | cuEventQuery {us(lambda: driver.cuEventQuery(ev)):.2f}")


def torch_costs():
    """The torch side of a step at B = 8: appends and decodes with torch tensors against
    DeviceArrays, torch.from_dlpack of the result, torch's own normal_ of the new K / V."""
    import torch

    dev = pyattn.get_device()
    B = 8
    cache = pyattn.PagedKVCache(B * 200, 16, 8, 128, "bfloat16")
    ids = [cache.add_sequence() for _ in range(B)]
    kv = torch.randn(B, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache.append(ids, kv, kv)
    tq = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    tk = torch.randn(B, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    dq, dk = pyattn.asarray(tq), pyattn.asarray(tk)
    dev.synchronize()
    torch.cuda.synchronize()

    def sync():
        torch.cuda.synchronize()
        dev.synchronize()

    us = lambda fn: per_call_us(fn, 600, sync, warmup=50)  # noqa: E731

    out = pyattn.decode(dq, cache, ids)
    rows = [("tk.normal_()", lambda: tk.normal_()),
            ("append, DeviceArray k / v", lambda: cache.append(ids, dk, dk)),
            ("append, torch k / v", lambda: cache.append(ids, tk, tk)),
            ("decode, DeviceArray q", lambda: pyattn.decode(dq, cache, ids)),
            ("decode, torch q", lambda: pyattn.decode(tq, cache, ids)),
            ("torch.from_dlpack(out)", lambda: torch.from_dlpack(out)),
            ("decode, torch q, from_dlpack", lambda: torch.from_dlpack(pyattn.decode(tq, cache, ids)))]
    for name, fn in rows:
        print(f"  {name:32} {us(fn):7.1f} us")


if __name__ == "__main__":
    import sys

    if "--micro" in sys.argv:
        sys.argv.remove("--micro")
        micro()
    if "--torch" in sys.argv:
        torch_costs()
    else:
        main()

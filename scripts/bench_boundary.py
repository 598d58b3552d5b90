"""The array boundary's cost: host time of tiny calls for every input kind, NumPy against its floor.

Usage: PYTHONPATH=. python scripts/bench_boundary.py [--json out.json]

1. Host time per tiny call, (1, 16, 2, 64) fp16: a loop of calls without synchronisation, wall time
   per call (the kernels are shorter than the host work, so the host is what is timed), median of 5
   loops; for ``DeviceArray``, torch (torch's current stream; an explicit stream; ``out=`` a torch
   tensor; the result taken back with ``torch.from_dlpack``), CuPy, and torch SDPA's own tiny call
   in the same process. Targets: <= 20 us (10 us aimed at); ``decode(q, cache, ids)`` <= 25 us.
2. NumPy in/out against the pinned-copy floor: (1, 4096, 16, 128) fp16 attention (floor: H2D of
   q, k, v plus D2H of out from pinned memory), and a decode step over a 32k-token bf16 cache
   (floor: pinned H2D of q, the kernel, pinned D2H of out, one synchronisation). Target <= 1.5x.
3. ``import torch`` after a compile in a fresh process (the defect of NVRTC writing into CPython's
   shared ``b" "``, fixed by giving NVRTC fresh ``bytearray`` buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def per_call_us(fn, n=2000, loops=5, sync=None) -> float:
    for _ in range(200):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        if sync:
            sync()
    return float(np.median(times))


def median_ms(fn, n=9) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def host_costs() -> dict:
    import ml_dtypes
    import torch
    import torch.nn.functional as F

    import pyattn

    rng = np.random.default_rng(0)
    shape = (1, 16, 2, 64)
    h = rng.standard_normal(shape).astype(np.float16)
    d = pyattn.asarray(h)
    t = torch.from_numpy(h).cuda()
    t_out = torch.empty_like(t)
    torch.cuda.synchronize()
    res = {}
    s = pyattn.Stream()
    res["DeviceArray, pyattn stream"] = per_call_us(lambda: pyattn.attention(d, d, d), sync=pyattn.get_device().synchronize)
    res["torch, stream=None (torch's)"] = per_call_us(lambda: pyattn.attention(t, t, t), sync=torch.cuda.synchronize)
    res["torch, out=torch"] = per_call_us(lambda: pyattn.attention(t, t, t, out=t_out), sync=torch.cuda.synchronize)
    res["torch, explicit pyattn stream"] = per_call_us(lambda: pyattn.attention(t, t, t, stream=s),
                                                       sync=lambda: (s.synchronize(), torch.cuda.synchronize()))
    res["torch in, torch.from_dlpack(out)"] = per_call_us(lambda: torch.from_dlpack(pyattn.attention(t, t, t)),
                                                          sync=torch.cuda.synchronize)
    tb = t.transpose(1, 2)
    res["torch SDPA tiny (same run)"] = per_call_us(lambda: F.scaled_dot_product_attention(tb, tb, tb),
                                                    sync=torch.cuda.synchronize)
    try:
        import cupy

        c = cupy.asarray(h)
        res["CuPy (CAI v3)"] = per_call_us(lambda: pyattn.attention(c, c, c), sync=pyattn.get_device().synchronize)
    except ImportError:
        pass
    cache = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16")
    ids = [cache.add_sequence() for _ in range(2)]
    kv = rng.standard_normal((2, 256, 2, 64)).astype(ml_dtypes.bfloat16)
    cache.append(ids, kv, kv)
    qd = pyattn.asarray(rng.standard_normal((2, 1, 8, 64)).astype(ml_dtypes.bfloat16))
    tq = torch.from_dlpack(qd).clone()
    res["decode(q, cache, ids), DeviceArray q"] = per_call_us(lambda: pyattn.decode(qd, cache, ids),
                                                             sync=pyattn.get_device().synchronize)
    res["decode(q, cache, ids), torch q"] = per_call_us(lambda: pyattn.decode(tq, cache, ids), sync=torch.cuda.synchronize)
    return res


def numpy_floors() -> dict:
    import ml_dtypes
    from cuda.bindings import driver as drv

    import pyattn
    from pyattn.runtime.errors import check
    from pyattn.runtime.memory import PinnedBuffer

    res = {}
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 4096, 16, 128)).astype(np.float16) for _ in range(3))
    dev = pyattn.get_device()
    s = pyattn.Stream()
    pin_in, pin_out = PinnedBuffer(3 * q.nbytes), PinnedBuffer(q.nbytes)
    d_in, d_out = pyattn.empty((3 * q.nbytes,), np.uint8), pyattn.empty((q.nbytes,), np.uint8)
    dev.synchronize()

    def floor():
        check(drv.cuMemcpyHtoDAsync(d_in.ptr, pin_in.ptr, 3 * q.nbytes, s.handle), "h2d")
        check(drv.cuMemcpyDtoHAsync(pin_out.ptr, d_out.ptr, q.nbytes, s.handle), "d2h")
        s.synchronize()
    res["attention (1,4096,16,128) fp16: pinned-copy floor ms"] = median_ms(floor)
    res["attention (1,4096,16,128) fp16: NumPy in/out ms"] = median_ms(lambda: pyattn.attention(q, k, v))
    res["attention (1,4096,16,128) fp16 causal: NumPy in/out ms"] = median_ms(lambda: pyattn.attention(q, k, v, causal=True))
    cache = pyattn.PagedKVCache(2048 + 64, 16, 8, 128, "bfloat16")
    sid = cache.add_sequence()
    kv = rng.standard_normal((1, 32768, 8, 128)).astype(ml_dtypes.bfloat16)
    cache.append([sid], kv, kv)
    qd = rng.standard_normal((1, 1, 32, 128)).astype(ml_dtypes.bfloat16)
    dq = pyattn.asarray(qd)
    pq, po = PinnedBuffer(qd.nbytes), PinnedBuffer(qd.nbytes)

    def decode_floor():
        check(drv.cuMemcpyHtoDAsync(dq.ptr, pq.ptr, qd.nbytes, s.handle), "h2d")
        o = pyattn.decode(dq, cache, [sid], stream=s)
        check(drv.cuMemcpyDtoHAsync(po.ptr, o.ptr, qd.nbytes, s.handle), "d2h")
        s.synchronize()
    res["decode B1 32k bf16: floor ms"] = median_ms(decode_floor, 51)
    res["decode B1 32k bf16: NumPy q ms"] = median_ms(lambda: pyattn.decode(qd, cache, [sid]), 51)
    return res


_TORCH_AFTER_COMPILE = textwrap.dedent("""
    import numpy as np, pyattn
    q = np.random.default_rng(0).standard_normal((1, 16, 2, 64)).astype(np.float16)
    pyattn.attention(q, q, q, causal=True)
    try:
        import torch
        print("import torch after a compile: OK", float(torch.ones(3, device="cuda").sum()))
    except Exception as e:
        print("import torch after a compile: FAILED", type(e).__name__, str(e).splitlines()[0][:100])
""")


def torch_after_compile() -> dict:
    import tempfile

    out = {}
    for label, extra in (("fresh process, compile first", {}),):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, PYATTN_CACHE_DIR=d, PYTHONPATH=ROOT, **extra)
            r = subprocess.run([sys.executable, "-c", _TORCH_AFTER_COMPILE], env=env, capture_output=True,
                               text=True, timeout=300)
            out[label] = (r.stdout.strip().splitlines() or [r.stderr.strip()[-200:]])[-1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    results = {"host_us": host_costs(), "numpy": numpy_floors(), "torch_after_compile": torch_after_compile()}
    print("| tiny call (1, 16, 2, 64) fp16 | host us per call |\n|---|---|")
    for name, us in results["host_us"].items():
        print(f"| {name} | {us:.1f} |")
    n = results["numpy"]
    a_floor, d_floor = n["attention (1,4096,16,128) fp16: pinned-copy floor ms"], n["decode B1 32k bf16: floor ms"]
    print("\n| NumPy in/out | ms | x floor |\n|---|---|---|")
    for name, ms in n.items():
        floor = a_floor if name.startswith("attention") else d_floor
        print(f"| {name} | {ms:.3f} | {ms / floor:.2f} |")
    print()
    for label, line in results["torch_after_compile"].items():
        print(f"{label}: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

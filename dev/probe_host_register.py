"""Dev probe (GPU): does page-locking the caller's own NumPy array in place (cuMemHostRegister)
scale with threads? One thread took 2.2 ms for 48 MiB plus 1.3 ms to unregister (BENCHMARKS.md,
forty-seventh session), slower than staging; never timed a slice a thread. Here: 48 MiB (the q, k,
v of (1, 4096, 16, 128) fp16) cut at 2 MiB boundaries into N slices, each registered (then
unregistered) by a thread of its own, N = 1, 2, 4, 8, 16; the H2D from the registered array (a
copy a slice: one copy spanning two registrations is refused, CUDA_ERROR_INVALID_VALUE); and the
floor (pinned H2D) beside it. Medians of 5 fresh arrays a count (a first touch done before).

    PYTHONPATH=. python dev/probe_host_register.py
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cuda.bindings import driver as d

import pyattn
from pyattn.runtime.errors import check
from pyattn.runtime.memory import get_pool
from pyattn.runtime.pinned import PinnedBuffer

MIB = 1 << 20


def cuts(ptr: int, nbytes: int, n: int) -> list:
    """[start, end) address ranges covering [ptr, ptr + nbytes), cut only at 2 MiB boundaries."""
    end = ptr + nbytes
    bounds = sorted({ptr, end} | {((ptr + i * nbytes // n) + (2 * MIB - 1)) & ~(2 * MIB - 1) for i in range(1, n)})
    bounds = [b for b in bounds if ptr <= b <= end]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def main() -> int:
    dev = pyattn.get_device()
    dev.activate()
    s = pyattn.Stream()
    nbytes = 48 * MIB
    alloc = get_pool(dev).allocate(nbytes, s)

    def h2d(ptr, ranges=None):  # a copy a registered range (one copy may not span two registrations)
        t = time.perf_counter()
        for a, b in ranges or [(ptr, ptr + nbytes)]:
            check(d.cuMemcpyHtoDAsync(alloc.ptr + (a - ptr), a, b - a, s.handle), "cuMemcpyHtoDAsync")
        s.synchronize()
        return time.perf_counter() - t

    def reg(ptr, n):  # on a worker thread: the context current first
        dev.activate()
        check(d.cuMemHostRegister(ptr, n, 0), "cuMemHostRegister")

    def unreg(ptr):
        dev.activate()
        check(d.cuMemHostUnregister(ptr), "cuMemHostUnregister")

    pin = PinnedBuffer(nbytes)
    pin.array(np.uint8, (nbytes,))[:] = 1
    floor = min(h2d(pin.ptr) for _ in range(5))
    print(f"pinned H2D 48 MiB: {1e3 * floor:.3f} ms")
    for n in (1, 2, 4, 8, 16):
        rows = []
        with ThreadPoolExecutor(n) as ex:
            for _ in range(5):
                a = np.ones(nbytes, np.uint8)  # faulted in, as a caller's array is
                ranges = cuts(a.ctypes.data, nbytes, n)
                t0 = time.perf_counter()
                list(ex.map(lambda r: reg(r[0], r[1] - r[0]), ranges))
                t1 = time.perf_counter()
                t_h2d = h2d(a.ctypes.data, ranges)
                t2 = time.perf_counter()
                list(ex.map(lambda r: unreg(r[0]), ranges))
                t3 = time.perf_counter()
                rows.append((t1 - t0, t_h2d, t3 - t2, len(ranges)))
        t_reg, t_cp, t_unreg, k = (float(np.median([r[i] for r in rows])) for i in range(4))
        print(f"{n:2d} threads ({int(k)} slices): register {1e3 * t_reg:.3f} ms, H2D {1e3 * t_cp:.3f} ms, "
              f"unregister {1e3 * t_unreg:.3f} ms; register + H2D = {(t_reg + t_cp) / floor:.2f}x the pinned H2D",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Dev probe: how CuPy takes pyattn's results. Does ``cupy.asarray(out)`` block the host until the
producing stream is done (CAI v3 consumers may synchronise), and does CuPy prefer an object's
``__cupy_get_ndarray__`` over its ``__cuda_array_interface__``?

Usage: PYTHONPATH=. python dev/probe_cupy_import.py
"""
import time

import cupy
import numpy as np

import pyattn

rng = np.random.default_rng(0)
big = cupy.asarray(rng.standard_normal((1, 8192, 16, 128)).astype(np.float16))
out = pyattn.attention(big, big, big)
out.stream.synchronize()


def host_us(fn, n=20):
    best = 1e9
    for _ in range(n):
        out.stream.synchronize()
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


t_call = host_us(lambda: pyattn.attention(big, big, big))
t_sync = host_us(lambda: pyattn.attention(big, big, big).stream.synchronize())
t_cai = host_us(lambda: cupy.asarray(pyattn.attention(big, big, big)))
t_dl = host_us(lambda: cupy.from_dlpack(pyattn.attention(big, big, big)))
print(f"host us: call {t_call:.1f}, call + sync {t_sync:.1f} (the kernel), call + cupy.asarray {t_cai:.1f}, "
      f"call + cupy.from_dlpack {t_dl:.1f}")
print("cupy.asarray blocks the host until the kernel ends:", t_cai > 0.5 * t_sync)


class Both:
    def __init__(self, a):
        self.a, self.seen = a, []

    @property
    def __cuda_array_interface__(self):
        self.seen.append("cai")
        return self.a.__cuda_array_interface__

    def __cupy_get_ndarray__(self):
        self.seen.append("hook")
        return cupy.from_dlpack(self.a)


b = Both(out)
cupy.asarray(b)
print("cupy.asarray reads, in order:", b.seen, "| cupy", cupy.__version__)

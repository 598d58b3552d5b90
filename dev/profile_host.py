"""Where does the host time of a small device-resident ``attention`` call go?

Usage: PYTHONPATH=. python dev/profile_host.py
Prints a cProfile of many tiny calls (sorted by own time) and a step-by-step timing of a warm
kernel load in this process (what a new process pays before its first launch; the first call as a
whole, step by step, is dev/probe_startup.py's).
"""

from __future__ import annotations

import cProfile
import pstats
import time

import numpy as np


def warm_load_steps() -> None:
    """Run in a fresh process with a warm disk cache: what the first get_kernel costs, step by step."""
    t = time.perf_counter()
    import pyattn

    steps = [("import pyattn", time.perf_counter() - t)]

    def step(name, fn):
        t0 = time.perf_counter()
        val = fn()
        steps.append((name, time.perf_counter() - t0))
        return val

    dev = step("get_device + activate (driver init)", lambda: (pyattn.get_device(), pyattn.get_device().activate())[0])
    from pyattn import jit
    from pyattn.jit.headers import cuda_include_dir
    from pyattn.jit.toolchain import headers_identity, nvrtc_identity
    from pyattn.jit.source import sources_digest
    from pyattn.kernels.registry import get_kernel
    from pyattn.kernels.specs import select_attention_spec

    step("nvrtc_identity", nvrtc_identity)
    step("cuda_include_dir", cuda_include_dir)
    step("headers_identity", headers_identity)
    step("sources_digest", sources_digest)
    fp = step("toolchain_fingerprint (rest)", jit.toolchain_fingerprint)
    spec = select_attention_spec("float16", 64, dev.arch)
    key = step("cache_key (renders the unit)", lambda: spec.cache_key(fp))
    step("cache.get (read + checksum)", lambda: jit.get_cache().get(key))
    step("get_kernel (load module + attrs)", lambda: get_kernel(spec, dev))
    for name, dt in steps:
        print(f"  {name:36} {dt * 1e3:8.2f} ms")
    total = sum(dt for name, dt in steps[2:])
    print(f"  {'warm load total (after driver init)':36} {total * 1e3:8.2f} ms")


def profile_calls(n: int = 3000) -> None:
    import pyattn

    q = pyattn.asarray(np.random.default_rng(0).standard_normal((1, 4, 1, 64)).astype(np.float16))
    s = pyattn.Stream()
    for _ in range(100):
        pyattn.attention(q, q, q, stream=s)
    s.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        pyattn.attention(q, q, q, stream=s)
    prof.disable()
    dt = time.perf_counter() - t0
    s.synchronize()
    print(f"  {dt / n * 1e6:.1f} us/call under cProfile")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    t0 = time.perf_counter()
    for _ in range(n):
        pyattn.attention(q, q, q, stream=s)
    print(f"  {(time.perf_counter() - t0) / n * 1e6:.1f} us/call without profiler")


if __name__ == "__main__":
    print("== warm load, step by step (cache must be warm: run twice)")
    warm_load_steps()
    print("== tiny device-resident calls")
    profile_calls()

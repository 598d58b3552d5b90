"""Dev probe: what torch.from_dlpack / cupy.asarray of pyattn's results cost on top of the call
(the pieces of torch's import, our export, the result's free through the capsule's deleter).

Usage: PYTHONPATH=. python dev/probe_dlpack_cost.py
"""
import time

import torch

import pyattn

t = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
out = pyattn.attention(t, t, t)
torch.cuda.synchronize()
sp = torch.cuda.current_stream().cuda_stream


def us(fn, n=5000):
    for _ in range(500):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    r = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return r


print("torch current stream handle", sp, "| result's stream", out.stream.ptr, out.stream)
keep = []
rows = [
    ("out.__dlpack__(stream=sp)", lambda: out.__dlpack__(stream=sp)),
    ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream()),
    ("torch.from_dlpack(out), same out", lambda: torch.from_dlpack(out)),
    ("attention torch in", lambda: pyattn.attention(t, t, t)),
    ("attention + from_dlpack", lambda: torch.from_dlpack(pyattn.attention(t, t, t))),
    ("attention + from_dlpack, kept (no free)", lambda: keep.append(torch.from_dlpack(pyattn.attention(t, t, t)))),
    ("attention + __dlpack__ capsule only", lambda: pyattn.attention(t, t, t).__dlpack__(stream=sp)),
    ("attention + torch._C._from_dlpack(capsule)",
     lambda: torch._C._from_dlpack(pyattn.attention(t, t, t).__dlpack__(stream=sp))),
]
for name, fn in rows:
    print(f"{name:45} {us(fn):7.2f} us")
    keep.clear()

# Where a fresh result's export goes: cProfile of the loop, and the driver calls it makes.
import cProfile
import collections
import pstats

from cuda.bindings import driver

counts = collections.Counter()
for name in [n for n in dir(driver) if n.startswith("cu") and callable(getattr(driver, n))]:
    fn = getattr(driver, name)

    def wrap(*a, _fn=fn, _name=name, **k):
        counts[_name] += 1
        return _fn(*a, **k)

    try:
        setattr(driver, name, wrap)
    except (AttributeError, TypeError):
        pass
for label, fn in (("attention", lambda: pyattn.attention(t, t, t)),
                  ("attention + capsule", lambda: pyattn.attention(t, t, t).__dlpack__(stream=sp))):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    counts.clear()
    for _ in range(100):
        fn()
    print(label, "driver calls per call:", {k: v / 100 for k, v in counts.items()})
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    pyattn.attention(t, t, t).__dlpack__(stream=sp)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(15)

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

# The same with the cyclic GC off (a fresh result per call allocates objects that trigger it), and
# what the driver's pointer query (torch's from_blob may ask it the device of the pointer) costs
# on a fresh result against one it has seen.
import gc  # noqa: E402

from cuda.bindings import driver as _drv  # noqa: E402

gc.disable()
for name, fn in rows[2:]:
    print(f"GC off: {name:37} {us(fn):7.2f} us")
    keep.clear()
gc.enable()
_attr = _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
print(f"{'cuPointerGetAttribute, same pointer':45} {us(lambda: _drv.cuPointerGetAttribute(_attr, out.ptr)):7.2f} us")
print(f"{'attention + cuPointerGetAttribute(result)':45} "
      f"{us(lambda: _drv.cuPointerGetAttribute(_attr, pyattn.attention(t, t, t).ptr)):7.2f} us")

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

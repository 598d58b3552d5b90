"""Dev probe: per-stage host cost of a tiny device attention call (the repeat-call path), and the NumPy
path's timeline. ``torch`` as an argument adds torch tensors."""
import time, sys
import numpy as np
import pyattn
from pyattn.array import allocate
from pyattn.interop.inputs import quick_key
from pyattn.interop.streams import torch_current_stream
from pyattn.pipeline.plans import get_plan
from pyattn.pipeline.device import begin
from pyattn.validate.attention import check_addresses
from pyattn.ops import attention as A
from pyattn.ops._fwd import build_fwd_plan, run_fwd
from pyattn.runtime.stream import check_stream_arg

def us(fn, n=20000):
    for _ in range(500): fn()
    t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e6

h = np.random.default_rng(0).standard_normal((1, 16, 2, 64)).astype(np.float16)
d = pyattn.asarray(h)
dev = pyattn.get_device()
print("total DeviceArray attention", round(us(lambda: pyattn.attention(d, d, d)), 2)); dev.synchronize()
# The repeat-call path, stage by stage (each stage timed alone).
params = dict(q=d, k=d, v=d, causal=False, mask=None, window=None, softcap=None, alibi_slopes=None, scale=None,
              layout="bshd", return_lse=False, allow_tf32=False, out=None, stream=None)
key = quick_key(params)
bound = A._quick.get(key)
arrays = (d, d, d, None, None, None)
P = bound.problem
print("check_stream_arg", round(us(lambda: check_stream_arg(None)), 2))
print("quick_key", round(us(lambda: quick_key(params)), 2))
print("memo get", round(us(lambda: A._quick.get(key)), 2))
print("begin (device, stream rule, producers)", round(us(lambda: begin(bound, None, arrays)), 2))
print("check_addresses", round(us(lambda: check_addresses(P, d.ptr, d.ptr, d.ptr)), 2))
print("get_plan", round(us(lambda: get_plan(build_fwd_plan, P, dev)), 2))
s = begin(bound, None, arrays)[0]
plan = get_plan(build_fwd_plan, P, dev)
print("allocate (+ free of the previous)", round(us(lambda: allocate(dev, s, *plan.out_layout)), 2)); dev.synchronize()
print("pack", round(us(lambda: plan.packer.pack(d.ptr, d.ptr, d.ptr, d.ptr, 0, 0, 0, 0, 0, 0, 0, 0)), 2))
print("run_fwd", round(us(lambda: run_fwd(plan, dev, s, d.ptr, d.ptr, d.ptr)), 2)); dev.synchronize()
print("_repeat (the whole repeat path)", round(us(lambda: A._repeat(bound, arrays, None, False)), 2)); dev.synchronize()
from pyattn.runtime.launch import launch
o = allocate(dev, s, *plan.out_layout)
params_b = plan.packer.pack(d.ptr, d.ptr, d.ptr, o.ptr, 0, 0, 0, 0, 0, 0, 0, 0)
print("launch only", round(us(lambda: launch(plan.kernel, plan.grid, plan.block, plan.shared_bytes, s, params_b)), 2)); dev.synchronize()
print("activate only", round(us(lambda: dev.activate()), 2))
from pyattn.runtime.stream import Event
e0, e1 = Event(dev, timing=True), Event(dev, timing=True)
s.record(e0)
for _ in range(1000): pyattn.attention(d, d, d)
s.record(e1); e1.synchronize()
print("GPU-side us per tiny call (events; equals host time when host-bound)", round(e0.elapsed_ms(e1), 3))
if "torch" in sys.argv:
    import torch
    t = torch.from_numpy(h).cuda(); torch.cuda.synchronize()
    print("with torch imported: DeviceArray", round(us(lambda: pyattn.attention(d, d, d)), 2)); dev.synchronize()
    print("torch tensors", round(us(lambda: pyattn.attention(t, t, t)), 2)); torch.cuda.synchronize()
    tparams = dict(params, q=t, k=t, v=t)
    print("quick_key torch", round(us(lambda: quick_key(tparams)), 2))
    tbound = A._quick.get(quick_key(tparams))
    print("begin torch", round(us(lambda: begin(tbound, None, (t, t, t, None, None, None))), 2))
    print("torch current stream read", round(us(lambda: torch_current_stream(dev)), 2))

# NumPy path timeline
import os
import pyattn.pipeline.host as H, pyattn.pipeline.chunks as C
q, k, v = (np.random.default_rng(i).standard_normal((1, 4096, 16, 128)).astype(np.float16) for i in range(3))
for _ in range(3): pyattn.attention(q, k, v)
ts = []
for _ in range(9):
    t0 = time.perf_counter(); pyattn.attention(q, k, v); ts.append((time.perf_counter() - t0) * 1e3)
print("numpy attention median ms", round(float(np.median(ts)), 3), "min", round(min(ts), 3))
stamps = []
def wrap(mod, name, tag):
    f = getattr(mod, name)
    def w(*a, **kw):
        t = time.perf_counter(); r = f(*a, **kw); stamps.append((tag, t, time.perf_counter())); return r
    setattr(mod, name, w)
for m, n in ((H, "finish_copies"), (H, "d2h_region"), (C, "_device_attention")):
    wrap(m, n, n)
wrap(C._Call, "_launch", "_launch")
t0 = time.perf_counter(); pyattn.attention(q, k, v); t1 = time.perf_counter()
print("numpy attention (instrumented) ms", round((t1 - t0) * 1e3, 3))
for tag, a, b in stamps:
    print(f"  {tag:18} start {1e3*(a-t0):7.3f}  dur {1e3*(b-a):7.3f}")

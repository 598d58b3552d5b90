"""Dev probe: per-stage host cost of a tiny device attention call, and the NumPy path's timeline."""
import time, sys
import numpy as np
import pyattn
from pyattn.interop.inputs import read, read_optional
from pyattn.pipeline.plans import signature, get_plan
from pyattn.pipeline.device import start, finish, output
from pyattn.validate.attention import check_pointers
from pyattn.ops import attention as A
from pyattn.ops._fwd import build_fwd_plan, device_extras, run_fwd
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
args = {n: (read if n in "qkv" else read_optional)(n, v) for n, v in zip(A._ARRAYS, (d, d, d, None, None, None))}
params = dict(q=d, k=d, v=d, causal=False, mask=None, window=None, softcap=None, alibi_slopes=None, scale=None,
              layout="bshd", return_lse=False, allow_tf32=False, out=None, stream=None)
key = signature(params, args); P = A._memo.get(key)
print("check_stream_arg", round(us(lambda: check_stream_arg(None)), 2))
print("read x6", round(us(lambda: {n: (read if n in "qkv" else read_optional)(n, params[n]) for n in A._ARRAYS}), 2))
print("signature", round(us(lambda: signature(params, args)), 2))
print("memo get", round(us(lambda: A._memo.get(key)), 2))
print("hash P", round(us(lambda: hash(P)), 2))
print("check_pointers", round(us(lambda: check_pointers(P, args["q"], args["k"], args["v"], args["out"])), 2))
arglist = [args[n] for n in A._ARRAYS]
print("start", round(us(lambda: start(None, arglist, None)), 2))
print("get_plan", round(us(lambda: get_plan(build_fwd_plan, P, dev)), 2))
s = start(None, arglist, None)[1]
plan = get_plan(build_fwd_plan, P, dev)
print("device_extras", round(us(lambda: device_extras(None, None, dev, s)), 2))
print("output()", round(us(lambda: output(dev, s, plan.out_shape, plan.dtype)), 2)); dev.synchronize()
print("pack", round(us(lambda: plan.packer.pack(d.ptr, d.ptr, d.ptr, d.ptr, 0, 0, 0, 0, 0, 0, 0, 0)), 2))
print("run_fwd", round(us(lambda: run_fwd(plan, dev, s, d, d, d)), 2)); dev.synchronize()
print("finish", round(us(lambda: finish(s, arglist)), 2))
from pyattn.runtime.launch import launch
params_b = plan.packer.pack(d.ptr, d.ptr, d.ptr, d.ptr, 0, 0, 0, 0, 0, 0, 0, 0)
o = output(dev, s, plan.out_shape, plan.dtype)
params_b = plan.packer.pack(d.ptr, d.ptr, d.ptr, o.ptr, 0, 0, 0, 0, 0, 0, 0, 0)
print("launch only", round(us(lambda: launch(plan.kernel, plan.grid, plan.block, plan.shared_bytes, s, params_b)), 2)); dev.synchronize()
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
    print("read torch", round(us(lambda: read("q", t)), 2))
    targs = [read(n, t) for n in "qkv"] + [None] * 3
    print("start torch", round(us(lambda: start(None, targs, None)), 2))

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

"""Dev probe: per-stage host cost of a tiny device attention call (the repeat-call path), and the NumPy
path's timeline. ``torch`` as an argument adds torch tensors; ``decode`` times the tiny decode of
bench_boundary stage by stage instead of the NumPy timeline, and lists one repeat call's C calls."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.array import allocate
from pyattn.interop.quick import quick_key
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
import inspect
# the call's locals() as attention sees them: every parameter in signature order, defaults but q, k, v
params = {n: p.default for n, p in inspect.signature(pyattn.attention).parameters.items()}
params.update(q=d, k=d, v=d)
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
print("run_fwd", round(us(lambda: run_fwd(plan, dev, s, d.ptr, d.ptr, d.ptr)), 2)); dev.synchronize()
print("_repeat (the whole repeat path)", round(us(lambda: A._repeat(bound, arrays, None, False, {})), 2)); dev.synchronize()
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

if "decode" not in sys.argv:  # the NumPy path's timeline
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

# ``decode`` as an argument: the tiny decode of bench_boundary, stage by stage, and the C functions
# (driver calls among them) one repeat call makes.
if "decode" in sys.argv:
    import collections
    from pyattn.ops import decode as Dm
    from pyattn.ops._decode import run_decode, _build
    rng = np.random.default_rng(0)
    cache, ids, hq = harness.tiny_decode(rng)
    qd = pyattn.asarray(hq)
    print("decode DeviceArray q", round(us(lambda: pyattn.decode(qd, cache, ids)), 2)); dev.synchronize()
    dparams = {n: p.default for n, p in inspect.signature(pyattn.decode).parameters.items()}
    dparams.update(q=qd, cache=cache.layout_key, seq_ids=2)
    dkey = quick_key(dparams)
    dbound = Dm._quick.get(dkey)
    print("  bound found", dbound is not None)
    print("  check_ids", round(us(lambda: cache.check_ids(ids)), 2))
    print("  dict(params) + quick_key", round(us(lambda: quick_key(dict(dparams))), 2))
    print("  begin", round(us(lambda: begin(dbound, None, (qd, None))), 2))
    ds = begin(dbound, None, (qd, None))[0]
    print("  cache.order", round(us(lambda: cache.order(ds)), 2))
    print("  device_tables", round(us(lambda: cache.device_tables(ids, ds)), 2))
    tables, max_len, total_len = cache.device_tables(ids, ds)
    DP = dbound.problem
    print("  get_plan", round(us(lambda: get_plan(_build, DP, dev)), 2))
    print("  run_decode", round(us(lambda: run_decode(DP, dev, qd.ptr, cache.k.ptr, cache.v.ptr, tables, max_len, 0,
                                                       ds, False, (0, 0), total_len)), 2)); dev.synchronize()
    print("  _repeat", round(us(lambda: Dm._repeat(dbound, cache, ids, (qd, None), None, False, {})), 2)); dev.synchronize()
    seen = collections.Counter()
    def prof(frame, event, arg):
        if event == "c_call":
            seen[getattr(arg, "__qualname__", getattr(arg, "__name__", "?"))] += 1
        elif event == "call":
            seen["(python) " + frame.f_code.co_name] += 1
    for _ in range(3): pyattn.decode(qd, cache, ids)
    sys.setprofile(prof); pyattn.decode(qd, cache, ids); sys.setprofile(None)
    print("  one repeat decode's calls:", ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
    seen.clear()
    for _ in range(3): pyattn.attention(d, d, d)
    sys.setprofile(prof); pyattn.attention(d, d, d); sys.setprofile(None)
    print("  one repeat attention's calls:", ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
    e0, e1 = Event(dev, timing=True), Event(dev, timing=True)
    s.record(e0)
    for _ in range(1000): pyattn.decode(qd, cache, ids)
    s.record(e1); e1.synchronize()
    print("  GPU-side us per tiny decode (events)", round(e0.elapsed_ms(e1), 3))
    import cProfile, pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5000): pyattn.decode(qd, cache, ids)
    pr.disable(); dev.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)

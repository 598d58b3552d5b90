"""Host cost of a tiny device-resident call, measured on a CPU with the fake driver (no GPU needed).

Usage: PYTHONPATH=. python dev/host_cost_cpu.py [--n 20000] [--no-stages]

The fake driver (``tests/fake_driver.py``) answers every ``cuda.bindings.driver`` call at once, so
what is timed is pyattn's own Python plus the fake's (tiny) stubs; the real driver calls cost
~1-2 us each on a GPU host, so their count per call is printed separately. For each call kind:
host time per repeat call, Python function calls and C calls per call (``sys.setprofile``), and
driver calls per call. Kinds: ``attention`` on DeviceArrays, on (fake) torch tensors with
``stream=None`` (torch's current stream, rule 2), on CuPy-like CUDA-array-interface objects with a
stream, on JAX-like DLPack-only objects (their export is pyattn's own here), and
``decode(q, cache, ids)`` with a DeviceArray q or a torch q, ``sparq_decode`` with a torch q,
``contiguous_decode`` with one int length, with ragged NumPy lengths (an upload a call) and with an
int length and one new token a sequence (k_new / v_new: an append launch too), ``attention_varlen``
with torch offsets and both maxima, and ``paged_prefill`` over torch pools and tables under its
bounds. The per-stage times of the attention call come after (each stage timed alone, as
``dev/prof_paths.py`` does on the GPU host).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fake_driver  # noqa: E402
import fake_torch  # noqa: E402

import pyattn  # noqa: E402


def per_call_us(fn, n) -> float:
    """Best of 5 runs of ``n`` calls, us of this process's CPU time per call (CPU time, not wall
    time: a shared machine's other processes then barely move the figure)."""
    for _ in range(min(n, 2000)):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - t) / n)
    return best * 1e6


def counts(fn) -> tuple:
    """(Python calls, C calls, driver calls by name) of one repeat call, in a steady loop."""
    for _ in range(3):
        fn()
    seen = collections.Counter()

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            seen[event] += 1

    fake_driver.CALLS.clear()
    sys.setprofile(prof)
    fn()
    sys.setprofile(None)
    driver = dict(fake_driver.CALLS)
    # the profiler counts the driver stubs (a Python wrapper and the fake method each) as calls
    stubs = sum(driver.values())
    return seen["call"] - 2 * stubs, seen["c_call"], driver


class CaiArray:
    """A CuPy-like array: a CUDA array interface v3 dict built per access, with its stream, and
    ``__dlpack_device__`` (which tells its device without a driver call)."""

    def __init__(self, shape, ptr, stream):
        self.shape, self._ptr, self._stream = shape, ptr, stream

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):  # never called: the interface is read first
        raise AssertionError("CaiArray is read through its __cuda_array_interface__")

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<f2", "descr": [("", "<f2")], "data": (self._ptr, False),
                "strides": None, "version": 3, "stream": self._stream}


class DlpackArray:
    """A JAX-like array: DLPack only, with shape and dtype attributes (dense, no strides)."""

    def __init__(self, da):
        self.da, self.shape, self.dtype = da, da.shape, da.dtype

    def __dlpack_device__(self):
        return self.da.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.da.__dlpack__(**kwargs)


def calls():
    """The calls of ``scripts/bench_boundary.py``'s host-cost table, on the fake driver."""
    import ml_dtypes

    shape = (1, 16, 2, 64)
    d = pyattn.empty(shape, np.float16)
    torch = sys.modules["torch"]
    t, t_out = torch.Tensor(shape, d.ptr), torch.Tensor(shape, d.ptr + 4096)
    c = CaiArray(shape, d.ptr, 0x5000)
    j = DlpackArray(d)
    s = pyattn.Stream()
    cache = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16")
    ids = [cache.add_sequence() for _ in range(2)]
    kv = np.zeros((2, 256, 2, 64), ml_dtypes.bfloat16)
    cache.append(ids, kv, kv)
    sq = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16", sparq=True)
    sq_ids = [sq.add_sequence() for _ in range(2)]
    sq.append(sq_ids, kv, kv)
    qd = pyattn.empty((2, 1, 8, 64), ml_dtypes.bfloat16)
    tq = torch.Tensor(qd.shape, qd.ptr, "bfloat16")
    kc = pyattn.empty((2, 256, 2, 64), ml_dtypes.bfloat16)  # contiguous caches (batch, max_len, Hkv, D)
    ragged = np.array([256, 100], np.int32)
    kn = pyattn.empty((2, 1, 2, 64), ml_dtypes.bfloat16)  # one new token a sequence
    tv, tp = torch.Tensor((16, 2, 64), d.ptr), torch.Tensor((8, 16, 2, 64), d.ptr + 8192)  # prefill over pools
    tcu = torch.Tensor((3,), d.ptr + 65536, "int32")
    ttab, tlens = torch.Tensor((2, 2), d.ptr + 65600, "int32"), torch.Tensor((2,), d.ptr + 65664, "int32")
    keep = [None]

    def run(f):
        def call():
            keep[0] = f()  # the previous result is freed here, as in a loop that rebinds it
        return call

    return {
        "attention DeviceArray": run(lambda: pyattn.attention(d, d, d)),
        "attention torch (stream=None)": run(lambda: pyattn.attention(t, t, t)),
        "attention torch, out=torch": run(lambda: pyattn.attention(t, t, t, out=t_out)),
        "attention torch, pyattn Stream": run(lambda: pyattn.attention(t, t, t, stream=s)),
        "attention CAI v3 (own stream)": run(lambda: pyattn.attention(c, c, c)),
        "attention DLPack only": run(lambda: pyattn.attention(j, j, j)),
        "decode DeviceArray q": run(lambda: pyattn.decode(qd, cache, ids)),
        "decode torch q": run(lambda: pyattn.decode(tq, cache, ids)),
        "sparq_decode torch q": run(lambda: pyattn.sparq_decode(tq, sq, sq_ids, r=16, k=64)),
        "contiguous_decode, int length": run(lambda: pyattn.contiguous_decode(qd, kc, kc, 200)),
        "contiguous_decode, NumPy ragged": run(lambda: pyattn.contiguous_decode(qd, kc, kc, ragged)),
        "contiguous_decode, int + k_new": run(lambda: pyattn.contiguous_decode(qd, kc, kc, 200, k_new=kn, v_new=kn)),
        "varlen torch, both maxima": run(lambda: pyattn.attention_varlen(tv, tv, tv, tcu, tcu, max_seqlen_q=9,
                                                                         max_seqlen_k=9)),
        "paged_prefill torch, bounded": run(lambda: pyattn.paged_prefill(tv, tp, tp, tcu, block_table=ttab,
                                                                         seq_lens=tlens, max_seqlen_q=9,
                                                                         max_seqlen_k=32)),
    }, d


def stages(d, n):
    """Each stage of a repeat DeviceArray attention call timed alone (internals: update when they move)."""
    from pyattn.array import allocate
    from pyattn.interop.quick import quick_key
    from pyattn.ops import attention as A
    from pyattn.ops._fwd import build_fwd_plan, run_fwd
    from pyattn.pipeline.device import begin
    from pyattn.pipeline.plans import get_plan
    from pyattn.runtime.launch import launch
    from pyattn.validate.attention import check_addresses

    # the call's locals() as attention sees them: every parameter, in signature order, defaults but q, k, v
    params = {n: p.default for n, p in inspect.signature(pyattn.attention).parameters.items()}
    params.update(q=d, k=d, v=d)
    pyattn.attention(d, d, d)
    key = quick_key(params)
    bound = A._quick.get(key)
    arrays = (d, d, d, None, None, None)
    s, ptrs = begin(bound, None, arrays)
    dev, P = bound.device, bound.problem
    plan = get_plan(build_fwd_plan, P, dev)
    o = allocate(dev, s, *plan.out_layout)
    packed = plan.packer.pack(d.ptr, d.ptr, d.ptr, o.ptr, 0, 0, 0, 0, 0, 0, 0, 0)
    rows = [
        ("quick_key", lambda: quick_key(params)),
        ("memo get", lambda: A._quick.get(key)),
        ("begin (device, stream rule, producers)", lambda: begin(bound, None, arrays)),
        ("check_addresses", lambda: check_addresses(P, d.ptr, d.ptr, d.ptr)),
        ("get_plan", lambda: get_plan(build_fwd_plan, P, dev)),
        ("allocate (+ free)", lambda: allocate(dev, s, *plan.out_layout)),
        ("pack", lambda: plan.packer.pack(d.ptr, d.ptr, d.ptr, o.ptr, 0, 0, 0, 0, 0, 0, 0, 0)),
        ("launch", lambda: launch(plan.kernel, plan.grid, plan.block, plan.shared_bytes, s, packed)),
        ("run_fwd (allocate + pack + launch)", lambda: run_fwd(plan, dev, s, d.ptr, d.ptr, d.ptr)),
        ("the repeat path (_repeat)", lambda: A._repeat(bound, arrays, None, False, {})),
    ]
    for name, fn in rows:
        print(f"  {name:40} {per_call_us(fn, n):6.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timing run")
    ap.add_argument("--no-stages", action="store_true", help="totals only (e.g. against an older checkout)")
    opts = ap.parse_args()
    n = opts.n
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "torch", fake_torch.fake_torch())
        fake_driver.install(mp)
        stub = per_call_us(lambda: fake_driver.driver.cuEventRecord(0, 0), n)
        print(f"fake driver call (counted stub): {stub:.2f} us each (included in the times below)")
        kinds, d = calls()
        print(f"{'call':32} {'us/call':>8} {'py calls':>9} {'C calls':>8}  driver calls")
        for name, fn in kinds.items():
            py, c, drv = counts(fn)
            print(f"{name:32} {per_call_us(fn, n):8.2f} {py:9d} {c:8d}  {sum(drv.values())}: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(drv.items())))
        if not opts.no_stages:
            print("stages of a repeat 'attention DeviceArray', each timed alone:")
            stages(d, n)


if __name__ == "__main__":
    main()

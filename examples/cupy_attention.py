"""pyattn on CuPy arrays: zero-copy in and out, and the stream-order rule.

1. CuPy float16 (and bfloat16, where this CuPy supports ``ml_dtypes.bfloat16``: CuPy >= 14 with
   NumPy >= 2.1.2) arrays go into ``pyattn.attention`` as they are; the result, a
   ``pyattn.DeviceArray``, comes back with ``cupy.from_dlpack(out)`` without a copy (same pointer),
   ordered after the call on the device. (``cupy.asarray(out)`` also works, but CuPy then
   synchronizes the host with the stream the array interface names: the host waits for the call.)
   Checked against the float64 reference ``pyattn.reference.attention_ref`` with the tolerance
   rule ``pyattn.reference.error_bound`` (2x a naive same-precision attention, plus a floor).
2. Streams: inputs written on a non-blocking ``cupy.cuda.Stream`` and ``pyattn.attention(...,
   stream=s)`` (any object with ``__cuda_stream__``, or the raw handle ``s.ptr``) run in order on
   that stream; ``s.synchronize()`` then waits for all of it. Without ``stream=``, pyattn runs on
   CuPy's current stream (the one CuPy names in the arrays' ``__cuda_array_interface__``), in
   order with CuPy's own kernels before and after it.

Run (pyattn and cupy-cuda13x installed): ``python examples/cupy_attention.py``.
Exit status 0 on success (or ``skipped: ...`` without CuPy or a GPU), 1 with ``FAILED: ...``.
"""

import importlib.util
import sys

import numpy as np

try:
    import pyattn
except ImportError as exc:
    sys.exit(f"error: cannot import pyattn ({exc}); run `pip install -e .` in the repository first")

B, S, HQ, HKV, D = 2, 512, 8, 2, 64  # GQA: 8 query heads share 2 KV heads


def check(ok, what):
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok    {what}")


def check_against_reference(o, host, name):
    """``o`` (CuPy, after its work is done) against the float64 reference of host inputs ``host``."""
    err = np.abs(o.get().astype(np.float64) - pyattn.reference.attention_ref(*host, causal=True)).max()
    bound = pyattn.reference.error_bound(*host, causal=True)
    check(err <= bound, f"{name}: max err {err:.2e} <= bound {bound:.2e}")


def main():
    if importlib.util.find_spec("cupy") is None:
        print("skipped: cupy is not installed (pip install cupy-cuda13x)")
        return
    if pyattn.device_count() == 0:
        print("skipped: no CUDA GPU (pyattn.device_count() == 0)")
        return
    import cupy
    import ml_dtypes

    dtypes = [np.dtype(np.float16)]
    try:  # bfloat16 needs CuPy >= 14 (ml_dtypes) and NumPy >= 2.1.2
        cupy.asarray(np.ones(2, ml_dtypes.bfloat16)).get()
        dtypes.append(np.dtype(ml_dtypes.bfloat16))
    except Exception as exc:
        print(f"note  bfloat16 skipped: this CuPy cannot hold ml_dtypes.bfloat16 ({type(exc).__name__}: {exc})")

    rng = np.random.default_rng(0)
    for dt in dtypes:
        host = [rng.standard_normal((B, S, h, D), dtype=np.float32).astype(dt) for h in (HQ, HKV, HKV)]
        q, k, v = (cupy.asarray(x) for x in host)  # copied on CuPy's current stream
        out = pyattn.attention(q, k, v, causal=True)  # stream=None: CuPy's current stream, after its copies
        o = cupy.from_dlpack(out)  # zero-copy; on the same stream, so nothing to wait for
        check(isinstance(out, pyattn.DeviceArray) and o.data.ptr == out.ptr and o.dtype == dt,
              f"{dt.name:8s} {o.shape} result imported zero-copy (ptr 0x{out.ptr:x})")
        check_against_reference(o, host, f"{dt.name:8s} causal GQA attention")

    # The stream rule, with a stream of our own: everything below is queued on s, in order.
    s = cupy.cuda.Stream(non_blocking=True)  # does not synchronise with the legacy default stream
    with s:  # CuPy work in this block runs on s
        q = cupy.random.standard_normal((B, S, HQ, D), dtype=cupy.float32).astype(cupy.float16)
        k = cupy.random.standard_normal((B, S, HKV, D), dtype=cupy.float32).astype(cupy.float16)
        v = cupy.random.standard_normal((B, S, HKV, D), dtype=cupy.float32).astype(cupy.float16)
        o1 = cupy.from_dlpack(pyattn.attention(q, k, v, causal=True, stream=s))  # s via __cuda_stream__
        o2 = cupy.from_dlpack(pyattn.attention(q, k, v, causal=True, stream=s.ptr))  # or the raw handle
        same = cupy.array_equal(o1, o2)  # queued on s too
    s.synchronize()
    check(bool(same), "stream=s and stream=s.ptr give the same result on a non-blocking CuPy stream")
    check_against_reference(o1, [x.get() for x in (q, k, v)], "float16 on the CuPy stream")


if __name__ == "__main__":
    main()

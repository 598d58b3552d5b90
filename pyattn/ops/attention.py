"""``pyattn.attention``: fused scaled-dot-product attention (forward).

Host overhead matters for small calls (decode loops call this thousands of times a second), so a
validated call is remembered as a :class:`~pyattn.ops._plan.Plan` keyed by everything validation
looked at (shapes, element strides, dtypes, device, options). A repeat call with device arrays is a
dict hit, one pool allocation, a small struct pack and a launch.
"""

from __future__ import annotations

import numpy as np

from ..array import DeviceArray, asarray
from ..kernels.registry import get_kernel
from ..runtime.stream import Stream, as_stream
from ._plan import make_plan, ptx_requested, run_plan, spec_for
from ._problem import make_problem

__all__ = ["attention"]

_MAX_PLANS = 4096  # distinct call signatures remembered; a workload with more just re-validates
_plans: dict = {}


def _meta(x):
    """Plan-key part of an optional argument: None, or a DeviceArray's layout (others: unkeyable)."""
    if x is None:
        return None
    if type(x) is DeviceArray:
        return (x.shape, x.elem_strides, x.dtype, x.device)
    raise TypeError  # host or foreign arrays take the validating path


def upload_extras(problem, mask, alibi_slopes, device, s):
    """Mask and ALiBi slopes as DeviceArrays (host ones copied: mask C-contiguous, slopes float32)."""
    dmask = dalibi = None
    if mask is not None:
        if problem.mask.on_device:
            dmask = asarray(mask, stream=s)
        else:
            m = np.asarray(mask)
            dmask = asarray(np.ascontiguousarray(m.astype(np.float32) if m.dtype == np.float64 else m),
                            device=device, stream=s)
    if alibi_slopes is not None:
        if problem.alibi.on_device:
            dalibi = asarray(alibi_slopes, stream=s)
        else:
            dalibi = asarray(np.ascontiguousarray(alibi_slopes, dtype=np.float32), device=device, stream=s)
    for name, a in (("mask", dmask), ("alibi_slopes", dalibi)):
        if a is not None and a.device is not device:
            raise ValueError(f"{name}: expected an array on device {device.ordinal} (with q), "
                             f"got device {a.device.ordinal}")
    return dmask, dalibi


def attention(q, k, v, *, causal=False, mask=None, window=None, softcap=None, alibi_slopes=None, scale=None,
              layout="bshd", return_lse=False, allow_tf32=False, out=None, stream=None):
    """Scaled-dot-product attention, ``softmax(scale * q k^T + bias) v``, computed by a fused GPU kernel.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim) for ``layout="bshd"``
        Queries. ``layout="bhsd"`` takes (batch, heads_q, seqlen_q, head_dim) (torch SDPA's order).
        NumPy arrays are copied to the GPU; CUDA arrays (``pyattn.DeviceArray``, CuPy, PyTorch,
        JAX, anything with ``__cuda_array_interface__`` or ``__dlpack__``) are read in place and
        may be strided, as long as the head_dim axis is contiguous.
    k, v : array, shape (batch, seqlen_k, heads_kv, head_dim)
        Keys and values, same layout. ``heads_q`` must be a multiple of ``heads_kv`` (GQA/MQA):
        query head ``h`` attends with key/value head ``h // (heads_q // heads_kv)``.
    causal : {False, True, "bottom_right", "top_left"}, default False
        ``True``/``"bottom_right"``: query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``
        (FlashAttention >= 2.1); when ``seqlen_q > seqlen_k`` the first rows see no key.
        ``"top_left"``: ``j <= i`` (torch SDPA's ``is_causal``).
    mask : array, optional
        Broadcastable to (batch, heads_q, seqlen_q, seqlen_k) (that axis order in both layouts).
        bool: True = may attend. float16/bfloat16/float32 (host float64 too): added to the scores;
        ``-inf`` masks. Host or device; a device mask is read in place (broadcast axes cost nothing).
    window : (int, int), optional
        Sliding window ``(left, right)``, -1 = unbounded: query ``i`` sees keys
        ``i + d - left <= j <= i + d + right`` with ``d = seqlen_k - seqlen_q``. Key tiles outside
        every row's window are skipped, so the cost is proportional to the window width.
    softcap : float, optional
        Scores become ``softcap * tanh(s / softcap)`` (Gemma-2, Grok) before ALiBi and the mask.
    alibi_slopes : array, shape (heads_q,) or (batch, heads_q), optional
        Adds ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores (FlashAttention's convention).
        Device slopes must be contiguous float32.
    scale : float, optional
        Score scale, default ``1 / sqrt(head_dim)``.
    layout : {"bshd", "bhsd"}
    return_lse : bool, default False
        Also return the log-sum-exp of the final scores, natural log, float32,
        shape (batch, heads_q, seqlen_q).
    allow_tf32 : bool, default False
        float32 inputs only: run on TF32 tensor cores (products of inputs rounded to a 10-bit
        mantissa, like torch's ``allow_tf32``) instead of exact CUDA-core FMA. Needs 16-byte
        aligned q/k/v with strides that are multiples of 4 elements.
    out : array, optional
        Destination of the output's exact shape and dtype: a device array for device inputs (any
        strides with a contiguous head_dim axis), a writable NumPy array for NumPy inputs.
    stream : optional
        Stream for all work (a ``pyattn.Stream``, an object with ``__cuda_stream__``, or an int
        ``CUstream``). Default: pyattn's own stream. Device results are ordered on it.

    Returns
    -------
    out : array, q's shape and dtype
        A NumPy array for NumPy inputs, a ``pyattn.DeviceArray`` for device inputs (``out`` itself
        when given).
    lse : array, optional
        Only with ``return_lse=True``.

    Notes
    -----
    q, k, v must share one dtype: float32, float16 or bfloat16 (``ml_dtypes.bfloat16`` on the
    host). Scores, softmax and accumulation are float32; the output is rounded to the input dtype.
    A query row that sees no key (fully masked) gets output 0 and LSE ``-inf``, never NaN.
    Scores are formed in the order of ``pyattn.reference.attention_ref``: scale, soft-cap, ALiBi,
    float mask, then causal/window/bool-mask exclusion. Head dims are multiples of 8 up to 256.
    fp16/bf16 run on tensor cores; float32 stays exact on CUDA cores unless ``allow_tf32``.

    All validation happens before any GPU work: bad input raises ``ValueError`` or ``TypeError``
    naming the argument. The call is thread-safe; results on one stream are ordered.

    Examples
    --------
    >>> import numpy as np, pyattn
    >>> q = np.random.randn(1, 128, 8, 64).astype(np.float16)
    >>> out = pyattn.attention(q, q, q, causal=True)  # doctest: +SKIP
    """
    if type(q) is DeviceArray and type(k) is DeviceArray and type(v) is DeviceArray:
        try:
            key = (q.shape, q.elem_strides, q.dtype, q.device, k.shape, k.elem_strides, k.dtype, k.device,
                   v.shape, v.elem_strides, v.dtype, v.device, causal, window, softcap, scale, layout,
                   _meta(mask), _meta(alibi_slopes), _meta(out), bool(allow_tf32), ptx_requested())
            plan = _plans.get(key)
        except TypeError:  # an unhashable or host argument: validation below handles it
            key = plan = None
        if plan is not None:
            s = stream if type(stream) is Stream else as_stream(stream, q.device)
            q.device.activate()
            o, lse = run_plan(plan, (q, k, v), (mask, alibi_slopes, None, None), s, return_lse=return_lse, out=out)
            return (o, lse) if return_lse else o
    else:
        key = None

    if not isinstance(allow_tf32, (bool, np.bool_)):
        raise TypeError(f"allow_tf32: expected a bool, got {type(allow_tf32).__name__}")
    allow_tf32 = bool(allow_tf32)
    problem, _ = make_problem(q, k, v, causal=causal, mask=mask, window=window, softcap=softcap,
                              alibi_slopes=alibi_slopes, scale=scale, layout=layout, out=out)
    if not problem.on_device:  # NumPy in/out: chunked so copies overlap the kernel (see _host)
        from ._host import attention_numpy

        return attention_numpy(q, k, v, layout=layout, return_lse=return_lse, stream=stream, out=out,
                               options=dict(causal=causal, mask=mask, window=window, softcap=softcap,
                                            alibi_slopes=alibi_slopes, scale=scale, allow_tf32=allow_tf32))
    dq = asarray(q, stream=stream)  # a zero-copy view; its device comes from the pointer
    device = dq.device
    s = as_stream(stream, device)
    device.activate()

    # Compile (or fetch) before touching the other inputs, so a compile error costs nothing else.
    spec = spec_for(problem.dtype, problem.head_dim, device.arch, ptx_requested(),
                    problem.mask.kind if problem.mask is not None else "none", problem.softcap > 0,
                    problem.alibi is not None, allow_tf32)
    kernel = get_kernel(spec, device)

    dk, dv = (asarray(x, stream=s) for x in (k, v))
    if not (dq.device is dk.device is dv.device):
        raise ValueError("q, k, v: expected arrays on one device, got devices "
                         f"{dq.device.ordinal}, {dk.device.ordinal}, {dv.device.ordinal}")
    dmask, dalibi = upload_extras(problem, mask, alibi_slopes, device, s)
    dout = asarray(out, stream=s) if out is not None else None
    plan = make_plan(problem, spec, kernel, (dq, dk, dv))
    if key is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    o, lse = run_plan(plan, (dq, dk, dv), (dmask, dalibi, None, None), s, return_lse=return_lse, out=dout)
    if out is not None:
        o = out  # the caller's own array object
    return (o, lse) if return_lse else o

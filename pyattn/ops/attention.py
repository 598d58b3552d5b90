"""``pyattn.attention``: fused scaled-dot-product attention (forward).

A thin function over the op pipeline: read the arguments, validate them into a frozen
``AttentionProblem`` (a repeat signature skips this: ``pipeline.plans.Memo``), then run the
planned kernel on the stream the stream-order rule picks, or take the chunked NumPy path. A repeat
call on device arrays (DeviceArrays, torch tensors, CUDA array interfaces, DLPack-only arrays) is
found by its quick key before any argument is validated (``interop.quick.quick_key``), and reads
only pointers and producer streams.
"""

from __future__ import annotations

from ..interop.inputs import read_args
from ..interop.quick import quick_key
from ..pipeline.device import begin, bind, finish, start
from ..pipeline.plans import Memo, get_plan, signature
from ..runtime.device import keeps_context
from ..runtime.stream import check_stream_arg
from ..validate.attention import check_addresses, check_pointers, make_problem
from ..validate.options import check_bool
from ._fwd import build_fwd_plan, device_extras, run_fwd

__all__ = ["attention"]

_ARRAYS = ("q", "k", "v", "mask", "alibi_slopes", "out")
_REQUIRED = ("q", "k", "v")
_memo = Memo()  # signature -> problem
_quick = Memo()  # quick key -> pipeline.device.Bound


@keeps_context
def attention(q, k, v, *, causal=False, mask=None, window=None, softcap=None, alibi_slopes=None, scale=None,
              layout="bshd", return_lse=False, allow_tf32=False, out=None, stream=None, descale_q=None,
              descale_k=None, descale_v=None):
    """Scaled-dot-product attention, ``softmax(scale * q k^T + bias) v``, computed by a fused GPU kernel.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim) for ``layout="bshd"``
        Queries. ``layout="bhsd"`` takes (batch, heads_q, seqlen_q, head_dim) (torch SDPA's order).
        NumPy arrays are copied to the GPU; CUDA arrays (``pyattn.DeviceArray``, torch, CuPy, JAX,
        anything with ``__cuda_array_interface__`` or ``__dlpack__``) are read in place and may be
        strided, as long as the head_dim axis is contiguous.
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
        On sm_90a a bool mask of any layout is packed to bits per call (a small kernel) for the
        TMA kernel; a float mask is fastest with consecutive keys and a 16-byte aligned address
        and strides (its tiles then ride the TMA kernel's ring; other float masks are read by a
        slower kernel). Tiles a mask leaves untouched (all True or all 0) cost what unmasked ones do.
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
        Also return the log-sum-exp of the final scores, natural log, float32, shape
        (batch, heads_q, seqlen_q) in both layouts: the convention every pyattn op returns and
        :func:`pyattn.merge_states` takes, so ``(out, lse)`` pairs merge as they are.
    allow_tf32 : bool, default False
        float32 inputs only: run on TF32 tensor cores (products of inputs rounded to a 10-bit
        mantissa, like torch's ``allow_tf32``) instead of exact CUDA-core FMA. Needs 16-byte
        aligned q/k/v with strides that are multiples of 4 elements.
    out : array, optional
        Destination of the output's exact shape and dtype: a device array for device inputs (any
        strides with a contiguous head_dim axis), a writable NumPy array for NumPy inputs.
    stream : optional
        Stream for all work (a ``pyattn.Stream``, an object with ``__cuda_stream__``, or an int
        ``CUstream``). Default (the stream-order rule, see the README): torch's current stream when
        any input is a torch tensor, else pyattn's own stream. Either way the call first waits
        (on the device) for the streams that produced its inputs; device results carry the stream
        for their consumers.
    descale_q, descale_k, descale_v : float, optional
        fp8 inputs only: the per-tensor factors that turn q's, k's and v's codes into values
        (``value = code * descale``), as FlashAttention-3 takes them; default 1.

    Returns
    -------
    out : array, q's shape and dtype (bfloat16 for fp8 inputs)
        A NumPy array for NumPy inputs (in pinned memory from a pool), a ``pyattn.DeviceArray`` for
        device inputs (``out`` itself when given); ``torch.from_dlpack(out)`` and
        ``cupy.asarray(out)`` take it zero-copy, bfloat16 included.
    lse : array, optional
        Only with ``return_lse=True``.

    Notes
    -----
    q, k, v must share one dtype: float32, float16 or bfloat16 (``ml_dtypes.bfloat16`` on the
    host). Scores, softmax and accumulation are float32; the output is rounded to the input dtype.
    On sm_90a, device arrays of ``float8_e4m3fn`` (torch's, or ``ml_dtypes``') run on 8-bit tensor
    cores at twice the 16-bit rate: the probabilities are rounded to e4m3 for P V (as in
    FlashAttention-3), the output is bfloat16, and a bool mask is the only mask they take; head dims
    up to 128 run in one 128-byte row (smaller ones padded), larger in two. Elsewhere, and for
    NumPy fp8 arrays, the call is refused before any GPU work (on another arch: when it is planned).
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
    params = locals()
    check_stream_arg(stream)
    reads = {}  # (the pointers and producers of CUDA array interfaces, read with the key)
    qkey = quick_key(params, reads)
    bound = _quick.get(qkey)
    if bound is not None:  # a repeat call: only pointers and producer streams are read
        return _repeat(bound, (q, k, v, mask, alibi_slopes, out), stream, return_lse, reads)
    # (a separate function: its closures and many locals would slow every call of this one)
    return _full(qkey, params, **params)


def _full(qkey, params, *, q, k, v, causal, mask, window, softcap, alibi_slopes, scale, layout, return_lse,
          allow_tf32, out, stream, descale_q, descale_k, descale_v):
    """A call read into Args: validated (or found by its signature), then run; binds its quick key."""
    args = read_args(params, _ARRAYS, _REQUIRED)
    key = signature(params, args, host_ok=("q", "k", "v"))
    P = _memo.get(key)
    if P is None:
        return_lse = check_bool("return_lse", return_lse)
        P = make_problem(args["q"], args["k"], args["v"], causal=causal, mask=args["mask"], window=window,
                         softcap=softcap, alibi=args["alibi_slopes"], scale=scale, layout=layout, out=args["out"],
                         allow_tf32=check_bool("allow_tf32", allow_tf32), descale=(descale_q, descale_k, descale_v))
        _memo.put(key, P)
    if not P.on_device:  # NumPy in, NumPy out: chunked so that copies overlap the kernels
        # Imported here: the NumPy path's modules (worker threads, concurrent.futures, logging) cost
        # ~4 ms of a first call on device arrays, which never uses them.
        from ..pipeline import chunks

        o, lse = chunks.attention_numpy(
            P, args["q"].obj, args["k"].obj, args["v"].obj, mask=_raw(args["mask"]),
            alibi_slopes=_raw(args["alibi_slopes"]), return_lse=return_lse, stream=stream,
            out=args["out"].obj if args["out"] is not None else None,
            options=dict(window=window, softcap=softcap, scale=scale, allow_tf32=allow_tf32))
        return (o, lse) if return_lse else o
    check_pointers(P, args["q"], args["k"], args["v"], args["out"])
    ordered = [args[n] for n in _ARRAYS]
    device, s, (dq, dk, dv, dmask, dalibi, dout) = start(
        stream, ordered, lambda a: check_pointers(P, a[0], a[1], a[2], a[5]))
    _quick.put(qkey, bind(P, device, ordered, _check))
    plan = get_plan(build_fwd_plan, P, device)
    extras = ()
    if dmask is not None or dalibi is not None:
        mask_ptr, alibi_ptr, keep = device_extras(dmask, dalibi, device, s)
        extras = (mask_ptr, alibi_ptr)
    o, lse = run_fwd(plan, device, s, dq.ptr, dk.ptr, dv.ptr, out=None if dout is None else dout.ptr,
                     return_lse=return_lse, extras=extras)
    finish(s, (dq, dk, dv, dmask, dalibi, dout))
    if out is not None:
        o = out  # the caller's own array object
    return (o, lse) if return_lse else o


def _repeat(bound, arrays, stream, return_lse, reads):
    """A call whose quick key was seen: the problem is known, its arrays are DeviceArrays, torch
    tensors (device ones) or CUDA array interfaces, so masks and slopes are read in place and
    nothing is uploaded."""
    P, device = bound.problem, bound.device
    s, (q, k, v, mask, alibi, out) = begin(bound, stream, arrays, reads)  # (addresses checked: _check)
    given = arrays[5] is not None
    plan = get_plan(build_fwd_plan, P, device)
    o, lse = run_fwd(plan, device, s, q, k, v, out=out if given else None, return_lse=return_lse,
                     extras=(mask, alibi) if mask or alibi else ())
    if given:
        o = arrays[5]
    return (o, lse) if return_lse else o


def _check(P, ptrs) -> None:
    """The per-call address checks of a repeat call (``check_pointers`` on bare addresses; an absent
    ``out`` reads as address 0, which passes)."""
    check_addresses(P, ptrs[0], ptrs[1], ptrs[2], ptrs[5])


def _raw(a):
    """The user's array behind an Arg (host NumPy data, or a device array passed through)."""
    return None if a is None else a.obj

"""``pyattn.attention_varlen``: attention over a batch of packed variable-length sequences."""

from __future__ import annotations

import numpy as np

from ..array import asarray
from ..kernels.registry import get_kernel
from ..runtime.device import get_device
from ..runtime.stream import as_stream
from ._plan import make_plan, ptx_requested, run_plan, spec_for
from ._problem import make_varlen_problem

__all__ = ["attention_varlen"]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     window=None, softcap=None, alibi_slopes=None, scale=None, return_lse=False, allow_tf32=False,
                     out=None, stream=None):
    """Attention over sequences of different lengths packed along the token axis (no padding).

    Parameters
    ----------
    q : array, shape (total_q, heads_q, head_dim)
        The queries of all sequences, concatenated.
    k, v : array, shape (total_k, heads_kv, head_dim)
    cu_seqlens_q, cu_seqlens_k : int32 array, shape (num_seqs + 1,)
        Sequence ``n`` owns query rows ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` and key rows
        ``cu_seqlens_k[n]:cu_seqlens_k[n + 1]``. Both must start at 0, be non-decreasing and end at
        the packed length; this is checked before launch (a device array's few values are copied
        back for it). Host or device, on the same side as q.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence; computed from the offsets when omitted (they are read anyway).
    causal, window, softcap, alibi_slopes, scale, allow_tf32, out, stream
        As in :func:`pyattn.attention`, per sequence: causal and the window align to each sequence's
        own bottom-right corner; ``alibi_slopes`` is (heads_q,) or (num_seqs, heads_q).
    return_lse : bool, default False
        Also return the natural-log LSE, float32, shape (heads_q, total_q) (FlashAttention's layout).

    Returns
    -------
    out : array, shape (total_q, heads_q, head_dim)
    lse : array, optional

    Notes
    -----
    Equal to calling :func:`pyattn.attention` on each sequence alone, in one launch. There is no
    ``mask`` argument (as in FlashAttention's varlen API): a mask has no fixed shape here.
    """
    if not isinstance(allow_tf32, (bool, np.bool_)):
        raise TypeError(f"allow_tf32: expected a bool, got {type(allow_tf32).__name__}")
    problem, _, (cu_q, cu_k) = make_varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, scale=scale, out=out)
    if problem.on_device:
        dq = asarray(q, stream=stream)
        device = dq.device
    else:
        device = get_device()
    s = as_stream(stream, device)
    device.activate()
    spec = spec_for(problem.dtype, problem.head_dim, device.arch, ptx_requested(), "none", problem.softcap > 0,
                    problem.alibi is not None, bool(allow_tf32))
    kernel = get_kernel(spec, device)
    if not problem.on_device:
        dq = asarray(q, device=device, stream=s)
    dk, dv = (asarray(x, device=device, stream=s) for x in (k, v))
    if problem.on_device:
        dcu_q, dcu_k = (asarray(x, stream=s) for x in (cu_seqlens_q, cu_seqlens_k))
    else:
        dcu_q, dcu_k = (asarray(np.ascontiguousarray(x), device=device, stream=s) for x in (cu_q, cu_k))
    for name, a in (("k", dk), ("v", dv), ("cu_seqlens_q", dcu_q), ("cu_seqlens_k", dcu_k)):
        if a.device is not device:
            raise ValueError(f"{name}: expected an array on device {device.ordinal} (with q), got {a.device.ordinal}")
        if name.startswith("cu") and a.elem_strides != (1,):
            raise ValueError(f"{name}: expected a contiguous array, got element strides {a.elem_strides}")
    from .attention import upload_extras

    _, dalibi = upload_extras(problem, None, alibi_slopes, device, s)
    dout = asarray(out, stream=s) if (out is not None and problem.on_device) else None
    plan = make_plan(problem, spec, kernel, (dq, dk, dv))
    o, lse = run_plan(plan, (dq, dk, dv), (None, dalibi, dcu_q, dcu_k), s, return_lse=return_lse, out=dout)
    if problem.on_device:
        if out is not None:
            o = out
        return (o, lse) if return_lse else o
    host_out = o.numpy(s)
    if out is not None:
        out[...] = host_out
        host_out = out
    return (host_out, lse.numpy(s)) if return_lse else host_out

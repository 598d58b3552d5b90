"""``pyattn.attention_varlen``: attention over a batch of packed variable-length sequences."""

from __future__ import annotations

import numpy as np

from ..interop.inputs import read_args
from ..interop.streams import order_inputs
from ..pipeline import host
from ..pipeline.device import fetch_values, finish, start
from ..pipeline.plans import get_plan
from ..runtime.stream import check_stream_arg
from ..validate.attention import check_pointers, make_varlen_problem
from ..validate.options import check_bool
from ._fwd import build_fwd_plan, device_extras, run_fwd

__all__ = ["attention_varlen"]

_ARRAYS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "out")
_REQUIRED = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")


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
        Also return the natural-log LSE, float32, shape (heads_q, total_q): FlashAttention's varlen
        layout, and what :func:`pyattn.merge_states` takes with ``layout="thd"``.

    Returns
    -------
    out : array, shape (total_q, heads_q, head_dim)
    lse : array, optional

    Notes
    -----
    Equal to calling :func:`pyattn.attention` on each sequence alone, in one launch. There is no
    ``mask`` argument (as in FlashAttention's varlen API): a mask has no fixed shape here.
    """
    check_stream_arg(stream)
    params = locals()
    args = read_args(params, _ARRAYS, _REQUIRED)
    return_lse = check_bool("return_lse", return_lse)
    P, (cu_q, cu_k) = make_varlen_problem(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
        lambda a: fetch_values(a) if a.on_device else a.obj, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        causal=causal, window=window, softcap=softcap, alibi=args["alibi_slopes"], scale=scale, out=args["out"],
        allow_tf32=check_bool("allow_tf32", allow_tf32))
    alibi = args["alibi_slopes"]
    if not P.on_device:  # NumPy in, NumPy out (a device alibi_slopes is passed through)
        ins = [args["q"].obj, args["k"].obj, args["v"].obj, cu_q.astype(np.int32), cu_k.astype(np.int32),
               np.asarray(alibi.obj, np.float32) if alibi is not None and not alibi.on_device else None]

        def run(dev, s):
            dq, dk, dv, dcq, dck, dal = dev
            if alibi is not None and alibi.on_device:
                order_inputs(s, dq.device, [alibi])
            dal_ptr = dal.ptr if dal is not None else (alibi.ptr if alibi is not None else 0)
            return run_fwd(get_plan(build_fwd_plan, P, dq.device), dq.device, s, dq.ptr, dk.ptr, dv.ptr,
                           return_lse=return_lse, extras=(0, dal_ptr, dcq.ptr, dck.ptr))

        o, lse = host.call(run, ins, [args["out"].obj if args["out"] is not None else None], stream)
        return (o, lse) if return_lse else o
    check_pointers(P, args["q"], args["k"], args["v"], args["out"])
    device, s, (dq, dk, dv, dcq, dck, dal, dout) = start(
        stream, [args[n] for n in _ARRAYS], lambda a: check_pointers(P, a[0], a[1], a[2], a[6]))
    _, alibi_ptr, keep = device_extras(None, dal, device, s)
    o, lse = run_fwd(get_plan(build_fwd_plan, P, device), device, s, dq.ptr, dk.ptr, dv.ptr,
                     out=None if dout is None else dout.ptr, return_lse=return_lse,
                     extras=(0, alibi_ptr, dcq.ptr, dck.ptr))
    finish(s, (dq, dk, dv, dcq, dck, dal, dout))
    if out is not None:
        o = out
    return (o, lse) if return_lse else o

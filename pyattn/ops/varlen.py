"""``pyattn.attention_varlen``: attention over a batch of packed variable-length sequences."""

from __future__ import annotations

import numpy as np

from ..interop.inputs import read_args
from ..interop.quick import quick_key
from ..interop.streams import order_inputs
from ..pipeline import host
from ..pipeline.device import begin, bind, fetch_values, finish, start
from ..pipeline.plans import Memo, get_plan
from ..runtime.device import keeps_context
from ..runtime.stream import check_stream_arg
from ..validate.attention import check_addresses, check_pointers, make_varlen_problem
from ..validate.options import check_bool
from ._fwd import build_fwd_plan, device_extras, run_fwd

__all__ = ["attention_varlen"]

_ARRAYS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "out")
_REQUIRED = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
# quick key -> pipeline.device.Bound of calls whose offsets are not read (device offsets, both maxima
# given): their key (the arrays' layouts and the options, maxima included) is then the whole problem,
# so a repeat call reads only pointers and producers, as pyattn.attention's does. Checked calls read
# the offsets' values every call and take the full path.
_quick = Memo()


@keeps_context
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
        the packed length. Host or device, on the same side as q. Host offsets are always checked;
        device offsets are checked (their few values copied back, a synchronisation) unless both
        maxima are given.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence (an upper bound is fine), computed from the offsets when omitted. With
        device offsets and both given, the offsets are not read on the host, as FlashAttention's
        varlen API takes them: no synchronisation, and a CUDA graph can capture the call. They are
        then your promise: the kernel clamps each sequence into the packed rows and its lengths to
        these maxima, so offsets that break it give wrong rows (or rows left unwritten), never
        reads or writes outside q, k, v, out and the LSE.
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
    qkey, reads = None, {}
    if max_seqlen_q is not None and max_seqlen_k is not None:
        qkey = quick_key(params, reads)
        bound = _quick.get(qkey)
        if bound is not None:
            return _repeat(bound, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, out), stream, return_lse, reads)
    args = read_args(params, _ARRAYS, _REQUIRED)
    return_lse = check_bool("return_lse", return_lse)
    P, cus = make_varlen_problem(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
        lambda a: fetch_values(a) if a.on_device else a.obj, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        causal=causal, window=window, softcap=softcap, alibi=args["alibi_slopes"], scale=scale, out=args["out"],
        allow_tf32=check_bool("allow_tf32", allow_tf32))
    alibi = args["alibi_slopes"]
    if not P.on_device:  # NumPy in, NumPy out (a device alibi_slopes is passed through)
        ins = [args["q"].obj, args["k"].obj, args["v"].obj, cus[0].astype(np.int32), cus[1].astype(np.int32),
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
    ordered = [args[n] for n in _ARRAYS]
    device, s, (dq, dk, dv, dcq, dck, dal, dout) = start(
        stream, ordered, lambda a: check_pointers(P, a[0], a[1], a[2], a[6]))
    if cus is None:  # (None: the offsets were not read)
        _quick.put(qkey, bind(P, device, ordered, _check))
    _, alibi_ptr, keep = device_extras(None, dal, device, s)
    o, lse = run_fwd(get_plan(build_fwd_plan, P, device), device, s, dq.ptr, dk.ptr, dv.ptr,
                     out=None if dout is None else dout.ptr, return_lse=return_lse,
                     extras=(0, alibi_ptr, dcq.ptr, dck.ptr))
    finish(s, (dq, dk, dv, dcq, dck, dal, dout))
    if out is not None:
        o = out
    return (o, lse) if return_lse else o


def _repeat(bound, arrays, stream, return_lse, reads):
    """A repeat of an unchecked call: pointers and producers read, the planned kernel launched."""
    P, device = bound.problem, bound.device
    s, (q, k, v, cu_q, cu_k, alibi, out) = begin(bound, stream, arrays, reads)  # (addresses checked: _check)
    o, lse = run_fwd(get_plan(build_fwd_plan, P, device), device, s, q, k, v, out=out if out else None,
                     return_lse=return_lse, extras=(0, alibi, cu_q, cu_k))
    if out:
        o = arrays[6]
    return (o, lse) if return_lse else o


def _check(P, ptrs) -> None:
    """A repeat call's address checks (``check_pointers`` on bare addresses; no ``out``: 0)."""
    check_addresses(P, ptrs[0], ptrs[1], ptrs[2], ptrs[6])

"""``sparse_attention``: attention where every query row attends to its own list of keys (CSR).

The key lists are a flat int32 ``indices`` array and ``offsets`` into it, one row of offsets per
query row, shared by every (batch, head), per query head, or per (batch, query head). Everything
about the lists is checked on the host before any GPU work (``pyattn.validate.csr``): the kernel
(``kernels_src/attention_sparse.cuh``) trusts that every listed index is in range and that no row
lists a key twice.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..array import c_strides
from ..interop.inputs import read_args
from ..kernels.registry import get_kernel
from ..kernels.specs import DTYPES, HEAD_DIM_BUCKETS, KernelSpec
from ..pipeline import host
from ..pipeline.device import finish, output, start
from ..pipeline.host import upload
from ..pipeline.plans import get_plan, ptx_requested
from ..runtime.device import keeps_context
from ..runtime.launch import launch
from ..runtime.stream import check_stream_arg
from ..validate.attention import make_problem
from ..validate.csr import check_csr, check_row_access
from ..validate.options import LOG2E, check_bool

__all__ = ["sparse_attention"]

_F32 = np.dtype(np.float32)
_ARRAYS = ("q", "k", "v", "out")
_REQUIRED = ("q", "k", "v")


class _Plan(NamedTuple):
    spec: object
    kernel: object


def _build(P, device) -> _Plan:
    bucket = next(b for b in HEAD_DIM_BUCKETS if b >= P.head_dim)
    spec = KernelSpec("attn_sparse", DTYPES[P.dtype][0], bucket, device.arch, ptx_requested())
    return _Plan(spec, get_kernel(spec, device))


def _run(P, csr, device, s, dq, dk, dv, dout, return_lse: bool):
    """Launch the gather kernel for a validated problem; returns ``(out, lse or None)``."""
    plan = get_plan(_build, P, device)
    B, Hq, Sq, D = P.batch, P.heads_q, P.seqlen_q, P.head_dim
    o = dout if dout is not None else output(device, s, P.out_shape(), dq.dtype)
    lse = output(device, s, P.lse_shape(), _F32) if return_lse else None
    if B * Hq * Sq:
        d_idx, d_off = upload([csr.indices, csr.offsets], device, s)
        sb, s1, s2, _ = P.out_strides if P.out_strides is not None else c_strides(P.out_shape())
        values = {"q": dq.ptr, "k": dk.ptr, "v": dv.ptr, "o": o.ptr, "lse": lse.ptr if lse is not None else 0,
                  "indices": d_idx.ptr, "offsets": d_off.ptr,
                  "off_stride_b": csr.stride_b, "off_stride_h": csr.stride_h,
                  "lse_stride_b": Hq * Sq, "lse_stride_h": Sq,
                  "batch": B, "heads_q": Hq, "group": P.group, "seqlen_q": Sq, "seqlen_k": P.seqlen_k,
                  "head_dim": D, "scale_log2": P.scale * LOG2E}
        o_bsh = (sb, s1, s2) if P.layout == "bshd" else (sb, s2, s1)
        for prefix, st in (("q", P.q_strides), ("k", P.k_strides), ("v", P.v_strides), ("o", o_bsh)):
            values.update({f"{prefix}_stride_{axis}": x for axis, x in zip("bsh", st)})
        spec = plan.spec
        launch(plan.kernel, spec.grid(B, Hq, Sq), (spec.threads, 1, 1), spec.shared_bytes, s, spec.params.pack(values))
    return o, lse


@keeps_context
def sparse_attention(q, k, v, indices, offsets, *, scale=None, layout="bshd", return_lse=False, out=None,
                     stream=None):
    """Attention in which each query row attends to its own list of keys (CSR sparsity).

    Query row ``i`` of batch ``b`` and query head ``h`` attends to the keys
    ``indices[offsets[..., i] : offsets[..., i + 1]]`` (positions into k/v's sequence axis); the
    softmax runs over exactly the listed keys, in any order.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim) for ``layout="bshd"``
        Queries; ``layout="bhsd"`` takes (batch, heads_q, seqlen_q, head_dim). NumPy arrays are
        copied to the GPU; CUDA arrays (``pyattn.DeviceArray``, CuPy, PyTorch, ...) are read in
        place (head_dim axis contiguous, 16-byte aligned, other strides multiples of 16 bytes).
    k, v : array, shape (batch, seqlen_k, heads_kv, head_dim)
        Keys and values, same layout and dtype. ``heads_q`` must be a multiple of ``heads_kv``:
        query head ``h`` reads key/value head ``h // (heads_q // heads_kv)``.
    indices : numpy.ndarray of int, shape (nnz,)
        Key positions in ``[0, seqlen_k)``, all lists in one flat array. Converted to int32.
        Entries no list covers are never read (nor checked).
    offsets : numpy.ndarray of int
        Absolute positions into ``indices``, non-decreasing along the last axis, in
        ``[0, nnz]``. Shape ``(seqlen_q + 1,)``: one pattern for every batch entry and head;
        ``(heads_q, seqlen_q + 1)``: per query head; ``(batch, heads_q, seqlen_q + 1)``: per
        (batch, query head). Axes of size 1 broadcast.
    scale : float, optional
        Score scale, default ``1 / sqrt(head_dim)``.
    layout : {"bshd", "bhsd"}
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of the scores, float32 (batch, heads_q, seqlen_q).
    out : array, optional
        Destination of the output's exact shape and dtype: a device array for device inputs, a
        writable NumPy array for NumPy inputs.
    stream : optional
        Stream for all work (``pyattn.Stream``, ``__cuda_stream__`` object or int ``CUstream``).

    Returns
    -------
    out : array, q's shape and dtype
        NumPy for NumPy inputs, ``pyattn.DeviceArray`` for device inputs (``out`` when given).
    lse : array, optional
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        Bad dtypes; ``indices``/``offsets`` not host NumPy integer arrays (device index arrays
        are not supported yet).
    ValueError
        Bad shapes; offsets outside ``[0, nnz]`` or decreasing within a row; an index outside
        ``[0, seqlen_k)``; a key listed twice by one row; misaligned device arrays. All before
        any GPU work; the message names the argument, the row and the value.

    Notes
    -----
    One warp per query row gathers the listed K/V rows from global memory; scores, softmax and
    accumulation are float32 and the output is rounded to q's dtype. A row with an empty list
    gets output 0 and LSE ``-inf``. Each output element is written by exactly one thread (no
    atomics), so results are deterministic. The host checks cost time linear in the number of
    listed entries per call (tens of ns each), plus a sort of the lists that are not strictly
    increasing (the duplicate check); sorted lists are the fast case.
    """
    check_stream_arg(stream)
    params = locals()
    args = read_args(params, _ARRAYS, _REQUIRED)
    return_lse = check_bool("return_lse", return_lse)
    P = make_problem(args["q"], args["k"], args["v"], scale=scale, layout=layout, out=args["out"])
    csr = check_csr(indices, offsets, P.batch, P.heads_q, P.seqlen_q, P.seqlen_k)
    if not P.on_device:  # NumPy in, NumPy out
        def run(dev, s):
            dq, dk, dv = dev
            return _run(P, csr, dq.device, s, dq, dk, dv, None, return_lse)

        o, lse = host.call(run, [args["q"].obj, args["k"].obj, args["v"].obj],
                           [args["out"].obj if args["out"] is not None else None], stream)
        return (o, lse) if return_lse else o
    device_args = [args[n] for n in _ARRAYS]
    for a in device_args:
        if a is not None:
            check_row_access(a)
    device, s, (dq, dk, dv, dout) = start(stream, device_args,
                                          lambda ordered: [check_row_access(a) for a in ordered if a is not None])
    o, lse = _run(P, csr, device, s, dq, dk, dv, dout, return_lse)
    finish(s, (dq, dk, dv, dout))
    if out is not None:
        o = out
    return (o, lse) if return_lse else o

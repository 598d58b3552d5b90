"""Launch plans for the forward attention kernels, shared by ``attention`` and ``attention_varlen``.

A :class:`Plan` holds everything a validated call needs besides its data pointers and stream: the
kernel, the launch shape, and the parameter struct with every non-pointer field pre-packed. A
repeat call is then one pool allocation, a small ``struct.pack`` and a launch.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np

from ..array import _c_strides, allocate
from ..kernels.specs import select_attention_spec
from ..runtime.launch import launch
from ..runtime.memory import Allocation

__all__ = ["Plan", "make_plan", "run_plan", "spec_for", "ptx_requested"]

_LOG2E = 1.4426950408889634
_F32 = np.dtype(np.float32)
_N_EXTRAS = 7  # pointer fields of AttnFwdParams after q, k, v, o, lse


@functools.lru_cache(maxsize=512)
def spec_for(dtype: str, head_dim: int, arch: str, ptx: bool, mask: str, softcap: bool, alibi: bool,
             allow_tf32: bool = False):
    """The kernel spec of a problem (cached: selection is on every slow-path call)."""
    return select_attention_spec(dtype, head_dim, arch, ptx=ptx, mask=mask, softcap=softcap, alibi=alibi,
                                 allow_tf32=allow_tf32)


def ptx_requested() -> bool:
    return os.environ.get("PYATTN_PTX", "") == "1"


class Plan(NamedTuple):
    """Everything a validated call needs besides the data pointers and the stream."""

    kernel: object
    grid: tuple
    block: tuple
    shared_bytes: int
    packer: object  # PartialPack: q, k, v, o, lse, mask, alibi, cu_q, cu_k pointers -> param bytes
    out_shape: tuple
    out_strides: tuple
    out_elem_strides: tuple
    out_nbytes: int
    lse_shape: tuple
    dtype: np.dtype
    empty: bool  # nothing to launch (a zero-size dimension)
    align_mask: int  # q/k/v addresses must have these bits clear (16-byte cp.async in the tensor-core kernels)
    out_align_mask: int  # and out's (the tensor-core kernels store pairs of elements)


def _bsh(elem_strides: tuple, layout: str) -> tuple:
    """Element strides (batch, seq, head) of an output in ``layout``."""
    if layout == "thd":
        return (0, elem_strides[0], elem_strides[1])
    sb, s1, s2, _ = elem_strides
    return (sb, s1, s2) if layout == "bshd" else (sb, s2, s1)


def make_plan(P, spec, kernel, arrays, tile_stride_h: int = 0) -> Plan:
    """Build the plan of problem ``P`` (an ``AttentionProblem``) for ``spec``/``kernel``.

    ``arrays`` are the q, k, v DeviceArrays; the tensor-core kernels' 16-byte loads need their strides
    to be multiples of 16 bytes (checked here, once per plan). ``tile_stride_h``: block-sparse
    calls, rows of the tile list per query head (0 = one layout shared by all heads).
    """
    itemsize = arrays[0].dtype.itemsize
    tensor_cores = spec.family in ("attn_fwd_mma", "attn_fwd_tf32", "attn_fwd_wgmma")
    align_mask = 15 if tensor_cores else 0
    if tensor_cores:
        per_chunk = 16 // itemsize
        for name, a in zip(("q", "k", "v"), arrays):
            if any(st % per_chunk for st in a.elem_strides[:-1]):
                raise ValueError(f"{name}: the tensor-core kernel reads 16-byte chunks; strides must be multiples "
                                 f"of {per_chunk} elements, got {a.elem_strides} (copy the array to make it "
                                 f"contiguous)")
        if P.out_strides is not None and any(st % 2 for st in P.out_strides[:-1]):
            raise ValueError(f"out: the tensor-core kernel writes pairs of elements; strides must be even, "
                             f"got {P.out_strides}")
    out_shape = P.out_shape()
    c_out = _c_strides(out_shape, 1)
    out_elem = P.out_strides if P.out_strides is not None else c_out
    qs, ks, vs = P.q_strides, P.k_strides, P.v_strides
    os_ = _bsh(out_elem, P.layout)
    if P.layout == "thd":  # FlashAttention's varlen LSE: (Hq, total_q)
        lse_shape, lse_b, lse_h = (P.heads_q, P.total_q), 0, P.total_q
    else:
        lse_shape, lse_b, lse_h = (P.batch, P.heads_q, P.seqlen_q), P.heads_q * P.seqlen_q, P.seqlen_q
    mask_strides = P.mask.strides if P.mask is not None else (0, 0, 0, 0)
    packer = spec.params.partial({
        "q_stride_b": qs[0], "q_stride_s": qs[1], "q_stride_h": qs[2],
        "k_stride_b": ks[0], "k_stride_s": ks[1], "k_stride_h": ks[2],
        "v_stride_b": vs[0], "v_stride_s": vs[1], "v_stride_h": vs[2],
        "o_stride_b": os_[0], "o_stride_s": os_[1], "o_stride_h": os_[2],
        "mask_stride_b": mask_strides[0], "mask_stride_h": mask_strides[1],
        "mask_stride_q": mask_strides[2], "mask_stride_k": mask_strides[3],
        "lse_stride_b": lse_b, "lse_stride_h": lse_h,
        "batch": P.batch, "heads_q": P.heads_q, "heads_kv": P.heads_kv, "group": P.group,
        "seqlen_q": P.seqlen_q, "seqlen_k": P.seqlen_k, "head_dim": P.head_dim, "causal": P.causal,
        "window_left": P.window[0], "window_right": P.window[1],
        "alibi_stride_b": P.alibi.stride_b if P.alibi is not None else 0,
        "scale_log2": P.scale * _LOG2E, "scale": P.scale, "softcap": P.softcap,
        "tile_stride_h": tile_stride_h,
    })
    n_out = int(np.prod(out_shape))
    empty = n_out == 0 or P.batch == 0
    return Plan(kernel, spec.grid(P.batch, P.heads_q, P.seqlen_q), (spec.threads, 1, 1), spec.shared_bytes,
                packer, out_shape, tuple(e * itemsize for e in c_out), c_out, n_out * itemsize,
                lse_shape, arrays[0].dtype, empty, align_mask, 2 * itemsize - 1 if tensor_cores else 0)


def _check_alignment(arrays, mask: int) -> None:
    """Reject, before launch, q/k/v/out addresses the kernel's 16-byte loads cannot use."""
    for name, a in zip(("q", "k", "v"), arrays):
        if a.ptr & mask:
            raise ValueError(f"{name}: the tensor-core kernel reads 16-byte chunks; the data address must be "
                             f"16-byte aligned (copy the array to make it aligned)")


def run_plan(plan: Plan, arrays, extras: tuple, s, *, return_lse: bool, out=None):
    """Allocate outputs (unless ``out`` is given) and launch a planned call on stream ``s``.

    Parameters
    ----------
    plan : Plan
    arrays : (q, k, v) DeviceArrays
    extras : (mask, alibi, cu_seqlens_q, cu_seqlens_k[, tile_ptr, tile_idx, tile_bits]) DeviceArrays or None
        Missing trailing entries are null (the block-sparse tile list is only given by its op).
    s : Stream
    return_lse : bool
    out : DeviceArray, optional
        Validated destination (its strides are in the plan).

    Returns
    -------
    (out, lse or None) as DeviceArrays
    """
    if plan.align_mask:
        _check_alignment(arrays, plan.align_mask)
        if out is not None and out.ptr & plan.out_align_mask:
            raise ValueError(f"out: the tensor-core kernel writes pairs of elements; the address must be "
                             f"{plan.out_align_mask + 1}-byte aligned")
    device = arrays[0].device
    if out is None:
        out = allocate(device, s, plan.out_shape, plan.dtype, plan.out_strides, plan.out_elem_strides,
                       plan.out_nbytes)
    lse = None
    if return_lse:
        shape = plan.lse_shape
        elem = _c_strides(shape, 1)
        n = int(np.prod(shape))
        lse = allocate(device, s, shape, _F32, tuple(4 * e for e in elem), elem, 4 * n)
    if not plan.empty:
        ptrs = [a.ptr if a is not None else 0 for a in extras] + [0] * (_N_EXTRAS - len(extras))
        params = plan.packer.pack(arrays[0].ptr, arrays[1].ptr, arrays[2].ptr, out.ptr,
                                  lse.ptr if lse is not None else 0, *ptrs)
        launch(plan.kernel, plan.grid, plan.block, plan.shared_bytes, s, params)
        for a in (*arrays, *extras):
            owner = a.owner if a is not None else None
            if type(owner) is Allocation and owner.stream is not s:
                owner.record_stream(s)  # the block's free must wait for this stream's use
    return out, lse

"""The launch plan of the backward pass, shared by ``attention_backward`` and ``attention_varlen_backward``.

Three launches on one parameter struct (``ATTN_BWD_PARAMS``): ``attn_bwd_pre`` over query rows
(dsum, the LSE in log2 units, dq_acc zeroed, deterministic counters zeroed), the main kernel over
key blocks (dK, dV; dQ into dq_acc), ``attn_bwd_convert`` over query rows (dq). The scratch (one
pool block per call: LSE, dsum, dq_acc, counters) is freed in stream order after the launches.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..array import c_strides
from ..interop.inputs import numpy_dtype
from ..kernels.registry import get_kernel
from ..kernels.specs import row_pass_rows_per_warp, select_backward_specs
from ..pipeline.device import layout, output
from ..pipeline.plans import ptx_requested
from ..runtime.launch import launch
from ..validate.options import LOG2E

__all__ = ["BwdPlan", "build_bwd_plan", "run_bwd", "VARLEN_ROW_PAD"]

_F32 = np.dtype(np.float32)
VARLEN_ROW_PAD = 128  # kernels_src/attention_bwd_common.cuh kBwdRowPad: scratch rows added per varlen sequence
_ALIGN_FLOATS = 64  # scratch regions start 256 bytes apart


class _Launch(NamedTuple):
    kernel: object
    grid: tuple
    block: tuple
    shared_bytes: int


class BwdPlan(NamedTuple):
    """Everything a validated backward call needs besides its pointers and stream."""

    launches: tuple  # (pre, main, convert): a _Launch each, or None where its grid is empty
    packer: object  # PartialPack: the 16 pointers of AttnBwdParams -> param bytes
    grads: tuple  # pipeline.device.layout of dq, dk, dv (for the ones the op allocates)
    scratch: tuple  # float offsets of lse_log2, dsum, dq_acc, sem (int32; -1: none) in the scratch block, its size


def _bsh(elem_strides: tuple, lay: str) -> tuple:
    """Element strides (batch, seq, head) of a C-contiguous result of layout ``lay``."""
    if lay == "thd":
        return (0, elem_strides[0], elem_strides[1])
    sb, s1, s2, _ = elem_strides
    return (sb, s1, s2) if lay == "bshd" else (sb, s2, s1)


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _scratch(P, bm: int, deterministic: bool) -> tuple:
    """(acc_stride_b, acc_stride_h, m_blocks, float offsets of the four regions and the total)."""
    if P.layout == "thd":  # each sequence's rows padded by VARLEN_ROW_PAD (>= a query tile)
        per_head = P.total_q + P.batch * VARLEN_ROW_PAD
        acc_b, acc_h, rows = 0, per_head, P.heads_q * per_head
    else:
        per_head = _up(P.seqlen_q, bm)
        acc_b, acc_h, rows = P.heads_q * per_head, per_head, P.batch * P.heads_q * per_head
    m_blocks = -(-P.seqlen_q // bm)
    sems = P.batch * P.heads_q * m_blocks if deterministic else 0
    offs, at = [], 0
    for n in (rows, rows, rows * P.head_dim, sems):
        offs.append(at if n else -1)  # -1: no such region (a null pointer)
        at += _up(n, _ALIGN_FLOATS)
    return acc_b, acc_h, m_blocks, (*offs, max(at, _ALIGN_FLOATS))  # (never an empty block)


def _main_grid(n_blocks: int, heads_kv: int, batch: int, deterministic: bool) -> tuple:
    """Key blocks fastest (a head's blocks share its Q/dO in L2), or slowest with ``deterministic``
    (blocks that take turns on a query tile then mostly run in different waves; see
    ``bwd_block`` in kernels_src/attention_bwd_common.cuh)."""
    return (heads_kv, batch, n_blocks) if deterministic else (n_blocks, heads_kv, batch)


def build_bwd_plan(problem, device) -> BwdPlan:
    """The plan of a :class:`~pyattn.validate.backward.BackwardProblem` on ``device``."""
    P = problem.base
    pre, main, conv = select_backward_specs(P.dtype, P.head_dim, device.arch, ptx=ptx_requested(),
                                            softcap=P.softcap > 0, alibi=P.alibi is not None)
    bm, bn = main.tiles.block_m, main.tiles.block_n
    B, Hq, Sq, Sk = P.batch, P.heads_q, P.seqlen_q, P.seqlen_k  # varlen: sequences, longest lengths
    acc_b, acc_h, m_blocks, scratch = _scratch(P, bm, problem.deterministic)
    dtype = numpy_dtype("q", P.dtype)
    q_shape, k_shape = P.out_shape(), problem.k_shape
    grad_strides = (problem.dq_strides or _bsh(c_strides(q_shape), P.layout),
                    problem.dk_strides or _bsh(c_strides(k_shape), P.layout),
                    problem.dv_strides or _bsh(c_strides(k_shape), P.layout))
    named = (("q", P.q_strides), ("k", P.k_strides), ("v", P.v_strides), ("o", problem.o_strides),
             ("dout", problem.dout_strides), ("dq", grad_strides[0]), ("dk", grad_strides[1]),
             ("dv", grad_strides[2]))
    lse_b, lse_h, lse_s = problem.lse_strides
    static = {f"{n}_stride_{a}": st for n, sts in named for a, st in zip("bsh", sts)}
    static.update({
        "lse_stride_b": lse_b, "lse_stride_h": lse_h, "lse_stride_s": lse_s, "acc_stride_b": acc_b,
        "acc_stride_h": acc_h, "batch": B, "heads_q": Hq, "heads_kv": P.heads_kv, "group": P.group,
        "seqlen_q": Sq, "seqlen_k": Sk, "head_dim": P.head_dim, "causal": P.causal, "window_left": P.window[0],
        "window_right": P.window[1], "alibi_stride_b": P.alibi.stride_b if P.alibi is not None else 0,
        "m_blocks": m_blocks, "block_m": bm, "deterministic": int(problem.deterministic), "scale": P.scale,
        "scale_log2": P.scale * LOG2E, "softcap": P.softcap, "total_q": P.total_q, "total_k": P.total_k,
    })
    rows_launch = B > 0 and Sq > 0
    row_block = pre.tiles.warps * row_pass_rows_per_warp(P.head_dim, dtype.itemsize)  # rows per block
    launches = (
        _Launch(get_kernel(pre, device), (-(-_up(Sq, bm) // row_block), Hq, B), (pre.threads, 1, 1), 0)
        if rows_launch else None,
        _Launch(get_kernel(main, device), _main_grid(-(-Sk // bn), P.heads_kv, B, problem.deterministic),
                (main.threads, 1, 1), main.shared_bytes) if B > 0 and Sk > 0 else None,
        _Launch(get_kernel(conv, device), (-(-Sq // row_block), Hq, B), (conv.threads, 1, 1), 0)
        if rows_launch else None,
    )
    grads = (layout(q_shape, dtype), layout(k_shape, dtype), layout(k_shape, dtype))
    return BwdPlan(launches, main.params.partial(static), grads, scratch)


def run_bwd(plan: BwdPlan, device, s, ptrs: tuple, given: tuple, extras: tuple = ()) -> tuple:
    """Allocate the missing gradients and the scratch, and launch the three kernels on ``s``.

    ``ptrs``: device addresses of (q, k, v, out, dout, lse); ``given``: addresses of the caller's
    (dq, dk, dv), None for each the op allocates; ``extras``: (alibi, cu_seqlens_q, cu_seqlens_k),
    missing ones 0. Returns the new DeviceArrays (None where the caller gave one).
    """
    new = tuple(output(device, s, *lay[:2]) if g is None else None for g, lay in zip(given, plan.grads))
    grads = tuple(g if g is not None else a.ptr for g, a in zip(given, new))
    *offs, total = plan.scratch
    block = output(device, s, (total,), _F32)  # freed in stream order once the launches are done
    lse2, dsum, acc, sem = (block.ptr + 4 * off if off >= 0 else 0 for off in offs)
    x = tuple(extras) + (0,) * (3 - len(extras))
    q, k, v, o, dout, lse = ptrs
    params = plan.packer.pack(q, k, v, o, dout, lse, *grads, acc, lse2, dsum, sem, *x)
    for ln in plan.launches:
        if ln is not None:
            launch(ln.kernel, ln.grid, ln.block, ln.shared_bytes, s, params)
    return new

"""Plans and launches of prefill / tree verification over a paged KV cache.

The kernel is the paged variant of the tensor-core prefill (``attn_prefill_wgmma`` on sm_90a, or
``attn_prefill_tma``, its K/V read as TMA page boxes, where the page size and head dim allow;
``attn_prefill_mma`` elsewhere; ``attn_tree_*`` with ancestor masks). A plan fixes everything
but the per-call values (which sequences, how many new tokens each, the page table): the page
table is the cache's own device copy (or the caller's, :func:`pyattn.paged_prefill`), and
cu_seqlens_q / tree masks go up in one small copy,
reused while a recent call had the same values. When the grid would not fill the GPU (a draft tree of a few
sequences), each block's key tiles are split and the fp32 partials merged by the decode combine.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..array import allocate
from ..interop.streams import note_use
from ..kernels.families.prefill import prefill_tma_serves
from ..kernels.params import PAGED_FWD_EXTRA
from ..kernels.registry import generation, get_kernel
from ..kernels.specs import DTYPES, HEAD_DIM_BUCKETS, WGMMA_ARCHS, KernelSpec
from ..pipeline.device import layout, output
from ..pipeline.host import upload
from ..pipeline.plans import get_plan, ptx_requested
from ..runtime.launch import launch
from ..validate.options import LOG2E
from ._decode import choose_num_splits, pool_maps

__all__ = ["KVTables", "PrefillPlan", "prefill_specs", "run_prefill"]

_F32 = np.dtype(np.float32)
# choose_num_splits by value: a pure function of three ints, which a repeat call (an engine's
# per-layer paged_prefill under its bounds) asks again each time (~5 us of host time a call).
_splits = functools.lru_cache(maxsize=1024)(choose_num_splits)
# The last few uploads of (cu_seqlens_q, tree masks), by value: a serving loop repeats its shapes
# (every chunk or tree alike), and a host upload goes through pinned staging, which waits for the
# stream's earlier work; a hit costs a bytes comparison instead.
_UPLOADS: dict = {}
_MAX_UPLOADS = 8


@functools.lru_cache(maxsize=256)
def prefill_specs(dtype: str, head_dim: int, arch: str, ptx: bool, softcap: bool, alibi: bool, tree: bool,
                  page_size: int = 0, generation: int = 0) -> tuple:
    """(prefill spec, combine spec): wgmma on sm_90a (64-wide head-dim buckets; K/V as TMA page
    boxes, attn_prefill_tma, where :func:`prefill_tma_serves` says so for pages of ``page_size``
    slots), mma.sync elsewhere. ``generation``: the registry's, so that a table replaced by
    ``override_tiles`` is read again."""
    tag = DTYPES[dtype][0]
    kind = "tree" if tree else "prefill"
    if arch in WGMMA_ARCHS:
        bucket = -(-head_dim // 64) * 64
        fam = "attn_prefill_tma" if prefill_tma_serves(arch, bucket, page_size, tree) else f"attn_{kind}_wgmma"
        spec = KernelSpec(fam, tag, bucket, arch, ptx, softcap=softcap, alibi=alibi)
    else:
        bucket = next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)
        spec = KernelSpec(f"attn_{kind}_mma", tag, bucket, arch, ptx, softcap=softcap, alibi=alibi)
    return spec, KernelSpec("split_combine", tag, next(b for b in HEAD_DIM_BUCKETS if b >= head_dim), arch, ptx)


class PrefillPlan(NamedTuple):
    """What a validated prefill needs besides the per-call values and pointers."""

    kernel: object
    ckernel: object
    block: tuple
    shared_bytes: int
    block_m: int
    block_n: int
    row_group: int  # query heads per block row group (1 with ALiBi: one slope per block)
    grid_y: int  # heads_q / row_group
    slots: int  # concurrent blocks on the GPU
    base: object  # PartialPack of the AttnFwdParams member: pointers -> bytes
    own: dict  # the PagedFwdExtra fields fixed by the plan
    cspec: object
    cthreads: int
    cwarps: int
    tma_box: int  # attn_prefill_tma: slots per page box (min(page size, block_n)); 0 for the cp.async kernels


def _build(P, device) -> PrefillPlan:
    spec, cspec = prefill_specs(P.dtype.name, P.head_dim, device.arch, ptx_requested(), P.softcap > 0,
                                P.alibi is not None, P.tree, P.pool.page_size, generation())
    kernel, ckernel = get_kernel(spec, device), get_kernel(cspec, device)
    t = spec.tiles
    rg = 1 if P.alibi is not None else P.group  # ALiBi slopes differ per head: one head per block
    Hq, D, pool = P.heads_q, P.head_dim, P.pool
    # LSE element (sequence, head h, token i) at q_row0 * lse_stride_b + h * lse_stride_h + i, q_row0
    # the sequence's first packed row (params.py PagedFwdExtra: the kernels keep no batch index).
    if P.layout == "thd":  # FlashAttention's varlen LSE: (Hq, total)
        lse_b, lse_h = 1, P.total_q
    else:  # (batch, Hq, t): q_row0 = b * t, element (b, h, i) at b * t * Hq + h * t + i
        lse_b, lse_h = Hq, P.total_q // P.batch
    base = spec.params.base.partial({
        "q_stride_b": 0, "q_stride_s": P.q_strides[0], "q_stride_h": P.q_strides[1],
        "k_stride_b": 0, "k_stride_s": 0, "k_stride_h": pool.k_strides[2],
        "v_stride_b": 0, "v_stride_s": 0, "v_stride_h": pool.v_strides[2],
        "o_stride_b": 0, "o_stride_s": Hq * D, "o_stride_h": D,
        "mask_stride_b": 0, "mask_stride_h": 0, "mask_stride_q": 0, "mask_stride_k": 0,
        "lse_stride_b": lse_b, "lse_stride_h": lse_h,
        "batch": P.batch, "heads_q": Hq, "heads_kv": P.heads_kv, "group": P.group, "seqlen_q": 0, "seqlen_k": 0,
        "head_dim": D, "causal": P.causal, "window_left": P.window[0], "window_right": P.window[1],
        "alibi_stride_b": P.alibi.stride_b if P.alibi is not None else 0,
        "scale_log2": P.scale * LOG2E, "scale": P.scale, "softcap": P.softcap, "tile_stride_h": 0,
        "o_scale": 1.0, "total_q": P.total_q, "total_k": 0,  # (the paged kernels read their own key lengths)
    })
    ps = pool.page_size
    own = {"k_stride_page": pool.k_strides[0], "k_stride_slot": pool.k_strides[1],
           "v_stride_page": pool.v_strides[0], "v_stride_slot": pool.v_strides[1],
           "part_stride": P.total_q * Hq, "page_size": ps,
           "page_shift": ps.bit_length() - 1 if ps & (ps - 1) == 0 else -1, "row_group": rg,
           "num_pages": pool.num_pages}
    slots = device.sm_count * max(1, kernel.max_active_blocks(spec.threads, spec.shared_bytes))
    box = min(ps, t.block_n) if spec.family == "attn_prefill_tma" else 0
    return PrefillPlan(kernel, ckernel, (spec.threads, 1, 1), spec.shared_bytes, t.block_m, t.block_n, rg, Hq // rg,
                       slots, base, own, cspec, cspec.threads, cspec.tiles.warps, box)


def _combine(plan: PrefillPlan, P, s, part, lpart, splits: int, out, lse, t: int) -> None:
    """Merge the splits' fp32 partials (split, total, Hq, D) into out and lse (split_combine: merge_states<float, T>)."""
    Hq, D, total = P.heads_q, P.head_dim, P.total_q
    rows = total * Hq
    if P.layout == "thd":  # rows (1, total, Hq); lse (Hq, total)
        dims, ost, pst, lst = (1, total, Hq), (0, Hq * D, D), (0, Hq, 1), (0, 1, total)
    else:  # rows (batch, t, Hq); lse (batch, Hq, t)
        dims, ost, pst, lst = (P.batch, t, Hq), (t * Hq * D, Hq * D, D), (t * Hq, Hq, 1), (Hq * t, 1, t)
    values = {"o_a": part.ptr, "lse_a": lpart.ptr, "o_b": part.ptr + 4 * rows * D, "lse_b": lpart.ptr + 4 * rows,
              "out": out.ptr, "out_lse": lse.ptr if lse is not None else 0, "n_b": splits - 1,
              "o_b_stride_n": rows * D, "lse_b_stride_n": rows, "dim0": dims[0], "dim1": dims[1], "dim2": dims[2],
              "head_dim": D}
    for name, st in (("o_a", ost), ("o_b", ost), ("out", ost), ("lse_a", pst), ("lse_b", pst), ("out_lse", lst)):
        values.update({f"{name}_stride_{i}": v for i, v in enumerate(st)})
    launch(plan.ckernel, (-(-rows // plan.cwarps), 1, 1), (plan.cthreads, 1, 1), 0, s,
           plan.cspec.params.pack(values))


def _values_on_device(device, s, cu32: np.ndarray, masks) -> tuple:
    """Device copies of the per-call index values, reused while a recent call had the same ones."""
    key = (device.ordinal, cu32.tobytes(), None if masks is None else masks.tobytes())
    hit = _UPLOADS.get(key)
    if hit is not None:
        note_use(s, [a for a in hit if a is not None])  # their frees wait for this stream's use too
        return hit
    if len(_UPLOADS) >= _MAX_UPLOADS:
        _UPLOADS.clear()
    hit = _UPLOADS[key] = tuple(upload([cu32, masks], device, s))
    return hit


class KVTables(NamedTuple):
    """Where a prefill's keys are: the K / V pools' addresses; the page table, CSR (``indices`` and
    ``indptr``: sequence ``b``'s pages start at ``indices + indptr[b]``) or a block table
    (``indptr`` None: row ``b`` at ``indices + b * stride``); ``kv_len`` (int32 device arrays, or
    anything with a ``ptr``); and a bound on the lengths (the kernel clamps them to it, and the split
    choice reads it)."""

    k: int
    v: int
    indices: object
    indptr: object
    kv_len: object
    max_len: int
    stride: int = 0


def run_prefill(P, device, s, q: int, tables, cu, masks, alibi_ptr: int, return_lse: bool, max_q: int = 0):
    """Launch the prefill (and the split combine) of problem ``P`` over ``P.pool``'s pages.

    ``q``: device address of the packed queries; ``tables``: a callable returning the
    :class:`KVTables` on ``s``, called only when some sequence has new tokens (a cache orders its
    stream and uploads its tables then); ``cu``: host cu_seqlens_q (int64), or a device int32 array
    read unchecked (then ``max_q``, a host bound on its counts, sizes the grid and the kernel
    clamps to it); ``masks``: the tree's uint64 ancestor masks (total,) or None. Returns ``(out,
    lse or None)`` DeviceArrays.
    """
    plan = get_plan(_build, P, device)
    t = P.total_q // P.batch if P.layout == "bshd" else 0
    out = allocate(device, s, *layout(P.out_shape(t), P.dtype))
    lse_shape = (P.heads_q, P.total_q) if P.layout == "thd" else (P.batch, P.heads_q, t)
    lse = allocate(device, s, *layout(lse_shape, _F32)) if return_lse else None
    on_host = isinstance(cu, np.ndarray)
    if on_host:
        max_q = int(np.diff(cu).max(initial=0))
    # The grid: the batch's query tiles for each row group, a block finding its sequence from the
    # offsets (attention_mask.cuh paged_unit / paged_tile). The tiles are bounded without reading the
    # offsets (a device cu_seqlens_q is not read): no more than the longest sequence's tiles each,
    # nor than the rows' tiles plus one part tile a sequence. (The longest's tiles for every
    # sequence, the grid before, gave a mixed step of one-token rows and a 2048-token chunk 63 empty
    # blocks for each real one.)
    bm, rg = plan.block_m, plan.row_group
    tiles = min(P.batch * -(-max_q * rg // bm), -(-P.total_q * rg // bm) + P.batch - 1)
    if tiles <= 0:
        return out, lse
    kv = tables(s)
    max_len = kv.max_len
    if P.num_splits:
        splits = P.num_splits
    else:
        units = tiles * plan.grid_y
        splits = _splits(units, -(-max_len // plan.block_n), plan.slots) if units < plan.slots else 1
    d_cu, d_masks = _values_on_device(device, s, cu.astype(np.int32), masks) if on_host else (cu, None)
    part = lpart = None
    if splits > 1:
        rows = P.total_q * P.heads_q
        part = output(device, s, (splits * rows * P.head_dim,), _F32)
        lpart = output(device, s, (splits * rows,), _F32)
    own = dict(plan.own, page_indices=kv.indices.ptr, page_indptr=kv.indptr.ptr if kv.indptr is not None else 0,
               kv_len=kv.kv_len.ptr, table_stride=kv.stride, max_q=max_q, max_k=max_len,
               tree_mask=d_masks.ptr if d_masks is not None else 0, o_part=part.ptr if part is not None else 0,
               lse_part=lpart.ptr if lpart is not None else 0, num_splits=splits,
               tmaps=pool_maps(device, P.pool, kv.k, kv.v, plan.tma_box, s) if plan.tma_box else 0)
    params = plan.base.pack(q, kv.k, kv.v, out.ptr, lse.ptr if lse is not None else 0, 0, alibi_ptr,
                            d_cu.ptr, 0, 0, 0, 0) + PAGED_FWD_EXTRA.pack(own)
    launch(plan.kernel, (tiles * splits * plan.grid_y, 1, 1), plan.block, plan.shared_bytes, s, params)
    if splits > 1:
        _combine(plan, P, s, part, lpart, splits, out, lse, t)
    return out, lse

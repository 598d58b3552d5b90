"""Launch plans of the forward attention kernels, shared by ``attention``, ``attention_varlen`` and
``block_sparse_attention``; and the per-call extras (a host mask or ALiBi slopes with device q).

A :class:`FwdPlan` holds everything a validated call needs besides its pointers and stream: the
kernel, the launch shape, and the parameter struct with every non-pointer field pre-packed. A
repeat call is then one pool allocation, a small ``struct.pack`` and a launch.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

import math
from typing import NamedTuple

import numpy as np

from ..array import allocate, c_strides
from ..interop.inputs import numpy_dtype
from ..kernels.registry import get_kernel
from ..kernels.specs import HEAD_DIM_BUCKETS, KernelSpec, select_attention_spec
from ..pipeline.device import layout
from ..pipeline.plans import get_plan, ptx_requested
from ..runtime.launch import launch
from ..runtime.tensormap import encode_tiled, rank4
from ..validate.attention import FP8
from ..validate.block_layout import band_limits
from ..validate.options import LOG2E
from ._fwd_tail import NO_TAIL, persistent_launch, persistent_units, tail_fields

__all__ = ["FwdPlan", "MaskMap", "MaskBits", "VtPass", "TmaMaps", "SparseFwd", "build_fwd_plan", "mask_layout",
           "packed_mask_layout", "packed_map_layout", "persistent_slots", "run_fwd", "device_extras"]

_F32 = np.dtype(np.float32)
_ZEROS = (0,) * 7  # the pointer fields of AttnFwdParams after q, k, v, o, lse, all null
_NO_MAP = bytes(128)  # attn_fwd_tma's mask map without a mask (never read)
_MASK_MAP_DTYPES = {"bool": ("u8", 1), "f16": ("f16", 2), "bf16": ("bf16", 2), "f32": ("f32", 4)}
_U32 = np.dtype(np.uint32)


class SparseFwd(NamedTuple):
    """A block-sparse forward problem: the attention problem, the kernel's sparse mode (1: the
    standard tiles, 2: 64 x 64 tiles) and whether the layout has one tile list per query head."""

    base: object
    sparse: int
    per_head: bool


class FwdPlan(NamedTuple):
    """Everything a validated call needs besides the data pointers and the stream."""

    spec: object
    kernel: object
    grid: tuple
    block: tuple
    shared_bytes: int
    packer: object  # PartialPack: q, k, v, o, lse, mask, alibi, cu_q, cu_k, tile pointers -> param bytes
    out_layout: tuple  # pipeline.device.layout of the output and of the LSE
    lse_layout: tuple
    empty: bool  # nothing to launch (a zero-size dimension)
    tma: object = None  # TmaMaps for a TMA kernel, else None
    problem: object = None  # what the plan was built for (a mask TMA cannot read needs another plan)
    bits: object = None  # MaskBits when the kernel reads the bool mask packed to bits
    vt: object = None  # VtPass when the kernel reads fp8 V transposed (attn_fwd_fp8)
    tail: object = None  # _fwd_tail.TailSplit when a persistent launch splits its last round by keys


class VtPass(NamedTuple):
    """fp8 V transposed ahead of attn_fwd_fp8 (kernels_src/fp8_vt.cuh) into a per-call buffer: the
    kernel, its launch shape, its parameters but the (v, vt) addresses, and the buffer's
    ``pipeline.device.layout``."""

    kernel: object
    grid: tuple
    block: tuple
    packer: object
    layout: tuple


class MaskBits(NamedTuple):
    """The per-call pack of a bool mask to bits (kernels_src/mask_bits.cuh) ahead of attn_fwd_tma:
    the pack kernel, its launch shape, its parameters but the (source, packed) addresses, and the
    packed buffer's ``pipeline.device.layout``."""

    kernel: object
    grid: tuple
    block: tuple
    packer: object
    layout: tuple


class MaskMap(NamedTuple):
    """The TMA map of a mask tensor: its map dtype, rank-4 layout (keys, query rows, heads,
    batch; ``runtime.tensormap.rank4``), box (keys, rows) and swizzle span in bytes."""

    dtype: str
    layout: tuple
    box: tuple
    swizzle: int


class TmaMaps(NamedTuple):
    """How a call's TMA tensor maps are made (attn_fwd_tma, attn_fwd_fp8): the map dtype, the rank-4
    layouts of q, k and v (``runtime.tensormap.rank4``; fp8: of V^T, the fp8_vt pass's buffer), the
    boxes (elements of the contiguous axis, rows) of each, the padding between the packed
    AttnFwdParams and the first (64-byte aligned) map, and the mask's map (None without)."""

    dtype: str
    layouts: tuple
    boxes: tuple
    pad: bytes
    mask: object = None

    def pack(self, q: int, k: int, v: int, mask: int = 0) -> bytes:
        """The maps' bytes, padding first, for the arrays at ``q, k, v`` (and ``mask``)."""
        (lq, lk, lv), (bq, bk, bv), m = self.layouts, self.boxes, self.mask
        return (self.pad + encode_tiled(self.dtype, q, lq, bq) + encode_tiled(self.dtype, k, lk, bk)
                + encode_tiled(self.dtype, v, lv, bv)
                + (encode_tiled(m.dtype, mask, m.layout, m.box, m.swizzle) if m is not None else _NO_MAP))


def _bsh(elem_strides: tuple, layout: str) -> tuple:
    """Element strides (batch, seq, head) of an output in ``layout``."""
    if layout == "thd":
        return (0, elem_strides[0], elem_strides[1])
    sb, s1, s2, _ = elem_strides
    return (sb, s1, s2) if layout == "bshd" else (sb, s2, s1)


def build_fwd_plan(problem, device, tma: bool = True) -> FwdPlan:
    """The plan of an ``AttentionProblem`` (or a :class:`SparseFwd`) on ``device``; ``tma=False``:
    one that does not load through TMA (for a mask whose address TMA cannot read)."""
    P, sparse, per_head = (problem.base, problem.sparse, problem.per_head) if isinstance(problem, SparseFwd) \
        else (problem, 0, False)
    maps = _tma_layouts(P) if tma else None
    mask_map_layout = mask_layout(P)
    spec = select_attention_spec(P.dtype, P.head_dim, device.arch, ptx=ptx_requested(),
                                 mask=P.mask.kind if P.mask is not None else "none", softcap=P.softcap,
                                 alibi=P.alibi is not None, allow_tf32=P.allow_tf32, sparse=sparse,
                                 tma=maps is not None and (P.mask is None or P.mask.kind == "bool"
                                                           or mask_map_layout is not None),
                                 keys=P.seqlen_k, mask_rows=P.mask is not None and P.mask.strides[2] == 0,
                                 causal=P.causal, queries=P.seqlen_q, batch_heads=P.batch * P.heads_q,
                                 sm_count=device.sm_count)
    out_shape = P.out_shape()
    out_elem = P.out_strides if P.out_strides is not None else c_strides(out_shape)
    qs, ks, vs, os_ = P.q_strides, P.k_strides, P.v_strides, _bsh(out_elem, P.layout)
    if P.layout == "thd":  # FlashAttention's varlen LSE: (Hq, total_q)
        lse_b, lse_h = 0, P.total_q
    else:
        lse_b, lse_h = P.heads_q * P.seqlen_q, P.seqlen_q
    mask_strides = P.mask.strides if P.mask is not None else (0, 0, 0, 0)
    bits, tiles = None, spec.tiles
    copies = tiles.block_m if tiles.mask_bits else 1  # a row broadcast over the queries: a whole box of it
    if spec.mask == "bits":
        bits, mask_strides = _mask_bits(P, device, copies)
    fp8 = spec.family == "attn_fwd_fp8"
    tma = fp8 or spec.family == "attn_fwd_tma"
    scale = P.scale * P.descale[0] * P.descale[1]  # fp8: the scores of the codes; else P.scale
    # attn_fwd_tma: AttnFwdParams packed here; the maps after it per call (TmaMaps.pack).
    packer = (spec.params.base if tma else spec.params).partial({
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
        "scale_log2": scale * LOG2E, "scale": scale, "softcap": P.softcap,
        "tile_stride_h": -(-P.seqlen_q // tiles.block_m) if per_head else 0, "o_scale": P.descale[2],
        "total_q": P.total_q, "total_k": P.total_k,  # (varlen's packed rows; 0 otherwise, unused)
    })
    empty = int(np.prod(out_shape)) == 0 or P.batch == 0
    mask_map = None
    if tma and spec.mask.endswith("_row"):  # a key-padding mask: the tile's keys of its one row, unswizzled
        mask_map = MaskMap(_MASK_MAP_DTYPES[P.mask.kind][0], mask_map_layout, (tiles.block_n, 1), 0)
    elif tma and tiles.mask_bits and bits is not None:  # the packed words ride the ring: rows of block_n / 32
        mask_map = MaskMap("u32", packed_map_layout(P, copies), (tiles.block_n // 32, tiles.block_m), 0)
    elif tma and spec.mask not in ("none", "bits"):
        kind, size = _MASK_MAP_DTYPES[P.mask.kind]
        swizzle = min(128, tiles.block_n * size)  # one row of the swizzle: the tile's keys, or 128 bytes of them
        # a whole tile of rows (a key-padding mask is a "_row" kind, above)
        mask_map = MaskMap(kind, mask_map_layout, (swizzle // size, tiles.block_m), swizzle)
    # (spec becomes the launched variant: the row's split one, q_tiles 3, where the tail splits;
    # its tiles, shared memory, grid and parameter struct are the row's)
    spec, kernel, held, tail = persistent_launch(P, spec, tiles, device, not sparse and not empty)
    slots = held if tail is not None else persistent_slots(P, tiles, held) if held else 0
    maps_of = None
    if tma and not empty:  # the maps follow AttnFwdParams at a multiple of 64 bytes
        inner = 128 if fp8 else 64  # elements of one 128-byte swizzle row
        # fp8 V^T: 128 keys of all head_dim rows (the bucket's: rows past head_dim arrive as zeros)
        boxes = ((inner, tiles.block_m), (inner, tiles.block_n), (128, spec.head_dim) if fp8 else (inner, tiles.block_n))
        maps_of = TmaMaps("u8" if fp8 else spec.dtype, maps, boxes, bytes(-spec.params.base.size % 64), mask_map)
    vt = _vt_pass(P, device) if fp8 and not empty else None
    return FwdPlan(spec, kernel, spec.grid(P.batch, P.heads_q, P.seqlen_q, slots), (spec.threads, 1, 1),
                   spec.shared_bytes,
                   packer, layout(out_shape, numpy_dtype("out", P.out_dtype)), layout(P.lse_shape(), _F32), empty,
                   maps_of, problem, bits, vt, tail)


def _vt_keys(P) -> int:
    """Keys a row of fp8 V^T holds: seqlen_k rounded up to whole 16-key groups (the permutation's unit;
    TMA also wants 16-byte row strides)."""
    return -(-P.seqlen_k // 16) * 16


def _vt_pass(P, device) -> VtPass:
    """The fp8_vt pass of an fp8 problem: V (B, Sk, Hkv, D) to V^T (B, Hkv, D, keys), keys permuted."""
    spec = KernelSpec("fp8_vt", "e4m3", HEAD_DIM_BUCKETS[0], device.arch, ptx_requested())
    keys = _vt_keys(P)
    key_tiles = -(-keys // spec.tiles.block_m)
    vs = P.v_strides
    packer = spec.params.partial({"v_stride_b": vs[0], "v_stride_s": vs[1], "v_stride_h": vs[2],
                                  "seqlen_k": P.seqlen_k, "keys_pad": keys, "heads_kv": P.heads_kv,
                                  "head_dim": P.head_dim, "key_tiles": key_tiles})
    grid = (key_tiles * P.batch * P.heads_kv, -(-P.head_dim // spec.tiles.block_n), 1)
    return VtPass(get_kernel(spec, device), grid, (spec.threads, 1, 1), packer,
                  layout((P.batch * P.heads_kv * P.head_dim * keys,), np.dtype(np.uint8)))


def packed_mask_layout(P, copies: int = 1) -> tuple:
    """How P's bool mask packs to bits (kernels_src/mask_bits.cuh): ``((rows_b, rows_h, rows_q),
    words, strides)``, the packed rows per axis, u32 words a row and the packed element strides
    over (B, Hq, Sq, Sk) that the kernel reads by (0 on broadcast axes; the key stride is unused).

    A row is whole 128-key groups of four words, each word one accumulator lane's keys of the
    group (mask_bits.cuh says which); a broadcast axis stays one packed row, so a key-padding
    mask packs to a row per batch entry, or to ``copies`` rows (a kernel that stages the words,
    ``TileConfig.mask_bits``, reads a whole box of block_m rows at row 0: its query stride stays 0).
    """
    sb, sh, sq, _ = P.mask.strides
    words = -(-P.seqlen_k // 128) * 4
    rows = (P.batch if sb else 1), (P.heads_q if sh else 1), (P.seqlen_q if sq else copies)
    return rows, words, (rows[1] * rows[2] * words if sb else 0, rows[2] * words if sh else 0, words if sq else 0, 1)


def packed_map_layout(P, copies: int = 1) -> tuple:
    """The rank-4 layout (words, query rows, heads, batch) of P's bool mask packed to bits
    (:func:`packed_mask_layout` with ``copies``) for a TMA map of u32 words; a broadcast axis is an
    axis of size 1 (the copies of a row broadcast over the queries are rows of their own)."""
    (_, _, rows_q), words, (sb, sh, _, _) = packed_mask_layout(P, copies)
    return rank4(words, rows_q, P.heads_q, P.batch, (sb, words, sh), 4)


def _mask_bits(P, device, copies: int = 1) -> tuple:
    """The pack of P's bool mask to bits (``packed_mask_layout(P, copies)``): ``(MaskBits or None,
    the packed mask's element strides)``; None when there is nothing to pack (no keys: the kernel
    reads no mask)."""
    per_axis, words, packed = packed_mask_layout(P, copies)
    _, rows_h, rows_q = per_axis
    rows = math.prod(per_axis)
    if words == 0 or rows == 0:
        return None, packed
    sb, sh, sq, sk = P.mask.strides
    # Groups outside a row's band are written as zeros unread (mask_bits.cuh); a row broadcast
    # over the queries serves them all, so its band is unbounded (no causal, no window).
    causal, window = (P.causal, P.window) if sq else (0, (-1, -1))
    lo, hi = band_limits(causal, window, P.seqlen_q, P.seqlen_k)
    spec = KernelSpec("mask_bits", "f16", HEAD_DIM_BUCKETS[0], device.arch, ptx_requested())
    packer = spec.params.partial({"stride_b": sb, "stride_h": sh, "stride_q": sq, "stride_k": sk, "rows": rows,
                                  "band_lo": lo, "band_hi": hi,
                                  "rows_h": rows_h, "rows_q": rows_q, "keys": P.seqlen_k, "words": words})
    blocks = min(-(-rows * words // 4 // spec.threads), 16 * device.sm_count)  # a thread a 128-key group
    return MaskBits(get_kernel(spec, device), (blocks, 1, 1), (spec.threads, 1, 1), packer,
                    layout((rows * words,), _U32)), packed


def persistent_slots(P, tiles, held: int) -> int:
    """The blocks a persistent forward kernel (attn_fwd_tma, ``tiles.persistent``) launches for
    problem ``P`` when the GPU holds ``held`` of them at once.

    A block walks work units (kernels_src/attention_fwd_tma.cuh, ``PersistentUnits``): a query
    tile, or for causal calls a pair of row blocks (or two middle ones) of equal total cost. ``held`` blocks save
    each unit's start and end (measured on H200 at d=128: about two key steps of a query tile) but
    split the units statically, in whole rounds. Without causality the per-tile launch rounds the
    same way, so persistence always wins (on three warpgroups the rounds rotate over the row blocks,
    so a 64-row last block is shared out: d = 64 at 1k keys 0.327 ms against 0.337-0.340 a block a
    tile, BENCHMARKS.md, twenty-fifth session). A causal per-tile launch is balanced by the hardware
    block by block, so there the rounding loss ``ceil(U / held) * held / U - 1`` is weighed
    against the start-and-end cost ``2 * 2 / (key steps of a unit)``; when rounding costs more
    (long causal calls: e.g. 16k x 16 heads at d=128, 3.1% against 3.1%) the launch takes one
    unit a block and the hardware balances the units.
    """
    if not P.causal:
        return held
    bm, bn = tiles.block_m, tiles.block_n
    n_mb = -(-P.seqlen_q // bm)
    units = persistent_units(P, bm)
    if units <= held:  # one round: nothing to balance
        return held
    rounding = -(-units // held) * held / units - 1
    start_end = 4 / max(1.0, (n_mb + 1) * bm / bn)
    return held if rounding < start_end else units


def _build_without_tma(problem, device) -> FwdPlan:
    """``build_fwd_plan(problem, device, tma=False)`` (a build function of its own for ``get_plan``)."""
    return build_fwd_plan(problem, device, tma=False)


def mask_layout(P):
    """The rank-4 layout (keys, query rows, heads, batch) of P's mask tensor for a TMA map, or None
    without a mask or when TMA cannot read it: its keys must be consecutive (a mask broadcast over
    keys is not) and its other strides whole 16 bytes. A mask broadcast over the query rows (a
    key-padding mask) is a map of one row."""
    if P.mask is None or P.mask.strides[3] != 1:
        return None
    sb, sh, sq, _ = P.mask.strides
    rows = P.seqlen_q if sq else 1
    return rank4(P.seqlen_k, rows, P.heads_q, P.batch, (sb, sq, sh), _MASK_MAP_DTYPES[P.mask.kind][1])


def _tma_layouts(P):
    """The rank-4 layouts of q, k, v for TMA maps (varlen: rows are the packed tokens), or None
    when one of them cannot be mapped (``runtime.tensormap.rank4``) or the dtype is not 16-bit.
    fp8: q, k as they are, 1 byte an element, and V^T (the fp8_vt pass's buffer) for v."""
    if P.dtype == FP8:
        keys = _vt_keys(P)
        vt = rank4(keys, P.head_dim, P.heads_kv, P.batch,
                   (P.heads_kv * P.head_dim * keys, keys, P.head_dim * keys), 1)
        layouts = (rank4(P.head_dim, P.seqlen_q, P.heads_q, P.batch, P.q_strides, 1),
                   rank4(P.head_dim, P.seqlen_k, P.heads_kv, P.batch, P.k_strides, 1), vt)
        return None if None in layouts else layouts
    if P.dtype not in ("float16", "bfloat16"):
        return None
    thd = P.layout == "thd"
    rows_q, rows_k = (P.total_q, P.total_k) if thd else (P.seqlen_q, P.seqlen_k)
    batch = 1 if thd else P.batch
    layouts = (rank4(P.head_dim, rows_q, P.heads_q, batch, P.q_strides, 2),
               rank4(P.head_dim, rows_k, P.heads_kv, batch, P.k_strides, 2),
               rank4(P.head_dim, rows_k, P.heads_kv, batch, P.v_strides, 2))
    return None if None in layouts else layouts


def run_fwd(plan: FwdPlan, device, s, q: int, k: int, v: int, *, out=None, return_lse=False, extras=()):
    """Allocate the results and launch.

    ``q, k, v``: device addresses; ``out``: the address of the caller's output (already validated)
    or None for a new one; ``extras``: pointers of (mask, alibi, cu_seqlens_q, cu_seqlens_k,
    tile_ptr, tile_idx, tile_bits), missing ones null. Returns ``(out, lse or None)``: ``out`` is a
    new DeviceArray, or None when the caller gave one.
    """
    o = None if out is not None else allocate(device, s, *plan.out_layout)
    lse = allocate(device, s, *plan.lse_layout) if return_lse else None
    if not plan.empty:
        ptrs = extras + _ZEROS[len(extras):] if extras else _ZEROS
        if plan.bits is not None:  # pack the bool mask; the buffer is freed in stream order after the kernel
            b = plan.bits
            packed = allocate(device, s, *b.layout)
            launch(b.kernel, b.grid, b.block, 0, s, b.packer.pack(ptrs[0], packed.ptr))
            ptrs = (packed.ptr,) + ptrs[1:]
        if plan.vt is not None:  # fp8: V^T for the kernel's V map; freed in stream order after the kernel
            t = plan.vt
            vt = allocate(device, s, *t.layout)
            launch(t.kernel, t.grid, t.block, 0, s, t.packer.pack(v, vt.ptr))
            v = vt.ptr
        if plan.tma is not None and plan.tma.mask is not None and ptrs[0] % 16:
            # TMA reads 16-byte aligned tensors only: a mask view off that alignment runs the
            # cp.async kernel, which reads such a mask in place (documented: slower).
            plan = get_plan(_build_without_tma, plan.problem, device)
        params = plan.packer.pack(q, k, v, o.ptr if out is None else out, lse.ptr if lse is not None else 0, *ptrs)
        keep = None
        if plan.tma is not None:  # the maps, then the tail split's fields (its partials freed after the kernel)
            tail, keep = tail_fields(plan.tail, device, s) if plan.tail is not None else (NO_TAIL, None)
            params += plan.tma.pack(q, k, v, ptrs[0]) + tail
        launch(plan.kernel, plan.grid, plan.block, plan.shared_bytes, s, params)
        del keep
    return o, lse


def device_extras(mask, alibi, device, s) -> tuple:
    """Device pointers of a mask and ALiBi slopes (Args or None): device ones read in place, host
    ones uploaded C-contiguous (a float64 mask and float slopes as float32). Returns
    ``(mask_ptr, alibi_ptr, keep_alive)``."""
    from ..pipeline.host import upload  # the NumPy path's module: only for host extras (see ops.attention)

    host = [None, None]
    if mask is not None and not mask.on_device:
        m = np.asarray(mask.obj)
        host[0] = np.ascontiguousarray(m.astype(np.float32) if m.dtype == np.float64 else m)
    if alibi is not None and not alibi.on_device:
        host[1] = np.ascontiguousarray(alibi.obj, dtype=np.float32)
    up = upload(host, device, s) if any(h is not None for h in host) else (None, None)
    ptrs = [u.ptr if u is not None else (a.ptr if a is not None else 0) for a, u in zip((mask, alibi), up)]
    return ptrs[0], ptrs[1], up

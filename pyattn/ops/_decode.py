"""Decode plans and launches, shared by ``pyattn.decode`` and ``pyattn.paged_decode``.

Flash-decoding: one block per (split, kv head, row block, sequence) reads its keys once for the
whole GQA group; when batch x kv heads is too small to fill the GPU, each sequence's keys are
split across blocks and their fp32 partials merged by LSE: by the last block of a unit's splits
to finish, in the same launch (``decode_combine_last`` in ``kernels_src/decode_merge.cuh``), when
that block's share is small; else by a second launch, ``split_combine`` (see :func:`fused_combine`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from ..array import allocate, c_strides
from ..kernels.registry import generation, get_kernel
from ..kernels.families.decode import decode_row, tma_decode_serves, tma_gathers
from ..kernels.specs import DTYPES, HEAD_DIM_BUCKETS, KV_HEAD_DIM_BUCKETS, KernelSpec
from ..pipeline.device import layout, output
from ..pipeline.host import upload
from ..pipeline.plans import get_plan, ptx_requested
from ..runtime.launch import launch
from ..runtime.memory import get_pool
from ..runtime.stream import capture_id
from ..runtime.tensormap import encode_tiled, page_rank5, rank4
from ..validate.options import LOG2E
from ..validate.paged import MAX_SPLITS

__all__ = ["DecodePlan", "Ptr", "run_decode", "choose_num_splits", "keyed_splits", "blocks_per_sm"]

_F32 = np.dtype(np.float32)
# Split partials up to this size share the output's block: a tiny decode's host time is mostly
# per-allocation Python; a big one's partials would stay alive with its output for nothing.
_PART_IN_OUT = 256 << 10


@functools.lru_cache(maxsize=256)
def _spec(dtype: str, head_dim: int, arch: str, ptx: bool, rows: int, softcap: bool, alibi: bool,
          kv: str = "", generation: int = 0, key_channel: bool = False, page_size: int = 1) -> KernelSpec:
    """The decode spec for ``rows`` = group * q_len query rows per kv head; ``kv``: the cache's
    8-bit kind ("" for 16-bit caches); ``generation``: the registry's, so that a tile table
    replaced by ``override_tiles`` is read again; ``key_channel``: per-channel key scales;
    ``page_size``: the pool's, which decides between attn_decode_tma (sm_90a, pages of 16 slots
    and more; other pages where its row gathers them) and attn_decode (cp.async rows, any page)."""
    tag = DTYPES[dtype][0]
    bucket = next(b for b in (KV_HEAD_DIM_BUCKETS if kv else HEAD_DIM_BUCKETS) if b >= head_dim)
    tma = tma_decode_serves(arch, bucket, page_size, kv, key_channel, rows)
    q_tiles = min(-(-rows // 16), decode_row(arch, bucket, kv, tma).max_q_tiles)
    # Up to 8 rows: the keys on the MMAs' M side (attn_decode_swap), not an m16 row tile that is half
    # padding or more.
    family = ("attn_decode_swap" if rows <= 8 else "attn_decode_tma") if tma else "attn_decode"
    return KernelSpec(family, tag, bucket, arch, ptx, softcap=softcap, alibi=alibi, q_tiles=q_tiles, kv=kv,
                      key_channel=key_channel, gather=tma and tma_gathers(page_size))


def blocks_per_sm(spec, kernel) -> int:
    """Concurrent blocks of ``spec`` per SM: registers bound the 8-bit kernels (shared memory alone
    said 3 where 2 fit, and the split choice then planned waves that did not exist)."""
    return max(1, kernel.max_active_blocks(spec.threads, spec.shared_bytes))




class Ptr:
    """A device array by address alone, as :func:`run_decode` reads a table (``.ptr``): a repeat
    call's device lengths and tables, whose layout its quick key holds."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class DecodePlan(NamedTuple):
    """What a validated decode needs besides pointers, the page table and the split count."""

    kernel: object
    cspec: object  # the separate split combine (split_combine), loaded when first needed
    cpacker: object  # PartialPack: pointers, n_b -> MergeStatesParams bytes
    cgrid: tuple
    cblock: tuple
    combine_items: int  # (row, 4-column) items one block's fused combine takes per thread
    block: tuple
    shared_bytes: int
    grid_yz: tuple  # (kv heads x row blocks, batch)
    packer: object  # PartialPack: pointers, num_splits, table_stride -> DecodeParams bytes
    block_n: int
    units: int  # independent blocks before splitting
    slots: int  # concurrent blocks on the GPU
    sm_slots: int  # the SM count where long splits fill one block an SM (16-bit TMA decodes), else 0
    out_layout: tuple  # pipeline.device.layout of the output and of the LSE
    lse_layout: tuple
    n_rows: int  # batch x q_len x heads_q
    head_dim: int
    tma_box: int  # attn_decode_tma: slots per page box of its maps; 0 for attn_decode and gathered rows
    tma_heads: bool  # attn_decode_tma's maps per kv head (pool_maps' per_head)


def _build(P, device) -> DecodePlan:
    """The plan of decode problem ``P`` (its pools included) on ``device``."""
    pool = P.pool
    rows = P.group * P.q_len
    kv = pool.kv
    spec = _spec(P.dtype.name, P.head_dim, device.arch, ptx_requested(), rows, P.softcap > 0, P.alibi is not None,
                 kv, generation(), pool.key_channel, pool.page_size)
    kernel = get_kernel(spec, device)
    t = spec.tiles
    row_blocks = -(-rows // t.block_m)
    if P.heads_kv * row_blocks > 65535:
        raise ValueError(f"q: heads_kv x row blocks must be <= 65535, got {P.heads_kv} x {row_blocks}")
    out_shape = (P.batch, P.q_len, P.heads_q, P.head_dim)
    qs, os_ = P.q_strides, c_strides(out_shape)
    ks, vs = pool.k_strides, pool.v_strides
    kss, vss = pool.ks_strides, pool.vs_strides  # (0, 0, 0) for 16-bit pools
    packer = spec.params.partial({
        "ks_stride_page": kss[0], "ks_stride_slot": kss[1], "ks_stride_h": kss[2],
        "vs_stride_page": vss[0], "vs_stride_slot": vss[1], "vs_stride_h": vss[2],
        "q_stride_b": qs[0], "q_stride_s": qs[1], "q_stride_h": qs[2],
        "o_stride_b": os_[0], "o_stride_s": os_[1], "o_stride_h": os_[2],
        "k_stride_page": ks[0], "k_stride_slot": ks[1], "k_stride_h": ks[2],
        "v_stride_page": vs[0], "v_stride_slot": vs[1], "v_stride_h": vs[2],
        "lse_stride_b": P.heads_q * P.q_len, "lse_stride_h": P.q_len,
        "batch": P.batch, "q_len": P.q_len, "heads_q": P.heads_q, "heads_kv": P.heads_kv, "group": P.group,
        "head_dim": P.head_dim, "page_size": pool.page_size, "num_pages": min(pool.num_pages, 2**31 - 1),
        "page_shift": pool.page_size.bit_length() - 1 if pool.page_size & (pool.page_size - 1) == 0 else -1,
        "row_blocks": row_blocks, "causal": P.causal, "window_left": P.window[0], "window_right": P.window[1],
        "alibi_stride_b": P.alibi.stride_b if P.alibi is not None else 0,
        "scale_log2": P.scale * LOG2E, "scale": P.scale, "softcap": P.softcap,
    })
    # The separate combine reads the fp32 partials (split, batch, q_len, heads_q, D) and writes rows
    # (batch, q_len, heads_q) of out and of lse, which is (batch, heads_q, q_len).
    D, H, L = P.head_dim, P.heads_q, P.q_len
    n_rows = P.batch * L * H
    cspec = KernelSpec("split_combine", spec.dtype, next(b for b in HEAD_DIM_BUCKETS if b >= D), device.arch, spec.ptx)
    cstatic = {"o_b_stride_n": n_rows * D, "lse_b_stride_n": n_rows, "dim0": P.batch, "dim1": L, "dim2": H,
               "head_dim": D}
    for name, st in (("o_a", (L * H * D, H * D, D)), ("o_b", (L * H * D, H * D, D)), ("out", os_[:3]),
                     ("lse_a", (L * H, H, 1)), ("lse_b", (L * H, H, 1)), ("out_lse", (H * L, 1, L))):
        cstatic.update({f"{name}_stride_{i}": v for i, v in enumerate(st)})
    items = -(-min(t.block_m, rows) * (spec.head_dim // 4) // (32 * (t.warps - t.ws)))  # consumer threads
    # The TMA kernels' maps (kernels_src/attention_decode_tma.cuh): a 16-bit head_dim that is its
    # bucket (whole 64-column blocks) takes per-head maps, a page chunk a box; a narrower one the
    # pools' maps in boxes of 16 slots; 8-bit codes the pools' maps, a page chunk a box, or none
    # where the producers gather the rows (tma_gathers).
    heads = bool(t.ws) and not kv and P.head_dim == spec.head_dim
    tma_box = (min(pool.page_size, t.block_n) if kv or heads else 16) if t.ws and not spec.gather else 0
    plan = DecodePlan(kernel, cspec, cspec.params.partial(cstatic), (-(-n_rows // cspec.tiles.warps), 1, 1),
                      (cspec.threads, 1, 1), items, (spec.threads, 1, 1), spec.shared_bytes,
                      (P.heads_kv * row_blocks, P.batch), packer, t.block_n, P.batch * P.heads_kv * row_blocks,
                      device.sm_count * blocks_per_sm(spec, kernel),
                      # the 16-bit TMA decodes, m16 rows and swapped-role blocks (choose_num_splits)
                      device.sm_count if spec.family in ("attn_decode_tma", "attn_decode_swap") and not kv else 0,
                      layout(out_shape, P.dtype),
                      layout((P.batch, P.heads_q, P.q_len), _F32), n_rows, D, tma_box, heads)
    return plan


# The fused combine's budget: L2 round trips of one thread (items x batches of 16 splits). Measured
# on an H200 (BENCHMARKS.md): B=1 x 32k, q_len 1 (2 items x 33 splits = 6) 54.7 us fused against 63
# with two launches; a q_len = 16 decode of the tree benchmark (16 items x 16 splits = 16) 67 us
# fused against 28.5 with two launches.
_FUSED_ROUND_TRIPS = 8


def fused_combine(items: int, splits: int) -> bool:
    """Whether a decode of ``splits`` splits merges them in its own launch: when the last block's
    share (``items`` per thread, each reading every split) stays within a few L2 round trips."""
    return items * -(-splits // 16) <= _FUSED_ROUND_TRIPS


def run_decode(P, device, q: int, k: int, v: int, tables, max_len: int, alibi_ptr: int, s, return_lse: bool,
               scales=(0, 0), total_len: int | None = None, capture: int | None = None, sparq=None):
    """Launch decode (and its split combine, fused in or a second launch) for a validated problem.

    Parameters
    ----------
    P : DecodeProblem
    device : Device
    q, k, v : int
        Device addresses of the queries and of the K and V pools.
    tables : (indices, indptr or None, table_stride, kv_len, order or None): device int32 arrays
        (``.ptr``); ``order``, the batch entries longest first: their blocks start first;
        ``kv_len`` may be an int, every sequence's length (passed by value, no device array)
    max_len : int
        The longest sequence (host value) for the split heuristic; device lengths are clamped to
        it in the kernel (a bound the caller checked, or ``max_seqlen``'s promise).
    alibi_ptr : int
        Device float32 ALiBi slopes, or 0.
    s : Stream
    return_lse : bool
    scales : (int, int)
        Device addresses of the K and V scale pools of an 8-bit cache; (0, 0) for 16-bit ones.
    total_len : int, optional
        The batch's total length (host value): a ragged batch gets more splits (see
        :func:`choose_num_splits`). None: every sequence is taken as ``max_len`` long.
    capture : int, optional
        ``s``'s :func:`~pyattn.runtime.stream.capture_id` if the caller asked in this call already,
        for the allocations (None: asked here, once).
    sparq : (int, DeviceArray), optional
        SparQ's chosen-key decode (:mod:`pyattn.ops.sparq`): the address of its finish records and
        the output its blended rows go to (the first half of each sequence's query heads;
        ``kernels_src/decode_merge.cuh``'s ``sparq_fold``). Its splits are then always combined in
        the decode's own launch, which does the finish.

    Returns
    -------
    (out, lse or None) as DeviceArrays; with ``sparq``, that output and None
    """
    plan = get_plan(_build, P, device)
    capture = capture_id(s.handle) if capture is None else capture  # (once: every allocation below takes it)
    if plan.n_rows == 0:  # an empty batch (a serving step with no sequence to decode): empty results
        return (allocate(device, s, *plan.out_layout, capture),
                allocate(device, s, *plan.lse_layout, capture) if return_lse else None)
    # (first: a pool pair's first call uploads its maps, which a graph capture refuses before any allocation)
    tmaps = pool_maps(device, P.pool, k, v, plan.tma_box, s, plan.tma_heads) if plan.tma_box else 0
    if P.num_splits:
        splits = P.num_splits
    else:
        visible = max_len if P.window[0] < 0 else min(max_len, P.window[0] + P.q_len + plan.block_n)
        fill = 1.0 if not total_len or not max_len or P.window[0] >= 0 else total_len / (P.batch * max_len)
        splits = _num_splits(plan.units, -(-visible // plan.block_n), plan.slots, _fill_bucket(fill), plan.block_n,
                             plan.sm_slots)
    n_rows, D = plan.n_rows, plan.head_dim
    part_bytes = 4 * splits * n_rows * (D + 1) if splits > 1 else 0  # fp32 partials and their LSEs
    if sparq is None and 0 < part_bytes <= _PART_IN_OUT:  # small: behind out in out's block (one allocation, one free)
        shape, dtype, strides, elem_strides, nbytes = plan.out_layout
        offset = -(-nbytes // 256) * 256
        out = allocate(device, s, shape, dtype, strides, elem_strides, offset + part_bytes, capture)
        part_ptr = out.ptr + offset
    else:  # (SparQ's decode writes the caller's output)
        out = allocate(device, s, *plan.out_layout, capture) if sparq is None else sparq[1]
        part = output(device, s, (part_bytes // 4,), _F32, capture) if part_bytes else None  # (kept to the launch)
        part_ptr = part.ptr if part_bytes else 0
    lpart_ptr = part_ptr + 4 * splits * n_rows * D if part_bytes else 0
    lse = allocate(device, s, *plan.lse_layout, capture) if return_lse else None
    lse_ptr = lse.ptr if lse is not None else 0
    fused = splits > 1 and (sparq is not None or fused_combine(plan.combine_items, splits))
    # 0: the kernel leaves the merge; ckeep: a graph capture's own counters, freed in it after the launch
    counters, ckeep = get_pool(device).counters(plan.units, s, capture) if fused else (0, None)
    indices, indptr, table_stride, kv_len, order = tables
    uniform = isinstance(kv_len, int)
    params = plan.packer.pack(q, k, v, out.ptr, lse_ptr, part_ptr, lpart_ptr, counters, indices.ptr,
                              indptr.ptr if indptr is not None else 0, 0 if uniform else kv_len.ptr,
                              order.ptr if order is not None else 0, alibi_ptr, scales[0], scales[1], tmaps, splits,
                              kv_len if uniform else max_len, table_stride,  # (the lengths' bound: DecodeParams)
                              sparq[0] if sparq is not None else 0)
    launch(plan.kernel, (splits, *plan.grid_yz), plan.block, plan.shared_bytes, s, params)
    if splits > 1 and not fused:
        cparams = plan.cpacker.pack(part_ptr, lpart_ptr, part_ptr + 4 * n_rows * D, lpart_ptr + 4 * n_rows, out.ptr,
                                    lse_ptr, splits - 1)
        launch(get_kernel(plan.cspec, device), plan.cgrid, plan.cblock, 0, s, cparams)
    return out, lse


# (device, k, v, pool geometry, box, per_head) -> DeviceArray of the maps: a serving loop decodes
# over one pair of pools a layer, so the maps are encoded and uploaded (a synchronisation) once per
# pool pair. Bounded, oldest out first (pools that come and go, e.g. paged_decode over a framework's
# fresh buffers), at room for every layer of the deepest models: at 64 an 80-layer model's caches,
# visited in turn, missed on every call. An entry is its maps' few KiB of device memory.
_maps: dict = {}
_MAX_MAPS = 1024


def pool_maps(device, pool, k: int, v: int, box: int, s, per_head: bool = False) -> int:
    """The device address of the tensor maps (K pool, V pool) attn_decode_tma and attn_prefill_tma
    read their page boxes through: (head dim, slot, kv head, page), boxes of 128 bytes (64 16-bit
    columns, or 128 8-bit codes) x ``box`` slots, 128-byte swizzle, and an L2 fetch of each row's
    own 128 bytes: the default 256-byte promotion also fetched the next kv head's row, which another
    block reads at another time (H200, GQA 32/8, D 128, B64 x 32k, dev/probe_q8_pages.py): int8
    1052 -> 994 us at pages of 16, 1205 -> 1072 at 128; bf16 1978 -> 1931, 2021 -> 1909.

    ``per_head`` (the 16-bit decode at a head_dim of whole 64-column blocks): instead a K and a V
    map for each kv head in turn, over :func:`~pyattn.runtime.tensormap.page_rank5`, whose boxes of
    (64, 16, head_dim / 64, ``box`` / 16) bring a page chunk's rows whole in one copy
    (kernels_src/attention_decode_tma.cuh). Their rows are whole 256-byte rows at d = 128, yet a
    256-byte promotion still read 5.5% slower (bf16 B64 x 32k 1920 -> 2026 us; none: level with 128).

    Maps live in device memory, not in the parameter struct: DecodeParams stays one layout for every
    decode kernel, and a repeat call passes one pointer instead of 256 bytes. The upload is ordered
    on ``s`` before the launch that reads it.
    """
    key = (device.ordinal, k, v, pool.num_pages, pool.page_size, pool.heads_kv, pool.head_dim, pool.dtype,
           pool.k_strides, pool.v_strides, box, per_head)
    maps = _maps.get(key)
    if maps is None:
        tag, size = ("u8", 1) if pool.kv else (DTYPES[pool.dtype.name][0], pool.dtype.itemsize)
        pools = ((k, pool.k_strides), (v, pool.v_strides))
        if per_head:
            hd, box5 = pool.head_dim, (64, 16, pool.head_dim // 64, box // 16)
            raw = b"".join(encode_tiled(tag, ptr + h * strides[2] * size,
                                        page_rank5(hd, pool.page_size, pool.num_pages, strides, size), box5,
                                        l2_promotion=128)
                           for h in range(pool.heads_kv) for ptr, strides in pools)
        else:
            raw = b"".join(
                encode_tiled(tag, ptr, rank4(pool.head_dim, pool.page_size, pool.heads_kv, pool.num_pages,
                                             strides, size), (128 // size, box), l2_promotion=128)
                for ptr, strides in pools)
        # (rank4 reads every validated pool: its strides are whole 16-byte multiples.)
        maps = upload([np.frombuffer(raw, np.uint8)], device, s)[0]
        s.synchronize()  # once per pool pair: a later call on another stream then reads it safely
        if len(_maps) >= _MAX_MAPS:
            _maps.pop(next(iter(_maps)))
        _maps[key] = maps
    return maps.ptr


# The fewest keys a decode split keeps where a batch fills less than one wave (choose_num_splits).
_MIN_SPLIT_KEYS = 256
# Splits at least this long fill one block an SM (choose_num_splits' sm_slots).
_LONG_SPLIT_KEYS = 512


def choose_num_splits(units: int, max_tiles: int, slots: int, fill: float = 1.0, tile_keys: int = 0,
                      sm_slots: int = 0) -> int:
    """Split count for ``units`` independent blocks over ``slots`` concurrent block slots (SMs x
    blocks per SM) when the longest sequence has ``max_tiles`` key tiles of ``tile_keys`` keys and
    the mean sequence ``fill`` times as many.

    ``sm_slots`` (the SM count; 0 for kernels not measured so): below one wave, a kernel whose
    splits are long fills one block an SM rather than every slot, when each split then keeps at
    least ``_LONG_SPLIT_KEYS`` keys and there are at least 4 splits. The 16-bit TMA decodes read
    at the SM's share of bandwidth with one block (two producer warps keep a 3-stage ring of page
    boxes in flight), so a second block an SM only adds its partial row and its share of the
    combine: half the splits halve the partials that the unit's last block folds in. Measured on
    an H200, bf16, Hq 32, Hkv 8, page 16 (``dev/probe_decode_fixed.py --splits 4,8,16,32``;
    every point in BENCHMARKS.md, fifty-ninth session): the swapped-role blocks (q_len 1-2; MHA)
    at one block an SM against the wave's count, B1 x 8k / 32k / 128k 10.5 / 36.9 / 124.5 us
    against 12.3 / 39.1 / 129.4, B2 -2 to -4%, B4 -2%, MHA B1 x 32k 121.5 against 123.2 (the
    thirty-fourth session's opposite reading predates the second producer warp and the
    page-chunk boxes); the m16 rows (q_len 4) at B1 x 8k, splits of 512 keys, 15.3 against 22.1,
    hence 512 keys, not the twelfth session's 1024. The 8-bit kernels (their dequantization is
    the longer path) are best at the wave's count (int8 B1 x 32k: 32 splits 25.9 us, 16 29.8).

    Decode (``tile_keys`` given) of an even batch whose unsplit blocks fill less than one wave
    takes the splits that fill the wave, ``slots // units``, as long as each split keeps at least
    ``_MIN_SPLIT_KEYS`` keys (and 2 tiles), or 8 splits of 2 tiles where a sequence has that many.
    Below a wave every block runs at once, so more splits shorten the call until a split's fixed
    work (its ring fill, its partial row, its share of the combine) outweighs its keys. Measured on
    an H200 (``dev/probe_q8_rows.py --splits``; BENCHMARKS.md, "Decode split counts below one wave"), Hkv 8:
    at B1 x 4k the best forced count was 16 (256 keys a split) for bf16 and int8, 10% faster than
    the wave-efficiency rule below (28 / 14 splits); B2 x 4k and B4 x 4k best at 16 / 8; B1 x 1k
    at 8 (128 keys); B1 x 16k-32k within 7% of the best (14-16 splits for bf16, 32 for int8).

    Every block of an even batch does the same work, so the grid runs in waves: the smallest split
    count whose last-wave efficiency (busy fraction of the block slots) is within 85% of the best
    (FlashAttention's rule, applied past one wave too: 512 blocks on 396 slots run 65% busy
    unsplit). At least 2 key tiles per split keep the combine cheap next to the attention.

    A ragged batch (``fill`` < 1) is not waves: its longest sequence's blocks end last. Each split
    of a sequence takes an equal share of its tiles, so those blocks carry ``max_tiles / s`` tiles
    while a block slot's mean load is ``units * fill * max_tiles / slots``. When the first exceeds
    the second, the longest sequence is the critical path (64 sequences of 128..64k tokens: one
    split, its 64k-token blocks taking ~3x the mean load); then ``s`` is raised until they carry at
    most half of it, ``s >= 2 * slots / (units * fill)``: the decode starts the longest sequences'
    blocks first (``PagedKVCache.device_tables``' batch order), so such blocks end within the mean
    load. More splits only add empty blocks, partials and combine work. Measured on an H200
    (``scripts/bench_ragged.py``, that batch, longest first): 1 split 52% of the copy rate, 2: 80%,
    4: 87%, 8: 85%, 16: 81%, 32: 74%; a quarter-load bound (13 splits) 84%. In the batch's own
    order the best was 16 splits at 82%.
    """
    limit = max(1, min(MAX_SPLITS, max_tiles // 2))
    if tile_keys and fill >= 1.0 and units < slots:
        per = max(2, -(-_MIN_SPLIT_KEYS // tile_keys))
        s = max(1, min(MAX_SPLITS, max(max_tiles // per, min(8, max_tiles // 2)), slots // units))
        one_an_sm = sm_slots // units
        if 4 <= one_an_sm < s and max_tiles * tile_keys >= one_an_sm * _LONG_SPLIT_KEYS:
            s = one_an_sm
        return s
    effs = []
    for s in range(1, limit + 1):
        waves = units * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    s = next(s for s, e in enumerate(effs, 1) if e >= 0.85 * best)
    if fill < 1.0 and s * units * fill < slots:
        s = max(s, min(limit, math.ceil(2 * slots / (units * fill))))
    return s


def _fill_bucket(fill: float) -> float:
    """``fill`` rounded up to 1/32: the split choice is cached on it, and a batch's lengths grow
    by one token a step."""
    return min(1.0, math.ceil(fill * 32) / 32)


def keyed_splits(splits: int, max_tiles: int) -> int:
    """``splits`` less those that would get no key tile: the kernel gives each split ``per =
    ceil(tiles / splits)`` tiles (``DecodeBlock``, decode_common.cuh), so only ``ceil(tiles / per)``
    of them hold keys, each as many as before. A split without keys still launches its block,
    writes an empty partial and is read by the combine. Measured on an H200 (B1 x 32k, Hkv 8: the
    wave's 33 splits over 512 key tiles of 64 (bf16) or 256 of 128 (8-bit) leave one empty;
    ``dev/probe_decode_fixed.py --splits 32,33``, BENCHMARKS.md, thirty-fifth session): 32 splits
    41.3 / 28.1 / 27.5 us a call against 33's 42.1 / 29.1 / 28.4 (bf16 / int8 / fp8)."""
    if splits <= 1 or max_tiles <= 0:
        return splits
    return -(-max_tiles // -(-max_tiles // splits))


@functools.lru_cache(maxsize=4096)
def _num_splits(units: int, max_tiles: int, slots: int, fill: float, tile_keys: int, sm_slots: int) -> int:
    """The decode's split count: :func:`choose_num_splits`, then :func:`keyed_splits`."""
    return keyed_splits(choose_num_splits(units, max_tiles, slots, fill, tile_keys, sm_slots), max_tiles)

"""The persistent forward kernel's tail split: its last, partial round of work units shared out
by keys over every block (kernels_src/fwd_tail_split.cuh has the kernel's side).

A persistent attn_fwd_tma launch of G blocks walks U equal work units (query tiles; causal:
pairs of row blocks) in rounds of G. With U = R G + r (0 < r < G) the call lasts R + 1 units' time
while G - r blocks sit out the last round: at d = 128 the FlashAttention benchmark's non-causal
shapes (2048 tiles of 128 rows at 1k / 4k / 16k keys) run 15.5 rounds on the H200's 132 SMs as
16. Split, the last r units' key tiles go to all G blocks in equal ranges, each block writing an
fp32 partial of the pieces it holds, and the last warp to finish a query tile's rows merges them
(the fused combine of the split decode). The rule weighs the rounds saved against what a piece
costs (:data:`PIECE_STEPS`, :data:`CAUSAL_PIECE_STEPS`).
"""

import struct
from typing import NamedTuple

import numpy as np

from ..kernels.families.tma import tma_tail_splits
from ..kernels.registry import get_kernel
from ..pipeline.device import output
from ..runtime.memory import get_pool

__all__ = ["TailSplit", "tail_split", "persistent_launch", "tail_fields", "persistent_units", "NO_TAIL"]

# What a split costs beyond its key tiles, in key-tile steps: a piece's start, its fp32 partial's
# store and count, and the merge on the warp that completes a tile, which is the last of its pieces
# and so ends the call. Measured at d = 128 on an H200 (BENCHMARKS.md, fifty-eighth session): a
# merge takes 7-8 us from its piece's end, about 4.5 key steps, and at 2k keys (16 key tiles, 15.5
# rounds), where two steps a piece predicted 2%, the split ran level with the whole call, so about
# 5-7; at 4k it gained 2%. The split is taken where it saves at least MIN_GAIN of the call.
PIECE_STEPS = 5
MIN_GAIN = 0.015
# Causal units: a piece may hold two query tiles (two starts, stores and merges), and at (4, 4k, 16,
# 128), 7.76 rounds, a split predicted at 2.3% (two steps a piece) ran 1.2% slower (BENCHMARKS.md,
# fifty-seventh session; forced again in the fifty-eighth, 1-3.6% slower), while (4, 4k, 17), 8.24
# rounds, gained 2.5%. Four steps with 3% asked separate those two calls; the causal cost is not
# otherwise modelled (a merge between a block's pieces delays the rest of them: 10-15 us there).
CAUSAL_PIECE_STEPS = 4
CAUSAL_MIN_GAIN = 0.03

_FMT = struct.Struct("@QQQiiiii")
# AttnFwdTmaParams' tail fields (after the maps) for a call without a split, padded to the struct's
# 64-byte alignment as the C++ struct is
NO_TAIL = _FMT.pack(0, 0, 0, 0, 0, 0, 0, 0) + bytes(-_FMT.size % 64)
_F32 = np.dtype(np.float32)


class TailSplit(NamedTuple):
    """A call's tail split: the first split unit (R G), the split units' key tiles in all
    (``iters``) and each unit's (``tiles``), the most blocks one query tile's key tiles span
    (``slots``), the split units (``units``), the fp32 floats a slot's O rows take (rows x head-dim
    bucket), the rows of a tile (one LSE each a slot), the consumer warps a block (a counter each a
    query tile), the most pieces one block holds (``pieces``) and the tail's query tiles."""

    first: int
    iters: int
    tiles: int
    slots: int
    units: int
    slot_floats: int
    rows: int
    warps: int
    pieces: int
    tiles_split: int  # the tail's query tiles (units; causal: two a unit), each with slots and counters


def persistent_units(P, block_m: int) -> int:
    """The work units a persistent attn_fwd_tma launch walks for problem ``P`` on ``block_m``-row
    tiles, as kernels_src/attention_fwd_tma.cuh ``PersistentUnits`` counts them: a query tile each,
    or causal a pair of row blocks; with an odd count of row blocks two (batch, head)s share a unit
    of their middle blocks (a last lone one: its pairs and its middle block)."""
    n_mb, n_bh = -(-P.seqlen_q // block_m), P.heads_q * P.batch
    if not P.causal:
        return n_mb * n_bh
    return n_mb // 2 * n_bh if n_mb % 2 == 0 else n_bh // 2 * n_mb + n_bh % 2 * (n_mb // 2 + 1)


def tail_split(P, spec, tiles, grid_blocks: int) -> "TailSplit | None":
    """The tail split of problem ``P`` on ``spec`` (its ``tiles``) launched as ``grid_blocks``
    persistent blocks, or None where the kernel takes none or it would not pay.

    Taken only where every unit costs the same key tiles: without causality (a unit is a query
    tile), or causal with as many keys as queries, 128-key tiles and an even count of row blocks
    (a unit pairs row blocks n - 1 - i and i: n + 1 key tiles); no window, varlen or mask tensor.
    And on the table's rows that have the split's variant (spec ``q_tiles`` 3, which the plan then
    launches: two consumer warpgroups of 64 rows, 16-bit, head dim <= 128, no ALiBi, not a
    bounded soft-cap's fixed reference, ``softcap`` 2).
    """
    # (tma_tail_splits: the table's row, which the q_tiles 0 spec's tiles are here, persistent on two
    # consumer warpgroups, so 128-row tiles)
    if (spec.family != "attn_fwd_tma" or spec.q_tiles
            or not tma_tail_splits(spec.arch, spec.head_dim, spec.mask, spec.softcap, spec.alibi)
            or P.window != (-1, -1) or P.mask is not None or P.total_q or grid_blocks <= 0 or not P.scale > 0):
        return None
    n_mb = -(-P.seqlen_q // tiles.block_m)
    if P.causal:
        if P.seqlen_q != P.seqlen_k or tiles.block_n != tiles.block_m or n_mb % 2:
            return None
        kt = n_mb + 1  # a pair's key tiles
    else:
        kt = -(-P.seqlen_k // tiles.block_n)
    units = persistent_units(P, tiles.block_m)
    rounds, r = divmod(units, grid_blocks)
    if rounds == 0 or r == 0 or kt < 2:
        return None
    iters = r * kt
    whole = (rounds + 1) * kt
    split = rounds * kt + -(-iters // grid_blocks) + (CAUSAL_PIECE_STEPS if P.causal else PIECE_STEPS)
    # every block at least one key tile: a tile's slots are its consecutive blocks, each writing one
    # (with fewer tiles than blocks, empty ranges among them left slots unwritten: the GPU test's
    # 6-unit case failed so); and the kernel's 32-bit products
    if (split > (1 - (CAUSAL_MIN_GAIN if P.causal else MIN_GAIN)) * whole or iters < grid_blocks
            or grid_blocks * iters >= 2 ** 31):
        return None

    def block_of(x: int) -> int:  # the block holding tail key tile x (fwd_tail_split.cuh tail_block_of)
        return ((x + 1) * grid_blocks - 1) // iters

    # each query tile's key tiles in the tail's order: [x0, x1); causal: side 0's c0 = n - i, then side 1's
    spans = []
    for t in range(r):
        c0 = n_mb - (rounds * grid_blocks + t) % (n_mb // 2) if P.causal else kt
        spans += [(t * kt, t * kt + c0)] + ([(t * kt + c0, (t + 1) * kt)] if P.causal else [])
    slots = max(block_of(x1 - 1) - block_of(x0) + 1 for x0, x1 in spans)
    # a block's pieces: the units its range [b I / G, (b + 1) I / G) meets
    pieces = max((((b + 1) * iters // grid_blocks - 1) // kt - b * iters // grid_blocks // kt + 1)
                 for b in range(grid_blocks) if (b + 1) * iters // grid_blocks > b * iters // grid_blocks)
    return TailSplit(rounds * grid_blocks, iters, kt, slots, r, tiles.block_m * spec.head_dim, tiles.block_m,
                     tiles.block_m // 16, pieces, len(spans))


def tail_fields(tail: TailSplit, device, s) -> tuple:
    """The tail fields' bytes for one call, and what must live until its launch is queued: the
    partials' buffer (freed in stream order after the kernel) and the counters' keep."""
    slots = tail.tiles_split * tail.slots
    part = output(device, s, (slots * (tail.slot_floats + tail.rows),), _F32)
    counters, keep = get_pool(device).counters(tail.tiles_split * tail.warps, s)
    lse = part.ptr + 4 * slots * tail.slot_floats
    raw = _FMT.pack(part.ptr, lse, counters, tail.first, tail.iters, tail.tiles, tail.slots, tail.pieces)
    return raw + bytes(-_FMT.size % 64), (part, keep)


def persistent_launch(P, spec, tiles, device, may_split: bool) -> tuple:
    """``(spec, kernel, held, tail)``: the variant a call of ``spec`` launches (the row's, or its
    split variant, q_tiles 3) and its kernel, the blocks the GPU holds at once (0 unless
    persistent) and the call's tail split (``may_split``: not sparse, not empty).

    A persistent kernel's grid is the blocks the GPU holds at once (one an SM for its rows), or for
    some causal calls one work unit a block (persistent_slots); held blocks where the last round is
    split by keys (the rounding that a block a unit weighs is then gone: module docstring). Whether the
    split pays depends on the blocks held, and the split is its own variant (q_tiles 3): so the
    decision is taken on the row's designed occupancy (``min_blocks``: the setmaxnreg split fills
    the register file at exactly that many blocks) and only the launched variant is loaded; the
    driver's count of that variant is the grid (both variants share threads, shared memory and
    launch bounds), and where it differs from the design the decision is taken again on it (a
    first call compiles one variant, not the row's as well).
    """
    if not tiles.persistent:
        return spec, get_kernel(spec, device), 0, None

    def decide(held: int):
        tail = tail_split(P, spec, tiles, held) if may_split else None
        launched = spec.replace(q_tiles=3) if tail is not None else spec
        return launched, get_kernel(launched, device), tail

    designed = device.sm_count * tiles.min_blocks
    launched, kernel, tail = decide(designed)
    held = device.sm_count * kernel.max_active_blocks(spec.threads, spec.shared_bytes)
    if held != designed:
        launched, kernel, tail = decide(held)
    return launched, kernel, held, tail

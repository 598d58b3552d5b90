"""The small-grid rule of attn_fwd_tma (sm_90a): when a plain call's query tiles would leave the
GPU's SMs a short last round, the short row's one-warpgroup ``mods_row`` (64-row tiles, two blocks
an SM; spec ``q_tiles`` 2) runs it in place of the row that serves it.

:func:`short_small_grid` decides, from each row's rounds of blocks an SM (the causal calls past the
short row's keys from a simulation of both rows, :func:`_causal_makespans`), against the row's
measured ``small_grid_rate``. ``pyattn.kernels.specs.select_attention_spec`` asks it; its fits and
predictions are in BENCHMARKS.md (twenty-eighth and twenty-ninth sessions).
"""

import heapq

from .tables import rows as table_rows
from .tma import ATTN_FWD_TMA
from .wgmma import WgmmaTile

__all__ = ["short_small_grid"]


def _bucket_row(table: str, arch: str, head_dim: int):
    """attn_fwd_tma's row of ``table`` on ``arch`` that names bucket ``head_dim`` exactly, or None
    (its rows serve exactly the buckets they name, unlike ``table_row``'s first covering row)."""
    return next((r for r in table_rows(ATTN_FWD_TMA, table, arch) if r.max_head_dim == head_dim), None)


# short_small_grid takes the small-grid row only where it predicts it this much faster: the rate is
# one figure for every grid, and from 4 rounds on the two rows' predictions come within 20%
_SMALL_GRID_MARGIN = 0.95
# Causal calls on the dense row are simulated up to this many of its tiles an SM; past that its
# blocks' last round is a small part of the call and the small-grid row's rate loses anyway
_SIMULATED_ROUNDS = 8


def short_small_grid(arch: str, head_dim: int, queries: int, batch_heads: int, causal: bool, sm_count: int,
                     short: bool = True, keys: int = 0) -> bool:
    """Whether a plain call (no mask tensor, no ALiBi) runs attn_fwd_tma's short row's ``mods_row``
    (its small-grid row: 64-row tiles, two blocks an SM) in place of the row that serves it.

    Each row's work units: ``batch_heads`` (batch x query heads) x its query tiles of ``queries``
    rows (causal, on the persistent short rows: pairs of them, a long row block with a short one).
    Each SM takes them in rounds of ``min_blocks`` blocks; a round's query rows over the row's
    ``small_grid_rate`` (the small-grid row's measured speed) is the time the model counts. A small
    grid's last round is what tips it: 192 units of 192 rows take 2 rounds (384 rows an SM) where
    512 of 64 take 2 of 128; at 240 units the small one takes 3.

    ``short`` False: the dense table's row serves the call (keys past the short row's), a block a
    query tile. Causal calls there (``keys`` of them, bottom-right) have tiles of unequal work that
    the GPU hands out in launch order: ``_causal_makespans`` simulates both rows.
    """
    row = _bucket_row("short", arch, head_dim)
    if row is None or not row.mods_row or not row.small_grid_rate or not sm_count:
        return False
    big = row if short else _bucket_row("dense", arch, head_dim)
    if big is None:
        return False
    if causal and not short:
        if batch_heads * -(-queries // (64 * big.warpgroups)) > _SIMULATED_ROUNDS * sm_count * big.min_blocks:
            return False
        small, dense = _causal_makespans(row, big, queries, max(keys, queries), batch_heads, sm_count)
        return small < _SMALL_GRID_MARGIN * dense

    def rows_an_sm(r) -> int:
        rows = 64 * r.warpgroups
        tiles = batch_heads * -(-queries // rows)
        units = -(-tiles // 2) if causal else tiles
        return -(-units // (sm_count * r.min_blocks)) * rows * r.min_blocks

    return rows_an_sm(row.mods_row) / row.small_grid_rate < _SMALL_GRID_MARGIN * rows_an_sm(big)


def _causal_makespans(row: WgmmaTile, big: WgmmaTile, queries: int, keys: int, batch_heads: int,
                      sm_count: int) -> tuple:
    """A causal (bottom-right) call's time on the short row's small-grid row and on the dense row
    ``big``, in the dense row's key-tile steps, as the GPU runs them.

    The dense row: a block a query tile, each (batch, head)'s longest first, in launch order; a
    block goes to the SM that frees first (one block an SM). The small-grid row (persistent): block
    u % G takes unit u, G its blocks (``min_blocks`` an SM); a unit pairs row block i with n - 1 - i
    of one (batch, head); with an odd count two (batch, head)s share a unit of their middle blocks
    (``PersistentUnits`` in kernels_src/attention_fwd_tma.cuh). Its key-tile step costs its rows
    over the dense row's, times the blocks sharing an SM, over ``small_grid_rate``. On the five
    shapes measured this predicted each ratio 1-2% low and ranked every one right (BENCHMARKS.md,
    twenty-eighth session)."""
    small = row.mods_row

    def key_tiles(rows: int, block_n: int, n: int) -> list:
        return [-(-(min(queries, rows * (i + 1)) + keys - queries) // block_n) for i in range(n)]

    n_big = -(-queries // (64 * big.warpgroups))
    per_head = key_tiles(64 * big.warpgroups, big.block_n, n_big)[::-1]  # longest first
    free = [0.0] * (sm_count * big.min_blocks)
    for _ in range(batch_heads):
        for work in per_head:
            heapq.heapreplace(free, free[0] + work)
    n = -(-queries // (64 * small.warpgroups))
    tiles = key_tiles(64 * small.warpgroups, small.block_n, n)
    pairs = [tiles[i] + tiles[n - 1 - i] for i in range(n // 2)]
    units = []
    for g in range(0, batch_heads, 2):
        heads = min(2, batch_heads - g)
        units += pairs * heads + ([tiles[n // 2] * heads] if n & 1 else [])
    blocks = [0.0] * (sm_count * small.min_blocks)
    for u, work in enumerate(units):
        blocks[u % len(blocks)] += work
    step = (small.warpgroups * small.block_n * small.min_blocks) / (big.warpgroups * big.block_n * row.small_grid_rate)
    return max(blocks) * step, max(free)

"""attn_fwd_tma's small-grid row (CPU only, no compiler): the d = 64 short row's one-warpgroup
``mods_row`` for calls with few query tiles. The rule against the shapes measured on an H200, which
calls it takes, the causal simulation and the rounds-an-SM model behind it."""

from __future__ import annotations

import pytest

from pyattn.kernels.specs import KernelSpec, select_attention_spec, standard_specs


# (B, S, H, causal) at d = 64 on an H200 (132 SMs), bf16, keys = queries: whether the short row's
# small-grid row (1) or the row that serves the call otherwise (0) measured faster, by more than the
# noise (dev/probe_small_grid.py, BENCHMARKS.md 2026-11-28)
SMALL_GRID_MEASURED = [
    (1, 1024, 32, False, 1), (1, 1024, 24, False, 1), (1, 1024, 40, False, 0), (16, 1024, 32, False, 0),
    (1, 1024, 32, True, 1), (1, 2048, 32, True, 1), (2, 2048, 8, True, 1), (1, 2048, 40, True, 0),
    (1, 2048, 44, True, 0), (16, 1024, 32, True, 0),
    (2, 2048, 8, False, 1), (1, 2048, 16, False, 1), (1, 4096, 8, False, 1), (1, 8192, 4, False, 1),
    (1, 16384, 2, False, 1), (1, 32768, 1, False, 1), (1, 4096, 9, False, 0), (1, 4096, 10, False, 0),
    (1, 4096, 12, False, 0), (1, 4096, 16, False, 0), (1, 2048, 20, False, 0), (1, 2048, 32, False, 0),
    (1, 8192, 8, False, 0), (4, 2048, 8, False, 0),
    (1, 8192, 8, True, 1), (1, 16384, 4, True, 1), (1, 8192, 16, True, 0), (1, 16384, 8, True, 0),
    (1, 32768, 2, True, 0),
]


def _small_grid_row():
    """attn_fwd_tma's short row that has a small-grid row (``small_grid_rate``); skips without one."""
    from pyattn.kernels.families import tile_table

    rows = [r for r in tile_table("attn_fwd_tma", "sm_90a", table="short") if r.small_grid_rate]
    if not rows:
        pytest.skip("no short row with a small-grid row")
    (row,) = rows
    return row


@pytest.mark.parametrize("B, S, H, causal, small", SMALL_GRID_MEASURED)
def test_small_grids_pick_the_row_that_measured_faster(B, S, H, causal, small):
    """The small-grid rule (short_small_grid's rounds-an-SM model, its simulation of causal calls on
    the dense row, and the row's small_grid_rate) picks, for every measured d = 64 shape, the row
    that measured faster: q_tiles 2 for the short row's small-grid row, else the short row (1) or
    the dense table's row (0) as the keys select."""
    row = _small_grid_row()
    plain = select_attention_spec("bfloat16", 64, "sm_90a", keys=S, causal=causal)
    got = select_attention_spec("bfloat16", 64, "sm_90a", keys=S, causal=causal, queries=S, batch_heads=B * H,
                                sm_count=132)
    assert got.q_tiles == (2 if small else plain.q_tiles)
    if small:
        assert got.tiles == row.mods_row.config() and "_m64n128w8p" in got.entry_name


def test_small_grid_row_only_for_plain_calls_on_a_known_grid():
    """The small-grid row takes plain calls only: a mask tensor or ALiBi keep their own rows (the
    short row's mods_row at q_tiles 1 below its keys), as do an unknown grid (sm_count 0) and
    buckets without such a row; a soft-cap rides along. Causal calls past the short row's keys are
    simulated: one query tile over a million keys stays on the dense row (a unit pairs two tiles)."""
    row = _small_grid_row()
    D = row.max_head_dim
    small = dict(keys=1000, queries=1000, batch_heads=1, sm_count=132)
    assert select_attention_spec("bfloat16", D, "sm_90a", **small).q_tiles == 2
    assert select_attention_spec("bfloat16", D, "sm_90a", **{**small, "sm_count": 0}).q_tiles == 1
    for mods in ({"alibi": True}, {"mask": "bool"}, {"mask": "bf16", "mask_rows": True}):
        assert select_attention_spec("bfloat16", D, "sm_90a", **small, **mods).q_tiles == 1, mods
    long = {**small, "keys": 1 << 20}
    assert select_attention_spec("bfloat16", D, "sm_90a", **long).q_tiles == 2
    for mods in ({"causal": True}, {"alibi": True}, {"mask": "bool"}):
        assert select_attention_spec("bfloat16", D, "sm_90a", **long, **mods).q_tiles == 0, mods
    capped = select_attention_spec("float16", D, "sm_90a", softcap=30.0, **small)
    assert capped.q_tiles == 2 and capped.softcap == 1  # a row max: the bounded soft-cap is the 3-warpgroup row's
    assert select_attention_spec("bfloat16", 128, "sm_90a", **small).q_tiles in (0, 1)
    with pytest.raises(ValueError, match="q_tiles"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", q_tiles=2)
    assert KernelSpec("attn_fwd_tma", "bf16", D, "sm_90a", q_tiles=2) in standard_specs("sm_90a")


def test_causal_small_grid_simulation():
    """_causal_makespans on hand-countable grids (one SM): a dense row of key-tile works 2, 3 and 5
    for one (batch, head) runs them one after another (10 steps); the small-grid row's units pair
    its 64-row tiles' works and its blocks take them by stride, each step costing its rows over the
    dense row's, times its blocks an SM, over the rate."""
    from pyattn.kernels.families import tile_table
    from pyattn.kernels.families.small_grid import _causal_makespans

    row = _small_grid_row()
    big = next(r for r in tile_table("attn_fwd_tma", "sm_90a") if r.max_head_dim == row.max_head_dim)
    assert (big.warpgroups, big.block_n, row.mods_row.warpgroups, row.mods_row.block_n) == (3, 128, 1, 128)
    # 576 queries and keys: dense row blocks of 192 rows see 192 / 384 / 576 keys: 2, 3, 5 key tiles
    small, dense = _causal_makespans(row, big, 576, 576, 1, 1)
    assert dense == 10
    # 9 tiles of 64 rows see 1, 1, 2, ..., 5 key tiles (ceil(64 (i + 1) / 128)); pairs (0, 8) (1, 7)
    # (2, 6) (3, 5) of works 6, 5, 6, 5 and the middle (4) of 3 alone: 25 steps on 2 blocks by stride
    step = 1 * 128 * row.mods_row.min_blocks / (3 * 128 * row.small_grid_rate)
    assert small == pytest.approx(max(6 + 6 + 3, 5 + 5) * step)
    # two (batch, head)s on 132 SMs: each dense block alone on an SM, the longest (5) the time
    assert _causal_makespans(row, big, 576, 576, 2, 132)[1] == 5


def test_small_grid_model_counts_rounds_an_sm():
    """short_small_grid's model on a made-up GPU of 10 SMs: at a rate of 0.84 the small-grid row
    takes the grids where it needs no more rounds than the big row (128 rows an SM a round against
    192), not those where it needs one more; at a rate of 0.5 it takes none."""
    from pyattn.kernels.families import override_tiles, tile_table
    from pyattn.kernels.families.small_grid import short_small_grid

    short = tile_table("attn_fwd_tma", "sm_90a", table="short")
    D = _small_grid_row().max_head_dim
    # 1000 queries: 6 tiles of 192 rows, 16 of 64; 10 SMs: 10 big blocks, 20 small ones a round
    for rate, flips in ((0.84, [1, 2]), (0.5, [])):
        rows = tuple(r._replace(small_grid_rate=rate) if r.small_grid_rate else r for r in short)
        with override_tiles("attn_fwd_tma", "sm_90a", rows, table="short"):
            picks = [short_small_grid("sm_90a", D, 1000, bh, False, 10) for bh in range(1, 7)]
        # bh 1: 6 big units (1 round, 192 rows) vs 16 small (1 round, 128 rows): small at 0.84;
        # bh 2: 12 (2 rounds, 384) vs 32 (2 rounds, 256); bh 3: 18 (2, 384) vs 48 (3, 384): big
        assert [bh for bh, p in enumerate(picks, 1) if p] == flips, (rate, picks)

"""The decode split count, ``pyattn.ops.decode.choose_num_splits`` (CPU only): fixed figures of the
benchmark grids and hypothesis properties (wave efficiency, ragged batches, decodes below one wave,
one block an SM)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyattn.ops.decode import choose_num_splits, keyed_splits


@pytest.mark.parametrize("args, expect", [((8, 512, 132), 15), ((64, 64, 132), 2), ((512, 64, 132), 1),
                                          ((512, 64, 396), 2), ((4096, 64, 396), 1), ((106, 1000, 132), 6),
                                          ((105, 1000, 132), 5), ((1, 3, 132), 1), ((1, 4, 132), 2),
                                          ((1, 10**6, 132), 113)])
def test_num_splits_figures(args, expect):
    assert choose_num_splits(*args) == expect


def _eff(units, s, slots):
    waves = units * s / slots
    return waves / math.ceil(waves)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 600), st.integers(0, 3000), st.integers(1, 600))
def test_num_splits_property(units, max_tiles, slots):
    s = choose_num_splits(units, max_tiles, slots)
    limit = max(1, min(256, max_tiles // 2))
    assert 1 <= s <= limit
    if max_tiles < 4:
        assert s == 1
        return
    best = max(_eff(units, k, slots) for k in range(1, limit + 1))
    assert _eff(units, s, slots) >= 0.85 * best
    assert all(_eff(units, k, slots) < 0.85 * best for k in range(1, s))  # the smallest such


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 600), st.integers(4, 3000), st.integers(1, 600), st.floats(0.01, 1.0))
def test_num_splits_of_a_ragged_batch(units, max_tiles, slots, fill):
    """A ragged batch: never fewer splits than an even one; the longest sequence's blocks carry at
    most half a slot's mean load unless the split limit stops it; an even batch (fill 1)
    unchanged."""
    s, even = choose_num_splits(units, max_tiles, slots, fill), choose_num_splits(units, max_tiles, slots)
    limit = max(1, min(256, max_tiles // 2))
    assert even <= s <= limit
    if fill == 1.0:
        assert s == even
        return
    mean_load = units * fill * max_tiles / slots
    if max_tiles / even > mean_load:  # the longest sequence was the critical path
        assert s == limit or max_tiles / s <= mean_load / 2 * (1 + 1e-9)
    else:
        assert s == even


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 600), st.integers(0, 3000), st.integers(1, 600), st.sampled_from([16, 32, 64, 128]))
def test_num_splits_of_a_decode_below_one_wave(units, max_tiles, slots, tile_keys):
    """Decode (tile_keys given) of an even batch below one wave fills the wave, each split keeping
    >= 256 keys and 2 tiles; from one wave on, and for a ragged batch, the rule is the prefill's."""
    s = choose_num_splits(units, max_tiles, slots, 1.0, tile_keys)
    if units >= slots:
        assert s == choose_num_splits(units, max_tiles, slots)
        assert choose_num_splits(units, max_tiles, slots, 0.5, tile_keys) == choose_num_splits(units, max_tiles,
                                                                                                slots, 0.5)
        return
    per = max(2, -(-256 // tile_keys))
    assert 1 <= s <= max(1, slots // units) and units * s <= max(slots, units)
    assert s == 1 or max_tiles // s >= per or (s <= 8 and max_tiles // s >= 2)  # each split keeps its keys
    keys_bound = max(max_tiles // per, min(8, max_tiles // 2))
    assert s in (slots // units, keys_bound, 256) or (s == 1 and keys_bound == 0)  # the wave, the keys or the cap


@pytest.mark.parametrize("units, keys, tile_keys, expect", [
    (8, 4096, 64, 16), (8, 4096, 128, 16), (8, 32768, 64, 33), (64, 4096, 64, 4), (64, 32768, 128, 4),
    (512, 32768, 64, 1), (8, 1024, 64, 8), (8, 1024, 128, 4), (32, 4096, 64, 8), (16, 4096, 64, 16)])
def test_num_splits_of_the_decode_grid(units, keys, tile_keys, expect):
    """The benchmark grid's points (Hkv 8: B1 -> 8 units, B8 -> 64, B64 -> 512; 132 SMs x 2)."""
    assert choose_num_splits(units, keys // tile_keys, 264, 1.0, tile_keys) == expect


@pytest.mark.parametrize("units, keys, expect", [
    (8, 16384, 16), (8, 32768, 16), (16, 16384, 8), (16, 32768, 8), (32, 32768, 4), (8, 4096, 16), (16, 4096, 8),
    (8, 8192, 16), (16, 8192, 8), (8, 6144, 24), (64, 32768, 4), (512, 32768, 1)])
def test_num_splits_of_long_splits_one_block_an_sm(units, keys, expect):
    """The 16-bit TMA decodes (sm_slots = 132 SMs; 64-key tiles, 2 blocks an SM): below one wave,
    splits of >= 512 keys fill one block an SM (the bf16 sweep's best: B1 x 8k 16 splits, B2 x 4k
    8); shorter ones keep the wave's count (B1 x 4k: 16 of 256 keys; B1 x 6k: 24, its splits of 384
    keys), as do counts that would fall below 4 (B8 x 32k: 4, not 2), and from one wave on nothing
    changes."""
    assert choose_num_splits(units, keys // 64, 264, 1.0, 64, 132) == expect


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 600), st.integers(0, 3000), st.integers(1, 600), st.sampled_from([16, 64, 128]),
       st.integers(1, 300))
def test_num_splits_with_sm_slots(units, max_tiles, slots, tile_keys, sms):
    """sm_slots only ever lowers the count, to one block an SM, and only where each split keeps
    >= 512 keys and 4 splits remain; without it the rule is unchanged."""
    base = choose_num_splits(units, max_tiles, slots, 1.0, tile_keys)
    s = choose_num_splits(units, max_tiles, slots, 1.0, tile_keys, sms)
    assert s == base or (4 <= s == sms // units < base and max_tiles * tile_keys >= s * 512 and units < slots)


def test_num_splits_of_the_ragged_benchmark_batch():
    """64 sequences of log-uniform lengths 128..64k (mean fill ~0.16), 8 kv heads, on 132 SMs x 2:
    one split before (its 64k-token blocks ~3x a slot's mean load), 7 now."""
    assert choose_num_splits(512, 1024, 264) == 1
    assert choose_num_splits(512, 1024, 264, 0.16) == 7


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.integers(0, 5000))
def test_keyed_splits_drops_only_empty_splits(splits, max_tiles):
    """The kernel gives each split ceil(tiles / splits) tiles: keyed_splits keeps that share and
    drops exactly the splits that it leaves without a tile (the longest sequence's)."""
    s = keyed_splits(splits, max_tiles)
    assert 1 <= s <= splits
    if splits == 1 or max_tiles == 0:
        assert s == splits
        return
    per = -(-max_tiles // splits)
    assert -(-max_tiles // s) == per  # each kept split keeps the same share
    assert (s - 1) * per < max_tiles  # every kept split holds a tile
    assert all(min(max_tiles, (k + 1) * per) <= k * per for k in range(s, splits))  # the dropped ones none


@pytest.mark.parametrize("splits, tiles, expect", [(33, 256, 32), (33, 512, 32), (33, 520, 33), (16, 256, 16),
                                                   (33, 128, 32), (7, 1024, 7), (13, 20, 10), (4, 3, 3)])
def test_keyed_splits_figures(splits, tiles, expect):
    """B1 x 32k (8 units, 264 slots: 33 splits) over 256 tiles of 128 keys (the 8-bit kernels') or
    512 of 64 (bf16's): 8 or 16 tiles a split, 32 splits."""
    assert keyed_splits(splits, tiles) == expect

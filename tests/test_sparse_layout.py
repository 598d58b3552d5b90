"""Block-sparse layouts (``pyattn.validate.block_layout``): validation of both layout forms, the band,
and the conversion to the kernels' per-tile lists with 16 x 16 sub-block bit masks (CPU only)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyattn.validate.block_layout import (TileLists, band_limits, block_mask_to_dense, check_block_layout,
                                       check_block_size, tile_lists, tiles_to_dense)

TILES = [(128, 128), (128, 64), (256, 64), (128, 32), (64, 16)]
WSIDE = st.just(-1) | st.integers(0, 40) | st.integers(0, 300)  # often unbounded (the no-band shortcut) or narrow


def to_bsr(mask):
    """(indptr (H, Mb + 1), indices) of a bool (H, Mb, Nb) mask, heads one after another."""
    h, mb, _ = mask.shape
    counts = mask.sum(axis=2).ravel()
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = np.concatenate([indptr[r * mb:(r + 1) * mb + 1][None] for r in range(h)])
    return rows, np.nonzero(mask)[2].astype(np.int32)


def band_dense(causal, window, sq, sk):
    """Bool (Sq, Sk) from the documented semantics, independent of band_limits."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    d = sk - sq
    ok = np.ones((sq, sk), dtype=bool)
    if causal == 1:
        ok &= j <= i + d
    if causal == 2:
        ok &= j <= i
    if window[0] >= 0:
        ok &= j >= i + d - window[0]
    if window[1] >= 0:
        ok &= j <= i + d + window[1]
    return ok


# --------------------------------------------------------------------------- block size and layouts


def test_check_block_size():
    assert check_block_size((16, 32)) == (16, 32)
    assert check_block_size([np.int64(64), 48]) == (64, 48)
    for bad in [(15, 16), (0, 16), (-16, 16), (16, 40)]:
        with pytest.raises(ValueError, match="block_size.*multiples of 16"):
            check_block_size(bad)
    for bad in [16, (16,), (16, 16, 16), (True, 16), (16.0, 16), "16"]:
        with pytest.raises(TypeError, match="block_size"):
            check_block_size(bad)


def test_layout_forms_agree():
    rng = np.random.default_rng(0)
    hq, sq, sk, bs = 3, 200, 130, (64, 32)  # Mb = 4, Nb = 5
    mask = rng.random((hq, 4, 5)) < 0.5
    kw = dict(block_size=bs, heads_q=hq, seqlen_q=sq, seqlen_k=sk)
    got = check_block_layout(mask, **kw)
    assert got.dtype == np.bool_ and got.flags.c_contiguous and np.array_equal(got, mask)
    np.testing.assert_array_equal(check_block_layout(to_bsr(mask), **kw), mask)
    np.testing.assert_array_equal(check_block_layout(mask[1], **kw), mask[1:2])  # (Mb, Nb): shared by heads
    np.testing.assert_array_equal(check_block_layout(mask[:1].tolist(), **kw), mask[:1])  # list of bools
    ip, ix = to_bsr(mask[2:])
    np.testing.assert_array_equal(check_block_layout((ip[0], ix), **kw), mask[2:])  # 1-D indptr
    # absolute positions: both heads read the same entries, placed after unused ones
    ip2 = np.stack([ip[0] + 3, ip[0] + 3]).astype(np.int64)
    both = check_block_layout((ip2, np.concatenate([[99, 99, 99], ix])), **{**kw, "heads_q": 2})
    np.testing.assert_array_equal(both, np.concatenate([mask[2:]] * 2))


class FakeDev:
    __cuda_array_interface__ = {"shape": (4, 5), "typestr": "|b1", "data": (0, False), "version": 3}


@pytest.mark.parametrize("layout, exc, match", [
    (np.ones((4, 6), bool), ValueError, r"layout: expected shape \(Mb, Nb\) = \(4, 5\)"),
    (np.ones((2, 4, 5), bool), ValueError, r"H in \{1, heads_q = 3\}"),
    (np.ones((4, 5), np.int8), TypeError, "layout: .*dtype bool"),
    (np.ones((4, 5), np.float32), TypeError, "layout: .*dtype bool"),
    (FakeDev(), TypeError, "layout: .*device"),
    (object(), TypeError, "layout"),
    ((np.array([0, 1, 1, 1, 1]),), TypeError, "layout: .*pair"),
    ((np.array([0, 2, 2, 2, 2]), np.array([1, 1])), ValueError, "layout: duplicate column-block id 1 in block row 0"),
    ((np.array([0, 0, 1, 1, 1]), np.array([5])), ValueError, r"layout: .*\[0, Nb = 5\).* 5 in block row 1"),
    ((np.array([0, 0, 1, 1, 1]), np.array([-1])), ValueError, "layout: .*-1 in block row 1"),
    ((np.array([0, 2, 1, 2, 2]), np.array([0, 1])), ValueError, "layout: indptr must be non-decreasing"),
    ((np.array([0, 1, 1, 1, 3]), np.array([0, 1])), ValueError, r"layout: indptr must lie in \[0, len"),
    ((np.array([0, 1, 1, 1]), np.array([0])), ValueError, r"layout: indptr must have shape \(Mb \+ 1,\) = \(5,\)"),
    ((np.zeros((2, 5), np.int32), np.array([0])), ValueError, "layout: indptr .*heads_q = 3"),
    ((np.array([0, 1, 1, 1, 1]), np.array([True])), TypeError, "layout: indices .*integer"),
    ((np.array([0, 1, 1, 1, 1.0]), np.array([0])), TypeError, "layout: indptr .*integer"),
    ((np.array([0, 1, 1, 1, 1]), np.array([[0]])), ValueError, "layout: indices must be 1-D"),
])
def test_layout_rejects(layout, exc, match):
    with pytest.raises(exc, match=match):
        check_block_layout(layout, block_size=(64, 32), heads_q=3, seqlen_q=200, seqlen_k=130)


def test_layout_rejects_block_size():
    with pytest.raises(ValueError, match="block_size"):
        check_block_layout(np.ones((1, 1), bool), block_size=(8, 8), heads_q=1, seqlen_q=8, seqlen_k=8)


# --------------------------------------------------------------------------- band and tile lists


@settings(max_examples=60, deadline=None)
@given(sq=st.integers(1, 90), sk=st.integers(1, 90), causal=st.sampled_from([0, 1, 2]),
       left=st.integers(-1, 40), right=st.integers(-1, 40))
def test_band_limits(sq, sk, causal, left, right):
    lo, hi = band_limits(causal, (left, right), sq, sk)
    diff = np.arange(sk)[None, :] - np.arange(sq)[:, None]
    np.testing.assert_array_equal((diff >= lo) & (diff <= hi), band_dense(causal, (left, right), sq, sk))


def test_tile_lists_hand_example():
    # causal 128 x 128, all blocks set, tiles 64 x 64: diagonal tiles hold the lower triangle of
    # their 4 x 4 sub-blocks (bits a * 4 + b with b <= a), the tile above the diagonal is dropped
    tl = tile_lists(np.ones((1, 2, 2), bool), (64, 64), 64, 64, 128, 128, causal=1)
    assert isinstance(tl, TileLists) and (tl.stride_h, tl.n_rows, tl.nnz) == (0, 2, 3)
    assert tl.ptr.dtype == tl.idx.dtype == np.int32 and tl.bits.dtype == np.uint64
    tri = sum(1 << (a * 4 + b) for a in range(4) for b in range(a + 1))
    assert (tl.ptr.tolist(), tl.idx.tolist(), tl.bits.tolist()) == ([0, 1, 3], [0, 0, 1], [tri, 0xFFFF, tri])
    two = tile_lists(np.ones((2, 2, 2), bool), (64, 64), 64, 64, 128, 128)
    assert (two.stride_h, two.n_rows, two.nnz) == (2, 4, 8)


def test_tile_lists_causal_short_queries():
    # 40 queries over 200 keys, causal: row i sees keys <= i + 160, so rows 0..15 miss keys 176..191
    # (sub-block (0, 3) of key tile 2) and only rows 32..39 reach key tile 3 (sub-block (2, 0))
    tl = tile_lists(np.ones((1, 1, 4), bool), (64, 64), 64, 64, 40, 200, causal=1)
    assert tl.idx.tolist() == [0, 1, 2, 3] and tl.bits.tolist() == [0xFFF, 0xFFF, 0xFF7, 0x100]


def test_tile_lists_empty_band():
    # top-left causal (j - i <= 0) with window left 0 and Sk > Sq (j - i >= 1): nothing is visible
    tl = tile_lists(np.ones((1, 1, 1), bool), (16, 16), 128, 128, 1, 2, causal=2, window=(0, -1))
    assert tl.nnz == 0 and tl.ptr.tolist() == [0, 0]


def test_tile_shape_checked():
    m = np.ones((1, 1, 1), bool)
    for tm, tn in [(256, 128), (24, 16), (0, 16)]:
        with pytest.raises(ValueError, match="tile_m, tile_n|tile_m"):
            tile_lists(m, (16, 16), tm, tn, 16, 16)
    with pytest.raises(ValueError, match="block_mask"):
        tile_lists(np.ones((1, 2, 1), bool), (16, 16), 64, 64, 16, 16)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), h=st.integers(1, 3), sq=st.integers(1, 400), sk=st.integers(1, 400),
       bs=st.sampled_from([16, 32, 48, 64, 128]), tile=st.sampled_from(TILES), causal=st.sampled_from([0, 1, 2]),
       window=st.tuples(WSIDE, WSIDE), density=st.floats(0, 1))
def test_tile_lists_match_block_mask(data, h, sq, sk, bs, tile, causal, window, density):
    tm, tn = tile
    mb, nb = -(-sq // bs), -(-sk // bs)
    seed = data.draw(st.integers(0, 2**32 - 1))
    mask = np.random.default_rng(seed).random((h, mb, nb)) < density
    tl = tile_lists(mask, (bs, bs), tm, tn, sq, sk, causal=causal, window=window)
    mt, nt = -(-sq // tm), -(-sk // tn)
    assert tl.n_rows == h * mt and tl.stride_h == (mt if h > 1 else 0) and tl.nnz == tl.idx.size == tl.bits.size
    assert tl.ptr.shape == (tl.n_rows + 1,) and tl.ptr[0] == 0 and tl.ptr[-1] == tl.nnz
    assert (tl.bits != 0).all() and ((tl.idx >= 0) & (tl.idx < nt)).all()
    for r in range(tl.n_rows):  # ascending, hence unique, key tiles per row
        assert (np.diff(tl.idx[tl.ptr[r]:tl.ptr[r + 1]]) > 0).all()
    band = band_dense(causal, window, sq, sk)
    want = block_mask_to_dense(mask, (bs, bs), sq, sk) & band
    got = tiles_to_dense(tl, tm, tn, sq, sk, h)
    np.testing.assert_array_equal(got & band, want)
    # exact: a sub-block's bit is set iff it holds a visible allowed element (so no dropped tile
    # holds one, and no listed sub-block is empty)
    r16, c16 = mt * tm // 16, nt * tn // 16

    def per_sub(x):
        pad = np.zeros((h, r16 * 16, c16 * 16), dtype=bool)
        pad[:, :sq, :sk] = x
        return pad.reshape(h, r16, 16, c16, 16).any(axis=(2, 4))

    np.testing.assert_array_equal(per_sub(got), per_sub(want))


def test_tiles_to_dense_shared_lists_broadcast():
    mask = np.eye(4, dtype=bool)[None]
    tl = tile_lists(mask, (32, 32), 64, 64, 128, 128)
    dense = tiles_to_dense(tl, 64, 64, 128, 128, heads=3)
    assert dense.shape == (3, 128, 128) and (dense == block_mask_to_dense(mask, (32, 32), 128, 128)).all()


def test_tile_lists_large():
    # The size the block-sparse op meets in practice (no timing asserted: ~20 ms on one core).
    h, s, density = 16, 16384, 0.1
    mask = np.random.default_rng(0).random((h, s // 64, s // 64)) < density
    tl = tile_lists(mask, (64, 64), 128, 128, s, s)
    tiles = h * (s // 128) ** 2
    p_tile = 1 - (1 - density) ** 4  # a 128 x 128 tile holds 2 x 2 blocks
    assert abs(tl.nnz - tiles * p_tile) < 0.02 * tiles * p_tile
    assert tl.bits.dtype == np.uint64 and tl.n_rows == h * s // 128
    causal = tile_lists(mask, (64, 64), 128, 128, s, s, causal=1)
    assert 0.45 * tl.nnz < causal.nnz < 0.55 * tl.nnz


# -- the plan reads the lists the way tile_lists lays them out -------------------------------------


class _Arch:
    ordinal = 0
    sm_count = 132  # an H200's (the spec selection weighs a call's query tiles against it)

    def __init__(self, arch):
        self.arch = arch


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("heads_in_layout", [1, 4])
@pytest.mark.parametrize("block", [(128, 128), (48, 80)])  # the standard tiles, and 64 x 64 tiles
def test_plan_tile_stride_matches_the_lists(monkeypatch, arch, heads_in_layout, block):
    """A shared layout (H = 1) has one list for all heads: the kernel's row for head h must not step
    by tiles-per-head (that read past the list: found on the GPU); per-head layouts step by it."""
    import struct

    from _problems import problem
    from pyattn.ops import _fwd, _fwd_tail
    from pyattn.ops.block_sparse import sparse_problem

    monkeypatch.setattr(_fwd_tail, "get_kernel", lambda spec, device: None)  # (persistent_launch's)
    q, kv = np.zeros((1, 268, 4, 64), np.float16), np.zeros((1, 210, 2, 64), np.float16)
    P = problem(q, kv, kv, causal="top_left")
    R, C = block
    mask = np.random.default_rng(0).random((heads_in_layout, -(-268 // R), -(-210 // C))) < 0.3
    plan = _fwd.build_fwd_plan(sparse_problem(P, mask, block, arch), _Arch(arch))
    fmt = plan.spec.params.format
    names = [n for n, _ in plan.spec.params.fields]
    values = dict(zip(names, struct.unpack(fmt, plan.packer.pack(*[0] * 12)[:struct.calcsize(fmt)])))
    t = plan.spec.tiles
    lists = tile_lists(mask, block, t.block_m, t.block_n, 268, 210, causal=2, window=(-1, -1))
    assert values["tile_stride_h"] == lists.stride_h
    assert values["tile_stride_h"] == (0 if heads_in_layout == 1 else -(-268 // t.block_m))

"""pyattn.patterns: every builder against a direct boolean definition, CSR invariants, coarsening,
random_k's draw, bigbird's structure and argument validation (CPU only)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyattn import patterns as P

SEQ = st.integers(1, 70)
BLOCK = st.tuples(st.integers(1, 24), st.integers(1, 24))
FAST = settings(max_examples=100, deadline=None)


# --------------------------------------------------------------------------- independent helpers


def grid(sq, sk):
    """(t, j): query positions (bottom-right aligned) as a column, keys as a row."""
    return (np.arange(sq) + sk - sq)[:, None], np.arange(sk)[None, :]


def visible(t, j, causal):
    """Bool (Sq, Sk): the causal constraint ``j <= t`` (all True without causal)."""
    return (j <= t) if causal else np.ones(np.broadcast_shapes(t.shape, j.shape), dtype=bool)


def check_csr(csr, sq, sk):
    """CSR invariants; returns the dense mask built row by row (independent of csr_to_mask)."""
    idx, off = csr
    assert idx.dtype == np.int32 and off.dtype == np.int32
    assert off.shape == (sq + 1,) and off[0] == 0 and off[-1] == idx.size
    assert (np.diff(off) >= 0).all()
    dense = np.zeros((sq, sk), dtype=bool)
    for i in range(sq):
        row = idx[off[i]:off[i + 1]]
        assert (np.diff(row) > 0).all(), f"row {i} not sorted/unique: {row}"
        assert row.size == 0 or (row[0] >= 0 and row[-1] < sk)
        dense[i, row] = True
    return dense


def coarsen(dense, r, c):
    sq, sk = dense.shape
    mb, nb = -(-sq // r), -(-sk // c)
    pad = np.zeros((mb * r, nb * c), dtype=bool)
    pad[:sq, :sk] = dense
    return pad.reshape(mb, r, nb, c).any(axis=(1, 3))


def check_builder(build, want, sq, sk, block):
    """CSR equals ``want``; the block form equals the coarsening of the token form."""
    dense = check_csr(build(block_size=None), sq, sk)
    np.testing.assert_array_equal(dense, want)
    got = build(block_size=block)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, coarsen(want, *block))


# --------------------------------------------------------------------------- builders


@FAST
@given(sq=SEQ, sk=SEQ, left=st.integers(-1, 20), right=st.integers(-1, 20), causal=st.booleans(), block=BLOCK)
def test_local(sq, sk, left, right, causal, block):
    t, j = grid(sq, sk)
    want = (j >= t - left if left >= 0 else True) & (j <= t + right if right >= 0 else True) & visible(t, j, causal)
    check_builder(lambda **kw: P.local(sq, sk, window=(left, right), causal=causal, **kw), want, sq, sk, block)


def test_local_int_window():
    t, j = grid(9, 9)
    np.testing.assert_array_equal(P.csr_to_mask(*P.local(9, window=2), 9), abs(t - j) <= 2)
    np.testing.assert_array_equal(P.csr_to_mask(*P.local(9, window=2, causal=True), 9), (t - j >= 0) & (t - j <= 2))
    assert P.local(5, window=-1)[0].size == 25


@FAST
@given(sq=SEQ, sk=SEQ, stride=st.integers(1, 12), width=st.integers(0, 6), causal=st.booleans(), block=BLOCK)
def test_strided(sq, sk, stride, width, causal, block):
    t, j = grid(sq, sk)
    want = (((t - j) % stride == 0) | (abs(t - j) <= width)) & visible(t, j, causal)
    check_builder(lambda **kw: P.strided(sq, sk, stride=stride, local=width, causal=causal, **kw), want, sq, sk,
                  block)


@FAST
@given(sq=SEQ, sk=SEQ, window=st.integers(0, 12), dil=st.integers(1, 9), causal=st.booleans(), block=BLOCK)
def test_dilated(sq, sk, window, dil, causal, block):
    t, j = grid(sq, sk)
    want = np.zeros((sq, sk), dtype=bool)
    for k in range(-window, (0 if causal else window) + 1):  # the definition, key by key
        want |= j == t + k * dil
    check_builder(lambda **kw: P.dilated(sq, sk, window=window, dilation=dil, causal=causal, **kw), want, sq, sk,
                  block)


@FAST
@given(sq=SEQ, sk=SEQ, data=st.data(), window=st.integers(0, 5), causal=st.booleans(), block=BLOCK)
def test_global_tokens(sq, sk, data, window, causal, block):
    tokens = data.draw(st.lists(st.integers(0, sk - 1), max_size=6))
    t, j = grid(sq, sk)
    want = (abs(t - j) <= window) | np.isin(j, tokens) | np.isin(t, tokens)
    want &= visible(t, j, causal)
    check_builder(lambda **kw: P.global_tokens(sq, sk, tokens=np.array(tokens, dtype=np.int64), window=window,
                                               causal=causal, **kw), want, sq, sk, block)


def test_global_tokens_rows_follow_positions():
    # 3 queries over 6 keys: query rows sit at positions 3, 4, 5; position 4 is global
    dense = P.csr_to_mask(*P.global_tokens(3, 6, tokens=[4], window=0), 6)
    assert dense[1].all() and dense[:, 4].all() and dense.sum() == 2 + 6 + 2  # band key + key 4; all; band key + key 4


@FAST
@given(sq=SEQ, sk=SEQ, k=st.integers(0, 80), seed=st.integers(0, 2**32), causal=st.booleans(), block=BLOCK)
def test_random_k(sq, sk, k, seed, causal, block):
    t, j = grid(sq, sk)
    allowed = visible(t, j, causal)
    kw = dict(k=k, seed=seed, causal=causal)
    drawn = check_csr(P.random_k(sq, sk, include_diagonal=False, **kw), sq, sk)
    assert not (drawn & ~allowed).any()
    np.testing.assert_array_equal(drawn.sum(axis=1), np.minimum(k, allowed.sum(axis=1)))
    # include_diagonal adds key t to the same draw; the block form is its coarsening
    want = drawn | (j == t)
    check_builder(lambda **b: P.random_k(sq, sk, **kw, **b), want, sq, sk, block)
    np.testing.assert_array_equal(P.random_k(sq, sk, **kw)[0], P.random_k(sq, sk, **kw)[0])  # deterministic


@pytest.mark.parametrize("k", [3, 40])  # Floyd's draw (k^2 <= 8 Sk) and the dense-score draw
def test_random_k_seed_and_uniformity(k):
    a, b = P.random_k(64, k=k, seed=1), P.random_k(64, k=k, seed=2)
    assert not np.array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0], P.random_k(64, k=k, seed=1)[0])
    idx, off = P.random_k(3000, 50, k=k, seed=7, include_diagonal=False)
    freq = np.bincount(idx, minlength=50)
    mean = 3000 * k / 50  # every key is drawn with probability k / 50
    assert abs(freq - mean).max() < 6 * np.sqrt(mean)


def test_bigbird_structure():
    nb, w, g, r = 12, 1, 2, 3
    m = P.bigbird(nb * 32 - 5, block_size=(32, 32), window_blocks=w, global_blocks=g, random_blocks=r, seed=3)
    assert m.shape == (nb, nb) and m.dtype == np.bool_
    i = np.arange(nb)
    base = (abs(i[:, None] - i[None, :]) <= w) | (i[:, None] < g) | (i[None, :] < g)
    assert (m >= base).all()
    assert m[:g].all() and m[:, :g].all()
    np.testing.assert_array_equal(m.sum(axis=1)[g:], np.minimum(base.sum(axis=1)[g:] + r, nb))
    np.testing.assert_array_equal(m, P.bigbird(nb * 32 - 5, block_size=32, window_blocks=w, global_blocks=g,
                                                random_blocks=r, seed=3))
    assert not np.array_equal(m, P.bigbird(nb * 32 - 5, block_size=32, window_blocks=w, global_blocks=g,
                                           random_blocks=r, seed=4))
    assert P.bigbird(64, block_size=16, random_blocks=9).all()  # more random blocks than free columns


# --------------------------------------------------------------------------- conversions


def test_csr_to_mask_batched_and_roundtrip():
    rng = np.random.default_rng(0)
    masks = rng.random((2, 3, 5, 7)) < 0.4
    idx, offs = [], []
    for m in masks.reshape(6, 5, 7):  # absolute positions into one flat indices array
        i, o = P.mask_to_csr(m)
        offs.append(o + sum(x.size for x in idx))
        idx.append(i)
    flat, off = np.concatenate(idx), np.stack(offs).reshape(2, 3, 6)
    np.testing.assert_array_equal(P.csr_to_mask(flat, off, 7), masks)
    np.testing.assert_array_equal(P.csr_to_mask(*P.mask_to_csr(masks[0, 0]), 7), masks[0, 0])
    np.testing.assert_array_equal(P.csr_to_bsr(flat, off, 7, (2, 3)),
                                  np.stack([coarsen(m, 2, 3) for m in masks.reshape(6, 5, 7)]).reshape(2, 3, 3, 3))


def test_union():
    a, b = P.local(20, window=1), P.strided(20, stride=5)
    got = check_csr(P.union(a, b, seqlen_k=20), 20, 20)
    np.testing.assert_array_equal(got, P.csr_to_mask(*a, 20) | P.csr_to_mask(*b, 20))
    dup = (np.array([3, 1, 1], np.int32), np.array([0, 3], np.int32))  # unsorted with a duplicate
    assert P.union(dup, seqlen_k=4)[0].tolist() == [1, 3]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("call, exc, name", [
    (lambda: P.local(0, window=1), ValueError, "seqlen_q"),
    (lambda: P.local(True, window=1), TypeError, "seqlen_q"),
    (lambda: P.local(4, 2.0, window=1), TypeError, "seqlen_k"),
    (lambda: P.local(4, window=(1,)), TypeError, "window"),
    (lambda: P.local(4, window=(1, -2)), ValueError, "window"),
    (lambda: P.local(4, window=1.5), TypeError, "window"),
    (lambda: P.local(4, window=1, causal=1), TypeError, "causal"),
    (lambda: P.local(4, window=1, block_size=(0, 4)), ValueError, "block_size"),
    (lambda: P.local(4, window=1, block_size="16"), TypeError, "block_size"),
    (lambda: P.strided(4, stride=0), ValueError, "stride"),
    (lambda: P.strided(4, stride=2, local=-1), ValueError, "local"),
    (lambda: P.dilated(4, window=1, dilation=0), ValueError, "dilation"),
    (lambda: P.dilated(4, window=-1, dilation=1), ValueError, "window"),
    (lambda: P.global_tokens(4, tokens=[4]), ValueError, "tokens"),
    (lambda: P.global_tokens(4, tokens=[0.0]), TypeError, "tokens"),
    (lambda: P.global_tokens(4, tokens=[[0]]), ValueError, "tokens"),
    (lambda: P.global_tokens(4, tokens=[True]), TypeError, "tokens"),
    (lambda: P.random_k(4, k=-1, seed=0), ValueError, "k"),
    (lambda: P.random_k(4, k=1, seed=1.0), TypeError, "seed"),
    (lambda: P.random_k(4, k=1, seed=0, include_diagonal=None), TypeError, "include_diagonal"),
    (lambda: P.bigbird(64, block_size=(16, 32)), ValueError, "block_size"),
    (lambda: P.bigbird(64, block_size=16, global_blocks=-1), ValueError, "global_blocks"),
    (lambda: P.csr_to_mask([0], [0, 2], 3), ValueError, "offsets"),
    (lambda: P.csr_to_mask([0, 1], [1, 0], 3), ValueError, "offsets"),
    (lambda: P.csr_to_mask([3], [0, 1], 3), ValueError, "indices"),
    (lambda: P.csr_to_mask([True], [0, 1], 3), TypeError, "indices"),
    (lambda: P.csr_to_mask([0], [0.0, 1.0], 3), TypeError, "offsets"),
    (lambda: P.mask_to_csr(np.ones((2, 2), np.int8)), TypeError, "mask"),
    (lambda: P.mask_to_csr(np.ones((1, 2, 2), bool)), ValueError, "mask"),
    (lambda: P.csr_to_bsr([0], [0, 1], 3, (0, 2)), ValueError, "block_size"),
    (lambda: P.union(seqlen_k=3), ValueError, "csrs"),
    (lambda: P.union(P.local(3, window=0), P.local(4, 3, window=0), seqlen_k=3), ValueError, "csrs\\[1\\]"),
    (lambda: P.union(([0],), seqlen_k=3), TypeError, "csrs\\[0\\]"),
])
def test_validation(call, exc, name):
    with pytest.raises(exc, match=name):
        call()

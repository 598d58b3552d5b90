"""The NumPy-in/NumPy-out pipeline's planning and host copies (``pyattn.pipeline.chunks`` and
``pyattn.pipeline.transfer``), CPU only: the chunk planner; the claim that query-row chunks (with
the causal key prefix) are independent problems, checked against the fp64 reference; mask
preparation; the threaded host copies; and ``transfer.cuts``. The pipeline run against a fake GPU
is in test_host_pipeline_fake.py, on a real GPU in test_gpu_host_pipeline.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _problems import problem
from pyattn.pipeline import chunks, transfer
from pyattn.pipeline.chunks import Chunk, plan_chunks, prepare_mask, row_chunkable
from pyattn.pipeline.transfer import addr
from pyattn.reference import attention_ref

ml_dtypes = pytest.importorskip("ml_dtypes")

MiB = 1 << 20


# -- planner ---------------------------------------------------------------------------------------


def test_split_range_covers_evenly():
    for n in range(0, 40):
        for parts in range(1, 12):
            r = transfer.split_range(n, parts)
            assert r[0][0] == 0 and r[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [b - a for a, b in r]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert len(r) == max(1, min(parts, n))


@pytest.fixture
def planner(monkeypatch):
    """Fixed planner constants, so these tests do not follow tuning."""
    for name, value in {"_MIN_PIPELINE_BYTES": 8 * MiB, "_CHUNK_BYTES": 4 * MiB, "_MAX_CHUNKS": 64}.items():
        monkeypatch.setattr(chunks, name, value)


def _p(B=1, Sq=4096, Sk=4096, Hq=16, Hkv=16, D=128, **kw):
    q, kv = np.empty((B, Sq, Hq, D), np.float16), np.empty((B, Sk, Hkv, D), np.float16)
    return problem(q, kv, kv, **kw)


def test_small_calls_are_one_chunk(planner):
    assert plan_chunks(_p(B=16), 8 * MiB - 1) == [Chunk(0, 16, 0, 4096, 4096, 0)]
    assert plan_chunks(_p(B=1, Sq=1), 10**9) == [Chunk(0, 1, 0, 1, 4096, 0)]  # one row: nothing to split


def test_batch_chunks_when_there_is_a_batch(planner):
    cs = plan_chunks(_p(B=32), 64 * MiB)  # 16 chunks wanted
    assert len(cs) == 16 and cs[0].b0 == 0 and cs[-1].b1 == 32 and all(c.s0 == 0 and c.s1 == 4096 for c in cs)
    assert len(plan_chunks(_p(B=2), 64 * MiB)) == 2  # fewer entries than chunks wanted: one each


def test_row_chunks_of_one_sequence(planner):
    cs = plan_chunks(_p(), 64 * MiB)
    assert len(cs) == 16 and cs[-1].s1 == 4096 and all(c.kv_len == 4096 and c.causal == 0 for c in cs)
    cs = plan_chunks(_p(Sq=1000, Sk=3000, causal=True), 64 * MiB)  # the causal prefix of each chunk
    assert all(c.kv_len == c.s1 + 2000 and c.causal == 1 for c in cs)
    cs = plan_chunks(_p(Sq=3000, Sk=1000, causal=True), 64 * MiB)  # early rows see no key at all
    assert cs[0].kv_len == 0 and all(c.kv_len == max(0, min(c.s1 - 2000, 1000)) for c in cs)
    cs = plan_chunks(_p(causal="top_left"), 64 * MiB)  # Sq == Sk: top-left is bottom-right
    assert len(cs) == 16 and all(c.causal == 1 and c.kv_len == c.s1 for c in cs)


def test_calls_that_rows_cannot_split_are_one_chunk(planner):
    for kw in (dict(window=(128, 0)), dict(alibi_slopes=np.ones(16, np.float32)),
               dict(causal="top_left", Sk=5000)):
        assert len(plan_chunks(_p(**kw), 64 * MiB)) == 1, kw
    assert len(plan_chunks(_p(causal=True, window=(128, 0), alibi_slopes=np.ones(16, np.float32)), 64 * MiB)) == 16


def test_chunk_count_is_bounded(planner):
    assert len(plan_chunks(_p(B=4096, Sq=8, Sk=8, Hq=1, Hkv=1, D=8), 100 * 1024 * MiB)) == 64


# -- row chunks reproduce the whole (the reason row_chunkable says what it says) ---------------------


@settings(max_examples=120, deadline=None)
@given(Sq=st.integers(1, 24), Sk=st.integers(0, 24), causal=st.sampled_from([False, True, "top_left"]),
       window=st.sampled_from([None, (3, 0), (2, 5), (-1, 1)]), alibi=st.booleans(),
       mask=st.sampled_from([None, "rows", "full", "keys"]), parts=st.integers(2, 5), seed=st.integers(0, 2**16))
def test_row_chunks_reproduce_the_whole(Sq, Sk, causal, window, alibi, mask, parts, seed):
    rng = np.random.default_rng(seed)
    Hq, Hkv, D = 4, 2, 8
    q, k, v = rng.standard_normal((1, Sq, Hq, D)), rng.standard_normal((1, Sk, Hkv, D)), rng.standard_normal((1, Sk, Hkv, D))
    opts = {"causal": causal, "window": window}
    if alibi:
        opts["alibi_slopes"] = rng.random(Hq)
    if mask is not None:
        shape = {"rows": (1, 1, Sq, 1), "full": (1, Hq, Sq, Sk), "keys": (1, 1, 1, Sk)}[mask]
        opts["mask"] = rng.random(shape) > 0.2
    P = problem(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), **opts)
    if not row_chunkable(P):
        return
    whole, whole_lse = attention_ref(q, k, v, return_lse=True, **opts)
    mask4, _ = prepare_mask(opts.get("mask"), (1, Hq, Sq, Sk))
    code = 1 if P.causal else 0
    for s0, s1 in transfer.split_range(Sq, parts):
        kv_len = Sk if not code else min(max(s1 + Sk - Sq, 0), Sk)
        copts = dict(opts, causal=bool(code))
        if mask4 is not None:
            m = mask4[:, :, s0:s1] if mask4.shape[2] > 1 else mask4
            copts["mask"] = m[..., :kv_len] if m.shape[3] > 1 else m
        o, lse = attention_ref(q[:, s0:s1], k[:, :kv_len], v[:, :kv_len], return_lse=True, **copts)
        np.testing.assert_allclose(o, whole[:, s0:s1], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(whole_lse[:, :, s0:s1]))
        fin = np.isfinite(lse)
        np.testing.assert_allclose(lse[fin], whole_lse[:, :, s0:s1][fin], rtol=1e-12, atol=1e-12)


def test_prepare_mask():
    shape = (2, 4, 5, 6)
    m, dt = prepare_mask(np.ones((5, 6)), shape)
    assert m.shape == (1, 1, 5, 6) and dt == np.float32
    m, dt = prepare_mask(np.broadcast_to(np.ones((2, 1, 1, 6), bool), shape), shape)
    assert m.shape == (2, 1, 1, 6) and dt == np.bool_  # broadcast (stride 0) axes shrink to 1
    m, dt = prepare_mask(np.zeros(shape, np.float16), shape)
    assert m.shape == shape and dt == np.float16
    assert prepare_mask(None, shape) == (None, None)


# -- threaded host copies -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.bool_])
def test_threaded_copies_of_strided_slices(monkeypatch, dtype):
    monkeypatch.setattr(transfer, "PIECE_BYTES", 512)
    rng = np.random.default_rng(1)
    src = (rng.standard_normal((2, 300, 8, 32)) > 0) if dtype is np.bool_ else \
        rng.standard_normal((2, 300, 8, 32)).astype(dtype)
    part = src[:, :, 2:6]  # a head slice: strided
    dst = np.empty(part.shape, part.dtype)
    futures = transfer.start_copies([(dst, part)])
    assert len(futures) > 1
    transfer.finish_copies(futures)
    assert np.array_equal(dst.view(np.uint8), np.ascontiguousarray(part).view(np.uint8))
    back = np.zeros_like(src)
    transfer.finish_copies(transfer.start_copies([(back[:, :, 2:6], dst)]))
    assert np.array_equal(back[:, :, 2:6].view(np.uint8), part.view(np.uint8))
    assert not back[:, :, :2].view(np.uint8).any() and not back[:, :, 6:].view(np.uint8).any()


def test_casting_copy():
    src = np.linspace(-3, 3, 4096).reshape(64, 64)
    dst = np.empty((64, 64), np.float32)
    transfer.finish_copies(transfer.start_copies([(dst, src)]))
    np.testing.assert_array_equal(dst, src.astype(np.float32))


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 7), min_size=0, max_size=4), itemsize=st.sampled_from([1, 2, 4]),
       target=st.integers(1, 300))
def test_cuts_tile_the_array_in_contiguous_pieces(shape, itemsize, target):
    """``transfer.cuts``: pieces in memory order, each contiguous, together the whole array, none larger
    than ``target`` unless a single element is."""
    shape = tuple(shape)
    a = np.arange(math.prod(shape) * itemsize, dtype=np.uint8).view(f"u{itemsize}").reshape(shape)
    pieces = transfer.cuts(shape, itemsize, target)
    pos = 0
    for idx, off, pshape in pieces:
        piece = a[idx] if idx else a
        assert piece.shape == pshape and piece.flags.c_contiguous
        assert off == pos and (piece.size == 0 or addr(piece) - addr(a) == off)
        assert piece.nbytes <= max(target, itemsize) or len(pieces) == 1 and a.nbytes <= target
        pos += piece.nbytes
    assert pos == a.nbytes

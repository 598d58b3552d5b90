"""Per-channel key scales and SparQ on the fake driver (``fake_driver.py``): the host paths run on a
CPU, and each call queues the kernels, in the order and with the grids, its design says."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from pyattn.kernels import registry


@pytest.fixture
def gpu(monkeypatch):
    with fake_driver.installed(monkeypatch, record_launches=True) as fake:
        yield fake


def _family(name):
    # entry points are pyattn_<family>_<dtype>_d<dim>_...: the family
    return re.match(r"pyattn_([a-z0-9_]+?)_(?:f16|bf16|f32)_d", name).group(1)


def _launched():
    names = [(_family(name), grid) for name, grid, _, _ in fake_driver.LAUNCHES]
    fake_driver.LAUNCHES.clear()
    return names


def test_per_channel_cache_appends_then_requantizes_pages(gpu):
    cache = pyattn.PagedKVCache(40, 16, 2, 128, "int8", key_scales="channel")
    a, b = cache.add_sequence(), cache.add_sequence()
    k = np.ones((2, 20, 2, 128), ml_dtypes.bfloat16)
    cache.append([a, b], k, k)
    assert [n for n, _ in _launched()] == ["kv_append", "kv_key_pages"]
    assert cache._keys.stage_of.keys() == {1, 3} and cache._stage.shape == (4, 16, 2, 128)  # a's and b's open pages
    c = cache.fork(a)
    cache.append([c], k[:1, :12], k[:1, :12])  # copy-on-write of the shared open page, now full
    assert [n for n, _ in _launched()] == ["kv_append", "kv_key_pages"]
    assert set(cache._keys.stage_of) == {1, 3}
    cache.truncate(a, 10)  # into the full first page (shared with c): copied and reopened at the next append
    assert set(cache._keys.stage_of) == {3}  # a's open page went back to the pool
    cache.append([a], k[:1, :1], k[:1, :1])
    _launched()
    assert set(cache._keys.stage_of) == {int(cache.book.pages(a)[-1]), 3} and cache.book.pages(a)[-1] != 0
    cache._keys.check()
    q = np.ones((2, 1, 8, 128), ml_dtypes.bfloat16)
    pyattn.decode(pyattn.asarray(q), cache, [a, b])
    # the fake GPU is sm_90a, pages of 16; a group of 4: the swapped-role blocks of the TMA-fed decode
    assert [n for n, _ in _launched()][0] == "attn_decode_swap"
    assert any(spec.family == "attn_decode_swap" and spec.key_channel for _, spec in registry.loaded_kernels())
    scale, chan, idx, kept = cache.read_key_scales()
    assert scale.shape == (40, 2) and chan.shape == (40, 2, 128) and chan.dtype == np.float16
    assert idx.shape == (40, 2, 4) and kept.shape == (40, 16, 2, 4) and kept.dtype == np.float16


def test_sparq_state_and_decode_launches(gpu):
    cache = pyattn.PagedKVCache(400, 16, 2, 64, "bfloat16", sparq=True)
    a, b = cache.add_sequence(), cache.add_sequence()
    k = np.ones((2, 2500, 2, 64), ml_dtypes.bfloat16)
    cache.append([a, b], k, k)
    assert [n for n, _ in _launched()] == ["kv_append", "kv_sparq"]
    c = cache.fork(a)  # whole: the V sum is copied now
    assert [n for n, _ in _launched()] == ["kv_sparq"]
    d = cache.fork(b, 700)  # partial: rebuilt later
    assert not _launched() and d in cache._sq.dirty
    cache.truncate(c, 1000)
    q = pyattn.asarray(np.ones((3, 1, 8, 64), ml_dtypes.bfloat16))
    fake_driver.MEMSETS.clear()
    fake_driver.PDL_LAUNCHES.clear()
    out, pos = pyattn.sparq_decode(q, cache, [a, c, d], r=16, k=100, return_indices=True)
    # on sm_90a every kernel launches as the kernel before's programmatic dependent: each entry
    # waits for it first (kernels_src/pdl.cuh)
    pdl = [_family(n) for n in fake_driver.PDL_LAUNCHES]
    dec_words = fake_driver.LAUNCHES[-1][3]  # the decode's first DecodeParams words
    names = _launched()
    rows = 3 * 2
    assert names[0] == ("kv_sparq", names[0][1])  # c's and d's sums rebuilt first
    # (the choice in score; the chosen keys' decode over one-slot pages: on sm_90a with 4 rows a KV
    # head the TMA kernel's gathered rows)
    assert [n for n, _ in names[1:]][:3] == ["sparq_score", "sparq_select", "attn_decode_swap"]
    assert names[1][1] == names[2][1] == (2, rows, 1)  # 2500 keys: 2 chunks of 2048
    # the score blocks add into the rows' histograms (4096 bins) and counters: the stream's zeroed
    # counter block, zeroed once as it grows here (before the score stage) ...
    (before, _, byte, n), = fake_driver.MEMSETS
    assert before == 1 and byte == 0 and n >= rows * (4096 + 4) * 4
    # the decode ends the call, its finish folded in: SparQ's output is its output, no LSE asked
    assert len(names) == 4 and dec_words[3] == out.ptr and dec_words[4] == 0
    assert pdl == [n for n, _ in names]
    fake_driver.MEMSETS.clear()  # ... and left zero by the stages: no memset in a call once it has grown
    pyattn.sparq_decode(q, cache, [a, c, d], r=16, k=100)
    assert not fake_driver.MEMSETS and [n for n, _ in _launched()][0] == "sparq_score"
    assert out.shape == (3, 1, 8, 64) and pos.shape == (3, 2, 100) and not cache._sq.dirty
    _, pos = pyattn.sparq_decode(q, cache, [a, c, d], r=16, k=100, select="head", return_indices=True)
    names = _launched()
    assert names[0] == ("sparq_score", (2, 3 * 8, 1)) and pos.shape == (3, 8, 100)  # a row per query head
    cache.free(a)
    assert a not in cache._sq.row_of
    host = pyattn.sparq_decode(np.ones((1, 1, 8, 64), ml_dtypes.bfloat16), cache, [b], r=64, k=5000)
    assert isinstance(host, np.ndarray) and host.shape == (1, 1, 8, 64)


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="int8", sparq=True), r"^sparq: SparQ reads 16-bit caches"),
    (dict(dtype="bfloat16", key_scales="channel"), r"^key_scales: per-channel key scales are for 8-bit caches"),
    (dict(dtype="int8", key_scales="page"), r"^key_scales: expected one of"),
    (dict(dtype="int8", key_scales="channel", page_size=8), r"^page_size: key_scales='channel' needs a multiple of 16"),
    (dict(dtype="bfloat16", sparq=True, page_size=12), r"^page_size: sparq=True needs a multiple of 8"),
    (dict(dtype="bfloat16", sparq=1), r"^sparq: expected a bool"),
])
def test_cache_options_are_refused_before_allocating(gpu, kw, match):
    kw = {"page_size": 16, **kw}
    ps = kw.pop("page_size")
    dt = kw.pop("dtype")
    with pytest.raises((ValueError, TypeError), match=match):
        pyattn.PagedKVCache(8, ps, 2, 64, dt, **kw)
    assert not fake_driver.CALLS.get("cuMemAllocFromPoolAsync")


def test_sparq_decode_needs_a_sparq_cache_and_live_tokens(gpu):
    plain = pyattn.PagedKVCache(8, 16, 2, 64, "bfloat16")
    s = plain.add_sequence()
    q = np.ones((1, 1, 4, 64), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="^cache: sparq_decode needs"):
        pyattn.sparq_decode(q, plain, [s], r=8, k=4)
    cache = pyattn.PagedKVCache(8, 16, 2, 64, "bfloat16", sparq=True)
    s = cache.add_sequence()
    with pytest.raises(ValueError, match="^seq_ids: SparQ needs at least one cached token"):
        pyattn.sparq_decode(q, cache, [s], r=8, k=4)
    with pytest.raises(ValueError, match="^select: expected one of"):
        pyattn.sparq_decode(q, cache, [s], r=8, k=4, select="heads")
    with pytest.raises(ValueError, match=r"^q: SparQ \(select='group'\) takes at most 16 query heads"):
        pyattn.sparq_decode(np.ones((1, 1, 64, 64), ml_dtypes.bfloat16), cache, [s], r=8, k=4)
    with pytest.raises(ValueError, match="^q: SparQ decodes one new token"):
        pyattn.sparq_decode(np.ones((1, 2, 4, 64), ml_dtypes.bfloat16), cache, [s], r=8, k=4)


def test_packed_append_counts_may_be_any_iterable_of_ints(gpu):
    """counts as a generator or a NumPy array append what a list does (a generator used to be used
    up by the type check, and the append then refused its own shape); a non-iterable is refused."""
    c = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16")
    ids = [c.add_sequence() for _ in range(3)]
    kv = np.zeros((6, 2, 64), ml_dtypes.bfloat16)
    c.append(ids, kv, kv, counts=[1, 2, 3])
    c.append(ids, kv, kv, counts=(n for n in (3, 2, 1)))
    c.append(ids, kv, kv, counts=np.array([2, 2, 2]))
    assert [c.length(s) for s in ids] == [6, 6, 6]
    with pytest.raises(TypeError, match="counts: expected a sequence of ints, got int"):
        c.append(ids, kv, kv, counts=6)
    with pytest.raises(TypeError, match="counts: expected ints"):
        c.append(ids, kv, kv, counts=[1.0, 2, 3])
    assert [c.length(s) for s in ids] == [6, 6, 6]


def test_sparq_repeat_calls_skip_validation_and_read_new_pointers(gpu, monkeypatch):
    """A repeat ``sparq_decode`` on a device q (its quick key seen) is not read into Args or validated
    again, launches with the new q's address, and still refuses an empty sequence (lengths are per
    call, not in the key); a changed r misses the key and is validated."""
    from pyattn.ops import sparq as op

    checks = []
    real = op.check_sparq
    monkeypatch.setattr(op, "check_sparq", lambda *a, **kw: checks.append(kw["r"]) or real(*a, **kw))
    cache = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16", sparq=True)
    a, b = cache.add_sequence(), cache.add_sequence()
    k = np.ones((2, 100, 2, 64), ml_dtypes.bfloat16)
    cache.append([a, b], k, k)
    q1, q2 = (pyattn.asarray(np.ones((2, 1, 8, 64), ml_dtypes.bfloat16)) for _ in range(2))
    pyattn.sparq_decode(q1, cache, [a, b], r=16, k=50)
    _launched()
    out = pyattn.sparq_decode(q2, cache, [a, b], r=16, k=50)
    assert checks == [16] and out.shape == (2, 1, 8, 64)
    assert fake_driver.LAUNCHES[0][3][0] == q2.ptr  # the score stage's SparqParams.q
    assert [n for n, _ in _launched()] == ["sparq_score", "sparq_select", "attn_decode_swap"]
    c = cache.add_sequence()
    with pytest.raises(ValueError, match=r"^seq_ids: SparQ needs at least one cached token per sequence; empty"):
        pyattn.sparq_decode(q2, cache, [a, c], r=16, k=50)
    assert not _launched() and checks == [16]
    pyattn.sparq_decode(q2, cache, [a, b], r=8, k=50)
    assert checks == [16, 8]


def test_sparq_select_grid_follows_its_own_occupancy(gpu, monkeypatch):
    # The score and select stages are kernels of their own: each grid is about one wave of its own
    # kernel (2048 keys a step). 132 SMs; score 1 block an SM, select 4: 16 rows x 9 chunks = 144
    # block steps take 2 steps a score block (5 x 16 blocks) and 1 a select block (9 x 16).
    monkeypatch.setitem(fake_driver.OCCUPANCY, "sparq_score", 1)
    monkeypatch.setitem(fake_driver.OCCUPANCY, "sparq_select", 4)
    cache = pyattn.PagedKVCache(4 * 18432 // 64 + 4, 64, 4, 32, "bfloat16", sparq=True)
    ids = [cache.add_sequence() for _ in range(4)]
    k = np.ones((4, 18432, 4, 32), ml_dtypes.bfloat16)
    cache.append(ids, k, k)
    _launched()
    pyattn.sparq_decode(pyattn.asarray(np.ones((4, 1, 16, 32), ml_dtypes.bfloat16)), cache, ids, r=8, k=2000)
    names = dict(_launched()[:2])
    assert names == {"sparq_score": (5, 16, 1), "sparq_select": (9, 16, 1)}


"""Decode-path validation (``pyattn.validate.paged``) and decode kernel specs/params (CPU only).

Device arrays are faked with ``__cuda_array_interface__`` (data pointer 0, never dereferenced).
The validators take arrays read by ``pyattn.interop.inputs.read``; the wrappers below read them
the way the ops do.
"""

from __future__ import annotations

import math
import pathlib
import re
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyattn.kernels.families import WGMMA_ARCHS, DecodeTile, override_tiles, tile_table
from pyattn.kernels.families.decode import decode_row, tma_decode_serves
from pyattn.kernels.params import DECODE_PARAMS, KV_APPEND_PARAMS
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec, decode_max_q_tiles, decode_specs, tile_config
from pyattn.interop.inputs import read, read_optional
from pyattn.ops.decode import choose_num_splits
from pyattn.validate import paged as V
from pyattn.validate.paged import DecodeProblem, PoolInfo


def check_pools(k_pool, v_pool, layout="nhd"):
    return V.check_pools(read("k_pool", k_pool), read("v_pool", v_pool), layout)


def check_query(q, pool_info, *, alibi_slopes=None, **kw):
    return V.check_query(read("q", q), pool_info, alibi_slopes=read_optional("alibi_slopes", alibi_slopes), **kw)


def check_block_table(table, lens, batch, pool_info, fetch):
    return V.check_block_table(read("block_table", table), read("seq_lens", lens), batch, pool_info,
                               lambda a: fetch(a.obj))


def check_csr(indptr, indices, last_page_len, batch, pool_info, fetch):
    return V.check_csr(read("indptr", indptr), read("indices", indices), read("last_page_len", last_page_len),
                       batch, pool_info, lambda a: fetch(a.obj))

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
OPTIN_SMEM = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90a": 232448, "sm_100a": 232448}
CUH = pathlib.Path(__file__).resolve().parents[1] / "kernels_src" / "decode_common.cuh"  # AttnDecodeTraits


def _c_elems(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class FakeDev:
    """A CUDA array seen through CAI (and array-API attributes); ``strides`` in elements."""

    def __init__(self, shape, dtype=F16, strides=None, payload=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        elem = tuple(strides) if strides is not None else _c_elems(self.shape)
        self.strides = tuple(s * self.dtype.itemsize for s in elem)  # bytes, as NumPy / CAI
        self.payload = payload
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False),
                                         "strides": None if strides is None else self.strides, "version": 3}


def pool(layout="nhd", pages=3, page_size=16, heads=2, dim=64, dtype=F16, strides=None):
    shape = (pages, page_size, heads, dim) if layout == "nhd" else (pages, heads, page_size, dim)
    return FakeDev(shape, dtype, strides)


POOL = PoolInfo(10, 4, 2, 64, F16, (512, 128, 64), (512, 128, 64))  # 10 pages of 4 slots


def _no_fetch(x):
    raise AssertionError("fetch must not be called for host arrays")


# --------------------------------------------------------------------------------------------
# check_pools
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_pools_nhd_and_hnd(dtype):
    info = check_pools(pool("nhd", 3, 16, 2, 64, dtype), pool("nhd", 3, 16, 2, 64, dtype), "nhd")
    assert (info.num_pages, info.page_size, info.heads_kv, info.head_dim, info.dtype) == (3, 16, 2, 64, dtype)
    assert info.k_strides == info.v_strides == (16 * 2 * 64, 2 * 64, 64)
    info = check_pools(pool("hnd", 5, 8, 4, 128, dtype), pool("hnd", 5, 8, 4, 128, dtype), layout="hnd")
    assert (info.num_pages, info.page_size, info.heads_kv, info.head_dim) == (5, 8, 4, 128)
    assert info.k_strides == (4 * 8 * 128, 128, 8 * 128)  # (page, slot, head)


def test_pools_strided_views():
    # K: every other page of a twice-as-large NHD pool; V: HND memory seen through NHD strides
    k = pool("nhd", 3, 16, 2, 64, strides=(2 * 16 * 2 * 64, 128, 64, 1))
    v = pool("nhd", 3, 16, 2, 64, strides=(4096, 64, 1024, 1))
    info = check_pools(k, v)
    assert info.k_strides == (4096, 128, 64) and info.v_strides == (4096, 64, 1024)
    h = pool("hnd", 3, 16, 2, 64, dtype=BF16, strides=(3000 * 8, 16 * 72, 72, 1))
    assert check_pools(h, h, "hnd").k_strides == (24000, 72, 1152)


K = pool()
BAD_POOLS = {
    "host k": (np.ones((3, 16, 2, 64), F16), K, "nhd", TypeError, r"^k_pool: expected a device array"),
    "host v": (K, np.ones((3, 16, 2, 64), F16), "nhd", TypeError, r"^v_pool: expected a device array"),
    "float32": (pool(dtype=np.float32), pool(dtype=np.float32), "nhd", TypeError,
                r"^k_pool: expected dtype float16 or bfloat16, got float32"),
    "int16 v": (K, pool(dtype=np.int16), "nhd", TypeError, r"^v_pool: expected dtype .* got int16"),
    "dtype mismatch": (K, pool(dtype=BF16), "nhd", TypeError, r"^v_pool: expected dtype float16 \(k_pool's\)"),
    "shape mismatch": (K, pool(pages=4), "nhd", ValueError, r"^v_pool: expected shape \(3, 16, 2, 64\)"),
    "3-D": (FakeDev((3, 16, 128)), FakeDev((3, 16, 128)), "nhd", ValueError, r"^k_pool: expected 4 dims"),
    "5-D hnd": (K, FakeDev((1, 3, 16, 2, 64)), "hnd", ValueError, r"^v_pool: expected 4 dims \(pages, heads"),
    "head_dim strided": (pool(strides=(4096, 256, 128, 2)), K, "nhd", ValueError,
                         r"^k_pool: the head_dim axis must be contiguous"),
    "stride % 8": (K, pool(strides=(16 * 136, 136, 68, 1)), "nhd", ValueError,
                   r"^v_pool: strides must be multiples of 8 elements"),
    "head_dim 12": (pool(heads=1, dim=12, strides=(256, 16, 16, 1)), pool(heads=1, dim=12, strides=(256, 16, 16, 1)),
                    "nhd", ValueError, r"^k_pool: head_dim must be a multiple of 8 in \[8, 256\], got 12"),
    "head_dim 264": (pool(dim=264), pool(dim=264), "nhd", ValueError, r"^k_pool: head_dim .* got 264"),
    "no pages": (pool(pages=0), pool(pages=0), "nhd", ValueError, r"^k_pool: expected at least one page"),
    "layout": (K, K, "bshd", ValueError, r"^layout: expected one of"),
    "layout upper": (K, K, "NHD", ValueError, r"^layout:"),
}


@pytest.mark.parametrize("case", BAD_POOLS, ids=list(BAD_POOLS))
def test_pools_rejected(case):
    k, v, layout, exc, match = BAD_POOLS[case]
    with pytest.raises(exc, match=match):
        check_pools(k, v, layout)


# --------------------------------------------------------------------------------------------
# check_query
# --------------------------------------------------------------------------------------------
OPTS = dict(causal=False, window=None, softcap=None, alibi_slopes=None, scale=None, num_splits=None)
P = PoolInfo(8, 16, 2, 64, F16, (2048, 128, 64), (2048, 128, 64))


def _q(shape=(3, 2, 8, 64), dtype=F16, **kw):
    return check_query(FakeDev(shape, dtype), P, **{**OPTS, **kw})


def test_query_problem_fields():
    prob = check_query(FakeDev((3, 2, 8, 64), strides=(4096, 1024, 128, 1)), P, **OPTS)
    assert isinstance(prob, DecodeProblem)
    assert (prob.batch, prob.q_len, prob.heads_q, prob.heads_kv, prob.head_dim, prob.group) == (3, 2, 8, 2, 64, 4)
    assert prob.q_strides == (4096, 1024, 128) and prob.q_on_device and prob.dtype == F16
    assert prob.scale == pytest.approx(1 / 8) and prob.window == (-1, -1) and prob.softcap == 0.0
    assert prob.alibi is None and prob.num_splits is None
    host = check_query(np.zeros((1, 1, 2, 64), F16), P, **OPTS)
    assert not host.q_on_device and host.q_strides == (128, 128, 64) and host.group == 1
    p128 = PoolInfo(8, 16, 1, 128, BF16, (2048, 128, 128), (2048, 128, 128))
    assert check_query(FakeDev((1, 1, 4, 128), BF16), p128, **OPTS).scale == pytest.approx(128 ** -0.5)


@pytest.mark.parametrize("causal, code", [(True, 1), ("top_left", 2), (False, 0), ("bottom_right", 1)])
def test_query_causal_codes(causal, code):
    assert _q(causal=causal).causal == code


def test_query_options_flow_through():
    prob = _q(window=(16, 0), softcap=30, scale=0.5, num_splits=np.int64(7),
              alibi_slopes=np.ones((3, 8), np.float32))
    assert (prob.window, prob.softcap, prob.scale, prob.num_splits) == ((16, 0), 30.0, 0.5, 7)
    assert prob.alibi.stride_b == 8 and not prob.alibi.on_device
    assert _q(alibi_slopes=FakeDev((8,), np.float32)).alibi.stride_b == 0
    assert _q(num_splits=1).num_splits == 1 and _q(num_splits=256).num_splits == 256


BAD_QUERIES = {
    "bf16 q, f16 pool": (dict(dtype=BF16), TypeError, r"^q: expected dtype float16 \(the KV cache's\)"),
    "3-D": (dict(shape=(3, 8, 64)), ValueError, r"^q: expected shape \(batch, q_len, heads_q, head_dim\)"),
    "head_dim": (dict(shape=(3, 1, 8, 128)), ValueError, r"^q: expected head_dim 64 \(the KV cache's\), got 128"),
    "heads not multiple": (dict(shape=(3, 1, 3, 64)), ValueError, r"^q: query heads \(3\) must be a multiple"),
    "no heads": (dict(shape=(3, 1, 0, 64)), ValueError, r"^q: query heads \(0\)"),
    "q_len 0": (dict(shape=(3, 0, 8, 64)), ValueError, r"^q: expected q_len >= 1"),
    "batch 65536": (dict(shape=(65536, 1, 2, 64)), ValueError, r"^q: batch must be <= 65535"),
    "splits 0": (dict(num_splits=0), ValueError, r"^num_splits: expected an int in \[1, 256\]"),
    "splits 257": (dict(num_splits=257), ValueError, r"^num_splits: expected an int in \[1, 256\]"),
    "splits bool": (dict(num_splits=True), TypeError, r"^num_splits: expected an int, got bool"),
    "splits float": (dict(num_splits=2.0), TypeError, r"^num_splits: expected an int, got float"),
    "window 3": (dict(window=(1, 2, 3)), ValueError, r"^window:"),
    "window -2": (dict(window=(-2, 0)), ValueError, r"^window: left must be -1"),
    "softcap 0": (dict(softcap=0.0), ValueError, r"^softcap:"),
    "softcap str": (dict(softcap="1"), TypeError, r"^softcap:"),
    "causal str": (dict(causal="yes"), ValueError, r"^causal:"),
    "causal int": (dict(causal=1), TypeError, r"^causal:"),
    "scale 0": (dict(scale=0.0), ValueError, r"^scale:"),
    "scale nan": (dict(scale=float("nan")), ValueError, r"^scale:"),
    "alibi shape": (dict(alibi_slopes=np.ones(4, np.float32)), ValueError, r"^alibi_slopes: expected shape"),
    "alibi device f16": (dict(alibi_slopes=FakeDev((8,), F16)), TypeError, r"^alibi_slopes: a device array"),
}


@pytest.mark.parametrize("case", BAD_QUERIES, ids=list(BAD_QUERIES))
def test_query_rejected(case):
    kw, exc, match = BAD_QUERIES[case]
    with pytest.raises(exc, match=match):
        _q(**kw)


def test_query_device_strides_checked():
    with pytest.raises(ValueError, match=r"^q: the head_dim axis must be contiguous"):
        check_query(FakeDev((1, 1, 2, 64), strides=(256, 256, 132, 1)), P, **OPTS)
    with pytest.raises(ValueError, match=r"^q: the head_dim axis"):
        check_query(FakeDev((1, 1, 2, 64), strides=(256, 256, 128, 2)), P, **OPTS)


# --------------------------------------------------------------------------------------------
# check_block_table (POOL: 10 pages of 4 slots)
# --------------------------------------------------------------------------------------------
def test_block_table_padding_unchecked():
    table = np.array([[3, 9, -1, 2**31 - 1], [0, -5, -5, -5], [-1, -1, -1, -1]], np.int32)
    lens = np.array([8, 3, 0], np.int32)  # 2 pages, 1 page, none
    t, l = check_block_table(table, lens, 3, POOL, _no_fetch)
    assert t is table and l is lens


@pytest.mark.parametrize("row, lens, bad", [
    ([3, 10, 0], 5, 10),  # second used page == num_pages (5 tokens: 2 pages)
    ([-1, 1, 0], 1, -1),  # first page negative
    ([0, 1, 2**31 - 1], 12, 2**31 - 1)])  # the whole row is used
def test_block_table_used_entries_checked(row, lens, bad):
    with pytest.raises(ValueError, match=rf"^block_table: page indices must be in \[0, 10\).* got {bad} among"):
        check_block_table(np.array([row], np.int32), np.array([lens], np.int32), 1, POOL, _no_fetch)


@pytest.mark.parametrize("table, lens, exc, match", [
    (np.zeros((2, 3), np.int64), np.zeros(2, np.int32), TypeError, r"^block_table: expected dtype int32"),
    (np.zeros((2, 3), np.int32), np.zeros(2, np.int64), TypeError, r"^seq_lens: expected dtype int32"),
    (np.zeros(3, np.int32), np.zeros(2, np.int32), ValueError, r"^block_table: expected 2 dim"),
    (np.zeros((3, 3), np.int32), np.zeros(2, np.int32), ValueError, r"^block_table, seq_lens: expected 2 rows"),
    (np.zeros((2, 3), np.int32), np.zeros(3, np.int32), ValueError, r"^block_table, seq_lens: expected 2 rows"),
    (np.zeros((2, 3), np.int32), np.array([1, -1], np.int32), ValueError, r"^seq_lens: .* got seq_lens\[1\] = -1"),
    (np.zeros((2, 3), np.int32), np.array([13, 0], np.int32), ValueError, r"^seq_lens: .*= 12, got seq_lens\[0\]"),
])
def test_block_table_rejected(table, lens, exc, match):
    with pytest.raises(exc, match=match):
        check_block_table(table, lens, 2, POOL, _no_fetch)


def test_block_table_device_uses_fetched_copy():
    good, bad = np.array([[1, 2, 77]], np.int32), np.array([[1, 77, 2]], np.int32)
    lens = np.array([6], np.int32)  # two pages used
    fetched = []

    def fetch(x):
        fetched.append(x)
        return x.payload

    dt = FakeDev((1, 3), np.int32, payload=good)
    t, l = check_block_table(dt, lens, 1, POOL, fetch)
    assert t is good and l is lens and fetched == [dt]
    with pytest.raises(ValueError, match=r"^block_table: .* got 77 among the used entries"):
        check_block_table(FakeDev((1, 3), np.int32, payload=bad), lens, 1, POOL, fetch)
    dl = FakeDev((1,), np.int32, payload=np.array([13], np.int32))
    with pytest.raises(ValueError, match=r"^seq_lens: .* got seq_lens\[0\] = 13"):
        check_block_table(dt, dl, 1, POOL, fetch)
    fetched.clear()
    with pytest.raises(ValueError, match=r"^block_table: the last axis must be contiguous"):
        check_block_table(FakeDev((1, 3), np.int32, strides=(6, 2), payload=good), lens, 1, POOL, fetch)
    dl = FakeDev((2,), np.int32, payload=np.array([4, 4], np.int32))
    with pytest.raises(ValueError, match=r"^block_table, seq_lens: expected 1 rows"):  # a shape error...
        check_block_table(dt, dl, 1, POOL, fetch)
    assert fetched == []  # ...is found before any device value is fetched


# --------------------------------------------------------------------------------------------
# check_csr (POOL: 10 pages of 4 slots)
# --------------------------------------------------------------------------------------------
def _i32(*x):
    return np.array(x, np.int32)


def test_csr_kv_len_and_tail_unchecked():
    ip, ix, kv = check_csr(_i32(0, 2, 2, 5), _i32(0, 9, 4, 4, 1, -7, 99), _i32(3, 0, 4), 3, POOL, _no_fetch)
    assert kv.dtype == np.int32 and kv.tolist() == [4 + 3, 0, 2 * 4 + 4]
    assert ip.tolist() == [0, 2, 2, 5] and ix.size == 7


@pytest.mark.parametrize("ip, ix, lp, exc, match", [
    (_i32(1, 2), _i32(0, 0), _i32(1), ValueError, r"^indptr: must start at 0"),
    (_i32(0, 2, 1), _i32(0, 0), _i32(1, 1), ValueError, r"^indptr: .*non-decreasing"),
    (_i32(0, 3), _i32(0, 0), _i32(1), ValueError, r"^indptr: .* at most at len\(indices\) = 2"),
    (_i32(0, 1, 1), _i32(0), _i32(1), ValueError, r"^indptr, last_page_len: expected shapes \(3,\), \(2,\)"),
    (_i32(0, 1), _i32(0), _i32(0), ValueError, r"^last_page_len: .* got last_page_len\[0\] = 0 with 1 page"),
    (_i32(0, 1), _i32(0), _i32(5), ValueError, r"^last_page_len: expected 1 to page_size = 4"),
    (_i32(0, 0), _i32(0), _i32(1), ValueError, r"^last_page_len: .* = 1 with 0 page"),
    (_i32(0, 2), _i32(3, 10), _i32(1), ValueError, r"^indices: page indices must be in \[0, 10\).* got 10"),
    (_i32(0, 2), _i32(-1, 0), _i32(1), ValueError, r"^indices: .* got -1"),
    (np.array([0, 1], np.int64), _i32(0), _i32(1), TypeError, r"^indptr: expected dtype int32"),
    (_i32(0, 1), np.zeros(1, np.uint32), _i32(1), TypeError, r"^indices: expected dtype int32"),
])
def test_csr_rejected(ip, ix, lp, exc, match):
    batch = lp.size if ip.size == lp.size + 1 else 2
    with pytest.raises(exc, match=match):
        check_csr(ip, ix, lp, batch, POOL, _no_fetch)


@st.composite
def csr_tables(draw):
    page_size, num_pages = draw(st.integers(1, 32)), draw(st.integers(1, 40))
    counts = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    used = draw(st.lists(st.integers(0, num_pages - 1), min_size=int(indptr[-1]), max_size=int(indptr[-1])))
    tail = draw(st.lists(st.integers(-2**31, 2**31 - 1), max_size=3))
    last = [draw(st.integers(1, page_size)) if n else 0 for n in counts]
    pool_info = PoolInfo(num_pages, page_size, 1, 64, F16, (page_size * 64, 64, 64), (page_size * 64, 64, 64))
    return pool_info, counts, indptr, np.array(used + tail, np.int32), np.array(last, np.int32)


@settings(max_examples=80, deadline=None)
@given(csr_tables(), st.data())
def test_csr_property(table, data):
    pool_info, counts, indptr, indices, last = table
    ip, ix, kv = check_csr(indptr, indices, last, len(counts), pool_info, _no_fetch)
    expect = [(n - 1) * pool_info.page_size + lp if n else 0 for n, lp in zip(counts, last.tolist())]
    assert kv.dtype == np.int32 and kv.tolist() == expect
    if indptr[-1]:
        bad = indices.copy()
        bad[data.draw(st.integers(0, int(indptr[-1]) - 1))] = data.draw(st.sampled_from([-1, pool_info.num_pages]))
        with pytest.raises(ValueError, match=r"^indices: page indices must be in"):
            check_csr(indptr, bad, last, len(counts), pool_info, _no_fetch)


# --------------------------------------------------------------------------------------------
# choose_num_splits
# --------------------------------------------------------------------------------------------
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
    (8, 16384, 16), (8, 32768, 16), (16, 16384, 8), (16, 32768, 8), (32, 32768, 4), (8, 4096, 16), (16, 4096, 16),
    (8, 8192, 32), (64, 32768, 4), (512, 32768, 1)])
def test_num_splits_of_long_splits_one_block_an_sm(units, keys, expect):
    """The 16-bit TMA decode (sm_slots = 132 SMs; 64-key tiles, 2 blocks an SM): below one wave,
    splits of >= 1024 keys fill one block an SM (the bf16 sweep's best); shorter ones keep the
    wave's count (B1 / B2 x 4k: 16), as do counts that would fall below 4 (B8 x 32k: 4, not 2), and
    from one wave on nothing changes."""
    assert choose_num_splits(units, keys // 64, 264, 1.0, 64, 132) == expect


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 600), st.integers(0, 3000), st.integers(1, 600), st.sampled_from([16, 64, 128]),
       st.integers(1, 300))
def test_num_splits_with_sm_slots(units, max_tiles, slots, tile_keys, sms):
    """sm_slots only ever lowers the count, to one block an SM, and only where each split keeps
    >= 1024 keys and 4 splits remain; without it the rule is unchanged."""
    base = choose_num_splits(units, max_tiles, slots, 1.0, tile_keys)
    s = choose_num_splits(units, max_tiles, slots, 1.0, tile_keys, sms)
    assert s == base or (4 <= s == sms // units < base and max_tiles * tile_keys >= s * 1024 and units < slots)


def test_num_splits_of_the_ragged_benchmark_batch():
    """64 sequences of log-uniform lengths 128..64k (mean fill ~0.16), 8 kv heads, on 132 SMs x 2:
    one split before (its 64k-token blocks ~3x a slot's mean load), 7 now."""
    assert choose_num_splits(512, 1024, 264) == 1
    assert choose_num_splits(512, 1024, 264, 0.16) == 7


# --------------------------------------------------------------------------------------------
# Decode kernel specs and parameter structs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(dtype="f32", q_tiles=1), r"^dtype: attn_decode takes f16 or bf16"),
    (dict(q_tiles=0), r"^q_tiles: attn_decode at head_dim 128 on sm_90a takes 1 to 2, got 0"),
    (dict(q_tiles=3), r"^q_tiles: .* got 3"),
    (dict(head_dim=256, q_tiles=2), r"^q_tiles: attn_decode at head_dim 256 on sm_90a takes 1 to 1"),
    (dict(mask="bool", q_tiles=1), r"^mask/softcap/alibi:"),
    (dict(family="merge_states", q_tiles=1),
     r"^q_tiles: only attn_fwd_tma / attn_decode / attn_decode_tma takes q_tiles"),
    (dict(family="kv_append", head_dim=32, q_tiles=1), r"^q_tiles: only attn_fwd_tma / attn_decode"),
    (dict(family="attn_fwd_mma", q_tiles=1), r"^q_tiles: only attn_fwd_tma / attn_decode"),
    (dict(family="merge_states", softcap=True), r"^mask/softcap/alibi:"),
    (dict(family="kv_append", head_dim=32, dtype="f32"), r"^dtype: kv_append takes f16 or bf16"),
])
def test_decode_spec_rejected(kw, match):
    args = {"family": "attn_decode", "dtype": "f16", "head_dim": 128, "arch": "sm_90a", **kw}
    with pytest.raises(ValueError, match=match):
        KernelSpec(**args)


def _cuh_smem(d, kpw, warps, mt, stages, kv=0, producer=0):
    """kPipeBytes / kMergeBytes evaluated from AttnDecodeTraits' own constexpr lines."""
    body = CUH.read_text().split("struct AttnDecodeTraits {")[1].split("};")[0]
    env = {"HEAD_DIM_": d, "KEYS_PER_WARP_": kpw, "WARPS_": warps, "M_TILES_": mt, "STAGES_": stages, "KV_": kv,
           "PRODUCER_": producer}
    for name, expr in re.findall(r"static constexpr int (\w+) = ([^;]+);", body):
        if name != "kSmemBytes":
            # plain integer arithmetic on the names above; `c ? a : b` read as Python's `a if c else b`
            expr = re.sub(r"^(.+?)\?(.+?):(.+)$", r"(\2) if (\1) else (\3)", " ".join(expr.split()), flags=re.S)
            env[name] = eval(expr.replace("/", "//"), {}, env)
    assert re.search(r"kSmemBytes = kPipeBytes > kMergeBytes \? kPipeBytes : kMergeBytes;", body)
    return max(env["kPipeBytes"], env["kMergeBytes"])


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_specs_fit_and_match_traits(arch):
    names = set()
    for d in HEAD_DIM_BUCKETS:
        t = tile_config("attn_decode", arch, d)
        for mt in range(1, decode_max_q_tiles(arch, d) + 1):
            for tag, ctype in (("f16", "__half"), ("bf16", "__nv_bfloat16")):
                for sc, al in ((False, False), (True, False), (False, True), (True, True)):
                    spec = KernelSpec("attn_decode", tag, d, arch, q_tiles=mt, softcap=sc, alibi=al)
                    names.add(spec.entry_name)
                    assert spec.entry_name == (f"pyattn_attn_decode_{tag}_d{d}_m{16 * mt}n{t.block_n}w{t.warps}"
                                               f"s{t.stages}" + "_softcap" * sc + "_alibi" * al)
            kpw = t.block_n // t.warps
            ring = (16 * mt + 2 * t.stages * t.block_n) * (d + 8) * 2
            merge = t.warps * 16 * mt * ((d + 8) + 2) * 4
            assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, t.warps, mt, t.stages)
            assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt)
            assert spec.tiles.block_m == 16 * mt and spec.threads == 32 * t.warps
            assert spec.template_id == (f"pyattn::attn_decode<pyattn::AttnDecodeTraits<{ctype}, {d}, {kpw}, "
                                        f"{t.warps}, {mt}, {t.stages}, 0, 0>, true, true>")
            assert kpw % 16 == 0 and t.stages >= 2 and (t.block_n * d // 8) % (32 * t.warps) == 0  # static_asserts
    n_variants = sum(decode_max_q_tiles(arch, d) for d in HEAD_DIM_BUCKETS) * 2 * 4
    assert len(names) == n_variants


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_decode_specs_fit_and_match_traits(arch):
    for d in (64, 128, 256):
        for kv, num in (("int8", 1), ("fp8e4m3", 2)):
            t = tile_config("attn_decode", arch, d, kv)
            for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1):
                spec = KernelSpec("attn_decode", "bf16", d, arch, q_tiles=mt, kv=kv)
                kpw = t.block_n // t.warps
                ring = 16 * mt * (d + 8) * 2 + t.stages * t.block_n * 2 * (d + 4)  # Q + codes + scales
                merge = t.warps * 16 * mt * ((d + 8) + 2) * 4
                assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, t.warps, mt, t.stages, num)
                assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt, kv)
                assert spec.entry_name.endswith(f"_kv{kv}")
                assert spec.template_id.endswith(f"{t.stages}, {num}, 0>, false, false>")
    with pytest.raises(ValueError, match="head_dim"):
        KernelSpec("attn_decode", "bf16", 96, arch, q_tiles=1, kv="int8")
    with pytest.raises(ValueError, match="kv"):
        KernelSpec("attn_fwd_mma", "bf16", 128, arch, kv="int8")


@pytest.mark.parametrize("arch", ARCHS)
def test_per_channel_key_decode_specs_fit_and_match_traits(arch):
    """key_scales="channel": the ring adds each 16-key segment's page record per stage (16 bytes,
    fp16 channel scales, 16 slots x 4 kept fp16 values)."""
    for d in (64, 128, 256):
        for kv, num in (("int8", 3), ("fp8e4m3", 4)):
            t = tile_config("attn_decode", arch, d, kv)
            for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1):
                spec = KernelSpec("attn_decode", "bf16", d, arch, q_tiles=mt, kv=kv, key_channel=True)
                ring = 16 * mt * (d + 8) * 2 + t.stages * t.block_n * 2 * (d + 4) + t.stages * t.block_n // 16 * (16 + d * 2 + 128)
                merge = t.warps * 16 * mt * ((d + 8) + 2) * 4
                kpw = t.block_n // t.warps
                assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, t.warps, mt, t.stages, num)
                assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt, kv)
                assert spec.entry_name.endswith(f"_kv{kv}_kch") and kpw % 16 == 0
                assert spec.template_id.endswith(f"{t.stages}, {num}, 0>, false, false>")


@pytest.mark.parametrize("arch", WGMMA_ARCHS)
def test_tma_decode_specs_fit_and_match_traits(arch):
    """attn_decode_tma: one more warp (the producer), the ring's K / V unpadded after Q and 1024
    bytes of alignment slack; the traits' own formula gives the same bytes."""
    for d in (64, 128, 192, 256):
        t = tile_config("attn_decode_tma", arch, d)
        consumers = t.warps - 1
        assert t.ws and t.block_n & (t.block_n - 1) == 0 and 16 <= t.block_n <= 256  # the kernel's static_assert
        for mt in range(1, decode_row(arch, d, tma=True).max_q_tiles + 1):
            spec = KernelSpec("attn_decode_tma", "bf16", d, arch, q_tiles=mt)
            kpw = t.block_n // consumers
            ring = 16 * mt * (d + 8) * 2 + 1024 + 2 * t.stages * t.block_n * d * 2
            merge = consumers * 16 * mt * ((d + 8) + 2) * 4
            assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, consumers, mt, t.stages, 0, 1)
            assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt)
            assert spec.threads == 32 * (consumers + 1) and spec.entry_name.endswith(f"s{t.stages}tma")
            assert spec.template_id == (f"pyattn::attn_decode<pyattn::AttnDecodeTraits<__nv_bfloat16, {d}, {kpw}, "
                                        f"{consumers}, {mt}, {t.stages}, 0, 1>, false, false>")
    for bad in (dict(head_dim=96), dict(head_dim=64, kv="int8"), dict(head_dim=64, kv="int8", key_channel=True)):
        with pytest.raises(ValueError, match="attn_decode_tma"):
            KernelSpec("attn_decode_tma", "bf16", arch=arch, q_tiles=1, **bad)


@pytest.mark.parametrize("arch", WGMMA_ARCHS)
def test_tma_decode_specs_of_8_bit_caches_fit_and_match_traits(arch):
    """attn_decode_tma on 8-bit caches: the producer warp, Q, 1024 bytes of slack, then per stage K
    and V codes in 128-column boxes and their fp32 scales (per-channel keys: and each 16-key
    segment's page record, at most 2 stages so that 2 blocks still fit an SM); the traits' formula
    gives the same bytes, and the kernel's static_asserts hold (block_n a power of two, at most 16
    segments: a producer lane pair each)."""
    for d in (128, 256):
        for kv, num in (("int8", 1), ("fp8e4m3", 2)):
            for kc in (False, True):
                t = tile_config("attn_decode_tma", arch, d, kv)
                stages = min(t.stages, 2) if kc else t.stages
                consumers = t.warps - 1
                assert t.ws and t.block_n & (t.block_n - 1) == 0 and 16 <= t.block_n <= 256 and t.block_n // 16 <= 16
                for mt in range(1, decode_row(arch, d, kv, tma=True).max_q_tiles + 1):
                    spec = KernelSpec("attn_decode_tma", "bf16", d, arch, q_tiles=mt, kv=kv, key_channel=kc)
                    kpw = t.block_n // consumers
                    ring = (16 * mt * (d + 8) * 2 + 1024 + stages * t.block_n * 2 * (d + 4)
                            + kc * stages * t.block_n // 16 * (16 + d * 2 + 128))
                    merge = consumers * 16 * mt * ((d + 8) + 2) * 4
                    assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, consumers, mt, stages,
                                                                              num + 2 * kc, 1)
                    assert spec.shared_bytes * t.min_blocks <= OPTIN_SMEM[arch], (arch, d, mt, kv, kc)
                    assert spec.threads == 32 * (consumers + 1)
                    assert spec.entry_name.endswith(f"s{stages}tma_kv{kv}" + "_kch" * kc)
                    assert spec.template_id.endswith(f"{mt}, {stages}, {num + 2 * kc}, 1>, false, false>")


@pytest.mark.parametrize("d", [64, 128])
def test_tma_decode_two_row_tiles_launch_for_one_block_an_sm(d):
    """attn_decode_tma's two-row-tile variant is bounded for one block an SM (2 blocks of 5 warps
    cap registers at 168, where its accumulators spilled); one row tile keeps the row's bound."""
    row = decode_row("sm_90a", d, tma=True)
    one = KernelSpec("attn_decode_tma", "bf16", d, "sm_90a", q_tiles=1)
    two = KernelSpec("attn_decode_tma", "bf16", d, "sm_90a", q_tiles=2)
    assert row.max_q_tiles == 2 and row.min_blocks == 2
    assert (one.tiles.min_blocks, two.tiles.min_blocks) == (2, 1)
    assert two.tiles.block_n == one.tiles.block_n and two.tiles.stages == one.tiles.stages


def test_tma_decode_per_channel_row_is_data():
    """A row's ``channel`` (keys per warp, stages) sets the per-channel variant's tile, and only its:
    the tuning hook dev/probe_q8_rows.py times."""
    base = tile_table("attn_decode_tma", "sm_90a", "kv8")
    with override_tiles("attn_decode_tma", "sm_90a", (base[0]._replace(channel=(16, 3)),) + base[1:], table="kv8"):
        kc = KernelSpec("attn_decode_tma", "bf16", 128, "sm_90a", q_tiles=1, kv="int8", key_channel=True)
        tok = KernelSpec("attn_decode_tma", "bf16", 128, "sm_90a", q_tiles=1, kv="int8")
        assert (kc.tiles.block_n, kc.tiles.stages) == (16 * base[0].warps, 3)
        assert (tok.tiles.block_n, tok.tiles.stages) == (base[0].keys_per_warp * base[0].warps, base[0].stages)
        assert kc.template_id.endswith(f"16, {base[0].warps}, 1, 3, 3, 1>, false, false>")


@pytest.mark.parametrize("arch, d, page, kv, tma", [
    ("sm_90a", 128, 16, "", True), ("sm_90a", 64, 256, "", True), ("sm_90a", 256, 1024, "", True),
    ("sm_90a", 128, 8, "", False),    # boxes of 8 slots: too small for TMA to pay
    ("sm_90a", 128, 48, "", False),   # not a power of two: a box could straddle pages
    ("sm_90a", 96, 16, "", False),    # not whole 64-column boxes
    ("sm_90a", 128, 16, "int8", True), ("sm_90a", 256, 64, "fp8e4m3", True),
    ("sm_90a", 64, 16, "int8", False),   # 8-bit: boxes of 128 columns (the 64 bucket keeps cp.async)
    ("sm_90a", 128, 8, "fp8e4m3", False), ("sm_80", 128, 16, "int8", False),
    ("sm_80", 128, 16, "", False), ("sm_89", 128, 16, "", False)])
@pytest.mark.parametrize("key_channel", [False, True])
def test_tma_decode_selection(arch, d, page, kv, tma, key_channel):
    """Per-channel key scales take the same kernel as per-token ones (page records by bulk copies)."""
    from pyattn.ops._decode import _spec
    kc = key_channel and bool(kv)
    assert tma_decode_serves(arch, d, page, kv) is tma
    spec = _spec("bfloat16", d, arch, False, 4, False, False, kv, 0, kc, page)
    assert spec.family == ("attn_decode_tma" if tma else "attn_decode")


def test_decode_shared_bytes_when_the_warp_merge_dominates():
    # No shipped tile has merge > ring; a hypothetical 16-warp d=32 tile does (the traits allow it).
    rows = (DecodeTile(32, 16, 16, 2, 2, 1, "test"),) + tile_table("attn_decode", "sm_90a")
    with override_tiles("attn_decode", "sm_90a", rows):
        spec = KernelSpec("attn_decode", "f16", 32, "sm_90a", q_tiles=2)
        ring, merge = (32 + 2 * 2 * 256) * 40 * 2, 16 * 32 * (40 + 2) * 4
        assert merge > ring and spec.shared_bytes == merge == _cuh_smem(32, 16, 16, 2, 2)


def test_append_templates():
    assert KernelSpec("kv_append", "f16", 32, "sm_80").template_id == "pyattn::kv_append<__half, 0>"
    assert KernelSpec("kv_append", "bf16", 32, "sm_80", kv="fp8e4m3").template_id == \
        "pyattn::kv_append<__nv_bfloat16, 2>"
    assert KernelSpec("attn_decode", "f16", 64, "sm_80", q_tiles=1).params is DECODE_PARAMS


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_specs_list(arch):
    """Both decode kernels of sm_90a are warmed (pages of 16 and more take the TMA one)."""
    specs = decode_specs(arch)
    tma = 6 if arch in WGMMA_ARCHS else 0
    assert len(specs) == 8 + tma and len(set(specs)) == 8 + tma
    fams = [s.family for s in specs]
    assert (fams.count("attn_decode"), fams.count("attn_decode_tma"), fams.count("kv_append")) == (6, tma, 2)
    assert all(s.arch == arch and s.q_tiles == (s.family != "kv_append") for s in specs)
    both = decode_specs(arch, q_tiles=(1, 2))
    assert len(both) == 12 + (10 if tma else 0)  # q_tiles 2 only where it fits: d=64 and d=128


CODES = {"ptr": "Q", "mut_ptr": "Q", "f32_ptr": "Q", "f32_cptr": "Q", "i32_cptr": "Q", "i32_ptr": "Q", "u64_cptr": "Q",
         "i64": "q", "i32": "i", "f32": "f"}
C_TYPES = {"ptr": "const void*", "mut_ptr": "void*", "f32_ptr": "float*", "f32_cptr": "const float*",
           "i32_cptr": "const int*", "i32_ptr": "int*", "u64_cptr": "const unsigned long long*",
           "i64": "long long", "i32": "int", "f32": "float"}


@pytest.mark.parametrize("p", [DECODE_PARAMS, KV_APPEND_PARAMS], ids=["decode", "kv_append"])
def test_decode_param_structs(p):
    fmt = "@" + "".join(CODES[k] for _, k in p.fields)
    assert p.size == struct.calcsize(fmt + "0q") == (struct.calcsize(fmt) + 7) // 8 * 8
    names = [n for n, _ in p.fields]
    assert len(set(names)) == len(names)
    decl = p.c_declaration()
    body = decl[decl.index("{") + 1:decl.index("};")]
    assert re.findall(r"^\s+(.+?)\s+(\w+);$", body, re.M) == [(C_TYPES[k], n) for n, k in p.fields]
    assert f"static_assert(sizeof({p.name}) == {p.size}," in decl
    assert len(p.pack({n: 1 for n in names})) == p.size


def test_decode_kernel_reads_only_declared_fields():
    used = set(re.findall(r"\bp\.(\w+)", CUH.read_text()))
    assert used and used <= {n for n, _ in DECODE_PARAMS.fields}


def test_max_splits_matches_the_kernels_combine_bound():
    """The fused split combine sizes its shared-memory weights by kMaxDecodeSplits: validation must
    never let more splits through."""
    from pyattn.jit.source import kernel_source_dir
    from pyattn.validate.paged import MAX_SPLITS

    text = (kernel_source_dir() / "decode_common.cuh").read_text()
    (bound,) = re.findall(r"constexpr int kMaxDecodeSplits = (\d+);", text)
    assert int(bound) == MAX_SPLITS

"""Decode-path validation (``pyattn.validate.paged``: pools, queries, block tables, CSR page lists; CPU only).

Device arrays are faked with ``__cuda_array_interface__`` (data pointer 0, never dereferenced).
The validators take arrays read by ``pyattn.interop.inputs.read``; the wrappers below read them
the way the ops do. The split count (``choose_num_splits``) is tested in test_decode_splits.py, the
decode kernel specs and parameter structs in test_decode_specs.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyattn.interop.inputs import read, read_optional
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


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.integers(-2**40, 2**40), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                       st.none()),
       top=st.integers(0, 2**20), on_device=st.booleans())
def test_max_seqlen_is_an_int_in_range_over_device_lengths(value, top, on_device):
    """``max_seqlen`` (paged_decode / contiguous_decode): taken only as an int in [0, top] (not a
    bool) over device lengths; anything else is refused with an error naming it, before any device
    work (host lengths are checked as they are, so the bound is refused with them)."""
    lens = read("seq_lens", FakeDev((2,), np.int32) if on_device else np.zeros(2, np.int32))
    ok = on_device and type(value) is int and 0 <= value <= top
    if ok:
        assert V.check_max_seqlen(value, lens, "seq_lens", top) == value
    else:
        with pytest.raises((ValueError, TypeError), match="^max_seqlen: "):
            V.check_max_seqlen(value, lens, "seq_lens", top)

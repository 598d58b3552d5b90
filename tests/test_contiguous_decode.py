"""``pyattn.contiguous_decode`` without a GPU: its validation and the paged view of the caches.

The view (``pyattn.ops._contiguous.paged_view``) must address every (sequence, token, head) of the
caches exactly where the caches hold it, for any strides the validators accept; the property test
below walks every address of random geometries. Device arrays are faked with
``__cuda_array_interface__`` (never dereferenced).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyattn
from pyattn.interop.inputs import read
from pyattn.ops._contiguous import VIEW_PAGE, paged_view
from pyattn.validate.contiguous import check_caches, check_seqlens
from test_decode_validation import F16, FakeDev


def caches(layout, batch, max_len, heads, dim, pad=0, v_pad=None):
    """Fake caches whose sequence stride carries ``pad`` extra slots (a view of a longer buffer)."""
    def one(p):
        L = max_len + p
        if layout == "nhd":
            shape, strides = (batch, max_len, heads, dim), (L * heads * dim, heads * dim, dim, 1)
        else:
            shape, strides = (batch, heads, max_len, dim), (heads * L * dim, L * dim, dim, 1)
        return FakeDev(shape, F16, strides)
    return one(pad), one(pad if v_pad is None else v_pad)


def info(layout, *args, **kw):
    k, v = caches(layout, *args, **kw)
    return check_caches(read("k_cache", k), read("v_cache", v), layout)


def test_caches_are_one_page_a_sequence():
    pool = info("hnd", 3, 100, 2, 64)
    assert (pool.num_pages, pool.page_size, pool.heads_kv, pool.head_dim) == (3, 100, 2, 64)
    assert pool.k_strides == (2 * 100 * 64, 64, 100 * 64)  # (sequence, slot, head)


@pytest.mark.parametrize("layout, max_len, pad, page, cols", [
    ("nhd", 4096, 0, VIEW_PAGE, 4096 // VIEW_PAGE), ("hnd", 4096, 0, VIEW_PAGE, 4096 // VIEW_PAGE),
    ("nhd", 48, 0, 16, 3), ("nhd", 96, 32, 32, 3), ("hnd", 64, 16, 32, 2), ("nhd", 100, 0, 100, 1),
    ("nhd", 4096, 8, 4096, 1)])
def test_view_page_size(layout, max_len, pad, page, cols):
    """The largest power-of-two page up to VIEW_PAGE dividing max_len and the sequence stride;
    else one page of max_len slots a sequence."""
    pool, per, c = paged_view(info(layout, 3, max_len, 2, 64, pad=pad))
    assert (pool.page_size, c) == (page, cols)


def test_view_needs_one_table_for_k_and_v():
    """K and V whose sequence strides span different page counts cannot share a table."""
    pool, per, cols = paged_view(info("nhd", 2, 256, 2, 64, pad=0, v_pad=128))
    assert (pool.page_size, per, cols) == (256, 1, 1)


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(["nhd", "hnd"]), batch=st.integers(1, 4), max_len=st.sampled_from([16, 48, 128, 256,
       320, 1000, 1024]), heads=st.integers(1, 3), pad=st.sampled_from([0, 0, 16, 64, 8, 128]))
def test_view_addresses_every_token_where_the_cache_holds_it(layout, batch, max_len, heads, pad):
    whole = info(layout, batch, max_len, heads, 64, pad=pad)
    pool, per, cols = paged_view(whole)
    P = pool.page_size
    assert max_len % P == 0 and cols == max_len // P
    table = np.arange(batch)[:, None] * per + np.arange(cols)
    assert table.max() < pool.num_pages  # within the view's extent (its tensor maps' page axis)
    b, t, h = np.meshgrid(np.arange(batch), np.arange(max_len), np.arange(heads), indexing="ij")
    for cache_strides, view_strides in ((whole.k_strides, pool.k_strides), (whole.v_strides, pool.v_strides)):
        want = b * cache_strides[0] + t * cache_strides[1] + h * cache_strides[2]
        got = table[b, t // P] * view_strides[0] + (t % P) * view_strides[1] + h * view_strides[2]
        np.testing.assert_array_equal(got, want)
    # the view's last page ends inside the caches (what its tensor maps may address)
    last = (pool.num_pages - 1) * pool.k_strides[0] + (P - 1) * pool.k_strides[1] + (heads - 1) * pool.k_strides[2]
    assert last <= (batch - 1) * whole.k_strides[0] + (max_len - 1) * whole.k_strides[1] + \
        (heads - 1) * whole.k_strides[2]


def test_caches_refused_with_their_names():
    k, v = caches("nhd", 2, 64, 2, 64)
    with pytest.raises(TypeError, match="k_cache: expected a device array"):
        check_caches(read("k_cache", np.zeros((2, 64, 2, 64), np.float16)), read("v_cache", v), "nhd")
    with pytest.raises(ValueError, match=r"v_cache: expected 4 dims \(batch, heads_kv, max_len, head_dim\)"):
        check_caches(read("k_cache", k), read("v_cache", FakeDev((2, 64, 64))), "hnd")
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        check_caches(read("k_cache", k), read("v_cache", FakeDev((2, 32, 2, 64))), "nhd")
    with pytest.raises(ValueError, match="layout: expected one of"):
        check_caches(read("k_cache", k), read("v_cache", v), "bhsd")


def _no_fetch(a):
    raise AssertionError("host lengths must not be fetched")


def test_seqlens_int_and_host_arrays():
    assert check_seqlens(7, 3, 64, _no_fetch) == 7 and isinstance(check_seqlens(np.int64(64), 3, 64, _no_fetch), int)
    lens = check_seqlens(read("cache_seqlens", np.array([0, 5, 64], np.int32)), 3, 64, _no_fetch)
    np.testing.assert_array_equal(lens, [0, 5, 64])


@pytest.mark.parametrize("value, err, match", [
    (65, ValueError, r"cache_seqlens: expected an int in \[0, 64\], got 65"),
    (-1, ValueError, r"cache_seqlens: expected an int in \[0, 64\]"),
    (True, TypeError, "cache_seqlens: expected an int or an int32 array, got bool"),
    (np.array([1, 2, 3], np.int64), TypeError, "cache_seqlens: expected an int or an int32 array, got dtype int64"),
    (np.array([1, 2], np.int32), ValueError, r"cache_seqlens: expected shape \(3,\) \(q's batch\), got \(2,\)"),
    (np.array([1, 65, 3], np.int32), ValueError, r"cache_seqlens\[1\] = 65"),
    (np.array([1, 2, -3], np.int32), ValueError, r"cache_seqlens\[2\] = -3")])
def test_seqlens_refused(value, err, match):
    arg = value if isinstance(value, (int, bool)) else read("cache_seqlens", value)
    with pytest.raises(err, match=match):
        check_seqlens(arg, 3, 64, _no_fetch)


def test_device_seqlens_are_fetched_after_their_metadata():
    fetched = []
    dev = FakeDev((3,), np.int32)
    lens = check_seqlens(read("cache_seqlens", dev), 3, 64, lambda a: fetched.append(a) or np.array([3, 4, 5]))
    assert len(fetched) == 1 and list(lens) == [3, 4, 5]
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 70"):
        check_seqlens(read("cache_seqlens", dev), 3, 64, lambda a: np.array([70, 4, 5]))


def test_public_call_checks_batch_before_device_work():
    k, v = caches("nhd", 2, 64, 2, 64)
    with pytest.raises(ValueError, match=r"k_cache: expected 3 sequences \(q's batch\)"):
        pyattn.contiguous_decode(np.zeros((3, 1, 4, 64), np.float16), k, v, 10)
    with pytest.raises(ValueError, match=r"q: query heads \(3\) must be a multiple"):
        pyattn.contiguous_decode(np.zeros((2, 1, 3, 64), np.float16), k, v, 10)

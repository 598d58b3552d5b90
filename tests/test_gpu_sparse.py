"""GPU tests of ``sparse_attention`` (CSR key lists) against the fp64 reference with the equivalent
boolean mask (marked ``gpu``; skipped without a driver).

Tolerance: the 2x rule of ``pyattn.reference.error_bound``, as in ``test_gpu_attention``. Outputs are
allocated poisoned (NaN bytes), so an element the kernel fails to write fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.ops.sparse import sparse_attention
from pyattn.reference import attention_ref, error_bound

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _check, _has_gpu, _inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]


KINDS = ("empty", "all", "subset", "one", "sparse")


def random_csr(rng, shape, seqlen_k, kinds=KINDS):
    """Random key lists for offsets of ``shape`` (..., seqlen_q + 1): (indices, offsets).

    Each row's list is one of ``kinds`` (empty, every key, a random subset, one key, ~5% of the
    keys), always in random order. The (batch, head) blocks are laid out in random order in
    ``indices``, with a few never-read garbage entries (-7) between them.
    """
    lead, seqlen_q = shape[:-1], shape[-1] - 1
    offsets = np.zeros(shape, np.int64)
    flat = []
    blocks = list(np.ndindex(*lead)) if lead else [()]
    for blk in (blocks[j] for j in rng.permutation(len(blocks))):
        flat += [-7] * int(rng.integers(0, 3))
        offsets[blk + (0,)] = len(flat)
        for i in range(seqlen_q):
            kind = kinds[rng.integers(len(kinds))] if seqlen_k else "empty"
            if kind == "all":
                keys = rng.permutation(seqlen_k)
            elif kind == "subset":
                keys = rng.permutation(seqlen_k)[:rng.integers(1, seqlen_k + 1)]
            elif kind == "one":
                keys = [rng.integers(seqlen_k)]
            elif kind == "sparse":
                keys = rng.permutation(np.flatnonzero(rng.random(seqlen_k) < 0.05))
            else:
                keys = []
            flat += [int(x) for x in keys]
            offsets[blk + (i + 1,)] = len(flat)
    return np.array(flat, np.int32), offsets.astype(np.int32)


def csr_mask(indices, offsets, seqlen_k):
    """The boolean mask (rows_b, rows_h, seqlen_q, seqlen_k) that allows exactly the listed keys."""
    off = offsets.reshape((1,) * (3 - offsets.ndim) + offsets.shape)
    rows_b, rows_h, n = off.shape
    mask = np.zeros((rows_b, rows_h, n - 1, seqlen_k), bool)
    for b, h, i in np.ndindex(rows_b, rows_h, n - 1):
        mask[b, h, i, indices[off[b, h, i]:off[b, h, i + 1]]] = True
    return mask


def offsets_shape(mode, B, Hq, Sq):
    return {"shared": (Sq + 1,), "head": (Hq, Sq + 1), "batch_head": (B, Hq, Sq + 1)}[mode]


def _check_sparse(out, lse, q, k, v, mask, layout="bshd", scale=None):
    _check(out, lse, q, k, v, mask=mask, layout=layout, scale=scale)
    empty = ~np.broadcast_to(mask, lse.shape + (mask.shape[-1],)).any(-1)  # (B, Hq, Sq)
    o = np.asarray(out).astype(np.float64)
    o = o if layout == "bhsd" else o.transpose(0, 2, 1, 3)
    assert np.all(o[empty] == 0), "a row with no key must be exactly 0"
    assert np.all(np.isneginf(lse[empty])), "a row with no key has LSE -inf"


LENGTHS = st.sampled_from([1, 7, 8, 9, 31, 32, 33, 100, 257]) | st.integers(1, 300)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       D=st.sampled_from([32, 40, 64, 128, 256]), dtype=st.sampled_from(sorted(DTYPES)),
       mode=st.sampled_from(["shared", "head", "batch_head"]), on_device=st.booleans(),
       layout=st.sampled_from(["bshd", "bhsd"]), seed=st.integers(0, 2**31 - 1))
def test_sparse_matches_reference(B, Sq, Sk, Hkv, group, D, dtype, mode, on_device, layout, seed):
    rng = np.random.default_rng(seed)
    Hq = Hkv * group
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype, layout)
    indices, offsets = random_csr(rng, offsets_shape(mode, B, Hq, Sq), Sk)
    mask = csr_mask(indices, offsets, Sk)
    if on_device:
        dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
        out, lse = sparse_attention(dq, dk, dv, indices, offsets, layout=layout, return_lse=True)
        assert isinstance(out, pyattn.DeviceArray) and out.shape == q.shape and out.dtype == q.dtype
        out, lse = out.numpy(), lse.numpy()
    else:
        out, lse = sparse_attention(q, k, v, indices, offsets, layout=layout, return_lse=True)
        assert isinstance(out, np.ndarray) and out.dtype == q.dtype
    assert lse.dtype == np.float32 and lse.shape == (B, Hq, Sq)
    _check_sparse(out, lse, q, k, v, mask, layout)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_sparse_equals_dense_attention_with_the_same_mask(dtype):
    rng = np.random.default_rng(11)
    B, Sq, Sk, Hq, Hkv, D = 2, 130, 333, 8, 2, 128
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    indices, offsets = random_csr(rng, (B, Hq, Sq + 1), Sk)
    mask = csr_mask(indices, offsets, Sk)
    dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
    so, sl = sparse_attention(dq, dk, dv, indices, offsets, return_lse=True)
    do, dl = pyattn.attention(dq, dk, dv, mask=pyattn.asarray(mask), return_lse=True)
    so, sl, do, dl = (x.numpy().astype(np.float64) for x in (so, sl, do, dl))
    # each kernel is within the bound of the fp64 reference, so they are within twice it of each other
    assert np.abs(so - do).max() <= 2 * error_bound(q, k, v, mask=mask)
    assert np.array_equal(np.isneginf(sl), np.isneginf(dl))
    finite = np.isfinite(dl)
    assert np.abs(sl[finite] - dl[finite]).max() <= 2e-3 * max(1.0, np.abs(dl[finite]).max())
    empty = ~mask.any(-1)
    assert empty.any() and np.all(so.transpose(0, 2, 1, 3)[empty] == 0) and np.all(do.transpose(0, 2, 1, 3)[empty] == 0)


def test_long_lists():
    """Rows of ~1200 keys: many 32-index batches, a partial last step."""
    rng = np.random.default_rng(12)
    B, Sq, Sk, Hq, Hkv, D = 1, 64, 4096, 4, 1, 128
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, "bfloat16")
    lists = [rng.permutation(np.flatnonzero(rng.random(Sk) < 0.3)) for _ in range(Sq)]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    indices = np.concatenate(lists).astype(np.int32)
    out, lse = sparse_attention(q, k, v, indices, offsets, return_lse=True)
    _check_sparse(out, lse, q, k, v, csr_mask(indices, offsets, Sk))


def test_empty_problems_and_rows():
    rng = np.random.default_rng(13)
    q, k, v = _inputs(rng, 2, 9, 20, 4, 2, 64, "float16")
    none = np.zeros(10, np.int32)  # every list empty
    out, lse = sparse_attention(q, k, v, np.zeros(0, np.int32), none, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    out, lse = sparse_attention(q, k[:, :0], v[:, :0], np.zeros(0, np.int32), none, return_lse=True)
    assert out.shape == q.shape and np.all(out == 0) and np.all(np.isneginf(lse))
    out = sparse_attention(q[:, :0], k, v, np.zeros(0, np.int32), np.zeros(1, np.int32))
    assert out.shape == (2, 0, 4, 64)


def test_strided_views_out_and_scale():
    """bhsd views of bshd device arrays (strided, read in place), a device ``out=``, a custom scale."""
    rng = np.random.default_rng(14)
    B, Sq, Sk, Hq, Hkv, D = 2, 50, 70, 4, 2, 64
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, "float16")
    views = [pyattn.asarray(x).transpose(0, 2, 1, 3) for x in (q, k, v)]
    indices, offsets = random_csr(rng, (Hq, Sq + 1), Sk)
    out = pyattn.empty((B, Hq, Sq, D), np.float16)
    res, lse = sparse_attention(*views, indices, offsets, layout="bhsd", scale=0.2, out=out, return_lse=True)
    assert res is out
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    _check_sparse(out.numpy(), lse.numpy(), qt, kt, vt, csr_mask(indices, offsets, Sk), "bhsd", scale=0.2)
    host_out = np.full((B, Sq, Hq, D), np.nan, np.float16)
    assert sparse_attention(q, k, v, indices, offsets, out=host_out) is host_out
    ref = attention_ref(q, k, v, mask=csr_mask(indices, offsets, Sk))
    assert np.abs(host_out.astype(np.float64) - ref).max() <= error_bound(q, k, v, mask=csr_mask(indices, offsets, Sk))


def test_misaligned_device_arrays_are_rejected():
    rng = np.random.default_rng(15)
    q, k, v = (pyattn.asarray(x) for x in _inputs(rng, 1, 8, 8, 2, 2, 64, "float16"))
    # 8 bytes into k: a valid (1, 7, 2, 64) view, but not 16-byte aligned
    shifted = pyattn.DeviceArray(k.ptr + 8, (1, 7, 2, 64), np.float16, k.device, strides=k.strides, owner=k)
    with pytest.raises(ValueError, match=r"^k: the sparse kernel accesses rows in 16-byte aligned pieces"):
        sparse_attention(q, shifted, shifted, np.zeros(0, np.int32), np.zeros(9, np.int32))

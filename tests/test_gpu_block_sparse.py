"""GPU property tests of block-sparse attention (marked ``gpu``; skipped without a driver).

``block_sparse_attention`` must equal dense attention (the fp64 reference) with the boolean mask
that expands the block layout, composed with causal / window / soft-cap, for any block size that is
a multiple of 16 against the kernels' own tile shapes (so tiles are partly covered, and the
16 x 16 sub-block masks are exercised), per-head and shared layouts, bool and BSR forms, and
rows that see no block (output 0, LSE -inf).
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.ops.block_sparse import block_sparse_attention

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _check, _has_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]
DT16 = ["float16", "bfloat16"]


def _expand(blocks, R, C, Sq, Sk):
    """(H_l, Mb, Nb) block mask -> (1 or Hq as H_l, Sq, Sk) element mask."""
    return np.repeat(np.repeat(blocks, R, axis=-2), C, axis=-1)[..., :Sq, :Sk]


def _bsr(blocks):
    """The (indptr, indices) form of a (H_l, Mb, Nb) or (Mb, Nb) mask (absolute positions)."""
    flat = blocks.reshape(-1, blocks.shape[-1])
    ptr = np.concatenate([[0], np.cumsum(flat.sum(axis=1))]).astype(np.int32)
    if blocks.ndim == 3:  # per head: rows of head h are ptr[h * Mb : h * Mb + Mb + 1]
        Mb = blocks.shape[1]
        indptr = np.stack([ptr[h * Mb:h * Mb + Mb + 1] for h in range(blocks.shape[0])])
    else:
        indptr = ptr
    return indptr, np.nonzero(flat)[1].astype(np.int32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Sq=st.integers(1, 400) | st.sampled_from([128, 256, 1000]),
       Sk=st.integers(1, 400) | st.sampled_from([128, 256, 1000]), Hkv=st.integers(1, 2),
       group=st.sampled_from([1, 2, 4]), D=st.sampled_from([64, 128, 40, 256]), dtype=st.sampled_from(DT16),
       block=st.sampled_from([(16, 16), (32, 64), (64, 64), (128, 128), (48, 80), (256, 32)]),
       per_head=st.booleans(), density=st.sampled_from([0.0, 0.1, 0.4, 1.0]), form=st.sampled_from(["bool", "bsr"]),
       causal=st.sampled_from([False, True, "top_left"]), window=st.none() | st.tuples(st.integers(-1, 300),
                                                                                        st.integers(-1, 300)),
       softcap=st.sampled_from([None, None, 20.0]), layout=st.sampled_from(["bshd", "bhsd"]),
       seed=st.integers(0, 2**31 - 1))
def test_block_sparse_matches_dense_with_expanded_mask(B, Sq, Sk, Hkv, group, D, dtype, block, per_head, density,
                                                       form, causal, window, softcap, layout, seed):
    rng = np.random.default_rng(seed)
    Hq, (R, C) = Hkv * group, block
    Mb, Nb = -(-Sq // R), -(-Sk // C)
    shape_q = (B, Sq, Hq, D) if layout == "bshd" else (B, Hq, Sq, D)
    shape_k = (B, Sk, Hkv, D) if layout == "bshd" else (B, Hkv, Sk, D)
    q = rng.standard_normal(shape_q).astype(DTYPES[dtype])
    k = rng.standard_normal(shape_k).astype(DTYPES[dtype])
    v = rng.standard_normal(shape_k).astype(DTYPES[dtype])
    blocks = rng.random((Hq, Mb, Nb) if per_head else (Mb, Nb)) < density
    arg = blocks if form == "bool" else _bsr(blocks)
    opts = dict(causal=causal, window=window, softcap=softcap)
    out, lse = block_sparse_attention(q, k, v, arg, block, tensor_layout=layout, return_lse=True, **opts)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and lse.shape == (B, Hq, Sq)
    mask = _expand(blocks, R, C, Sq, Sk)
    mask = mask[None] if per_head else mask[None, None]
    _check(out, lse, q, k, v, mask=mask, layout=layout, **opts)


@pytest.mark.parametrize("dtype", DT16)
def test_empty_block_rows_give_zero_and_neg_inf(dtype):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 512, 2, 128)).astype(DTYPES[dtype]) for _ in range(3))
    blocks = rng.random((4, 4)) < 0.5
    blocks[1] = False  # query rows 128..255 see nothing
    dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
    out, lse = block_sparse_attention(dq, dk, dv, blocks, (128, 128), return_lse=True)
    assert isinstance(out, pyattn.DeviceArray)
    o, l_ = out.numpy(), lse.numpy()
    assert np.all(o[:, 128:256].astype(np.float64) == 0) and np.all(np.isneginf(l_[:, :, 128:256]))
    _check(o, l_, q, k, v, mask=_expand(blocks, 128, 128, 512, 512)[None, None])


def test_matches_attention_with_bool_mask_on_device():
    """The same problem through pyattn.attention's mask path: identical semantics, both on the GPU."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 700, 4, 64)).astype(np.float16) for _ in range(3))
    blocks = rng.random((4, 11, 11)) < 0.3
    out = block_sparse_attention(q, k, v, blocks, (64, 64), causal=True)
    ref = pyattn.attention(q, k, v, causal=True, mask=_expand(blocks, 64, 64, 700, 700)[None])
    assert np.abs(out.astype(np.float32) - ref.astype(np.float32)).max() <= 2e-3


def test_bad_layout_rejected_before_launch():
    q = np.zeros((1, 256, 2, 64), np.float16)
    with pytest.raises(ValueError, match="layout"):
        block_sparse_attention(q, q, q, np.ones((3, 3), bool), (128, 128))  # needs (2, 2)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_attention(q, q, q, np.ones((2, 2), bool), (100, 128))
    with pytest.raises(TypeError, match="q"):
        block_sparse_attention(q.astype(np.float32), q, q, np.ones((2, 2), bool), (128, 128))

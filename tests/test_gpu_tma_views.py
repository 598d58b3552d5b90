"""GPU tests of the TMA-fed sm_90a kernel (attn_fwd_tma) against the fp64 reference: its dense path,
tensor maps over strided views and broadcast (stride 0) axes, head dims below and between the 64-wide
boxes, GQA, layouts, soft-cap and ALiBi, outputs through unaligned views, and maps re-encoded when the
same layout comes with other arrays; marked ``gpu``, skipped without an sm_90a GPU.

The other GPU modules reach the kernel too (every 16-bit call on sm_90a whose bucket its table has);
these aim at what is new on its path. Its mask tensors: test_gpu_tma_masks.py; its persistent blocks,
warpgroups, short and small-grid rows and varlen: test_gpu_tma_persistent.py; shared helpers:
_tma_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.kernels.specs import select_attention_spec

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from _tma_helpers import LENGTHS, SETTINGS, TMA_DIMS, _view  # noqa: E402
from test_gpu_attention import DTYPES, _check, _inputs  # noqa: E402
from test_gpu_wgmma_ws import _is_sm90a  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]


def test_the_dense_path_is_the_tma_kernel():
    assert TMA_DIMS, "attn_fwd_tma serves no head dim"
    assert select_attention_spec("bfloat16", 128, "sm_90a", mask="bool").family == "attn_fwd_tma"


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       D=st.sampled_from(TMA_DIMS or [128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       causal=st.sampled_from([False, True, "top_left"]), window=st.sampled_from([None, (100, 0), (37, 11)]),
       softcap=st.sampled_from([None, 15.0]), alibi=st.booleans(), layout=st.sampled_from(["bshd", "bhsd"]),
       seed=st.integers(0, 2**31 - 1))
def test_tma_kernel_matches_the_reference(B, Sq, Sk, Hkv, group, D, dtype, causal, window, softcap, alibi, layout,
                                          seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype, layout)
    opts = dict(causal=causal, window=window, softcap=softcap, layout=layout)
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, Hkv * group).astype(np.float32)
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    _check(out, lse, q, k, v, **opts)


@SETTINGS
@given(B=st.integers(1, 3), S=LENGTHS, H=st.integers(1, 3), D=st.sampled_from(TMA_DIMS or [128]),
       dtype=st.sampled_from(["float16", "bfloat16"]), causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_packed_qkv_views(B, S, H, D, dtype, causal, seed):
    """q, k, v as views into one (B, S, 3, H, D + 8) buffer: row strides of 3 H (D + 8) elements,
    a head stride that is not the head dim, and the padding columns never read."""
    rng = np.random.default_rng(seed)
    host = rng.standard_normal((B, S, 3, H, D + 8)).astype(DTYPES[dtype])
    base = pyattn.asarray(host)
    st_ = (S * 3 * H * (D + 8), 3 * H * (D + 8), D + 8, 1)
    q, k, v = (_view(base, i * H * (D + 8), (B, S, H, D), st_) for i in range(3))
    out = pyattn.attention(q, k, v, causal=causal)
    _check(out.numpy(), None, *(np.ascontiguousarray(host[:, :, i, :, :D]) for i in range(3)), causal=causal)


@pytest.mark.parametrize("Sk", [300, 4096])  # d = 64: the short row below 2048 keys, the dense row from there
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_outputs_through_views_4_bytes_aligned(D, Sk):
    """The warp-specialized rows store O in 16-byte pieces when the output's rows are 16-byte
    aligned, else in 4-byte pairs (the others always in pairs): an ``out=`` view 4 bytes off with a
    row stride of D + 2 elements takes the pairs (and the columns between the rows stay untouched);
    the same call into a fresh output takes the 16-byte stores, with the same result."""
    rng = np.random.default_rng(D + Sk)
    B, Sq, H = 2, 333, 2
    q, k, v = (pyattn.asarray(x) for x in _inputs(rng, B, Sq, Sk, H, H, D, "bfloat16"))
    row = H * (D + 2)
    base = pyattn.asarray(np.full((B * Sq * row + 2,), 7.0, dtype=ml_dtypes.bfloat16))
    out = _view(base, 2, (B, Sq, H, D), (Sq * row, row, D + 2, 1))
    assert out.ptr % 16 == 4
    res, lse = pyattn.attention(q, k, v, causal=True, out=out, return_lse=True)
    fresh = pyattn.attention(q, k, v, causal=True)
    hq, hk, hv = (x.numpy() for x in (q, k, v))
    _check(fresh.numpy(), None, hq, hk, hv, causal=True)
    got = base.numpy()[2:].reshape(B, Sq, H, D + 2)
    _check(got[..., :D], lse.numpy(), hq, hk, hv, causal=True)
    assert np.array_equal(got[..., :D].astype(np.float32), fresh.numpy().astype(np.float32))
    assert (got[..., D:].astype(np.float32) == 7.0).all() and base.numpy()[:2].astype(np.float32).tolist() == [7, 7]


@pytest.mark.parametrize("D", [64, 128])
def test_keys_broadcast_over_the_batch(D):
    """K and V with batch stride 0 (one cache shared by every batch entry): a map axis of size 1."""
    if D not in TMA_DIMS:
        pytest.skip(f"attn_fwd_tma does not serve d={D}")
    rng = np.random.default_rng(D)
    B, Sq, Sk, H = 3, 77, 200, 2
    q = rng.standard_normal((B, Sq, H, D)).astype(ml_dtypes.bfloat16)
    kv1 = [rng.standard_normal((1, Sk, H, D)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    dk, dv = (pyattn.asarray(x) for x in kv1)
    k, v = (_view(x, 0, (B, Sk, H, D), (0, H * D, D, 1)) for x in (dk, dv))
    out, lse = pyattn.attention(pyattn.asarray(q), k, v, return_lse=True)
    kb, vb = (np.broadcast_to(x, (B, Sk, H, D)) for x in kv1)
    _check(out.numpy(), lse.numpy(), q, kb, vb)


def test_broadcast_sequence_axis_takes_the_cp_async_kernel():
    """A key axis of stride 0 cannot be a TMA map's row axis: the call runs attn_fwd_wgmma, correctly."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 40, 2, 128)).astype(ml_dtypes.bfloat16)
    row = [rng.standard_normal((1, 1, 2, 128)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    k, v = (_view(pyattn.asarray(x), 0, (1, 90, 2, 128), (2 * 128, 0, 128, 1)) for x in row)
    out = pyattn.attention(pyattn.asarray(q), k, v)
    _check(out.numpy(), None, q, *(np.broadcast_to(x, (1, 90, 2, 128)) for x in row))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cap", [15.0, 50.0, 51.0])
def test_softcap_at_its_range_ends(cap, dtype):
    """Rows whose logits all lie far below / above the cap (tanh saturated: every score at -cap or
    +cap, so the row max ties across keys) next to ordinary rows, causal so that rows see 1..S keys,
    at |logits| ~ 400."""
    rng = np.random.default_rng(int(cap))
    B, S, H, D = 1, 300, 2, 128
    u = np.ones(D) / np.sqrt(D)
    sign = np.where(np.arange(S) % 3 == 0, -1.0, np.where(np.arange(S) % 3 == 1, 1.0, 0.0))  # -, +, plain rows
    q = (2 * sign[None, :, None, None] * u + 0.3 * rng.standard_normal((B, S, H, D)) * (sign == 0)[None, :, None, None])
    k = 2 * u + 0.05 * rng.standard_normal((B, S, H, D))
    v = rng.standard_normal((B, S, H, D))
    q, k, v = (x.astype(DTYPES[dtype]) for x in (q, k, v))
    opts = dict(causal=True, softcap=cap, scale=100.0)  # |logits| ~ 400 on the saturated rows
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    _check(out, lse, q, k, v, **opts)


def test_new_arrays_with_the_same_layout_get_their_own_maps():
    """The maps are memoised by address: a second call with other arrays must read those."""
    rng = np.random.default_rng(5)
    sets = [_inputs(rng, 1, 300, 300, 2, 1, 128, "bfloat16") for _ in range(3)]
    dev = [[pyattn.asarray(x) for x in s] for s in sets]
    for s, d in zip(sets * 2, dev * 2):
        _check(pyattn.attention(*d, causal=True).numpy(), None, *s, causal=True)

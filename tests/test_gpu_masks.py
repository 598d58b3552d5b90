"""GPU property tests of masks, windows, both causal alignments, soft-cap, ALiBi, ``out=`` and varlen
against the fp64 reference (marked ``gpu``; skipped without a driver).

Tolerance: the 2x rule of ``pyattn.reference.error_bound``. Outputs are allocated poisoned, so an
unwritten element fails as NaN. Head dims are drawn from a few buckets here (every new variant is a
compile); ``test_every_head_dim_bucket_with_modifiers`` covers the whole table once.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.kernels.specs import HEAD_DIM_BUCKETS
from pyattn.reference import attention_ref, attention_varlen_ref, error_bound

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _check, _has_gpu, _inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = st.sampled_from([1, 16, 63, 64, 65, 130, 300]) | st.integers(1, 200)


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2]),
       D=st.sampled_from([64, 128]), dtype=st.sampled_from(sorted(DTYPES)),
       keep=st.lists(st.booleans(), min_size=2, max_size=4), density=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
       dead_row=st.booleans(), dead_batch=st.booleans(), on_device=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_bool_mask(B, Sq, Sk, Hkv, group, D, dtype, keep, density, dead_row, dead_batch, on_device, seed):
    rng = np.random.default_rng(seed)
    Hq = Hkv * group
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    full = (B, Hq, Sq, Sk)
    shape = tuple(n if kp else 1 for n, kp in zip(full[4 - len(keep):], keep))
    mask = rng.random(shape) >= density
    if dead_row and shape[-2] > 1:
        mask[..., rng.integers(shape[-2]), :] = False  # a fully masked query row
    if dead_batch and len(shape) == 4 and shape[0] > 1:
        mask[0] = False  # a fully masked batch entry
    m = pyattn.asarray(mask) if on_device else mask
    if on_device:
        out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), mask=m, return_lse=True)
        out, lse = out.numpy(), lse.numpy()
    else:
        out, lse = pyattn.attention(q, k, v, mask=m, return_lse=True)
    _check(out, lse, q, k, v, mask=mask)


@SETTINGS
@given(Sq=LENGTHS, Sk=LENGTHS, mdtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**31 - 1))
def test_additive_mask_with_neg_inf(Sq, Sk, mdtype, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, 1, Sq, Sk, 2, 1, 64, dtype)
    mask = rng.standard_normal((2, Sq, Sk)) * 2
    mask[rng.random(mask.shape) < 0.3] = -np.inf
    mask[:, 0, :] = -np.inf  # a fully masked row through -inf alone
    mask = mask.astype(DTYPES[mdtype])
    out, lse = pyattn.attention(q, k, v, mask=mask, return_lse=True)
    _check(out, lse, q, k, v, mask=mask)


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, D=st.sampled_from([64, 128]), dtype=st.sampled_from(sorted(DTYPES)),
       left=st.sampled_from([-1, 0, 1, 7, 64, 100]), right=st.sampled_from([-1, 0, 3, 64]),
       causal=st.sampled_from([False, True, "top_left"]), seed=st.integers(0, 2**31 - 1))
def test_window_equals_the_explicit_mask(B, Sq, Sk, D, dtype, left, right, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, 2, 2, D, dtype)
    out, lse = pyattn.attention(q, k, v, window=(left, right), causal=causal, return_lse=True)
    _check(out, lse, q, k, v, window=(left, right), causal=causal)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :] - (Sk - Sq)
    explicit = np.ones((Sq, Sk), bool)
    if left >= 0:
        explicit &= j >= i - left
    if right >= 0:
        explicit &= j <= i + right
    out_m = pyattn.attention(q, k, v, mask=explicit, causal=causal)
    bound = error_bound(q, k, v, mask=explicit, causal=causal)
    assert np.abs(out.astype(np.float64) - out_m.astype(np.float64)).max(initial=0) <= bound


@SETTINGS
@given(Sq=LENGTHS, Sk=LENGTHS, dtype=st.sampled_from(sorted(DTYPES)), layout=st.sampled_from(["bshd", "bhsd"]),
       causal=st.sampled_from([True, "bottom_right", "top_left"]), seed=st.integers(0, 2**31 - 1))
def test_both_causal_alignments(Sq, Sk, dtype, layout, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, 2, Sq, Sk, 4, 2, 64, dtype, layout)
    out, lse = pyattn.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    _check(out, lse, q, k, v, causal=causal, layout=layout)


@SETTINGS
@given(Sq=LENGTHS, Sk=LENGTHS, dtype=st.sampled_from(sorted(DTYPES)), cap=st.sampled_from([0.5, 5.0, 30.0]),
       causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_softcap(Sq, Sk, dtype, cap, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, 1, Sq, Sk, 2, 1, 128, dtype)
    q = (q.astype(np.float32) * 3).astype(q.dtype)  # large scores, so the cap bites
    out, lse = pyattn.attention(q, k, v, softcap=cap, causal=causal, return_lse=True)
    _check(out, lse, q, k, v, softcap=cap, causal=causal)


@SETTINGS
@given(B=st.integers(1, 3), Sq=LENGTHS, Sk=LENGTHS, dtype=st.sampled_from(sorted(DTYPES)),
       per_batch=st.booleans(), causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_alibi(B, Sq, Sk, dtype, per_batch, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, 4, 2, 64, dtype)
    slopes = rng.uniform(0.0, 0.5, (B, 4) if per_batch else (4,)).astype(np.float32)
    out, lse = pyattn.attention(q, k, v, alibi_slopes=slopes, causal=causal, return_lse=True)
    _check(out, lse, q, k, v, alibi_slopes=slopes, causal=causal)


@pytest.mark.parametrize("D", [d for d in (8, 40) + HEAD_DIM_BUCKETS])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_head_dim_bucket_with_modifiers(D, dtype):
    rng = np.random.default_rng(D)
    q, k, v = _inputs(rng, 1, 77, 150, 2, 1, D, dtype)
    mask = rng.random((77, 150)) > 0.2
    opts = dict(mask=mask, softcap=10.0, alibi_slopes=np.array([0.1, 0.02], np.float32), window=(90, 5), causal=True)
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    _check(out, lse, q, k, v, **opts)
    out2, lse2 = pyattn.attention(q, k, v, return_lse=True, window=(60, -1))  # plain kernel, window only
    _check(out2, lse2, q, k, v, window=(60, -1))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_out_argument(dtype):
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, 2, 50, 70, 4, 2, 64, dtype)
    host_out = np.empty_like(q)
    res = pyattn.attention(q, k, v, causal=True, out=host_out)
    assert res is host_out
    _check(host_out, None, q, k, v, causal=True)
    dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
    dout = pyattn.empty(q.shape, q.dtype)
    for _ in range(2):  # the second call takes the cached plan
        assert pyattn.attention(dq, dk, dv, causal=True, out=dout) is dout
        _check(dout.numpy(), None, q, k, v, causal=True)


@SETTINGS
@given(lens=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 150)), min_size=1, max_size=5),
       dtype=st.sampled_from(sorted(DTYPES)), D=st.sampled_from([64, 128]),
       causal=st.sampled_from([False, True, "top_left"]), window=st.sampled_from([None, (16, 0), (-1, 8)]),
       alibi=st.booleans(), on_device=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_varlen_equals_per_sequence_dense_calls(lens, dtype, D, causal, window, alibi, on_device, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 4, D)).astype(dt)
    k, v = (rng.standard_normal((cu_k[-1], 2, D)).astype(dt) for _ in range(2))
    slopes = rng.uniform(0, 0.3, (len(lens), 4)).astype(np.float32) if alibi else None
    opts = dict(causal=causal, window=window, alibi_slopes=slopes)
    args = (q, k, v, cu_q, cu_k)
    if on_device:
        args = tuple(pyattn.asarray(x) for x in args)
    out, lse = pyattn.attention_varlen(*args, return_lse=True, **opts)
    if on_device:
        out, lse = out.numpy(), lse.numpy()
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape == (4, cu_q[-1])
    assert not np.isnan(out.astype(np.float64)).any()
    for n, (a, b) in enumerate(lens):  # per sequence, the dense bound of that sequence
        rows = slice(cu_q[n], cu_q[n + 1])
        if a == 0:
            continue
        sl = None if slopes is None else slopes[n]
        qs, ks, vs = q[None, rows], k[None, cu_k[n]:cu_k[n + 1]], v[None, cu_k[n]:cu_k[n + 1]]
        bound = error_bound(qs, ks, vs, causal=causal, window=window, alibi_slopes=sl)
        assert np.abs(out[rows].astype(np.float64) - ref[rows]).max() <= bound
        if b == 0:
            assert not out[rows].astype(np.float64).any()  # no keys: output 0 (and LSE -inf, below)
            continue
        dense = pyattn.attention(qs, ks, vs, causal=causal, window=window, alibi_slopes=sl)
        assert np.abs(dense[0].astype(np.float64) - ref[rows]).max() <= bound
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~finite)
    if finite.any():
        assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-3 * max(1.0, np.abs(ref_lse[finite]).max())


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 3]),
       D=st.sampled_from([8, 32, 64, 72, 128, 160, 256]), causal=st.sampled_from([False, True, "top_left"]),
       window=st.sampled_from([None, (32, 8)]), mods=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_allow_tf32(B, Sq, Sk, Hkv, group, D, causal, window, mods, seed):
    """TF32 rounds q, k, v and P to a 10-bit mantissa, as float16 does (with fp32's range), so the
    yardstick is the naive float16 computation against the float32 inputs' exact result."""
    from pyattn.reference import attention_lowp

    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, "float32")
    opts = dict(causal=causal, window=window)
    if mods:
        opts.update(softcap=20.0, mask=rng.random((Sq, Sk)) > 0.1)
    out, lse = pyattn.attention(q, k, v, allow_tf32=True, return_lse=True, **opts)
    assert out.dtype == np.float32
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **opts)
    naive = attention_lowp(*(x.astype(np.float16) for x in (q, k, v)), **opts)
    bound = 2 * np.abs(naive - ref).max(initial=0) + 1e-3
    assert not np.isnan(out).any()
    assert np.abs(out - ref).max(initial=0) <= bound
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~finite)
    if finite.any():
        assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-2 * max(1.0, np.abs(ref_lse[finite]).max())

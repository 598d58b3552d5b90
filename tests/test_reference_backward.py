"""The backward reference (``pyattn.reference.attention_backward_ref``) against finite differences
of the forward reference, and its same-precision yardstick (CPU only).

The oracle is independent of the backward's formulas: central differences of
``sum(dout * attention_ref(...))`` in float64, one input element at a time.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyattn.reference import (attention_backward_lowp, attention_backward_ref, attention_ref,
                              attention_varlen_backward_ref, attention_varlen_ref, backward_error_bounds)

FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def numeric_grads(dout, q, k, v, eps=1e-6, **opts):
    """Central differences of sum(dout * attention_ref(q, k, v)) for every element of q, k, v."""
    loss = lambda *a: float(np.sum(dout * attention_ref(*a, **opts)))  # noqa: E731
    grads = []
    for i, x in enumerate((q, k, v)):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q, k, v]
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args[i] = xp
            hi = loss(*args)
            args[i] = xm
            g[idx] = (hi - loss(*args)) / (2 * eps)
        grads.append(g)
    return grads


def _problem(rng, B, Sq, Sk, Hq, Hkv, D, layout="bshd"):
    def shape(S, H):
        return (B, S, H, D) if layout == "bshd" else (B, H, S, D)

    return (rng.standard_normal(shape(Sq, Hq)), rng.standard_normal(shape(Sq, Hq)),
            rng.standard_normal(shape(Sk, Hkv)), rng.standard_normal(shape(Sk, Hkv)))


@FAST
@given(sq=st.sampled_from([1, 3, 5]), sk=st.sampled_from([1, 4, 6]), hkv=st.integers(1, 2), group=st.integers(1, 2),
       causal=st.sampled_from([False, True, "top_left"]),
       window=st.one_of(st.none(), st.tuples(st.integers(-1, 3), st.integers(-1, 3))),
       softcap=st.sampled_from([None, 1.5]), alibi=st.booleans(), layout=st.sampled_from(["bshd", "bhsd"]),
       seed=st.integers(0, 2**31 - 1))
def test_gradients_match_finite_differences(sq, sk, hkv, group, causal, window, softcap, alibi, layout, seed):
    rng = np.random.default_rng(seed)
    dout, q, k, v = _problem(rng, 1, sq, sk, hkv * group, hkv, 4, layout)
    opts = dict(causal=causal, window=window, softcap=softcap, layout=layout,
                alibi_slopes=rng.uniform(0.1, 1.0, hkv * group) if alibi else None)
    got = attention_backward_ref(dout, q, k, v, **opts)
    want = numeric_grads(dout, q, k, v, **opts)
    for name, g, w, x in zip("qkv", got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == np.float64
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5, err_msg=f"d{name}")


def test_scale_and_float_mask_match_finite_differences():
    rng = np.random.default_rng(1)
    dout, q, k, v = _problem(rng, 2, 3, 4, 2, 1, 8)
    mask = rng.standard_normal((1, 2, 3, 4))
    got = attention_backward_ref(dout, q, k, v, scale=0.37, mask=mask)
    for g, w in zip(got, numeric_grads(dout, q, k, v, scale=0.37, mask=mask)):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5)


def test_fully_masked_rows_give_zero_gradients_never_nan():
    rng = np.random.default_rng(2)
    dout, q, k, v = _problem(rng, 1, 6, 2, 2, 2, 8)
    dq, dk, dv = attention_backward_ref(dout, q, k, v, causal=True)  # rows 0..3 see no key
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert np.all(dq[:, :4] == 0)
    # the masked rows add nothing to dk, dv: the same as the problem without them
    _, dk2, dv2 = attention_backward_ref(dout[:, 4:], q[:, 4:], k, v, causal=True)
    np.testing.assert_allclose(dk, dk2, atol=1e-14)
    np.testing.assert_allclose(dv, dv2, atol=1e-14)
    dq, dk, dv = attention_backward_ref(dout, q, k[:, :0], v[:, :0])  # no keys at all
    assert np.all(dq == 0) and dk.shape == (1, 0, 2, 8)


def test_gqa_sums_dk_dv_over_each_group():
    rng = np.random.default_rng(3)
    dout, q, k, v = _problem(rng, 1, 5, 7, 4, 2, 8)
    dq, dk, dv = attention_backward_ref(dout, q, k, v, causal=True)
    kr, vr = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # each kv head copied for its 2 query heads
    dq_r, dk_r, dv_r = attention_backward_ref(dout, q, kr, vr, causal=True)
    np.testing.assert_allclose(dq, dq_r, atol=1e-12)
    np.testing.assert_allclose(dk, dk_r.reshape(1, 7, 2, 2, 8).sum(axis=3), atol=1e-12)
    np.testing.assert_allclose(dv, dv_r.reshape(1, 7, 2, 2, 8).sum(axis=3), atol=1e-12)


def test_varlen_is_each_sequence_alone():
    rng = np.random.default_rng(4)
    lens_q, lens_k = [3, 0, 5], [4, 2, 1]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    q, dout = rng.standard_normal((8, 2, 8)), rng.standard_normal((8, 2, 8))
    k, v = rng.standard_normal((7, 1, 8)), rng.standard_normal((7, 1, 8))
    slopes = rng.uniform(0.1, 1, (3, 2))
    got = attention_varlen_backward_ref(dout, q, k, v, cu_q, cu_k, causal=True, softcap=2.0, alibi_slopes=slopes)
    for n in range(3):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        one = attention_backward_ref(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], causal=True, softcap=2.0,
                                     alibi_slopes=slopes[n])
        for g, w, s in zip(got, one, (qs, ks, ks)):
            np.testing.assert_allclose(g[s], w[0], atol=1e-14)
    # and the finite differences of the varlen forward agree
    loss = lambda k_: float(np.sum(dout * attention_varlen_ref(q, k_, v, cu_q, cu_k, causal=True)))  # noqa: E731
    dk = attention_varlen_backward_ref(dout, q, k, v, cu_q, cu_k, causal=True)[1]
    e = np.zeros_like(k)
    e[2, 0, 3] = 1e-6
    np.testing.assert_allclose(dk[2, 0, 3], (loss(k + e) - loss(k - e)) / 2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_lowp_gradients_are_close_and_bounds_cover_them(dtype):
    rng = np.random.default_rng(5)
    dout, q, k, v = (x.astype(dtype) for x in _problem(rng, 1, 33, 40, 4, 2, 16))
    opts = dict(causal=True, softcap=5.0)
    ref = attention_backward_ref(dout, q, k, v, **opts)
    low = attention_backward_lowp(dout, q, k, v, **opts)
    bare = backward_error_bounds(dout, q, k, v, floor=0.0, **opts)
    floored = backward_error_bounds(dout, q, k, v, **opts)
    eps = float(ml_dtypes.finfo(dtype).eps)
    for r, lo, b, f in zip(ref, low, bare, floored):
        scale = np.abs(r).max()
        err = np.abs(lo - r).max()
        assert 0 < err < 64 * eps * scale  # rounding-sized, not wrong
        assert b == pytest.approx(2 * err) and f > b


def test_argument_errors_name_the_argument():
    rng = np.random.default_rng(6)
    dout, q, k, v = _problem(rng, 1, 3, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="^dout:"):
        attention_backward_ref(dout[:, :2], q, k, v)
    with pytest.raises(TypeError, match="^return_lse:"):
        attention_backward_ref(dout, q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="^k, v, dout:"):
        half = [x.astype(np.float16) for x in (q, k, v)]
        attention_backward_lowp(dout.astype(np.float32), *half)
    with pytest.raises(ValueError, match="^floor:"):
        backward_error_bounds(dout, q, k, v, floor=-1.0)

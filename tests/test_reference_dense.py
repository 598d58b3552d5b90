"""Tests of pyattn.reference's dense attention against independent computations (CPU only):
``attention_ref``'s semantics (causal modes, windows, masks, softcap, ALiBi, GQA, layouts, LSE,
empty and fully masked rows), and the tolerance rule (``attention_lowp``, ``error_bound``).

The oracle for most properties is ``brute``: an explicit per-(batch, head, query) loop
that applies the ARCHITECTURE.md rules one key at a time, sharing no code with the
vectorised reference.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _reference_helpers import CAUSAL, FAST, WINDOW, close, problems, rule
from pyattn.reference import attention_lowp, attention_ref, error_bound


def alibi_bias(slopes, b, hq, sq, sk):
    """(B, Hq, Sq, Sk) additive ALiBi bias by loops: -slope * |i + Sk - Sq - j|."""
    slopes = np.broadcast_to(slopes, (b, hq))
    bias = np.zeros((b, hq, sq, sk))
    for bi, h, i, j in np.ndindex(b, hq, sq, sk):
        bias[bi, h, i, j] = -slopes[bi, h] * abs(i + sk - sq - j)
    return bias


def brute(q, k, v, allowed, bias=None, scale=None, softcap=None):
    """Loop attention on bshd float64 arrays; allowed/bias broadcast to (B, Hq, Sq, Sk)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    allowed = np.broadcast_to(allowed, (b, hq, sq, sk))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, sq, hq, v.shape[-1]))
    lse = np.full((b, hq, sq), -np.inf)
    for bi, h, i in np.ndindex(b, hq, sq):
        kh = h // (hq // hkv)
        scores = []
        for j in range(sk):
            if not allowed[bi, h, i, j]:
                continue
            s = scale * float(np.dot(q[bi, i, h], k[bi, j, kh]))
            if softcap is not None:
                s = softcap * math.tanh(s / softcap)
            if bias is not None:
                s += float(np.broadcast_to(bias, allowed.shape)[bi, h, i, j])
            if s != -math.inf:
                scores.append((s, j))
        if scores:
            m = max(s for s, _ in scores)
            w = [math.exp(s - m) for s, _ in scores]
            out[bi, i, h] = sum(wj * v[bi, j, kh] for wj, (_, j) in zip(w, scores)) / sum(w)
            lse[bi, h, i] = m + math.log(sum(w))
    return out, lse


# --------------------------------------------------------------------------- dense semantics


@FAST
@given(problems(), CAUSAL, WINDOW, st.sampled_from([None, 0.7, 3.0]), st.booleans(),
       st.sampled_from([None, "bool", "float"]), st.sampled_from([None, 0.3]))
def test_matches_bruteforce(prob, causal, window, softcap, alibi, mask_kind, scale):
    q, k, v, rng = prob
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    slopes = rng.uniform(0, 1, (hq,)) if alibi else None
    mask = None
    allowed = rule(sq, sk, causal, window)[None, None]
    bias = alibi_bias(slopes, b, hq, sq, sk) if alibi else np.zeros((1, 1, sq, sk))
    if mask_kind is not None:
        keep = rng.random((b, hq, sq, sk)) < 0.7
        keep[:, :, rng.integers(sq)] = False  # one fully masked row per head
        if mask_kind == "bool":
            mask, allowed = keep, allowed & keep
        else:
            mask = np.where(keep, rng.normal(size=keep.shape), -np.inf)
            bias = bias + mask
    out, lse = attention_ref(q, k, v, causal=causal, window=window, softcap=softcap,
                             alibi_slopes=slopes, mask=mask, scale=scale, return_lse=True)
    want_out, want_lse = brute(q, k, v, allowed, bias, scale, softcap)
    assert out.dtype == np.float64 and lse.shape == (b, hq, sq)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    close(out, want_out)
    close(lse, want_lse)


@FAST
@given(problems(), CAUSAL, WINDOW)
def test_probabilities_rows_sum_to_one(prob, causal, window):
    q, k, _, _ = prob
    b, sq, _, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    v = np.broadcast_to(np.eye(sk)[None, :, None, :], (b, sk, hkv, sk))  # output row = P row
    p = attention_ref(q, k, v, causal=causal, window=window).transpose(0, 2, 1, 3)
    allowed = rule(sq, sk, causal, window)  # (Sq, Sk); p is (B, Hq, Sq, Sk)
    assert (p >= 0).all()
    assert (p[:, :, ~allowed] == 0).all()
    sums = p.sum(-1)
    close(sums[:, :, allowed.any(1)], 1.0, 1e-12)
    assert (sums[:, :, ~allowed.any(1)] == 0).all()


@FAST
@given(problems(), CAUSAL)
def test_output_is_convex_combination_of_v(prob, causal):
    q, k, v, _ = prob
    group = q.shape[2] // k.shape[2]
    live = rule(q.shape[1], k.shape[1], causal).any(1)  # fully masked rows are 0 instead
    out = attention_ref(q, k, v, causal=causal)[:, live]
    vr = np.repeat(v, group, axis=2)  # (B, Sk, Hq, Dv)
    assert (out <= vr.max(1, keepdims=True) + 1e-12).all()
    assert (out >= vr.min(1, keepdims=True) - 1e-12).all()


@FAST
@given(problems(), st.sampled_from([True, "bottom_right", "top_left"]))
def test_causal_first_row_sees_only_key_zero(prob, causal):
    q, k, v, _ = prob
    n = min(q.shape[1], k.shape[1])
    q, k, v = q[:, :n], k[:, :n], v[:, :n]  # Sq == Sk
    out = attention_ref(q, k, v, causal=causal)
    group = q.shape[2] // k.shape[2]
    close(out[:, 0], np.repeat(v[:, 0], group, axis=1), 1e-12)


@FAST
@given(problems(), st.sampled_from(["bottom_right", "top_left"]))
def test_causal_alignment_against_sliced_keys(prob, mode):
    q, k, v, _ = prob
    sq, sk = q.shape[1], k.shape[1]
    out, lse = attention_ref(q, k, v, causal=mode, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    for i in range(sq):
        last = i + sk - sq if mode == "bottom_right" else min(i, sk - 1)
        if last < 0:  # bottom-right with Sq > Sk: the first Sq - Sk rows see nothing
            assert (out[:, i] == 0).all() and (lse[:, :, i] == -np.inf).all()
            continue
        o_i, l_i = attention_ref(q[:, i:i + 1], k[:, :last + 1], v[:, :last + 1],
                                 return_lse=True)
        close(out[:, i], o_i[:, 0])
        close(lse[:, :, i], l_i[:, :, 0])


def test_causal_modes_differ_when_lengths_differ():
    rng = np.random.default_rng(0)
    for sq, sk in ((3, 7), (7, 3)):
        q, k, v = (rng.standard_normal((1, s, 2, 8)) for s in (sq, sk, sk))
        a = attention_ref(q, k, v, causal="bottom_right")
        assert not np.allclose(a, attention_ref(q, k, v, causal="top_left"))
        close(a, attention_ref(q, k, v, causal=True), 0)


@FAST
@given(problems(), CAUSAL)
def test_gqa_equals_repeated_kv(prob, causal):
    q, k, v, _ = prob
    group = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    o1, l1 = attention_ref(q, k, v, causal=causal, return_lse=True)
    o2, l2 = attention_ref(q, kr, vr, causal=causal, return_lse=True)
    close(o1, o2, 1e-12)
    close(l1, l2, 1e-12)


@FAST
@given(problems())
def test_key_permutation_invariance(prob):
    q, k, v, rng = prob
    perm = rng.permutation(k.shape[1])
    o1, l1 = attention_ref(q, k, v, return_lse=True)
    o2, l2 = attention_ref(q, k[:, perm], v[:, perm], return_lse=True)
    close(o1, o2, 1e-12)
    close(l1, l2, 1e-12)


@FAST
@given(problems(), CAUSAL, WINDOW)
def test_bhsd_equals_bshd_transposed(prob, causal, window):
    q, k, v, rng = prob
    mask = rng.random((q.shape[0], 1, q.shape[1], k.shape[1])) < 0.8
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    o1, l1 = attention_ref(q, k, v, causal=causal, window=window, mask=mask, return_lse=True)
    o2, l2 = attention_ref(t(q), t(k), t(v), causal=causal, window=window, mask=mask,
                           layout="bhsd", return_lse=True)
    close(t(o1), o2, 0)
    close(l1, l2, 0)


@FAST
@given(problems(), st.tuples(st.integers(-1, 6), st.integers(-1, 6)))
def test_window_equals_explicit_mask(prob, window):
    q, k, v, _ = prob
    sq, sk = q.shape[1], k.shape[1]
    close(attention_ref(q, k, v, window=window), attention_ref(q, k, v, mask=rule(sq, sk,
                                                                                  window=window)))
    close(attention_ref(q, k, v, window=(-1, 0)), attention_ref(q, k, v, causal=True), 0)
    close(attention_ref(q, k, v, window=(-1, -1)), attention_ref(q, k, v), 0)


@FAST
@given(problems())
def test_fully_masked_rows_and_additive_inf_mask(prob):
    q, k, v, rng = prob
    b, sq, hq, _ = q.shape
    keep = rng.random((b, hq, sq, k.shape[1])) < 0.6
    keep[..., rng.integers(sq), :] = False
    dead = ~keep.any(-1)  # (B, Hq, Sq)
    o1, l1 = attention_ref(q, k, v, mask=keep, return_lse=True)
    o2, l2 = attention_ref(q, k, v, mask=np.where(keep, 0.0, -np.inf), return_lse=True)
    assert (o1.transpose(0, 2, 1, 3)[dead] == 0).all() and (l1[dead] == -np.inf).all()
    assert np.isfinite(l1[~dead]).all() and not np.isnan(o1).any()
    close(o1, o2, 0)
    close(l1, l2, 0)


@FAST
@given(problems(), st.sampled_from([0.1, 0.5, 2.0]))
def test_softcap(prob, cap):
    q, k, v, _ = prob
    close(attention_ref(q, k, v, softcap=1e9), attention_ref(q, k, v), 1e-9)
    # scores in (-cap, cap)  =>  log(Sk) - cap < lse < log(Sk) + cap, even for huge q
    _, lse = attention_ref(10 * q, k, v, softcap=cap, return_lse=True)
    n = k.shape[1]
    assert (lse < math.log(n) + cap + 1e-12).all() and (lse > math.log(n) - cap - 1e-12).all()


@FAST
@given(problems(), st.booleans())
def test_alibi(prob, per_batch):
    q, k, v, rng = prob
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    zero = np.zeros((b, hq) if per_batch else (hq,))
    close(attention_ref(q, k, v, alibi_slopes=zero), attention_ref(q, k, v), 0)
    slopes = rng.uniform(0, 1, zero.shape)
    bias = alibi_bias(slopes, b, hq, sq, sk)
    close(attention_ref(q, k, v, alibi_slopes=slopes), attention_ref(q, k, v, mask=bias))
    # causal form: slope * (j - i - Sk + Sq) on the allowed keys
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    causal_bias = np.broadcast_to(slopes, (b, hq))[:, :, None, None] * (j - i - sk + sq)
    close(attention_ref(q, k, v, alibi_slopes=slopes, causal=True),
          attention_ref(q, k, v, mask=causal_bias, causal=True))


def test_lse_tiny_bruteforce():
    q = np.array([[[[1.0, 0.0]], [[0.5, -1.0]]]])  # (1, 2, 1, 2)
    k = np.array([[[[1.0, 2.0]], [[0.0, 1.0]], [[-1.0, 0.5]]]])  # (1, 3, 1, 2)
    v = np.arange(6.0).reshape(1, 3, 1, 2)
    for causal in (False, True):
        out, lse = attention_ref(q, k, v, causal=causal, scale=0.5, return_lse=True)
        for i in range(2):
            js = range(3) if not causal else range(i + 2)  # bottom-right: j <= i + 1
            s = [0.5 * sum(q[0, i, 0, d] * k[0, j, 0, d] for d in range(2)) for j in js]
            total = sum(math.exp(x) for x in s)
            assert lse[0, 0, i] == pytest.approx(math.log(total), rel=1e-14)
            want = [sum(math.exp(x) * v[0, j, 0, d] for x, j in zip(s, js)) / total
                    for d in range(2)]
            assert out[0, i, 0] == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_low_precision_inputs_are_upcast(dtype):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 5, 2, 8)).astype(dtype) for _ in range(3))
    out = attention_ref(q, k, v)
    assert out.dtype == np.float64
    close(out, attention_ref(*(x.astype(np.float64) for x in (q, k, v))), 0)


def test_empty_key_set_gives_zero_and_neg_inf():
    q = np.ones((1, 3, 2, 8))
    out, lse = attention_ref(q, np.ones((1, 0, 2, 8)), np.ones((1, 0, 2, 4)), return_lse=True)
    assert out.shape == (1, 3, 2, 4) and (out == 0).all() and (lse == -np.inf).all()


# --------------------------------------------------------------------------- tolerance rule


@FAST
@given(problems(), st.sampled_from([np.float16, ml_dtypes.bfloat16]), CAUSAL)
def test_lowp_differs_slightly_for_16_bit(prob, dtype, causal):
    q, k, v = (x.astype(dtype) for x in prob[:3])
    ref = attention_ref(q, k, v, causal=causal)
    diff = np.abs(attention_lowp(q, k, v, causal=causal) - ref).max()
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert 0 <= diff < 8 * eps
    if rule(q.shape[1], k.shape[1], causal).sum(1).max() >= 2:  # one key only: P = 1, exact
        assert diff > 0  # a float64 mix of >= 2 random rows is never exactly representable
    bound = error_bound(q, k, v, causal=causal)
    assert bound >= 2 * diff and bound > 0


def test_lowp_float64_equals_reference_and_fp32_is_tight():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 17, 4, 16)), *rng.standard_normal((2, 1, 33, 2, 16))
    opts = dict(causal=True, softcap=2.0, alibi_slopes=np.full(4, 0.1), window=(8, -1))
    o1, l1 = attention_lowp(q, k, v, return_lse=True, **opts)
    o2, l2 = attention_ref(q, k, v, return_lse=True, **opts)
    close(o1, o2, 1e-12)
    close(l1, l2, 1e-12)
    assert error_bound(q, k, v, **opts) < 1e-11
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    assert 0 < np.abs(attention_lowp(*f32, **opts) - o2).max() < 1e-5
    assert 1e-5 <= error_bound(*f32, **opts) < 2e-5


def test_lowp_fully_masked_rows_do_not_nan():
    q, k, v = (np.ones((1, s, 1, 8), dtype=np.float16) for s in (5, 2, 2))
    out, lse = attention_lowp(q, k, v, causal=True, return_lse=True)  # rows 0..2 see nothing
    assert (out[0, :3] == 0).all() and (lse[0, 0, :3] == -np.inf).all()
    assert np.isfinite(out).all()

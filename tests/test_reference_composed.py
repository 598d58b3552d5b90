"""Tests of pyattn.reference's composed references (CPU only): ``attention_varlen_ref`` equals
dense attention per sequence, and ``merge_states_ref`` of attention over disjoint key sets (dead
parts included) equals attention over all keys, in every layout's LSE convention.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _reference_helpers import CAUSAL, FAST, WINDOW, close, problems, rule
from pyattn.reference import attention_ref, attention_varlen_ref, merge_states_ref


# --------------------------------------------------------------------------- varlen and merge


@FAST
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 5, 17]), st.sampled_from([0, 1, 5, 17])),
                min_size=1, max_size=3),
       st.integers(1, 2), st.integers(1, 3), CAUSAL, WINDOW, st.booleans(),
       st.integers(0, 2**32 - 1))
def test_varlen_equals_per_sequence_dense(lens, hkv, group, causal, window, alibi, seed):
    rng = np.random.default_rng(seed)
    hq, d = hkv * group, 8
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d))
    k, v = rng.standard_normal((2, cu_k[-1], hkv, d))
    slopes = rng.uniform(0, 1, (len(lens), hq)) if alibi else None
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                    alibi_slopes=slopes, return_lse=True)
    assert out.shape == (cu_q[-1], hq, d) and lse.shape == (hq, cu_q[-1])
    for n in range(len(lens)):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        o, l = attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=causal,
                             window=window, return_lse=True,
                             alibi_slopes=None if slopes is None else slopes[n])
        close(out[qs], o[0], 0)
        close(lse[:, qs], l[0], 0)


@FAST
@given(problems(), st.integers(1, 3), st.booleans())
def test_merge_states_of_split_keys_equals_whole(prob, parts, bshd):
    q, k, v, rng = prob
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    # lower-triangular-ish mask: later key chunks leave early query rows fully masked
    mask = rule(sq, sk, causal="top_left")[None, None] | (rng.random((b, hq, sq, sk)) < 0.2)
    owner = rng.integers(parts, size=sk)  # disjoint key sets, some possibly empty
    layout = "bshd" if bshd else "bhsd"
    t = (lambda x: x.transpose(0, 2, 1, 3)) if not bshd else (lambda x: x)
    whole_o, whole_l = attention_ref(t(q), t(k), t(v), mask=mask, layout=layout,
                                     return_lse=True)
    outs, lses = [], []
    for p in range(parts + 1):  # the extra part is fully masked: lse -inf everywhere
        idx = np.flatnonzero(owner == p) if p < parts else np.arange(sk)
        m = mask[..., idx] if p < parts else np.zeros((1, 1, sq, idx.size), dtype=bool)
        o, l = attention_ref(t(q), t(k[:, idx]), t(v[:, idx]), mask=m, layout=layout,
                             return_lse=True)
        outs.append(o)
        lses.append(l)  # (B, H, S) in both layouts: merged as attention returns it
    assert (lses[-1] == -np.inf).all()
    outs[-1] = np.full_like(outs[-1], np.nan)  # a dead part's garbage must not leak
    o, l = merge_states_ref(outs, lses, layout)
    close(o, whole_o)
    close(l, whole_l)


def test_merge_states_all_dead_and_shapes():
    o, l = merge_states_ref([np.ones((3, 2, 4))] * 2, [np.full((2, 3), -np.inf)] * 2, "thd")  # lse (H, T)
    assert (o == 0).all() and (l == -np.inf).all() and l.shape == (2, 3)
    with pytest.raises(ValueError, match=r"lses\[1\]: expected shape \(2, 3\)"):
        merge_states_ref([np.ones((3, 2, 4))] * 2, [np.zeros((2, 3)), np.zeros((3, 2))], "thd")
    with pytest.raises(ValueError, match=r"lses\[0\]: expected shape \(1, 3, 2\)"):  # bshd: (B, H, S)
        merge_states_ref([np.ones((1, 2, 3, 4))] * 2, [np.zeros((1, 2, 3))] * 2, "bshd")
    with pytest.raises(ValueError, match="outputs"):
        merge_states_ref([], [])
    with pytest.raises(ValueError, match="^layout"):
        merge_states_ref([np.ones((3, 2, 4))], [np.zeros((2, 3))], "tdh")


def test_merge_states_layouts_agree():
    """One set of states, written in each layout with its own LSE shape, merges to the same numbers."""
    rng = np.random.default_rng(7)
    o = rng.standard_normal((3, 2, 5, 4, 8))  # (n, B, S, H, D)
    lse = rng.standard_normal((3, 2, 4, 5))  # (n, B, H, S)
    a, la = merge_states_ref(list(o), list(lse), "bshd")
    b, lb = merge_states_ref(list(o.transpose(0, 1, 3, 2, 4)), list(lse), "bhsd")
    np.testing.assert_allclose(a, b.transpose(0, 2, 1, 3), rtol=1e-12, atol=0)
    np.testing.assert_allclose(la, lb, rtol=1e-12, atol=0)
    c, lc = merge_states_ref(list(o[:, 0].reshape(3, 5, 4, 8)), list(lse[:, 0]), "thd")  # T = S, lse (H, T)
    np.testing.assert_allclose(c, a[0], rtol=1e-12, atol=0)
    np.testing.assert_allclose(lc, la[0], rtol=1e-12, atol=0)

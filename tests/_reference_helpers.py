"""Shared by the pyattn.reference test modules (test_reference_dense.py, test_reference_composed.py):
the hypothesis settings and strategies (random bshd float64 problems, causal modes, windows), the
allowed-keys rule written straight from the spec, one element at a time, and ``close``.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEQ = st.sampled_from([1, 2, 5, 17, 33])
CAUSAL = st.sampled_from([False, True, "bottom_right", "top_left"])
WINDOW = st.one_of(st.none(), st.tuples(st.integers(-1, 6), st.integers(-1, 6)))


@st.composite
def problems(draw, sq=SEQ, sk=SEQ):
    """Random bshd float64 (q, k, v, rng); GQA ratio 1..3, Dv may differ from D."""
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sq, sk, d = draw(sq), draw(sk), draw(st.sampled_from([8, 16, 24]))
    dv = draw(st.sampled_from([d, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((b, sq, hkv * group, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, dv))
    return q, k, v, rng


def rule(sq, sk, causal=False, window=None):
    """(Sq, Sk) allowed matrix written straight from the spec, one element at a time."""
    ok = np.ones((sq, sk), dtype=bool)
    for i in range(sq):
        off = i + sk - sq
        for j in range(sk):
            if causal in (True, "bottom_right") and j > off:
                ok[i, j] = False
            if causal == "top_left" and j > i:
                ok[i, j] = False
            if window is not None:
                left, right = window
                if (left != -1 and j < off - left) or (right != -1 and j > off + right):
                    ok[i, j] = False
    return ok


def close(a, b, tol=1e-10):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)

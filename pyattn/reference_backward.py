"""Float64 reference gradients of attention, and the same-precision yardstick of the 2x rule.

Re-exported by :mod:`pyattn.reference` (import them from there). The gradients are those of
``attention_ref`` with respect to q, k and v for an upstream gradient ``dout``, written out as
the backward pass computes them: ``P`` recomputed from q and k, ``dV = P^T dO``, ``dP = dO V^T``,
``dS = P * (dP - rowsum(P * dP))`` (times ``1 - tanh^2`` under a soft-cap), ``dQ = scale dS K``,
``dK = scale dS^T Q``. With GQA/MQA, dk and dv sum over the query heads of each group. A fully
masked query row has ``P = 0``, so its dq row is 0 and it adds nothing to dk, dv; never NaN.
"""

from __future__ import annotations

import numpy as np

from .reference_composed import attention_varlen_ref
from .reference_dense import (_DEFAULT_FLOOR, _allowed, _as_float_array, _bias, _check_real, _grouped, _prepare, _pv,
                              _qk, _safe_softmax)

__all__ = ["attention_backward_ref", "attention_backward_lowp", "attention_varlen_backward_ref",
           "backward_error_bounds"]


def _to_bhsd(x, layout: str, name: str) -> np.ndarray:
    a = _as_float_array(x, name)
    if a.ndim != 4:
        raise ValueError(f"{name}: expected 4 dims ({layout.upper()}), got shape {a.shape}")
    return a.transpose(0, 2, 1, 3) if layout == "bshd" else a


def _kv_sum(x: np.ndarray, hkv: int) -> np.ndarray:
    """(B, Hq, S, D) -> (B, Hkv, S, D): the sum over each group's query heads."""
    return _grouped(x, hkv).sum(axis=2)


def _out(x: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3) if layout == "bshd" else x, dtype=np.float64)


def _grads(dout, q, k, v, options: dict, c, rnd):
    """The backward in compute dtype ``c`` with ``rnd`` applied where a framework stores a tensor
    (the identity for the float64 reference). Returns (dq, dk, dv) in the caller's layout."""
    p = _prepare(q, k, v, **options)
    do = _to_bhsd(dout, p.layout, "dout")
    if do.shape != p.q.shape[:3] + (p.v.shape[3],):
        want = p.q.shape[:3] + (p.v.shape[3],)
        raise ValueError(f"dout: expected the output's shape {want} (in (B, H, S, D) order), got {do.shape}")
    qc, kc, vc, doc = (x.astype(c) for x in (p.q, p.k, p.v, do))
    hkv = kc.shape[1]
    s = rnd(_qk(qc, kc) * c.type(p.scale))
    t = None
    if p.softcap is not None:
        cap = c.type(p.softcap)
        t = np.tanh(s / cap)
        s = rnd(cap * t)
    bias = _bias(p, s.shape, c)
    if bias is not None:
        s = rnd(s + bias)
    s = np.where(_allowed(s.shape, p.causal, p.window, p.mask_bool), s, c.type(-np.inf))
    pr, _ = _safe_softmax(s)
    pr = rnd(pr)
    dv = rnd(_kv_sum(np.swapaxes(pr, -1, -2) @ doc, hkv))
    dp = rnd(_qk(doc, vc))  # dO V^T, each query head against its group's value head
    # rowsum(P * dP) = rowsum(dO * O): the kernels take it from the forward's output
    ds = rnd(pr * (dp - np.sum(pr * dp, axis=-1, keepdims=True)))
    if t is not None:  # d(cap * tanh(x / cap)) / dx; t is finite (taken before masking), P = 0 where masked
        ds = rnd(ds * (1 - t * t))
    dq = rnd(_pv(ds, kc) * c.type(p.scale))
    dk = rnd(_kv_sum(np.swapaxes(ds, -1, -2) @ qc, hkv) * c.type(p.scale))
    return _out(dq, p.layout), _out(dk, p.layout), _out(dv, p.layout)


def attention_backward_ref(dout, q, k, v, **options):
    """Float64 gradients of ``sum(dout * attention_ref(q, k, v, **options))`` with respect to q, k, v.

    Parameters
    ----------
    dout : array_like, the output's shape
        Upstream gradient, in ``layout`` (default ``"bshd"``).
    q, k, v : array_like
        As in :func:`pyattn.reference.attention_ref`.
    **options
        Any keyword option of :func:`pyattn.reference.attention_ref` except ``return_lse``:
        ``causal``, ``mask``, ``window``, ``softcap``, ``alibi_slopes``, ``scale``, ``layout``.

    Returns
    -------
    dq, dk, dv : ndarray of float64
        The shapes of q, k and v. With GQA/MQA, dk and dv are summed over the query heads that
        share each key/value head. Fully masked query rows give dq rows of 0.
    """
    if "return_lse" in options:
        raise TypeError("return_lse: not an option of the backward reference")
    f64 = np.dtype(np.float64)
    return _grads(dout, q, k, v, options, f64, lambda x: x)


def attention_backward_lowp(dout, q, k, v, **options):
    """Naive same-precision gradients, the yardstick of the backward's tolerance rule.

    With ``T = q.dtype`` and ``C`` = float32 (float64 when T is float64), as
    :func:`pyattn.reference.attention_lowp` does for the forward: every tensor a framework stores
    (scores, probabilities, dP, dS, the gradients) is rounded to T, matrix products and the
    softmax are computed in C. This is what autograd through a plain T implementation gives.

    Returns
    -------
    dq, dk, dv : ndarray of float64
        The T-rounded gradients, shapes of q, k and v.
    """
    dts = [_as_float_array(x, n).dtype for n, x in (("q", q), ("k", k), ("v", v), ("dout", dout))]
    t = dts[0]
    if any(d != t for d in dts):
        raise TypeError(f"k, v, dout: attention_backward_lowp needs q, k, v, dout of one dtype, got "
                        f"{', '.join(map(str, dts))}")
    c = np.dtype(np.float64) if t == np.float64 else np.dtype(np.float32)
    return _grads(dout, q, k, v, options, c, lambda x: x.astype(t).astype(c))


def backward_error_bounds(dout, q, k, v, *, floor=None, **options) -> tuple:
    """Tolerances for a kernel's (dq, dk, dv): ``2 * max|lowp - ref| + floor``, one per gradient.

    The backward form of :func:`pyattn.reference.error_bound` (FlashAttention's rule: a kernel's
    max abs error against the float64 reference is at most twice that of a naive same-precision
    implementation, plus a floor). The floor is relative to each gradient's scale: the default
    dtype floor (about one ulp at 1) times ``max(1, max|ref|)``, since gradients are not
    normalised the way softmax outputs are.

    Returns
    -------
    tuple of 3 float
        Bounds on ``max|kernel - ref|`` for dq, dk, dv.
    """
    if floor is None:
        floor = _DEFAULT_FLOOR[_as_float_array(q, "q").dtype]
    floor = _check_real(floor, "floor")
    if floor < 0:
        raise ValueError(f"floor: must be >= 0, got {floor}")
    refs = attention_backward_ref(dout, q, k, v, **options)
    lows = attention_backward_lowp(dout, q, k, v, **options)
    return tuple(float(2.0 * np.max(np.abs(lo - r), initial=0.0) + floor * max(1.0, np.max(np.abs(r), initial=0.0)))
                 for lo, r in zip(lows, refs))


def attention_varlen_backward_ref(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Reference gradients of :func:`pyattn.reference.attention_varlen_ref`: each sequence alone.

    Parameters
    ----------
    dout, q : array_like, shape (total_q, Hq, D)
    k, v : array_like, shape (total_k, Hkv, D)
    cu_seqlens_q, cu_seqlens_k : ndarray of int32, shape (N + 1,)
    **options
        ``causal``, ``window``, ``softcap``, ``alibi_slopes`` ((Hq,) or (N, Hq)), ``scale``.

    Returns
    -------
    dq, dk, dv : ndarray of float64, the shapes of q, k, v
    """
    attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)  # the same argument checks
    do = _as_float_array(dout, "dout")
    if do.shape != q.shape[:2] + (v.shape[2],):
        raise ValueError(f"dout: expected shape {q.shape[:2] + (v.shape[2],)}, got {do.shape}")
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    slopes = options.pop("alibi_slopes", None)
    slopes = None if slopes is None else np.asarray(slopes, dtype=np.float64)
    dq, dk, dv = (np.zeros(x.shape, np.float64) for x in (q, k, v))
    for n in range(cu_q.size - 1):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        sl = None if slopes is None else slopes[n] if slopes.ndim == 2 else slopes
        g = attention_backward_ref(do[None, qs], q[None, qs], k[None, ks], v[None, ks], alibi_slopes=sl, **options)
        dq[qs], dk[ks], dv[ks] = (x[0] for x in g)
    return dq, dk, dv

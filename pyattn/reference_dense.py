"""Float64 NumPy reference of attention (``attention_ref``), its naive same-precision twin and the
2x tolerance rule built on them: the semantics kernels must match. Re-exported by
:mod:`pyattn.reference` with every other op's reference (import them from there).

Clarity over speed: the full (B, Hq, Sq, Sk) score tensor is materialised in float64.
Inputs may be float16, bfloat16 (ml_dtypes), float32 or float64; all results are float64.
Scores are built in this order: ``s = scale * q.k``; soft-cap ``cap * tanh(s / cap)``;
``+ alibi``; ``+ float mask``; keys not allowed (causal, window, bool mask) -> ``-inf``.
A query row with no finite score yields output 0 and LSE ``-inf``, never NaN.
"""

from __future__ import annotations

from numbers import Real
from typing import NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["attention_ref", "attention_lowp", "error_bound"]

_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64,
                                               ml_dtypes.bfloat16))
_LAYOUTS = ("bshd", "bhsd")
_CAUSAL_MODES = ("bottom_right", "top_left")
# Default error_bound floors, about one output ulp near |o| ~ 1 for the 16-bit
# types (the kernel's final rounding to T alone costs up to half an ulp, and on
# a tiny problem the naive error can happen to be 0).  For fp32 the floor of
# ~80 ulps covers summation-order and exp2-vs-exp differences that a naive
# implementation may not exhibit.  fp64 only needs to absorb rounding noise.
_DEFAULT_FLOOR = {
    np.dtype(np.float16): 1e-3,  # eps(fp16) = 2**-10 ~ 9.8e-4
    np.dtype(ml_dtypes.bfloat16): 8e-3,  # eps(bf16) = 2**-7 ~ 7.8e-3
    np.dtype(np.float32): 1e-5,  # eps(fp32) = 2**-23 ~ 1.2e-7
    np.dtype(np.float64): 1e-12,
}


class _Problem(NamedTuple):
    """Validated dense problem; q, k, v are (B, H, S, D) views in their own dtype."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    layout: str
    causal: str | None  # None, "bottom_right" or "top_left"
    window: tuple[int, int] | None
    mask_bool: np.ndarray | None
    mask_add: np.ndarray | None  # float64
    softcap: float | None
    alibi: np.ndarray | None  # float64, (Hq,) or (B, Hq)
    scale: float


# --------------------------------------------------------------------------- validation


def _as_float_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float16, bfloat16, float32 or float64, "
                        f"got {arr.dtype}")
    return arr


def _check_causal(causal) -> str | None:
    if isinstance(causal, (bool, np.bool_)):
        return "bottom_right" if causal else None
    if isinstance(causal, str):
        if causal in _CAUSAL_MODES:
            return causal
        raise ValueError(f"causal: expected False, True, 'bottom_right' or 'top_left', "
                         f"got {causal!r}")
    raise TypeError(f"causal: expected a bool or a str, got {type(causal).__name__}")


def _check_window(window) -> tuple[int, int] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected a (left, right) pair or None, got {window!r}")
    for side, w in zip(("left", "right"), window):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window: {side} must be an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"window: {side} must be >= 0 or -1 (unbounded), got {w}")
    return int(window[0]), int(window[1])


def _check_real(x, name: str) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, Real):
        raise TypeError(f"{name}: expected a real number or None, got {type(x).__name__}")
    x = float(x)
    if not np.isfinite(x):
        raise ValueError(f"{name}: must be finite, got {x}")
    return x


def _check_mask(mask, shape):
    """Split ``mask`` into (bool mask, float64 additive mask); at most one is not None."""
    if mask is None:
        return None, None
    mask = np.asarray(mask)
    if mask.ndim > 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], shape[::-1])):
        raise ValueError(f"mask: expected a shape broadcastable to (B, Hq, Sq, Sk) = {shape}, "
                         f"got {mask.shape}")
    if mask.dtype == np.bool_:
        return mask, None
    if mask.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"mask: expected a bool or float dtype, got {mask.dtype}")
    mask = mask.astype(np.float64, copy=False)
    # +inf or NaN would turn whole rows into NaN; -inf is the additive "masked" value.
    if np.isnan(mask).any() or np.isposinf(mask).any():
        raise ValueError("mask: a float mask may hold finite values or -inf, not NaN or +inf")
    return None, mask


def _check_alibi(alibi_slopes, batch: int, hq: int) -> np.ndarray | None:
    if alibi_slopes is None:
        return None
    slopes = _as_float_array(alibi_slopes, "alibi_slopes").astype(np.float64, copy=False)
    if slopes.shape not in ((hq,), (batch, hq)):
        raise ValueError(f"alibi_slopes: expected shape (Hq,) = ({hq},) or (B, Hq) = "
                         f"({batch}, {hq}), got {slopes.shape}")
    if not np.isfinite(slopes).all():
        raise ValueError("alibi_slopes: must be finite")
    return slopes


def _prepare(q, k, v, *, causal=False, mask=None, window=None, softcap=None,
             alibi_slopes=None, scale=None, layout="bshd") -> _Problem:
    """Validate the arguments of a dense op and bring q, k, v to (B, H, S, D) views."""
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'bshd' or 'bhsd', got {layout!r}")
    arrs = {n: _as_float_array(x, n) for n, x in (("q", q), ("k", k), ("v", v))}
    for name, a in arrs.items():
        if a.ndim != 4:
            raise ValueError(f"{name}: expected 4 dims ({layout.upper()}), got shape {a.shape}")
        if min(a.shape[-1], a.shape[1 if layout == "bhsd" else 2]) < 1:
            raise ValueError(f"{name}: heads and head_dim must be >= 1, got shape {a.shape}")
    if layout == "bshd":  # views only: no copy yet
        arrs = {n: a.transpose(0, 2, 1, 3) for n, a in arrs.items()}
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    (b, hq, sq, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if bk != b:
        raise ValueError(f"k: batch size {bk} does not match q's {b}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} does not match q's {d}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: (batch, heads, seq) {v.shape[:3]} must match k's {k.shape[:3]} "
                         f"(in (B, H, S) order)")
    if hq % hkv:
        raise ValueError(f"k: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    mask_bool, mask_add = _check_mask(mask, (b, hq, sq, sk))
    if softcap is not None:
        softcap = _check_real(softcap, "softcap")
        if softcap <= 0:
            raise ValueError(f"softcap: must be > 0 (use None to disable), got {softcap}")
    scale = 1.0 / np.sqrt(d) if scale is None else _check_real(scale, "scale")
    return _Problem(q, k, v, layout, _check_causal(causal), _check_window(window), mask_bool,
                    mask_add, softcap, _check_alibi(alibi_slopes, b, hq), scale)


# --------------------------------------------------------------------------- shared math


def _allowed(shape, causal, window, mask_bool) -> np.ndarray:
    """Bool (B, Hq, Sq, Sk) "query i may attend key j"; a read-only broadcast view (no copy)."""
    _, _, sq, sk = shape
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq  # bottom-right aligned diagonal (FlashAttention 2.1+)
    ok = np.ones((sq, sk), dtype=bool)
    if causal == "bottom_right":
        ok &= j <= diag
    elif causal == "top_left":
        ok &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
    if mask_bool is not None:
        ok = ok & mask_bool
    return np.broadcast_to(ok, shape)


def _bias(p: _Problem, shape, dtype) -> np.ndarray | None:
    """ALiBi plus additive mask, broadcastable to (B, Hq, Sq, Sk), or None."""
    bias = None
    if p.alibi is not None:
        _, _, sq, sk = shape
        dist = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
        slopes = p.alibi.reshape(-1, shape[1], 1, 1)  # (1 or B, Hq, 1, 1)
        bias = (-slopes * dist).astype(dtype, copy=False)
    if p.mask_add is not None:
        add = p.mask_add.astype(dtype, copy=False)
        bias = add if bias is None else bias + add
    return bias


def _grouped(x: np.ndarray, hkv: int) -> np.ndarray:
    """(B, Hq, ...) -> (B, Hkv, G, ...): query head h = kv head h // G, member h % G."""
    return x.reshape(x.shape[0], hkv, x.shape[1] // hkv, *x.shape[2:])


def _qk(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q (B, Hq, Sq, D) @ k (B, Hkv, Sk, D)^T -> (B, Hq, Sq, Sk) without repeating KV heads."""
    s = _grouped(q, k.shape[1]) @ k[:, :, None].swapaxes(-1, -2)
    return s.reshape(q.shape[:3] + (k.shape[2],))


def _pv(pr: np.ndarray, v: np.ndarray) -> np.ndarray:
    """pr (B, Hq, Sq, Sk) @ v (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv)."""
    o = _grouped(pr, v.shape[1]) @ v[:, :, None]
    return o.reshape(pr.shape[:3] + (v.shape[3],))


def _safe_softmax(s: np.ndarray):
    """(P, lse) of a row softmax in the dtype of ``s``; rows with no finite score -> 0, -inf."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # initial: Sk may be 0
    dead = m == -np.inf
    m = np.where(dead, 0.0, m).astype(s.dtype, copy=False)
    e = np.exp(s - m)  # exp(-inf) = 0 for masked keys, and for every key of a dead row
    den = np.sum(e, axis=-1, keepdims=True)
    den = np.where(dead, 1.0, den).astype(s.dtype, copy=False)  # >= 1 on live rows
    lse = np.where(dead, -np.inf, m + np.log(den)).astype(s.dtype, copy=False)
    return e / den, lse[..., 0]


def _finish(o: np.ndarray, lse: np.ndarray, layout: str, return_lse: bool):
    if layout == "bshd":
        o = o.transpose(0, 2, 1, 3)
    o = np.ascontiguousarray(o, dtype=np.float64)
    return (o, lse.astype(np.float64, copy=False)) if return_lse else o


# --------------------------------------------------------------------------- public ops


def attention_ref(q, k, v, *, causal=False, mask=None, window=None, softcap=None,
                  alibi_slopes=None, scale=None, layout="bshd", return_lse=False):
    """Float64 reference scaled-dot-product attention.

    Parameters
    ----------
    q : array_like, shape (B, Sq, Hq, D) for ``"bshd"`` or (B, Hq, Sq, D) for ``"bhsd"``
        Queries; float16, bfloat16, float32 or float64 (upcast to float64).
    k : array_like, shape (B, Sk, Hkv, D) or (B, Hkv, Sk, D)
        Keys. ``Hq % Hkv == 0`` (GQA/MQA): query head h uses kv head ``h // (Hq // Hkv)``.
    v : array_like, shape (B, Sk, Hkv, Dv) or (B, Hkv, Sk, Dv)
        Values; ``Dv`` may differ from ``D``.
    causal : {False, True, "bottom_right", "top_left"}, optional
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Sk - Sq``
        (FlashAttention 2.1+). ``"top_left"``: ``j <= i`` (torch SDPA ``is_causal``).
    mask : array_like of bool or float, broadcastable to (B, Hq, Sq, Sk), optional
        Axes are (B, Hq, Sq, Sk) in both layouts. bool: True = may attend. float: added
        to the scores after soft-cap; finite values or ``-inf`` only.
    window : tuple of int (left, right), optional
        Sliding window, -1 = unbounded: key j allowed iff
        ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``(-1, 0)`` equals causal.
        Combines with ``causal`` and ``mask`` by AND.
    softcap : float > 0, optional
        Replace the scaled score s by ``softcap * tanh(s / softcap)`` before ALiBi/mask.
    alibi_slopes : array_like, shape (Hq,) or (B, Hq), optional
        Adds ``-slope * |i + Sk - Sq - j|`` to the scores (FlashAttention's convention; the
        distance is bottom-right aligned whatever ``causal`` is). On the keys a bottom-right
        causal mask allows this equals ``slope * (j - i - Sk + Sq)``.
    scale : float, optional
        Score scale; default ``1 / sqrt(D)``.
    layout : {"bshd", "bhsd"}, optional
        Layout of q, k, v and of the output.
    return_lse : bool, optional
        Also return the log-sum-exp of the final scores.

    Returns
    -------
    out : ndarray of float64, layout of q with last dim Dv
        Rows with no allowed key (or only ``-inf`` scores) are 0.
    lse : ndarray of float64, shape (B, Hq, Sq)
        Natural-log ``log(sum_j exp(s_ij))``; ``-inf`` for fully masked rows. Only when
        ``return_lse`` is True.

    Raises
    ------
    ValueError, TypeError
        On a bad shape, dtype or option; the message names the argument.
    """
    p = _prepare(q, k, v, causal=causal, mask=mask, window=window, softcap=softcap,
                 alibi_slopes=alibi_slopes, scale=scale, layout=layout)
    s = _qk(p.q.astype(np.float64), p.k.astype(np.float64))
    s *= p.scale
    if p.softcap is not None:
        s = p.softcap * np.tanh(s / p.softcap)
    bias = _bias(p, s.shape, np.float64)
    if bias is not None:
        s += bias
    s = np.where(_allowed(s.shape, p.causal, p.window, p.mask_bool), s, -np.inf)
    pr, lse = _safe_softmax(s)
    return _finish(_pv(pr, p.v.astype(np.float64)), lse, p.layout, return_lse)


def attention_lowp(q, k, v, *, return_lse=False, **options):
    """Naive same-precision attention, the yardstick of the tolerance rule.

    With ``T = q.dtype`` (k and v must share it) and ``C`` = float32 (float64 when T is
    float64): ``S = q @ k^T`` accumulated in C, ``S * scale`` rounded to T; soft-cap and
    bias (ALiBi + float mask) each computed in C and rounded to T; softmax in C, ``P``
    rounded to T; ``O = P @ v`` accumulated in C and rounded to T. This mimics a plain
    framework implementation in T, as FlashAttention's tests do.

    Parameters
    ----------
    q, k, v : ndarray
        As in :func:`attention_ref`; all three of one dtype.
    return_lse : bool, optional
        Also return the log-sum-exp (computed in C), shape (B, Hq, Sq).
    **options
        Any keyword option of :func:`attention_ref`.

    Returns
    -------
    out : ndarray of float64
        The T-rounded output values, in the layout of q.
    lse : ndarray of float64, shape (B, Hq, Sq)
        Only when ``return_lse`` is True.
    """
    p = _prepare(q, k, v, **options)
    t = p.q.dtype
    if p.k.dtype != t or p.v.dtype != t:
        raise TypeError(f"k, v: attention_lowp needs q, k, v of one dtype, got {t}, "
                        f"{p.k.dtype}, {p.v.dtype}")
    c = np.dtype(np.float64) if t == np.float64 else np.dtype(np.float32)

    def rnd(x):  # store in T, keep computing in C
        return x.astype(t).astype(c)

    s = rnd(_qk(p.q.astype(c), p.k.astype(c)) * c.type(p.scale))
    if p.softcap is not None:
        cap = c.type(p.softcap)
        s = rnd(cap * np.tanh(s / cap))
    bias = _bias(p, s.shape, c)
    if bias is not None:
        s = rnd(s + bias)
    s = np.where(_allowed(s.shape, p.causal, p.window, p.mask_bool), s, c.type(-np.inf))
    pr, lse = _safe_softmax(s)
    return _finish(rnd(_pv(rnd(pr), p.v.astype(c))), lse, p.layout, return_lse)


def error_bound(q, k, v, *, floor=None, **options) -> float:
    """Tolerance for a kernel's output: ``2 * max|attention_lowp - attention_ref| + floor``.

    FlashAttention's rule: a kernel passes when its max abs error against the float64
    reference is at most twice that of a naive same-precision implementation, plus a floor.

    Parameters
    ----------
    q, k, v : ndarray
        The kernel's inputs (one dtype).
    floor : float, optional
        Absolute floor; default by dtype: 1e-3 float16, 8e-3 bfloat16, 1e-5 float32,
        1e-12 float64 (about one output ulp for 16-bit types).
    **options
        Keyword options of :func:`attention_ref` except ``return_lse``.

    Returns
    -------
    float
        The bound on ``max|kernel - attention_ref|``.
    """
    if "return_lse" in options:
        raise TypeError("return_lse: error_bound bounds the output only")
    if floor is None:
        floor = _DEFAULT_FLOOR[_as_float_array(q, "q").dtype]
    floor = _check_real(floor, "floor")
    if floor < 0:
        raise ValueError(f"floor: must be >= 0, got {floor}")
    diff = np.abs(attention_lowp(q, k, v, **options) - attention_ref(q, k, v, **options))
    return float(2.0 * np.max(diff, initial=0.0) + floor)

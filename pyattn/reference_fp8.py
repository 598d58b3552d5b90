"""float64 reference of attention on fp8 e4m3 inputs (``pyattn.attention`` on ``float8_e4m3fn`` q, k,
v with per-tensor descale factors), and its naive fp8 twin (the yardstick of the 2x tolerance rule).

The inputs' values are their codes times their descale factors (``value = code * descale``, as
FlashAttention-3 defines them); the reference is :func:`pyattn.reference.attention_ref` on those
values. What a naive fp8 implementation does differently, and every fp8 attention kernel with it:
the probabilities enter the P V product as e4m3 codes. Rounding *normalised* probabilities to e4m3
would be a poor yardstick: at 1/Sk they fall below e4m3's smallest normal (2**-6) and keep a step
of 2**-9, an error no kernel makes. So the twin rounds the row's exponentials referred to the row
max (``exp(s - max) <= 1``, the un-normalised P of a flash kernel), multiplies them with V in
float32 and divides by their float32 sum; scores, soft-cap and bias stay float32 (no kernel stores
them in 8 bits); the output is rounded to bfloat16, the kernels' output dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .reference_dense import _allowed, _bias, _finish, _prepare, _pv, _qk, attention_ref

__all__ = ["FP8_DTYPE", "quantize_fp8", "dequantize_fp8", "attention_fp8_ref", "attention_fp8_lowp",
           "fp8_error_bound"]

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
_E4M3_MAX = 448.0
_BF16 = np.dtype(ml_dtypes.bfloat16)


def quantize_fp8(x) -> tuple:
    """Per-tensor e4m3 codes of ``x`` and their descale factor: ``(codes, descale)`` with
    ``codes * descale`` approximating ``x`` (amax mapped to 448, round to nearest, saturating).

    Parameters
    ----------
    x : array_like of float
        Any real values, finite.

    Returns
    -------
    codes : ndarray of ``ml_dtypes.float8_e4m3fn``
    descale : float
        ``amax / 448`` (1.0 for an all-zero ``x``).
    """
    x = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("x: expected finite values")
    amax = float(np.abs(x).max(initial=0.0))
    descale = amax / _E4M3_MAX if amax > 0 else 1.0
    return np.clip(x / descale, -_E4M3_MAX, _E4M3_MAX).astype(FP8_DTYPE), descale


def dequantize_fp8(codes, descale: float) -> np.ndarray:
    """``codes * descale`` in float64 (e4m3 codes are exact in float64)."""
    codes = np.asarray(codes)
    if codes.dtype != FP8_DTYPE:
        raise TypeError(f"codes: expected dtype float8_e4m3fn, got {codes.dtype}")
    return codes.astype(np.float64) * float(descale)


def _values(q, k, v, descale, dtype):
    if len(descale) != 3:
        raise ValueError(f"descale: expected (descale_q, descale_k, descale_v), got {descale!r}")
    return tuple(dequantize_fp8(x, d).astype(dtype) for x, d in zip((q, k, v), descale))


def attention_fp8_ref(q, k, v, *, descale=(1.0, 1.0, 1.0), **options):
    """Float64 attention of fp8 inputs: :func:`~pyattn.reference.attention_ref` on their values.

    Parameters
    ----------
    q, k, v : ndarray of ``ml_dtypes.float8_e4m3fn``
        Codes, shaped as ``attention_ref`` takes them.
    descale : (float, float, float)
        The factors of q, k, v (``pyattn.attention``'s ``descale_q``, ``descale_k``, ``descale_v``).
    **options
        Any keyword option of ``attention_ref`` (``return_lse`` included).
    """
    return attention_ref(*_values(q, k, v, descale, np.float64), **options)


def attention_fp8_lowp(q, k, v, *, descale=(1.0, 1.0, 1.0), return_lse=False, **options):
    """Naive fp8 attention (see the module text): float32 scores, e4m3 probabilities referred to the
    row max, float32 P V and row sums, a bfloat16 output. Arguments as :func:`attention_fp8_ref`."""
    p = _prepare(*_values(q, k, v, descale, np.float32), **options)
    c = np.float32
    s = _qk(p.q, p.k) * c(p.scale)
    if p.softcap is not None:
        s = c(p.softcap) * np.tanh(s / c(p.softcap))
    bias = _bias(p, s.shape, np.dtype(c))
    if bias is not None:
        s = s + bias
    s = np.where(_allowed(s.shape, p.causal, p.window, p.mask_bool), s, c(-np.inf)).astype(c)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    dead = m == -np.inf
    m = np.where(dead, c(0), m).astype(c)
    e = np.exp(s - m).astype(c)
    den = np.where(dead, c(1), np.sum(e, axis=-1, keepdims=True)).astype(c)
    lse = np.where(dead, -np.inf, m + np.log(den))[..., 0]
    o = _pv(e.astype(FP8_DTYPE).astype(c), p.v) / den
    return _finish(o.astype(_BF16).astype(np.float64), lse, p.layout, return_lse)


def fp8_error_bound(q, k, v, *, descale=(1.0, 1.0, 1.0), floor: float = 8e-3, **options) -> float:
    """``2 * max|attention_fp8_lowp - attention_fp8_ref| + floor``: the 2x rule for fp8 inputs.

    ``floor`` defaults to about one bfloat16 ulp near 1 (the output's own rounding). Other
    arguments as :func:`attention_fp8_ref` (no ``return_lse``).
    """
    if "return_lse" in options:
        raise TypeError("return_lse: fp8_error_bound bounds the output only")
    diff = np.abs(attention_fp8_lowp(q, k, v, descale=descale, **options)
                  - attention_fp8_ref(q, k, v, descale=descale, **options))
    return float(2.0 * np.max(diff, initial=0.0) + floor)

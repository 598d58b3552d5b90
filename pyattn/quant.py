"""8-bit KV-cache quantization: the NumPy reference of what ``kv_append`` stores.

A quantized :class:`~pyattn.PagedKVCache` keeps 8-bit codes plus one float32 scale per token and
KV head ("row": the ``head_dim`` values of one token's key, or value, for one KV head).

Why per token and KV head: quantizing on append never revisits earlier tokens (a per-page or
per-channel scale would have to grow, and requantize, as tokens arrive), an outlier token only
costs its own precision, and the scales cost 4 / head_dim of the codes (3% at head_dim 128).

The rules, per row ``x`` converted to float32 (exact from float16 / bfloat16), every step one
correctly rounded float32 operation in this order (the kernel does the same, bit for bit)::

    amax  = max |x|
    inv   = min(M / amax, FLT_MAX)       M = 127 (int8) or 448 (fp8 e4m3)
    code  = encode(x * inv)
    scale = amax / M
    value = code * scale                 (dequantized, float32)

- ``"int8"``: ``encode(y) = clip(rint(y), -127, 127)``, round half to even (CUDA
  ``__float2int_rn``); -128 is never produced.
- ``"fp8e4m3"``: ``encode(y)`` = ``y`` rounded to nearest even in OCP fp8 e4m3 (``ml_dtypes.float8_e4m3fn``:
  no infinities, largest finite 448), saturating to +-448 (CUDA ``__nv_cvt_float_to_fp8(y,
  __NV_SATFINITE, __NV_E4M3)``).
- ``amax == 0`` (all zeros, of either sign): codes +0 and scale 0.
- A row holding NaN or +-inf: codes +0 and scale NaN (bits 0x7fffffff), so every value of that row dequantizes to NaN
  (a non-finite input poisons its token and head, as it would poison attention over a 16-bit cache).
- ``min(.., FLT_MAX)``: for ``amax < M / FLT_MAX`` (below 3.8e-37 for int8, 1.4e-36 for fp8; only
  bfloat16 or float32 inputs get there) ``M / amax`` would overflow to inf, and ``0 * inf`` is NaN.

Error bounds (derived from one correct rounding per step; checked by ``tests/test_quant.py``), for
every element of a finite row with ``amax >= M / FLT_MAX``:

- int8: ``|x - value| <= scale / 2 + 2**-21 * amax + 2**-140``: half a code step, plus 8 float32
  roundings of the row's range.
- fp8 e4m3: ``|x - value| <= max(2**-4 * |x|, 2**-10 * scale) + 2**-21 * amax + 2**-140``: e4m3
  keeps 3 mantissa bits (relative error 2**-4 in its normal range, codes >= 2**-6) and steps of
  2**-9 in its subnormal range.

The ``2**-140`` term only matters where ``scale`` itself is a float32 subnormal (``amax < M * 2**-126``:
1.5e-36 for int8, 5.3e-36 for fp8): there its rounding error is absolute, up to 2**-150. Rows with
``0 < amax < M / FLT_MAX`` lose their values: the codes and the input share signs and
``|value| <= amax + M * 2**-150``, so ``|x - value| <= 2 * amax`` (< 2.7e-36). At the other end, a
float32 row (the cache takes float16 / bfloat16 only) whose amax is FLT_MAX itself may dequantize
to +-inf under int8 (``127 * scale`` rounds past FLT_MAX).
"""

from __future__ import annotations

import numpy as np

__all__ = ["KV_KINDS", "CODE_MAX", "code_dtype", "kind_of", "quantize_rows", "dequantize", "quantize_page",
           "dequantize_page", "fp16_round_up", "KEPT_CHANNELS"]

KV_KINDS = ("int8", "fp8e4m3")
CODE_MAX = {"int8": 127.0, "fp8e4m3": 448.0}  # M above: the largest code magnitude
_FLT_MAX = np.finfo(np.float32).max
_QNAN = np.array(0x7FFFFFFF, np.uint32).view(np.float32)  # the kernel's NaN bits (__int_as_float(0x7fffffff))
_SOURCE_DTYPES = ("float16", "bfloat16", "float32")
# Channels of each (page, kv head) that a per-channel key cache keeps apart in float16 (see
# quantize_page; BENCHMARKS.md "Per-channel key scales: kept channels" says why 4).
KEPT_CHANNELS = 4


def code_dtype(kind: str) -> np.dtype:
    """The NumPy dtype of ``kind``'s codes: ``int8`` or ``ml_dtypes.float8_e4m3fn``."""
    if kind == "int8":
        return np.dtype(np.int8)
    if kind == "fp8e4m3":
        import ml_dtypes

        return np.dtype(ml_dtypes.float8_e4m3fn)
    raise ValueError(f"kind: expected one of {KV_KINDS}, got {kind!r}")


def kind_of(dtype) -> str:
    """The quantization kind of a code dtype, or ``""`` for any other dtype.

    Parameters
    ----------
    dtype : numpy.dtype-like or str
        ``int8`` / ``numpy.int8`` give ``"int8"``; ``"fp8_e4m3"``, ``"fp8e4m3"``,
        ``"float8_e4m3fn"`` / ``ml_dtypes.float8_e4m3fn`` give ``"fp8e4m3"``.
    """
    if not isinstance(dtype, str):
        try:
            return kind_of(np.dtype(dtype).name)
        except TypeError:  # not a NumPy dtype: a torch dtype prints as "torch.int8"
            dtype = str(dtype).replace("torch.", "")
    if dtype in ("fp8_e4m3", "fp8e4m3", "float8_e4m3fn"):
        return "fp8e4m3"
    return "int8" if dtype == "int8" else ""


def _check_kind(kind) -> str:
    if kind not in KV_KINDS:
        raise ValueError(f"kind: expected one of {KV_KINDS}, got {kind!r}")
    return kind


def quantize_rows(x, kind: str) -> tuple:
    """Quantize each row (last axis) of ``x`` exactly as ``kv_append`` does (see the module docstring).

    Parameters
    ----------
    x : array_like
        float16, bfloat16 or float32, shape (..., head_dim) with head_dim >= 1. (float64 is
        refused: rounding it to float32 first would be a step the kernel never takes.)
    kind : {"int8", "fp8e4m3"}

    Returns
    -------
    codes : numpy.ndarray
        ``x``'s shape, dtype :func:`code_dtype` (kind).
    scales : numpy.ndarray
        float32, shape ``x.shape[:-1]``.
    """
    _check_kind(kind)
    x = np.asarray(x)
    if x.dtype.name not in _SOURCE_DTYPES:
        raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape (..., head_dim) with head_dim >= 1, got {x.shape}")
    m = np.float32(CODE_MAX[kind])
    x32 = x.astype(np.float32)
    with np.errstate(all="ignore"):  # inf / NaN rows and zero rows are masked below
        amax = np.max(np.abs(x32), axis=-1)  # NaN propagates through np.max
        finite, zero = amax <= _FLT_MAX, amax == 0
        inv = np.minimum(m / amax, _FLT_MAX)
        y = x32 * inv[..., None]
        scales = np.where(finite, np.where(zero, np.float32(0), amax / m), _QNAN).astype(np.float32)
        keep = (finite & ~zero)[..., None]
        if kind == "int8":
            codes = np.where(keep, np.clip(np.rint(y), -127, 127), 0).astype(np.int8)
        else:  # saturate first: ml_dtypes turns anything beyond the last rounding midpoint into NaN
            codes = np.where(keep, np.clip(y, -m, m), np.float32(0)).astype(code_dtype(kind))
    return codes, scales


def dequantize(codes, scales) -> np.ndarray:
    """``codes * scales[..., None]`` in float32 (the values a quantized cache stands for).

    Parameters
    ----------
    codes : numpy.ndarray
        int8 or ``ml_dtypes.float8_e4m3fn``, shape (..., head_dim).
    scales : numpy.ndarray
        float32, shape ``codes.shape[:-1]``.
    """
    codes, scales = np.asarray(codes), np.asarray(scales)
    if not kind_of(codes.dtype):
        raise TypeError(f"codes: expected dtype int8 or float8_e4m3fn, got {codes.dtype}")
    if scales.dtype != np.float32:
        raise TypeError(f"scales: expected dtype float32, got {scales.dtype}")
    if codes.ndim < 1 or scales.shape != codes.shape[:-1]:
        raise ValueError(f"scales: expected shape {codes.shape[:-1]} (codes.shape[:-1]), got {scales.shape}")
    return codes.astype(np.float32) * scales[..., None]


# -- per-channel key scales (``PagedKVCache(..., key_scales="channel")``) -----------------------


def fp16_round_up(x) -> np.ndarray:
    """float32 ``x`` rounded up (toward +inf) to float16, as CUDA ``__float2half_ru``."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)  # round to nearest even: the neighbour below or above x
        low = h.astype(np.float32) < x
        return np.where(low, np.nextafter(h, np.float16(np.inf)), h).astype(np.float16)


def quantize_page(x, kind: str, keep: int = KEPT_CHANNELS) -> tuple:
    """Quantize the keys of one page (one kv head) with per-channel scales, as ``kv_key_pages`` does.

    A page of a ``key_scales="channel"`` cache stores 8-bit codes, one float32 page scale ``S``, one
    float16 relative channel scale ``r[c]`` in [0, 1] per channel, and its ``keep`` largest channels
    apart: their indices and, per slot, their values in units of ``S`` as float16 (a sparse
    correction: 8 bits cannot hold an outlier channel's own values closely enough, and those
    channels dominate the scores). The value of slot ``s``, channel ``c`` is ``k[s, c] * S * r[c]``,
    plus ``kept[s, j] * S`` where ``c == idx[j]`` (whose ``r[c]`` is 0 and code 0). Every step below
    is one correctly rounded float32 operation (the kernel does the same, bit for bit)::

        amax[c] = max_s |x[s, c]|,  A = max_c amax[c]
        S       = A / M                          M = 127 (int8) or 448 (fp8 e4m3)
        idx     = the keep channels of largest amax, largest first (ties: the lower channel)
        r[c]    = round_up_fp16(amax[c] / A)     (rounded up: |x / e| never exceeds M by more
                  0 for c in idx                  than float32 rounding, so codes never clip)
        e[c]    = S * r[c]
        inv[c]  = min(1 / e[c], FLT_MAX), 0 where e[c] == 0
        code    = encode(x * inv[c])             encode as :func:`quantize_rows` (kept channels: +0)
        kept    = round_fp16(x[:, idx] / S)      (|kept| <= M: float16 never overflows)

    A page whose values are all zero gets ``S = 0``, ``r = 0``, codes 0, ``idx = 0 .. keep - 1``
    and kept 0; a page holding NaN or +-inf anywhere gets ``S`` NaN (bits 0x7fffffff), ``r = 0``,
    codes 0, ``idx = 0 .. keep - 1`` and kept 0, so every key of the page dequantizes to NaN for
    that kv head (a non-finite key poisons its page's scores, as one poisons the softmax over a
    16-bit cache).

    Error: for a finite page, ``|x - value| <= e[c] / 2 + 2**-21 * amax[c] + 2**-140`` (int8:
    half a step of the channel's own scale, ``e[c] <= amax[c] / M * (1 + 2**-10)``; fp8 e4m3:
    ``max(2**-4 * |x|, 2**-10 * e[c]) + ...``), plus, for a channel whose ``amax[c] / A`` is below
    2**-24 (r[c] a float16 subnormal), at most ``2**-25 * A``; for a kept channel
    ``|x - value| <= 2**-11 * (1 + 2**-12) * |x| + 2**-25 * S`` (float16's rounding, relative in
    its normal range, absolute 2**-25 below it).

    Parameters
    ----------
    x : array_like
        float16, bfloat16 or float32, shape (..., n, head_dim): the n >= 1 filled slots of a page.
    kind : {"int8", "fp8e4m3"}
    keep : int, default :data:`KEPT_CHANNELS`
        Channels kept apart, 0 to head_dim (the cache keeps ``KEPT_CHANNELS``; other values are for
        studies of the rule).

    Returns
    -------
    codes : numpy.ndarray
        ``x``'s shape, dtype :func:`code_dtype` (kind).
    page_scale : numpy.ndarray
        float32, shape ``x.shape[:-2]``: ``S``.
    chan : numpy.ndarray
        float16, shape ``x.shape[:-2] + (head_dim,)``: ``r``.
    idx : numpy.ndarray
        uint8 (int16 when head_dim > 256), shape ``x.shape[:-2] + (keep,)``: the kept channels.
    kept : numpy.ndarray
        float16, shape ``x.shape[:-1] + (keep,)``: their values over ``S``.
    """
    _check_kind(kind)
    x = np.asarray(x)
    if x.dtype.name not in _SOURCE_DTYPES:
        raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if x.ndim < 2 or x.shape[-1] < 1 or x.shape[-2] < 1:
        raise ValueError(f"x: expected shape (..., n, head_dim) with n, head_dim >= 1, got {x.shape}")
    if isinstance(keep, (bool, np.bool_)) or not isinstance(keep, (int, np.integer)) or not 0 <= keep <= x.shape[-1]:
        raise ValueError(f"keep: expected an int in [0, head_dim = {x.shape[-1]}], got {keep!r}")
    m = np.float32(CODE_MAX[kind])
    x32 = x.astype(np.float32)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(x32), axis=-2)  # (..., D); NaN propagates
        big = np.max(amax, axis=-1)  # (...,)
        finite, zero = big <= _FLT_MAX, big == 0
        ok = finite & ~zero
        safe = np.where(ok, big, np.float32(1))
        scale = np.where(finite, np.where(zero, np.float32(0), safe / m), _QNAN).astype(np.float32)
        # largest amax first, ties to the lower channel (a stable sort of -amax); special pages: 0, 1, ..
        order = np.argsort(-np.where(ok[..., None], amax, np.float32(0)), axis=-1, kind="stable")[..., :keep]
        idx = np.where(ok[..., None], order, np.arange(keep)).astype(np.uint8 if x.shape[-1] <= 256 else np.int16)
        chan = np.where(ok[..., None], fp16_round_up(amax / safe[..., None]), np.float16(0)).astype(np.float16)
        np.put_along_axis(chan, idx.astype(np.int64), np.float16(0), axis=-1)
        e = (np.where(ok, scale, np.float32(0))[..., None] * chan.astype(np.float32)).astype(np.float32)
        inv = np.where(e > 0, np.minimum(np.float32(1) / np.where(e > 0, e, np.float32(1)), _FLT_MAX),
                       np.float32(0)).astype(np.float32)
        y = x32 * inv[..., None, :]
        quantized = np.ones(chan.shape, bool)
        np.put_along_axis(quantized, idx.astype(np.int64), False, axis=-1)
        keep_ok = ok[..., None, None]
        code_ok = keep_ok & quantized[..., None, :]  # kept channels: code +0 (not e4m3's -0 of x * 0)
        if kind == "int8":
            codes = np.where(code_ok, np.clip(np.rint(y), -127, 127), 0).astype(np.int8)
        else:
            codes = np.where(code_ok, np.clip(y, -m, m), np.float32(0)).astype(code_dtype(kind))
        sel = np.take_along_axis(x32, np.broadcast_to(idx.astype(np.int64)[..., None, :],
                                                      x32.shape[:-1] + (keep,)), axis=-1)
        kept = np.where(keep_ok, (sel / np.where(ok, scale, np.float32(1))[..., None, None]).astype(np.float32),
                        np.float32(0)).astype(np.float16)
    return codes, scale, chan, idx, kept


def dequantize_page(codes, page_scale, chan, idx=None, kept=None) -> np.ndarray:
    """The float64 values of a per-channel page: ``codes * page_scale * chan`` (exact products), the
    kept channels ``kept * page_scale`` (see :func:`quantize_page`).

    Parameters
    ----------
    codes : numpy.ndarray
        int8 or ``ml_dtypes.float8_e4m3fn``, shape (..., n, head_dim).
    page_scale : numpy.ndarray
        float32, shape ``codes.shape[:-2]``.
    chan : numpy.ndarray
        float16, shape ``codes.shape[:-2] + (head_dim,)``.
    idx, kept : numpy.ndarray, optional
        The kept channels (integer, ``codes.shape[:-2] + (keep,)``) and their float16 values over
        ``page_scale`` (``codes.shape[:-1] + (keep,)``); both or neither.
    """
    codes, page_scale, chan = np.asarray(codes), np.asarray(page_scale), np.asarray(chan)
    if not kind_of(codes.dtype):
        raise TypeError(f"codes: expected dtype int8 or float8_e4m3fn, got {codes.dtype}")
    if page_scale.dtype != np.float32 or chan.dtype != np.float16:
        raise TypeError(f"page_scale, chan: expected float32 and float16, got {page_scale.dtype} and {chan.dtype}")
    if codes.ndim < 2 or page_scale.shape != codes.shape[:-2] or chan.shape != codes.shape[:-2] + codes.shape[-1:]:
        raise ValueError(f"page_scale, chan: expected shapes {codes.shape[:-2]} and "
                         f"{codes.shape[:-2] + codes.shape[-1:]}, got {page_scale.shape} and {chan.shape}")
    s64 = page_scale.astype(np.float64)[..., None, None]
    out = codes.astype(np.float64) * s64 * chan.astype(np.float64)[..., None, :]
    if (idx is None) != (kept is None):
        raise ValueError("idx, kept: expected both or neither")
    if idx is not None:
        idx, kept = np.asarray(idx), np.asarray(kept)
        if kept.dtype != np.float16 or not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"idx, kept: expected an integer dtype and float16, got {idx.dtype} and {kept.dtype}")
        k = idx.shape[-1:]
        if idx.shape != codes.shape[:-2] + k or kept.shape != codes.shape[:-1] + k:
            raise ValueError(f"idx, kept: expected shapes {codes.shape[:-2] + k} and {codes.shape[:-1] + k}, "
                             f"got {idx.shape} and {kept.shape}")
        where = np.broadcast_to(idx.astype(np.int64)[..., None, :], kept.shape)
        np.put_along_axis(out, where, kept.astype(np.float64) * s64, axis=-1)
    return out

"""Checks of the scalar and optional-array arguments shared by the ops.

Nothing here touches the GPU: every mistake is a ``ValueError``/``TypeError`` whose message starts
with the argument's name. Numbers the kernels take as float32 or int32 must fit those types
(``scale=1e300`` would become ``inf`` in the kernel's parameters, ``1e-300`` zero). Semantics
follow ``pyattn.reference``.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

import math
from numbers import Integral, Real
from typing import NamedTuple

import numpy as np

__all__ = ["LOG2E", "CAUSAL_CODES", "check_causal", "check_window", "check_softcap", "check_scale", "check_bool",
           "check_int", "check_fp32", "MaskInfo", "check_mask", "AlibiInfo", "check_alibi", "check_out",
           "INT32_MAX"]

# log2(e): the kernels take scores in exp2 form (scale_log2 = scale * LOG2E), which must fit float32 too
LOG2E = 1.4426950408889634

INT32_MAX = 2**31 - 1
_FP32_MAX = float(np.finfo(np.float32).max)
_FP32_TINY = float(np.finfo(np.float32).smallest_subnormal)
# causal argument -> the kernels' code (params.causal): 0 none, 1 bottom-right, 2 top-left
CAUSAL_CODES = {False: 0, True: 1, "bottom_right": 1, "top_left": 2}
_MASK_KINDS = {"bool": "bool", "float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def check_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def check_int(name: str, x, lo: int = 0, hi: int = INT32_MAX) -> int:
    """An int in ``[lo, hi]`` (bools refused)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, Integral):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if not lo <= x <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {x}")
    return int(x)


def check_fp32(name: str, x, *, positive: bool = True) -> float:
    """A real number that survives conversion to float32: finite, and nonzero unless it was zero."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, Real):
        raise TypeError(f"{name}: expected a number, got {type(x).__name__}")
    v = float(x)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{name}: expected a finite {'positive ' if positive else ''}number, got {x!r}")
    if abs(v) > _FP32_MAX or (v != 0 and abs(v) < _FP32_TINY):
        raise ValueError(f"{name}: {x!r} is outside float32's range (the kernels take it as a float32)")
    return v


def check_causal(causal) -> int:
    """Return the kernel code of ``causal`` (False, True, "bottom_right" or "top_left")."""
    if isinstance(causal, (bool, np.bool_)):
        return int(bool(causal))
    if isinstance(causal, str):
        if causal in CAUSAL_CODES:
            return CAUSAL_CODES[causal]
        raise ValueError(f"causal: expected False, True, 'bottom_right' or 'top_left', got {causal!r}")
    raise TypeError(f"causal: expected a bool or 'bottom_right'/'top_left', got {type(causal).__name__} ({causal!r})")


def check_window(window) -> tuple:
    """Return ``(left, right)``; ``None`` and -1 mean unbounded."""
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected a (left, right) pair of ints or None, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, Integral):
            raise TypeError(f"window: {side} must be an int, got {type(w).__name__}")
        if not -1 <= w < 2**30:
            raise ValueError(f"window: {side} must be -1 (unbounded) or in [0, 2**30), got {w}")
        out.append(int(w))
    return tuple(out)


def check_softcap(softcap) -> float:
    """Return the soft-cap, 0.0 for none."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, Real):
        raise TypeError(f"softcap: expected a positive number or None, got {type(softcap).__name__}")
    return check_fp32("softcap", softcap)


def check_scale(scale, head_dim: int) -> float:
    """The score scale, default ``1 / sqrt(head_dim)``; the kernels also use ``scale * log2(e)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    v = check_fp32("scale", scale)
    check_fp32("scale", v * LOG2E)  # the kernels' exp2 form must fit too
    return v


class MaskInfo(NamedTuple):
    """A validated mask: its kernel kind and its element strides over (B, Hq, Sq, Sk), 0 on
    broadcast axes. Host masks are uploaded C-contiguous (``strides`` describe that copy)."""

    kind: str  # "bool", "f16", "bf16", "f32"
    strides: tuple
    on_device: bool


def check_mask(mask, shape4: tuple) -> MaskInfo | None:
    """Validate a mask :class:`~pyattn.interop.inputs.Arg` against (B, Hq, Sq, Sk).

    Boolean (True = may attend) or additive float (float16/bfloat16/float32; host float64 is
    accepted and sent as float32, so its values must fit float32 or be -inf).
    """
    if mask is None:
        return None
    name = mask.dtype.name
    if not mask.on_device and name == "float64":
        name = "float32"  # uploaded as float32
    if name not in _MASK_KINDS:
        raise TypeError(f"mask: expected dtype bool, float16, bfloat16 or float32, got {mask.dtype}")
    if len(mask.shape) > 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], shape4[::-1])):
        raise ValueError(f"mask: expected a shape broadcastable to (B, Hq, Sq, Sk) = {shape4}, got {mask.shape}")
    pad = 4 - len(mask.shape)
    shape = (1,) * pad + tuple(mask.shape)
    if mask.on_device:
        strides = (0,) * pad + tuple(mask.strides)
    else:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
        if name != "bool":
            m = np.asarray(mask.obj, dtype=np.float64)
            finite = np.isfinite(m)
            if np.isnan(m).any() or np.isposinf(m).any() or (np.abs(m[finite]) > _FP32_MAX).any():
                raise ValueError("mask: a float mask may hold finite float32 values or -inf, not NaN, +inf or "
                                 "values beyond float32's range")
    strides = tuple(0 if n == 1 else s for n, s in zip(shape, strides))
    return MaskInfo(_MASK_KINDS[name], strides, mask.on_device)


class AlibiInfo(NamedTuple):
    """Validated ALiBi slopes: float32 on the device, ``stride_b`` 0 for per-head slopes."""

    stride_b: int
    on_device: bool


def check_alibi(alibi, batch: int, heads_q: int) -> AlibiInfo | None:
    """Validate ALiBi slopes (an Arg) of shape (Hq,) or (B, Hq); device slopes must be contiguous float32."""
    if alibi is None:
        return None
    if alibi.shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes: expected shape (Hq,) = ({heads_q},) or (B, Hq) = ({batch}, {heads_q}), "
                         f"got {alibi.shape}")
    if alibi.on_device:
        if alibi.dtype != np.float32:
            raise TypeError(f"alibi_slopes: a device array must be float32, got {alibi.dtype}")
        if alibi.strides[-1] != 1 or (len(alibi.shape) == 2 and alibi.strides[0] != heads_q and batch > 1):
            raise ValueError(f"alibi_slopes: a device array must be contiguous, got element strides {alibi.strides}")
    else:
        if alibi.dtype.kind != "f":
            raise TypeError(f"alibi_slopes: expected a float dtype, got {alibi.dtype}")
        a = np.asarray(alibi.obj, dtype=np.float64)
        if not np.isfinite(a).all() or (np.abs(a) > _FP32_MAX).any():
            raise ValueError("alibi_slopes: must be finite and within float32's range")
    return AlibiInfo(heads_q if len(alibi.shape) == 2 else 0, alibi.on_device)


def check_out(out, shape: tuple, dtype: np.dtype, on_device: bool):
    """Validate ``out=`` (an Arg): the output's exact shape and dtype, on the same side as q.

    Returns the element strides of ``out`` (host outputs: None, they are filled by a copy).
    """
    if out is None:
        return None
    if out.on_device != on_device:
        raise TypeError(f"out: expected a {'device' if on_device else 'NumPy'} array like q, "
                        f"got a {'device' if out.on_device else 'host'} array")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype}, got {out.dtype}")
    if not on_device:
        if not out.obj.flags.writeable:
            raise ValueError("out: the array is read-only")
        return None
    if out.strides[-1] != 1 and shape[-1] > 1:
        raise ValueError(f"out: the head_dim axis must be contiguous, got element strides {out.strides}")
    return tuple(out.strides)

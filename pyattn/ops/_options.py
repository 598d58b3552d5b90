"""Validate the attention options beyond q/k/v: causal mode, window, soft-cap, mask, ALiBi, out.

Like ``_problem``, nothing here touches the GPU: every mistake is a ``ValueError``/``TypeError``
naming the argument. Semantics follow ``pyattn.reference.attention_ref``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

__all__ = ["CAUSAL_CODES", "check_causal", "check_window", "check_softcap", "MaskInfo", "describe_mask",
           "AlibiInfo", "describe_alibi", "check_out"]

# causal argument -> the kernels' code (params.causal): 0 none, 1 bottom-right, 2 top-left
CAUSAL_CODES = {False: 0, True: 1, "bottom_right": 1, "top_left": 2}
_MASK_KINDS = {"bool": "bool", "float16": "f16", "bfloat16": "bf16", "float32": "f32"}


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
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap: expected a finite number > 0 (None disables it), got {softcap!r}")
    return float(softcap)


@dataclass(frozen=True)
class MaskInfo:
    """A validated mask: its kernel kind and its element strides over (B, Hq, Sq, Sk), 0 on
    broadcast axes. Host masks are uploaded C-contiguous (``strides`` describe that copy)."""

    kind: str  # "bool", "f16", "bf16", "f32"
    strides: tuple
    on_device: bool


def describe_mask(mask, shape4: tuple, describe_input) -> MaskInfo | None:
    """Validate ``mask`` against the logical (B, Hq, Sq, Sk) shape.

    Parameters
    ----------
    mask : array or None
        Boolean (True = may attend) or additive float (float16/bfloat16/float32; host float64
        is accepted and sent as float32).
    shape4 : tuple
        (batch, heads_q, seqlen_q, seqlen_k).
    describe_input : callable
        ``_problem.describe_input`` (passed in to keep the import graph acyclic).
    """
    if mask is None:
        return None
    inp = describe_input("mask", mask)
    name = inp.dtype.name
    if not inp.on_device and name == "float64":
        name = "float32"  # uploaded as float32
    if name not in _MASK_KINDS:
        raise TypeError(f"mask: expected dtype bool, float16, bfloat16 or float32, got {inp.dtype}")
    if len(inp.shape) > 4 or any(m not in (1, t) for m, t in zip(inp.shape[::-1], shape4[::-1])):
        raise ValueError(f"mask: expected a shape broadcastable to (B, Hq, Sq, Sk) = {shape4}, got {inp.shape}")
    pad = 4 - len(inp.shape)
    shape = (1,) * pad + tuple(inp.shape)
    if inp.on_device:
        strides = (0,) * pad + tuple(inp.strides)
    else:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
        if name != "bool":
            m = np.asarray(mask)
            if np.isnan(m).any() or np.isposinf(m).any():
                raise ValueError("mask: a float mask may hold finite values or -inf, not NaN or +inf")
    strides = tuple(0 if n == 1 else s for n, s in zip(shape, strides))
    return MaskInfo(_MASK_KINDS[name], strides, inp.on_device)


@dataclass(frozen=True)
class AlibiInfo:
    """Validated ALiBi slopes: float32 on the device, ``stride_b`` 0 for per-head slopes."""

    stride_b: int
    on_device: bool


def describe_alibi(alibi_slopes, batch: int, heads_q: int, describe_input) -> AlibiInfo | None:
    """Validate ALiBi slopes of shape (Hq,) or (B, Hq); device slopes must be contiguous float32."""
    if alibi_slopes is None:
        return None
    inp = describe_input("alibi_slopes", alibi_slopes)
    if inp.shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes: expected shape (Hq,) = ({heads_q},) or (B, Hq) = ({batch}, {heads_q}), "
                         f"got {inp.shape}")
    if inp.on_device:
        if inp.dtype != np.float32:
            raise TypeError(f"alibi_slopes: a device array must be float32, got {inp.dtype}")
        if inp.strides[-1] != 1 or (len(inp.shape) == 2 and inp.strides[0] != heads_q and batch > 1):
            raise ValueError(f"alibi_slopes: a device array must be contiguous, got element strides {inp.strides}")
    else:
        if inp.dtype.kind != "f":
            raise TypeError(f"alibi_slopes: expected a float dtype, got {inp.dtype}")
        if not np.isfinite(np.asarray(alibi_slopes, dtype=np.float64)).all():
            raise ValueError("alibi_slopes: must be finite")
    return AlibiInfo(heads_q if len(inp.shape) == 2 else 0, inp.on_device)


def check_out(out, shape: tuple, dtype: np.dtype, on_device: bool, describe_input):
    """Validate ``out=``: the output's exact shape and dtype, on the same side (host/device) as q.

    Returns the element strides of ``out`` (host outputs: None, they are filled by a copy).
    """
    if out is None:
        return None
    inp = describe_input("out", out)
    if inp.on_device != on_device:
        raise TypeError(f"out: expected a {'device' if on_device else 'NumPy'} array like q, "
                        f"got a {'device' if inp.on_device else 'host'} array")
    if tuple(inp.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(inp.shape)}")
    if inp.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype}, got {inp.dtype}")
    if not on_device:
        if not out.flags.writeable:
            raise ValueError("out: the array is read-only")
        return None
    if inp.strides[-1] != 1 and shape[-1] > 1:
        raise ValueError(f"out: the head_dim axis must be contiguous, got element strides {inp.strides}")
    return tuple(inp.strides)

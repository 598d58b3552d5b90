"""Validate ``merge_states`` arguments, in pyattn's one LSE convention.

Every op returns its log-sum-exp as float32 (batch, heads, seq) for 4-D outputs in either layout,
and (heads, total) for packed varlen outputs, so ``merge_states`` takes them in exactly those
shapes: ``layout="bshd"`` pairs o (B, S, H, D) with lse (B, H, S), ``"bhsd"`` o (B, H, S, D) with
lse (B, H, S), ``"thd"`` o (T, H, D) with lse (H, T). The kernel addresses rows by o's leading
indices; :func:`lse_row_strides` maps an LSE array's strides to that row order, so no transposed
copy is ever made.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .attention import SUPPORTED_DTYPES
from .options import INT32_MAX

__all__ = ["MergeRequest", "check_merge", "lse_shape_of", "lse_row_strides", "MERGE_LAYOUTS", "MAX_HEAD_DIM"]

MERGE_LAYOUTS = ("bshd", "bhsd", "thd")
MAX_HEAD_DIM = 256
_F32 = np.dtype(np.float32)
_ORDER = {"bshd": "(batch, seq, heads, head_dim)", "bhsd": "(batch, heads, seq, head_dim)",
          "thd": "(total, heads, head_dim)"}


def lse_shape_of(o_shape: tuple, layout: str) -> tuple:
    """The LSE shape that goes with one state's output shape."""
    if layout == "bshd":
        b, s, h, _ = o_shape
        return (b, h, s)
    if layout == "bhsd":
        return tuple(o_shape[:3])
    t, h, _ = o_shape
    return (h, t)


def lse_row_strides(lse_strides: tuple, layout: str) -> tuple:
    """An LSE's element strides in the kernel's row order (o's leading indices, padded to 3)."""
    if layout == "bshd":
        sb, sh, ss = lse_strides
        return (sb, ss, sh)
    if layout == "bhsd":
        return tuple(lse_strides)
    sh, st = lse_strides
    return (0, st, sh)


class MergeRequest(NamedTuple):
    """A validated call. ``os``/``lses`` hold one stacked Arg (``stacked``) or one per state."""

    stacked: bool
    os: tuple
    lses: tuple
    shape: tuple  # one state's o shape
    lse_shape: tuple
    dtype: np.dtype
    n_states: int
    on_device: bool
    out: tuple  # (o_out Arg or None, lse_out Arg or None)
    layout: str


def _forms(args):
    """Sort the positional forms into ``(stacked, os, lses, o_names, lse_names)``."""
    if len(args) == 4:
        o_a, lse_a, o_b, lse_b = args
        return False, (o_a, o_b), (lse_a, lse_b), ("o_a", "o_b"), ("lse_a", "lse_b")
    if len(args) != 2:
        raise TypeError(f"merge_states: expected (o_a, lse_a, o_b, lse_b) or (os, lses), got {len(args)} "
                        f"positional arguments")
    os_, lses = args
    if isinstance(os_, (list, tuple)) != isinstance(lses, (list, tuple)):
        raise TypeError(f"os, lses: expected two lists (or tuples) of arrays or two stacked arrays, got "
                        f"{type(os_).__name__} and {type(lses).__name__}")
    if not isinstance(os_, (list, tuple)):
        return True, (os_,), (lses,), ("os",), ("lses",)
    if len(os_) == 0 or len(os_) != len(lses):
        raise ValueError(f"os, lses: expected equally long non-empty lists, got lengths {len(os_)} and {len(lses)}")
    n = len(os_)
    return False, tuple(os_), tuple(lses), tuple(f"os[{i}]" for i in range(n)), tuple(f"lses[{i}]" for i in range(n))


def _outs(out):
    if out is None:
        return (None, None), ("out", "out[1]")
    if isinstance(out, (list, tuple)):
        if len(out) != 2:
            raise ValueError(f"out: expected an array or an (o, lse) pair, got a sequence of {len(out)}")
        return tuple(out), ("out[0]", "out[1]")
    return (out, None), ("out", "out[1]")


def check_merge(args, out, layout: str, read) -> MergeRequest:
    """Validate ``merge_states(*args, out=out, layout=layout)``; ``read(name, x)`` reads an array."""
    if layout not in MERGE_LAYOUTS:
        raise ValueError(f"layout: expected one of {MERGE_LAYOUTS}, got {layout!r}")
    stacked, os_, lses, o_names, lse_names = _forms(args)
    outs, out_names = _outs(out)
    o_ins = [read(n, x) for n, x in zip(o_names, os_)]
    l_ins = [read(n, x) for n, x in zip(lse_names, lses)]
    out_ins = [read(n, x) if x is not None else None for n, x in zip(out_names, outs)]
    every = o_ins + l_ins + [i for i in out_ins if i is not None]
    if len({i.on_device for i in every}) != 1:
        where = ", ".join(f"{i.name} on {'device' if i.on_device else 'host'}" for i in every)
        raise TypeError(f"merge_states: expected all host (NumPy) or all device arrays, got {where}")
    on_device = every[0].on_device
    dtype = o_ins[0].dtype
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(f"{o_ins[0].name}: expected dtype float32, float16 or bfloat16, got {dtype}")
    for i in o_ins[1:]:
        if i.dtype != dtype:
            raise TypeError(f"{i.name}: expected dtype {dtype} (from {o_ins[0].name}), got {i.dtype}")
    for i in l_ins:
        if i.dtype != _F32:
            raise TypeError(f"{i.name}: expected dtype float32 (LSEs are float32), got {i.dtype}")
    rank = 3 if layout == "thd" else 4
    if stacked:
        (o,), (lse,) = o_ins, l_ins
        if len(o.shape) != rank + 1:
            raise ValueError(f"os: expected (n_states,) + {_ORDER[layout]} for layout={layout!r}, got {o.shape}")
        n_states, shape = o.shape[0], tuple(o.shape[1:])
        if n_states < 1:
            raise ValueError(f"os: expected at least one state (axis 0), got shape {o.shape}")
        want = (n_states,) + lse_shape_of(shape, layout)
        if tuple(lse.shape) != want:
            raise ValueError(f"lses: expected shape {want} (n_states + the LSE of a {layout} output), got {lse.shape}")
    else:
        n_states, shape = len(o_ins), tuple(o_ins[0].shape)
        if len(shape) != rank:
            raise ValueError(f"{o_ins[0].name}: expected {_ORDER[layout]} for layout={layout!r}, got {shape}")
        for o, lse in zip(o_ins, l_ins):
            if tuple(o.shape) != shape:
                raise ValueError(f"{o.name}: expected shape {shape} (from {o_ins[0].name}), got {o.shape}")
            if tuple(lse.shape) != lse_shape_of(shape, layout):
                raise ValueError(f"{lse.name}: expected shape {lse_shape_of(shape, layout)} (the LSE of a {layout} "
                                 f"output of shape {shape}), got {lse.shape}")
    lse_shape = lse_shape_of(shape, layout)
    head_dim = shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{o_ins[0].name}: head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")
    if max(shape) > INT32_MAX or int(np.prod(shape[:-1])) > INT32_MAX or n_states > INT32_MAX:
        raise ValueError(f"{o_ins[0].name}: dims, rows and states must each be < 2**31, got shape {shape} and "
                         f"{n_states} states")
    if out_ins[0] is not None and (tuple(out_ins[0].shape) != shape or out_ins[0].dtype != dtype):
        raise ValueError(f"{out_ins[0].name}: expected shape {shape} and dtype {dtype}, "
                         f"got shape {out_ins[0].shape} and dtype {out_ins[0].dtype}")
    if out_ins[1] is not None and (tuple(out_ins[1].shape) != lse_shape or out_ins[1].dtype != _F32):
        raise ValueError(f"{out_ins[1].name}: expected shape {lse_shape} and dtype float32, "
                         f"got shape {out_ins[1].shape} and dtype {out_ins[1].dtype}")
    if on_device:
        for i in o_ins + out_ins[:1]:
            if i is not None and i.strides[-1] != 1 and i.shape[-1] > 1:
                raise ValueError(f"{i.name}: the head_dim axis must be contiguous (stride 1 element), "
                                 f"got strides {i.strides} (in elements) for shape {i.shape}")
    else:
        for i in out_ins:
            if i is not None and not i.obj.flags.writeable:
                raise ValueError(f"{i.name}: expected a writeable NumPy array")
        for i in l_ins:
            a = np.asarray(i.obj)
            if np.isnan(a).any() or np.isposinf(a).any():  # as merge_states_ref; unchecked on the device
                raise ValueError(f"{i.name}: LSE values must be finite or -inf, got NaN or +inf")
    return MergeRequest(stacked, tuple(o_ins), tuple(l_ins), shape, lse_shape, dtype, n_states, on_device,
                        tuple(out_ins), layout)

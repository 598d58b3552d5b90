"""Validate and normalise attention inputs into a frozen problem description.

Everything here looks only at shapes, dtypes and strides: no driver call, so every error a user
can make is reported as ``ValueError``/``TypeError`` naming the argument before any GPU work,
and it is all testable without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..array import _c_strides
from ._options import check_causal, check_out, check_softcap, check_window, describe_alibi, describe_mask

__all__ = ["AttentionProblem", "describe_input", "make_problem", "make_varlen_problem", "SUPPORTED_DTYPES",
           "LAYOUTS"]

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("bshd", "bhsd")
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y/z, which carry heads and batch


@dataclass(frozen=True)
class _Input:
    """Shape, dtype and element strides of one argument, host or device alike."""

    name: str
    shape: tuple
    dtype: np.dtype
    strides: tuple  # in elements
    on_device: bool


def describe_input(name: str, x) -> _Input:
    """Read shape/dtype/strides of ``x`` without touching the GPU.

    Parameters
    ----------
    name : str
        Argument name for error messages.
    x : numpy.ndarray, DeviceArray or CUDA array (CAI / DLPack)
    """
    from ..array import DeviceArray, is_device_array

    if isinstance(x, DeviceArray):
        return _Input(name, x.shape, x.dtype, x.elem_strides, True)
    if is_device_array(x):
        shape, dtype, strides = _foreign_meta(name, x)
        return _Input(name, shape, dtype, strides, True)
    if isinstance(x, np.ndarray):
        # Host arrays are copied to the device contiguously, so their strides do not matter.
        return _Input(name, x.shape, x.dtype, _c_strides(x.shape, 1), False)
    raise TypeError(f"{name}: expected a NumPy array or a CUDA device array "
                    f"(__cuda_array_interface__ / __dlpack__), got {type(x).__name__}")


def _foreign_meta(name, x):
    cai = None
    try:
        cai = x.__cuda_array_interface__
    except Exception:  # no CAI, or a dtype CAI cannot express (torch bfloat16): use the dtype attribute
        pass
    from ..array import cai_dtype

    dtype = cai_dtype(cai) if cai is not None else None
    if dtype is not None:
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        if strides is not None and any(s % dtype.itemsize for s in strides):
            raise ValueError(f"{name}: strides must be multiples of the item size {dtype.itemsize}, "
                             f"got byte strides {tuple(strides)}")
        strides = _c_strides(shape, 1) if strides is None else tuple(s // dtype.itemsize for s in strides)
        return shape, dtype, strides
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name}: cannot tell the dtype of {type(x).__name__}: its array interface has an "
                        f"opaque type and it has no .dtype/.shape (use DLPack or a typed interface)")
    shape = tuple(int(n) for n in x.shape)
    dtype = _dtype_of(name, x.dtype)
    if callable(getattr(x, "stride", None)):  # torch: element strides from .stride()
        strides = tuple(int(s) for s in x.stride())
    elif getattr(x, "strides", None) is not None:  # array-API style: byte strides
        strides = tuple(int(s) // dtype.itemsize for s in x.strides)
    else:  # JAX arrays are always dense row-major
        strides = _c_strides(shape, 1)
    return shape, dtype, strides


def _dtype_of(name, dt) -> np.dtype:
    text = str(dt).replace("torch.", "")
    if text == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(text)
    except TypeError:
        raise TypeError(f"{name}: unsupported dtype {dt}") from None


@dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call. Shapes are logical (layout already resolved).

    Strides are in elements, ordered (batch, seq, head); the head dim is contiguous. ``causal`` is
    the kernel code (0 none, 1 bottom-right, 2 top-left), ``window`` is (left, right) with -1
    unbounded, ``softcap`` 0.0 when off. Varlen problems (``layout == "thd"``) have batch = number
    of sequences, seqlen_q/k = the longest, and batch stride 0.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    layout: str
    causal: int
    scale: float
    on_device: bool
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple
    window: tuple = (-1, -1)
    softcap: float = 0.0
    mask: object = None  # _options.MaskInfo
    alibi: object = None  # _options.AlibiInfo
    out_strides: tuple | None = None  # element strides of a device ``out=``
    total_q: int = 0  # varlen: packed query rows

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def out_shape(self) -> tuple:
        """Output shape in the caller's layout."""
        if self.layout == "thd":
            return (self.total_q, self.heads_q, self.head_dim)
        if self.layout == "bshd":
            return (self.batch, self.seqlen_q, self.heads_q, self.head_dim)
        return (self.batch, self.heads_q, self.seqlen_q, self.head_dim)


def _bshd(inp: _Input, layout: str):
    """Return (B, S, H, D) and element strides (b, s, h) of a 4-D input in ``layout``."""
    if len(inp.shape) != 4:
        order = "(batch, seq, heads, head_dim)" if layout == "bshd" else "(batch, heads, seq, head_dim)"
        raise ValueError(f"{inp.name}: expected a 4-D array {order} for layout={layout!r}, got shape {inp.shape}")
    if layout == "bshd":
        (b, s, h, d), (sb, ss, sh, sd) = inp.shape, inp.strides
    else:
        (b, h, s, d), (sb, sh, ss, sd) = inp.shape, inp.strides
    if inp.on_device and sd != 1 and d > 1:
        raise ValueError(f"{inp.name}: the head_dim axis must be contiguous (stride 1 element), "
                         f"got strides {inp.strides} (in elements) for shape {inp.shape}")
    return (b, s, h, d), (sb, ss, sh)


def _check_qkv(ins):
    places = {i.on_device for i in ins}
    if len(places) != 1:
        where = ", ".join(f"{i.name} on {'device' if i.on_device else 'host'}" for i in ins)
        raise TypeError(f"q, k, v: expected all host (NumPy) or all device arrays, got {where}")
    for i in ins:
        if i.dtype.name not in SUPPORTED_DTYPES:
            raise TypeError(f"{i.name}: expected dtype float32, float16 or bfloat16, got {i.dtype}")
    if len({i.dtype for i in ins}) != 1:
        raise TypeError("q, k, v: expected one dtype, got " + ", ".join(f"{i.name} {i.dtype}" for i in ins))


def _check_heads(Hq, Hk, D, Dk, Sq, Sk, B):
    if Dk != D:
        raise ValueError(f"k: expected head_dim {D} (from q), got {Dk}")
    if Hk < 1 or Hq % Hk != 0:
        raise ValueError(f"k: query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    if D % 8 != 0 or not 8 <= D <= 256:
        raise ValueError(f"q: head_dim must be a multiple of 8 in [8, 256], got {D}")
    if B > _MAX_GRID_YZ or Hq > _MAX_GRID_YZ:
        raise ValueError(f"q: batch and heads must each be <= {_MAX_GRID_YZ}, got batch {B}, heads {Hq}")
    if max(Sq, Sk) >= 2**31:
        raise ValueError(f"q/k: sequence lengths must be < 2**31, got {Sq}, {Sk}")


def _check_scale(scale, D) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if (isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer))
            or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    return float(scale)


def make_problem(q, k, v, *, causal=False, mask=None, window=None, softcap=None, alibi_slopes=None, scale=None,
                 layout="bshd", out=None) -> tuple:
    """Validate ``attention`` arguments.

    Returns
    -------
    (AttentionProblem, tuple of _Input)

    Raises
    ------
    TypeError
        Wrong argument types, unsupported or mixed dtypes, host mixed with device arrays.
    ValueError
        Wrong ranks or shapes, head counts that do not divide, head_dim not a multiple of 8 or
        above 256, a non-contiguous head_dim axis, a non-finite or non-positive scale, a mask not
        broadcastable to (B, Hq, Sq, Sk), bad window/softcap/ALiBi/out arguments.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    causal = check_causal(causal)
    ins = (describe_input("q", q), describe_input("k", k), describe_input("v", v))
    _check_qkv(ins)
    (B, Sq, Hq, D), qs = _bshd(ins[0], layout)
    (Bk, Sk, Hk, Dk), ks = _bshd(ins[1], layout)
    (Bv, Sv, Hv, Dv), vs = _bshd(ins[2], layout)
    if (Bk, Sk, Hk, Dk) != (Bv, Sv, Hv, Dv):
        raise ValueError(f"v: expected the same shape as k {ins[1].shape}, got {ins[2].shape}")
    if Bk != B:
        raise ValueError(f"k: expected batch {B} (from q), got {Bk}")
    _check_heads(Hq, Hk, D, Dk, Sq, Sk, B)
    scale = _check_scale(scale, D)
    window, softcap = check_window(window), check_softcap(softcap)
    mask_info = describe_mask(mask, (B, Hq, Sq, Sk), describe_input)
    alibi = describe_alibi(alibi_slopes, B, Hq, describe_input)
    on_device = ins[0].on_device
    problem = AttentionProblem(B, Hq, Hk, Sq, Sk, D, ins[0].dtype.name, layout, causal, scale, on_device,
                               qs, ks, vs, window, softcap, mask_info, alibi)
    out_strides = check_out(out, problem.out_shape(), ins[0].dtype, on_device, describe_input)
    if out_strides is not None:
        problem = _replace(problem, out_strides=out_strides)
    return problem, ins


def _replace(problem, **changes):
    import dataclasses

    return dataclasses.replace(problem, **changes)


def _cu_seqlens(name: str, cu, total: int, on_device: bool) -> np.ndarray:
    """Range-check cumulative lengths (on the host; a device array's N+1 ints are copied back)."""
    inp = describe_input(name, cu)
    if inp.dtype != np.int32:
        raise TypeError(f"{name}: expected dtype int32, got {inp.dtype}")
    if len(inp.shape) != 1 or inp.shape[0] < 1:
        raise ValueError(f"{name}: expected shape (num_seqs + 1,), got {inp.shape}")
    if inp.on_device != on_device:
        raise TypeError(f"{name}: expected a {'device' if on_device else 'NumPy'} array like q")
    if inp.on_device:
        from ..array import asarray

        host = asarray(cu).numpy()  # N + 1 ints: the range check needs their values
    else:
        host = np.asarray(cu)
    if host[0] != 0 or host[-1] != total or (np.diff(host) < 0).any():
        raise ValueError(f"{name}: must start at 0, be non-decreasing and end at the packed length {total}, "
                         f"got {host.tolist() if host.size <= 16 else host}")
    return host


def make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                        causal=False, window=None, softcap=None, alibi_slopes=None, scale=None, out=None):
    """Validate ``attention_varlen`` arguments: packed (total, H, D) arrays and int32 cumulative lengths.

    Returns
    -------
    (AttentionProblem, tuple of _Input, (cu_q, cu_k) host copies)
    """
    causal = check_causal(causal)
    ins = (describe_input("q", q), describe_input("k", k), describe_input("v", v))
    _check_qkv(ins)
    for i in ins:
        if len(i.shape) != 3:
            raise ValueError(f"{i.name}: expected a 3-D array (total_tokens, heads, head_dim), got shape {i.shape}")
        if i.on_device and i.strides[2] != 1 and i.shape[2] > 1:
            raise ValueError(f"{i.name}: the head_dim axis must be contiguous, got element strides {i.strides}")
    (Tq, Hq, D), (Tk, Hk, Dk) = ins[0].shape, ins[1].shape
    if ins[2].shape != ins[1].shape:
        raise ValueError(f"v: expected the same shape as k {ins[1].shape}, got {ins[2].shape}")
    on_device = ins[0].on_device
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, Tq, on_device)
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, Tk, on_device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: expected {cu_q.size} entries like cu_seqlens_q, got {cu_k.size}")
    n = cu_q.size - 1
    longest = []
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        actual = int(np.diff(cu).max(initial=0))
        if given is not None:
            if isinstance(given, (bool, np.bool_)) or not isinstance(given, (int, np.integer)) or given < actual:
                raise ValueError(f"{name}: expected an int >= the longest sequence ({actual}), got {given!r}")
            actual = int(given)
        longest.append(actual)
    _check_heads(Hq, Hk, D, Dk, Tq, Tk, max(n, 1))
    scale = _check_scale(scale, D)
    window, softcap = check_window(window), check_softcap(softcap)
    alibi = describe_alibi(alibi_slopes, n, Hq, describe_input)
    strides = tuple((0, i.strides[0], i.strides[1]) for i in ins)
    problem = AttentionProblem(n, Hq, Hk, longest[0], longest[1], D, ins[0].dtype.name, "thd", causal, scale,
                               on_device, *strides, window, softcap, None, alibi, total_q=Tq)
    out_strides = check_out(out, problem.out_shape(), ins[0].dtype, on_device, describe_input)
    if out_strides is not None:
        problem = _replace(problem, out_strides=out_strides)
    return problem, ins, (cu_q, cu_k)

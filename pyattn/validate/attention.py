"""Validate attention arguments (already read by :mod:`pyattn.interop.inputs`) into a frozen problem.

Everything here looks at shapes, dtypes, strides and host values only: no driver call, so every
mistake is a ``ValueError``/``TypeError`` naming the argument before any GPU work, and all of it is
testable without a GPU. The frozen :class:`AttentionProblem` is what plans are cached on.

The problem records here and in :mod:`.options` are NamedTuples, not frozen dataclasses: both are
immutable, hashable values, but a frozen dataclass builds its methods with ``exec`` when its module
is imported, which cost ~0.5 ms per class of a fresh process's first call (a 15 ms budget), while a
named tuple costs ~0.1 ms. Plans key on a problem together with the function that plans it, so a
tuple comparing equal to a record of another type never meets it.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

from typing import NamedTuple

import numpy as np

from .options import (INT32_MAX, LOG2E, check_alibi, check_causal, check_fp32, check_mask, check_out,
                      check_scale, check_softcap, check_window)

__all__ = ["AttentionProblem", "make_problem", "make_varlen_problem", "check_pointers", "check_addresses",
           "SUPPORTED_DTYPES", "FP8", "LAYOUTS", "TENSOR_CORE_ALIGN"]

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
# fp8 e4m3 inputs: ``attention`` only (dense calls on sm_90a), with per-tensor descale factors;
# the output is bfloat16.
FP8 = "float8_e4m3fn"
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, FP8: 1}
LAYOUTS = ("bshd", "bhsd")
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y/z, which carry heads and batch
TENSOR_CORE_ALIGN = 16  # the tensor-core kernels read q/k/v in 16-byte chunks (cp.async)


class AttentionProblem(NamedTuple):
    """A validated attention call. Shapes are logical (layout already resolved).

    Strides are in elements, ordered (batch, seq, head); the head dim is contiguous. ``causal`` is
    the kernel code (0 none, 1 bottom-right, 2 top-left), ``window`` is (left, right) with -1
    unbounded, ``softcap`` 0.0 when off. Varlen problems (``layout == "thd"``) have batch = number
    of sequences, seqlen_q/k = the longest, and batch stride 0. ``align`` is the byte alignment
    the kernel needs of the q/k/v addresses (16 for the tensor-core kernels, else 1).
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
    mask: object = None  # options.MaskInfo
    alibi: object = None  # options.AlibiInfo
    out_strides: tuple | None = None  # element strides of a device ``out=``
    total_q: int = 0  # varlen: packed query rows
    allow_tf32: bool = False
    align: int = 1
    total_k: int = 0  # varlen: packed key rows
    descale: tuple = (1.0, 1.0, 1.0)  # fp8: the per-tensor factors of q, k, v (codes * factor = value)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def out_dtype(self) -> str:
        """The output's dtype name: q's, or bfloat16 for fp8 inputs."""
        return "bfloat16" if self.dtype == FP8 else self.dtype

    def out_shape(self) -> tuple:
        """Output shape in the caller's layout."""
        if self.layout == "thd":
            return (self.total_q, self.heads_q, self.head_dim)
        if self.layout == "bshd":
            return (self.batch, self.seqlen_q, self.heads_q, self.head_dim)
        return (self.batch, self.heads_q, self.seqlen_q, self.head_dim)

    def lse_shape(self) -> tuple:
        """(B, Hq, Sq); varlen: (Hq, total_q), FlashAttention's layout."""
        if self.layout == "thd":
            return (self.heads_q, self.total_q)
        return (self.batch, self.heads_q, self.seqlen_q)


def _bshd(a, layout: str):
    """Return (B, S, H, D) and element strides (b, s, h) of a 4-D input Arg in ``layout``."""
    if len(a.shape) != 4:
        order = "(batch, seq, heads, head_dim)" if layout == "bshd" else "(batch, heads, seq, head_dim)"
        raise ValueError(f"{a.name}: expected a 4-D array {order} for layout={layout!r}, got shape {a.shape}")
    if layout == "bshd":
        (b, s, h, d), (sb, ss, sh, sd) = a.shape, a.strides
    else:
        (b, h, s, d), (sb, sh, ss, sd) = a.shape, a.strides
    if a.on_device and sd != 1 and d > 1:
        raise ValueError(f"{a.name}: the head_dim axis must be contiguous (stride 1 element), "
                         f"got strides {a.strides} (in elements) for shape {a.shape}")
    return (b, s, h, d), (sb, ss, sh)


def _check_qkv(ins, allow_tf32: bool, fp8: bool = False) -> int:
    """Common checks of q, k, v (``fp8``: float8_e4m3fn allowed too); returns the byte alignment the
    kernel needs."""
    places = {a.on_device for a in ins}
    if len(places) != 1:
        where = ", ".join(f"{a.name} on {'device' if a.on_device else 'host'}" for a in ins)
        raise TypeError(f"q, k, v: expected all host (NumPy) or all device arrays, got {where}")
    for a in ins:
        if a.dtype.name not in SUPPORTED_DTYPES and not (fp8 and a.dtype.name == FP8):
            kinds = f"float32, float16, bfloat16 or {FP8}" if fp8 else "float32, float16 or bfloat16"
            raise TypeError(f"{a.name}: expected dtype {kinds}, got {a.dtype}")
    if len({a.dtype for a in ins}) != 1:
        raise TypeError("q, k, v: expected one dtype, got " + ", ".join(f"{a.name} {a.dtype}" for a in ins))
    ordinals = {a.ordinal for a in ins if a.ordinal is not None}
    if len(ordinals) > 1:
        raise ValueError(f"q, k, v: expected arrays on one device, got devices {sorted(ordinals)}")
    return TENSOR_CORE_ALIGN if ins[0].dtype.itemsize <= 2 or allow_tf32 else 1


def _check_tc_strides(ins, align: int) -> None:
    """The tensor-core kernels read 16-byte chunks: every device stride a multiple of 16 bytes."""
    if align <= 1:
        return
    per_chunk = align // ins[0].dtype.itemsize
    for a in ins:
        if a.on_device and any(st % per_chunk for st, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1):
            raise ValueError(f"{a.name}: the tensor-core kernel reads 16-byte chunks; strides must be multiples of "
                             f"{per_chunk} elements, got {a.strides} (copy the array to make it contiguous)")


def _check_heads(Hq, Hk, D, Dk, Sq, Sk, B):
    if Dk != D:
        raise ValueError(f"k: expected head_dim {D} (from q), got {Dk}")
    if Hk < 1 or Hq % Hk != 0:
        raise ValueError(f"k: query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    if D % 8 != 0 or not 8 <= D <= 256:
        raise ValueError(f"q: head_dim must be a multiple of 8 in [8, 256], got {D}")
    if B > _MAX_GRID_YZ or Hq > _MAX_GRID_YZ:
        raise ValueError(f"q: batch and heads must each be <= {_MAX_GRID_YZ}, got batch {B}, heads {Hq}")
    if max(Sq, Sk) > INT32_MAX:
        raise ValueError(f"q/k: sequence lengths must be < 2**31, got {Sq}, {Sk}")


def _with_out(problem: AttentionProblem, out, dtype) -> AttentionProblem:
    out_strides = check_out(out, problem.out_shape(), dtype, problem.on_device)
    if out_strides is not None:
        if problem.align > 1 and any(st % 2 for st in out_strides[:-1]):
            raise ValueError(f"out: the tensor-core kernel writes pairs of elements; strides must be even, "
                             f"got {out_strides}")
        problem = problem._replace(out_strides=out_strides)
    return problem


def _check_descale(dtype: str, descale) -> tuple:
    """The (q, k, v) descale factors: positive, finite in fp32, and only for fp8 inputs."""
    named = tuple(zip(("descale_q", "descale_k", "descale_v"), descale))
    if dtype != FP8:
        given = [n for n, x in named if x is not None]
        if given:
            raise ValueError(f"{given[0]}: descale factors are for {FP8} inputs only, got {dtype} inputs")
        return (1.0, 1.0, 1.0)
    return tuple(1.0 if x is None else check_fp32(name, x) for name, x in named)


def make_problem(q, k, v, *, causal=False, mask=None, window=None, softcap=None, alibi=None, scale=None,
                 layout="bshd", out=None, allow_tf32=False, descale=(None, None, None)) -> AttentionProblem:
    """Validate ``attention`` arguments (``Arg`` objects for q, k, v, mask, alibi, out).

    Raises
    ------
    TypeError
        Wrong argument types, unsupported or mixed dtypes, host mixed with device arrays.
    ValueError
        Wrong ranks or shapes, head counts that do not divide, head_dim not a multiple of 8 or
        above 256, a non-contiguous head_dim axis, a bad scale, a mask not broadcastable to
        (B, Hq, Sq, Sk), bad window/softcap/ALiBi/out arguments, strides the kernel cannot read.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    causal = check_causal(causal)
    ins = (q, k, v)
    align = _check_qkv(ins, allow_tf32, fp8=True)
    (B, Sq, Hq, D), qs = _bshd(q, layout)
    (Bk, Sk, Hk, Dk), ks = _bshd(k, layout)
    (Bv, Sv, Hv, Dv), vs = _bshd(v, layout)
    if (Bk, Sk, Hk, Dk) != (Bv, Sv, Hv, Dv):
        raise ValueError(f"v: expected the same shape as k {k.shape}, got {v.shape}")
    if Bk != B:
        raise ValueError(f"k: expected batch {B} (from q), got {Bk}")
    _check_heads(Hq, Hk, D, Dk, Sq, Sk, B)
    fp8 = q.dtype.name == FP8
    if fp8 and D % 16:
        raise ValueError(f"q: {FP8} inputs need a head_dim that is a multiple of 16 (rows of whole 16 bytes for "
                         f"TMA), got {D}")
    _check_tc_strides(ins, align)
    scale = check_scale(scale, D)
    window, softcap = check_window(window), check_softcap(softcap)
    mask_info = check_mask(mask, (B, Hq, Sq, Sk))
    alibi_info = check_alibi(alibi, B, Hq)
    factors = _check_descale(q.dtype.name, descale)
    if fp8:
        _check_fp8(q, mask_info, (qs, ks, vs), Sk)
        # the kernel's score scale (scale * descale_q * descale_k, and its log2(e) form) is a float32
        check_fp32("descale_q", scale * factors[0] * factors[1] * LOG2E)
    problem = AttentionProblem(B, Hq, Hk, Sq, Sk, D, q.dtype.name, layout, causal, scale, q.on_device, qs, ks, vs,
                               window, softcap, mask_info, alibi_info, allow_tf32=bool(allow_tf32), align=align,
                               descale=factors)
    return _with_out(problem, out, _bf16() if fp8 else q.dtype)


def _bf16() -> np.dtype:
    import ml_dtypes  # a dependency; imported where fp8 calls need the bf16 output dtype

    return np.dtype(ml_dtypes.bfloat16)


def _check_fp8(q, mask_info, strides, sk: int) -> None:
    """What the fp8 kernel (attn_fwd_fp8: dense, TMA-fed) cannot take, refused before device work."""
    if mask_info is not None and mask_info.kind != "bool":
        raise ValueError(f"mask: {FP8} inputs take a bool mask (or none), got a {mask_info.kind} mask")
    if not q.on_device:
        raise TypeError(f"q: {FP8} inputs must be device arrays (torch / CuPy / DeviceArray), got a NumPy array")
    for name, (_, ss, _) in zip("qkv", strides):
        if ss == 0 and sk > 1:
            raise ValueError(f"{name}: {FP8} inputs are read by TMA, which cannot broadcast the sequence axis")


def _cu_meta(cu) -> None:
    if cu.dtype != np.int32:
        raise TypeError(f"{cu.name}: expected dtype int32, got {cu.dtype}")
    if len(cu.shape) != 1 or cu.shape[0] < 1:
        raise ValueError(f"{cu.name}: expected shape (num_seqs + 1,), got {cu.shape}")
    if cu.on_device and cu.strides[0] != 1 and cu.shape[0] > 1:
        raise ValueError(f"{cu.name}: expected a contiguous array, got element strides {cu.strides}")


def _cu_values(cu, values, total: int) -> np.ndarray:
    host = np.asarray(values).astype(np.int64)
    if host[0] != 0 or host[-1] != total or (np.diff(host) < 0).any():
        raise ValueError(f"{cu.name}: must start at 0, be non-decreasing and end at the packed length {total}, "
                         f"got {host.tolist() if host.size <= 16 else host}")
    return host


def make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, fetch, *, max_seqlen_q=None, max_seqlen_k=None,
                        causal=False, window=None, softcap=None, alibi=None, scale=None, out=None,
                        allow_tf32=False) -> tuple:
    """Validate ``attention_varlen`` arguments: packed (total, H, D) Args and int32 cumulative lengths
    (Args). Their values are range-checked after every other check: a device array's values come
    back through ``fetch(arg)``, the only device work before the launch. Returns the problem and
    the host values ``(cu_q, cu_k)`` (int64).

    Device offsets with both ``max_seqlen_q`` and ``max_seqlen_k`` given are not read (FlashAttention's
    varlen contract): ``fetch`` is never called and the host values are None. The call then needs no
    synchronisation and a CUDA graph can hold it; the kernels clamp each sequence's rows into the
    packed arrays and its lengths to the maxima (kernels_src/common.cuh ``clamp_rows``), so wrong
    offsets give wrong rows, never accesses outside q, k, v, out and the LSE."""
    causal = check_causal(causal)
    ins = (q, k, v)
    align = _check_qkv(ins, allow_tf32)
    for a in ins:
        if len(a.shape) != 3:
            raise ValueError(f"{a.name}: expected a 3-D array (total_tokens, heads, head_dim), got shape {a.shape}")
        if a.on_device and a.strides[2] != 1 and a.shape[2] > 1:
            raise ValueError(f"{a.name}: the head_dim axis must be contiguous, got element strides {a.strides}")
    (Tq, Hq, D), (Tk, Hk, Dk) = q.shape, k.shape
    if v.shape != k.shape:
        raise ValueError(f"v: expected the same shape as k {k.shape}, got {v.shape}")
    _check_heads(Hq, Hk, D, Dk, Tq, Tk, 1)
    _check_tc_strides(ins, align)
    scale = check_scale(scale, D)
    window, softcap = check_window(window), check_softcap(softcap)
    for cu in (cu_seqlens_q, cu_seqlens_k):
        _cu_meta(cu)
        if cu.on_device != q.on_device:
            raise TypeError(f"{cu.name}: expected a {'device' if q.on_device else 'NumPy'} array like q")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} entries like cu_seqlens_q, "
                         f"got {cu_seqlens_k.shape[0]}")
    n = cu_seqlens_q.shape[0] - 1
    if n > _MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: at most {_MAX_GRID_YZ} sequences, got {n}")
    alibi_info = check_alibi(alibi, n, Hq)
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if given is not None and (isinstance(given, (bool, np.bool_)) or not isinstance(given, (int, np.integer))):
            raise TypeError(f"{name}: expected an int, got {type(given).__name__}")
        if given is not None and not 0 <= given <= INT32_MAX:  # before the values are fetched from the device
            raise ValueError(f"{name}: expected an int in [0, 2**31 - 1], got {given!r}")
    strides = tuple((0, a.strides[0], a.strides[1]) for a in ins)
    problem = AttentionProblem(n, Hq, Hk, 0, 0, D, q.dtype.name, "thd", causal, scale, q.on_device, *strides,
                               window, softcap, None, alibi_info, total_q=Tq, allow_tf32=bool(allow_tf32),
                               align=align, total_k=Tk)
    problem = _with_out(problem, out, q.dtype)
    if q.on_device and max_seqlen_q is not None and max_seqlen_k is not None:  # unread: see the docstring
        return problem._replace(seqlen_q=int(max_seqlen_q), seqlen_k=int(max_seqlen_k)), None
    cu_q = _cu_values(cu_seqlens_q, fetch(cu_seqlens_q), Tq)
    cu_k = _cu_values(cu_seqlens_k, fetch(cu_seqlens_k), Tk)
    longest = []
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        actual = int(np.diff(cu).max(initial=0))
        if given is not None:
            if not actual <= given <= INT32_MAX:
                raise ValueError(f"{name}: expected an int in [the longest sequence ({actual}), 2**31 - 1], "
                                 f"got {given!r}")
            actual = int(given)
        longest.append(actual)
    return problem._replace(seqlen_q=longest[0], seqlen_k=longest[1]), (cu_q, cu_k)


def check_pointers(problem, q, k, v, out=None) -> None:
    """Per-call address checks (the plan is shared by calls with other addresses); ``q, k, v, out``
    are Args (``out`` may be None)."""
    if problem.align > 1:
        check_addresses(problem, q.ptr, k.ptr, v.ptr, None if out is None else out.ptr)


def check_addresses(problem, q: int, k: int, v: int, out=None) -> None:
    """:func:`check_pointers` on bare addresses (the repeat-call path reads no Args); ``out`` is
    None when there is no ``out=`` (its dtype is q's, validated with the problem)."""
    if problem.align <= 1:
        return
    for name, ptr in (("q", q), ("k", k), ("v", v)):
        if ptr % problem.align:
            raise ValueError(f"{name}: the tensor-core kernel reads 16-byte chunks; the data address must be "
                             f"16-byte aligned, got {ptr:#x} (copy the array to make it aligned)")
    pair = 2 * _ITEMSIZE[problem.out_dtype]
    if out is not None and out % pair:
        raise ValueError(f"out: the tensor-core kernel writes pairs of elements; the address must be "
                         f"{pair}-byte aligned, got {out:#x}")

"""Validate ``attention_backward`` / ``attention_varlen_backward`` arguments into a frozen problem.

The forward's arguments (q, k, v and every option) go through the forward's own validators
(:func:`~.attention.make_problem`, :func:`~.attention.make_varlen_problem`), so the backward
accepts and refuses exactly what ``attention`` / ``attention_varlen`` do (minus ``mask``,
``allow_tf32`` and ``out=``, which it does not take). Then the backward's own arrays:

- ``dout`` and ``out``: q's shape, dtype and place; ``dout`` is read in 16-byte chunks by the
  tensor-core kernel (the alignment q has), ``out`` by plain loads;
- ``lse``: float32 in the shape ``attention(..., return_lse=True)`` returns, (B, Hq, Sq) (varlen
  (Hq, total_q)), any strides on the device; a host LSE may hold ``-inf`` (rows that saw no key)
  but no NaN or ``+inf``;
- ``dq``, ``dk``, ``dv``: optional destinations, q's / k's / v's shape and q's dtype, same place
  (dk and dv are stored as element pairs by the tensor-core kernel: even strides and addresses).

No device is touched here (varlen offsets on the device are fetched by the caller's ``fetch``,
exactly as for the forward).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .attention import TENSOR_CORE_ALIGN, make_problem, make_varlen_problem
from .options import check_bool, check_out

__all__ = ["BackwardProblem", "make_backward_problem", "make_varlen_backward_problem", "check_backward_addresses"]

_F32 = np.dtype(np.float32)


class BackwardProblem(NamedTuple):
    """A validated backward call: the forward's problem (``base``; its ``out_strides`` unused) and
    the element strides of the backward's own arrays. Strides of dout, out, dq, dk, dv are
    (batch, seq, head) like q's in ``base`` (varlen: batch stride 0); ``lse_strides`` are
    (batch, head, seq). ``dq/dk/dv_strides`` are None when the op allocates the result."""

    base: object
    dout_strides: tuple
    o_strides: tuple
    lse_strides: tuple
    dq_strides: tuple | None
    dk_strides: tuple | None
    dv_strides: tuple | None
    deterministic: bool
    k_shape: tuple  # k's (and dk's, dv's) shape in the caller's layout

    @property
    def on_device(self) -> bool:
        return self.base.on_device


def _bsh(a, layout: str) -> tuple:
    """Element strides (batch, seq, head) of a validated array Arg in ``layout``."""
    st = a.strides
    if layout == "thd":
        return (0, st[0], st[1])
    return (st[0], st[1], st[2]) if layout == "bshd" else (st[0], st[2], st[1])


def _like_q(a, q, P) -> tuple:
    """``dout`` / ``out``: q's exact shape and dtype, same place, head_dim contiguous; dout also
    readable in 16-byte chunks where q must be."""
    if a.on_device != q.on_device:
        raise TypeError(f"{a.name}: expected a {'device' if q.on_device else 'NumPy'} array like q, "
                        f"got a {'device' if a.on_device else 'host'} array")
    if tuple(a.shape) != tuple(q.shape):
        raise ValueError(f"{a.name}: expected q's shape {tuple(q.shape)}, got {tuple(a.shape)}")
    if a.dtype != q.dtype:
        raise TypeError(f"{a.name}: expected q's dtype {q.dtype}, got {a.dtype}")
    if a.on_device:
        if a.strides[-1] != 1 and a.shape[-1] > 1:
            raise ValueError(f"{a.name}: the head_dim axis must be contiguous (stride 1 element), got strides "
                             f"{a.strides}")
        if a.name == "dout" and P.align > 1:
            per_chunk = P.align // a.dtype.itemsize
            if any(st % per_chunk for st, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1):
                raise ValueError(f"dout: the tensor-core kernel reads 16-byte chunks; strides must be multiples of "
                                 f"{per_chunk} elements, got {a.strides} (copy the array to make it contiguous)")
    return _bsh(a, P.layout)


def _check_lse(lse, shape: tuple, on_device: bool) -> tuple:
    """The forward's LSE: float32, ``shape``, same place; returns its (batch, head, seq) strides."""
    if lse.on_device != on_device:
        raise TypeError(f"lse: expected a {'device' if on_device else 'NumPy'} array like q, got a "
                        f"{'device' if lse.on_device else 'host'} array")
    if lse.dtype != _F32:
        raise TypeError(f"lse: expected dtype float32 (as attention(..., return_lse=True) returns it), got {lse.dtype}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"lse: expected shape {tuple(shape)} (the LSE attention(..., return_lse=True) returns), "
                         f"got {tuple(lse.shape)}")
    if not on_device:
        x = np.asarray(lse.obj)
        if np.isnan(x).any() or np.isposinf(x).any():
            raise ValueError("lse: must be finite or -inf (a row that saw no key), not NaN or +inf")
    st = lse.strides
    return (0, st[0], st[1]) if len(shape) == 2 else tuple(st)


def _grad_out(a, shape: tuple, dtype, P, pairs: bool):
    """A ``dq``/``dk``/``dv`` destination: element strides (batch, seq, head), or None."""
    if a is None:
        return None
    strides = check_out(a, shape, dtype, P.on_device)  # (out: ... messages; renamed below)
    if strides is None:
        return None
    if pairs and P.align > 1 and any(st % 2 for st in strides[:-1]):
        raise ValueError(f"{a.name}: the tensor-core kernel writes pairs of elements; strides must be even, "
                         f"got {strides}")
    return _bsh(a, P.layout)


def _renamed(fn, name_of):
    """Run a check whose messages say ``out:`` and make them name the real argument."""
    try:
        return fn()
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        if msg.startswith("out:"):
            raise type(exc)(f"{name_of}:{msg[4:]}") from None
        raise


_MAX_DETERMINISTIC_KEYS = 65535 * 32  # deterministic grids put key blocks (>= 32 keys) on gridDim.z


def _finish(P, dout, out, lse, dq, dk, dv, deterministic, q, k, v) -> BackwardProblem:
    deterministic = check_bool("deterministic", deterministic)
    if deterministic and getattr(P, "seqlen_k", 0) > _MAX_DETERMINISTIC_KEYS:
        raise ValueError(f"deterministic: supported up to {_MAX_DETERMINISTIC_KEYS} keys per sequence, got "
                         f"{P.seqlen_k}")
    do_st = _like_q(dout, q, P)
    o_st = _like_q(out, q, P)
    lse_st = _check_lse(lse, P.lse_shape(), P.on_device)
    dtype = q.dtype
    grads = []
    for a, like, pairs in ((dq, q, False), (dk, k, True), (dv, v, True)):
        grads.append(None if a is None else _renamed(
            lambda a=a, like=like, pairs=pairs: _grad_out(a, tuple(like.shape), dtype, P, pairs), a.name))
    return BackwardProblem(P, do_st, o_st, lse_st, *grads, deterministic, tuple(k.shape))


def make_backward_problem(dout, q, k, v, out, lse, *, causal=False, window=None, softcap=None, alibi=None,
                          scale=None, layout="bshd", dq=None, dk=None, dv=None,
                          deterministic=False) -> BackwardProblem:
    """Validate ``attention_backward`` arguments (Args; the optional ones may be None).

    Raises
    ------
    TypeError, ValueError
        Everything ``attention`` refuses for q, k, v and the options, and a dout/out/lse/dq/dk/dv
        of the wrong shape, dtype, place or strides, a bad ``deterministic``; messages name the
        argument.
    """
    P = make_problem(q, k, v, causal=causal, window=window, softcap=softcap, alibi=alibi, scale=scale, layout=layout)
    return _finish(P, dout, out, lse, dq, dk, dv, deterministic, q, k, v)


def make_varlen_backward_problem(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, fetch, *, max_seqlen_q=None,
                                 max_seqlen_k=None, causal=False, window=None, softcap=None, alibi=None, scale=None,
                                 dq=None, dk=None, dv=None, deterministic=False) -> tuple:
    """Validate ``attention_varlen_backward`` arguments; returns the problem and the host offsets
    ``(cu_q, cu_k)`` (see :func:`~.attention.make_varlen_problem`). Every check that needs no
    offset values runs before ``fetch`` is first called (the one device read)."""
    checked = []

    def fetch_after_checks(a):
        if not checked:  # q, k, v and the options passed: the backward's own arrays before any device read
            tq, hq = q.shape[0], q.shape[1]
            early = _Early(TENSOR_CORE_ALIGN if q.dtype.itemsize == 2 else 1, q.on_device, (hq, tq))
            _finish(early, dout, out, lse, dq, dk, dv, deterministic, q, k, v)
            checked.append(True)
        return fetch(a)

    P, cus = make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, fetch_after_checks, max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k, causal=causal, window=window, softcap=softcap, alibi=alibi,
                                 scale=scale)
    return _finish(P, dout, out, lse, dq, dk, dv, deterministic, q, k, v), cus


class _Early(NamedTuple):
    """What the backward's own checks read of a varlen problem, known before its offsets are."""

    align: int
    on_device: bool
    lse: tuple
    layout: str = "thd"

    def lse_shape(self) -> tuple:
        return self.lse


def check_backward_addresses(P: BackwardProblem, dout: int, dk: int = 0, dv: int = 0) -> None:
    """Per-call address checks (a plan is shared by calls with other addresses; q, k, v are the
    forward's :func:`~.attention.check_addresses`): dout read in 16-byte chunks, dk/dv stored as
    element pairs by the tensor-core kernel (0: allocated by the op)."""
    if P.base.align <= 1:
        return
    if dout % P.base.align:
        raise ValueError(f"dout: the tensor-core kernel reads 16-byte chunks; the data address must be 16-byte "
                         f"aligned, got {dout:#x} (copy the array to make it aligned)")
    pair = 2 * np.dtype(np.float16).itemsize
    for name, ptr in (("dk", dk), ("dv", dv)):
        if ptr % pair:
            raise ValueError(f"{name}: the tensor-core kernel writes pairs of elements; the address must be "
                             f"{pair}-byte aligned, got {ptr:#x}")

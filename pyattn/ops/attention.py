"""``pyattn.attention``: fused scaled-dot-product attention (forward).

Host overhead matters for small calls (decode loops call this thousands of times a second), so a
validated call is remembered as a :class:`_Plan` keyed by everything validation looked at
(shapes, element strides, dtypes, device, options). A repeat call with device arrays is a dict
hit, one pool allocation, a 40-byte struct pack and a launch.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np

from ..array import DeviceArray, _c_strides, allocate, asarray
from ..kernels.registry import get_kernel
from ..kernels.specs import select_attention_spec
from ..runtime.device import get_device
from ..runtime.launch import launch
from ..runtime.memory import Allocation
from ..runtime.stream import Stream, as_stream
from ._problem import make_problem

__all__ = ["attention"]

_LOG2E = 1.4426950408889634
_MAX_PLANS = 4096  # distinct shapes remembered; a workload with more just re-validates


@functools.lru_cache(maxsize=256)
def _spec_for(dtype: str, head_dim: int, arch: str, ptx: bool):
    return select_attention_spec(dtype, head_dim, arch, ptx=ptx)


def _ptx_requested() -> bool:
    return os.environ.get("PYATTN_PTX", "") == "1"


class _Plan(NamedTuple):
    """Everything a validated call needs besides the data pointers and the stream."""

    kernel: object
    grid: tuple
    block: tuple
    shared_bytes: int
    packer: object  # PartialPack: q, k, v, o, lse pointers -> param bytes
    out_shape: tuple
    out_strides: tuple
    out_elem_strides: tuple
    out_nbytes: int
    lse_shape: tuple
    dtype: np.dtype
    empty: bool  # nothing to launch (a zero-size dimension)
    align_mask: int  # q/k/v addresses must have these bits clear (16-byte cp.async in the MMA kernel)


def _check_alignment(dq, dk, dv, mask: int) -> None:
    """Reject, before launch, q/k/v addresses the kernel's 16-byte loads cannot read."""
    if (dq.ptr | dk.ptr | dv.ptr) & mask:
        bad = next(name for name, a in (("q", dq), ("k", dk), ("v", dv)) if a.ptr & mask)  # for the message
        raise ValueError(f"{bad}: the tensor-core kernel reads 16-byte chunks; the data address must be "
                         f"16-byte aligned (copy the array to make it aligned)")


_plans: dict = {}


def _bsh(elem_strides: tuple, layout: str) -> tuple:
    """Element strides of a 4-D array as (batch, seq, head)."""
    sb, s1, s2, _ = elem_strides
    return (sb, s1, s2) if layout == "bshd" else (sb, s2, s1)


def _make_plan(P, spec, kernel, dq, dk, dv) -> _Plan:
    align_mask = 15 if spec.family == "attn_fwd_mma" else 0
    if align_mask:
        for name, a in (("q", dq), ("k", dk), ("v", dv)):
            if any(st % 8 for st in a.elem_strides[:3]):
                raise ValueError(f"{name}: the tensor-core kernel reads 16-byte chunks; strides must be multiples "
                                 f"of 8 elements, got {a.elem_strides} (copy the array to make it contiguous)")
    out_shape = P.out_shape()
    out_elem = _c_strides(out_shape, 1)
    qs, ks, vs, os_ = (_bsh(a, P.layout) for a in (dq.elem_strides, dk.elem_strides, dv.elem_strides, out_elem))
    packer = spec.params.partial({
        "q_stride_b": qs[0], "q_stride_s": qs[1], "q_stride_h": qs[2],
        "k_stride_b": ks[0], "k_stride_s": ks[1], "k_stride_h": ks[2],
        "v_stride_b": vs[0], "v_stride_s": vs[1], "v_stride_h": vs[2],
        "o_stride_b": os_[0], "o_stride_s": os_[1], "o_stride_h": os_[2],
        "batch": P.batch, "heads_q": P.heads_q, "heads_kv": P.heads_kv, "group": P.group,
        "seqlen_q": P.seqlen_q, "seqlen_k": P.seqlen_k, "head_dim": P.head_dim, "causal": int(P.causal),
        "scale_log2": P.scale * _LOG2E, "scale": P.scale,
    })
    itemsize = dq.dtype.itemsize
    n_out = P.batch * P.heads_q * P.seqlen_q * P.head_dim
    return _Plan(kernel, spec.grid(P.batch, P.heads_q, P.seqlen_q), (spec.threads, 1, 1), spec.shared_bytes,
                 packer, out_shape, tuple(e * itemsize for e in out_elem), out_elem, n_out * itemsize,
                 (P.batch, P.heads_q, P.seqlen_q), dq.dtype, n_out == 0, align_mask)


def _run(plan: _Plan, dq, dk, dv, return_lse: bool, s: Stream):
    """Allocate outputs and launch a planned call on stream ``s``; returns DeviceArrays."""
    if plan.align_mask:
        _check_alignment(dq, dk, dv, plan.align_mask)
    device = dq.device
    out = allocate(device, s, plan.out_shape, plan.dtype, plan.out_strides, plan.out_elem_strides, plan.out_nbytes)
    lse = None
    if return_lse:
        b, h, n = plan.lse_shape
        lse = allocate(device, s, plan.lse_shape, _F32, (h * n * 4, n * 4, 4), (h * n, n, 1), b * h * n * 4)
    if not plan.empty:
        params = plan.packer.pack(dq.ptr, dk.ptr, dv.ptr, out.ptr, lse.ptr if lse is not None else 0)
        launch(plan.kernel, plan.grid, plan.block, plan.shared_bytes, s, params)
        for a in (dq, dk, dv):
            owner = a.owner
            if type(owner) is Allocation and owner.stream is not s:
                owner.record_stream(s)  # the block's free must wait for this stream's use
    return out, lse


_F32 = np.dtype(np.float32)


def attention(q, k, v, *, causal=False, scale=None, layout="bshd", return_lse=False, stream=None):
    """Scaled-dot-product attention, ``softmax(scale * q k^T) v``, computed by a fused GPU kernel.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim) for ``layout="bshd"``
        Queries. ``layout="bhsd"`` takes (batch, heads_q, seqlen_q, head_dim) (torch SDPA's order).
        NumPy arrays are copied to the GPU; CUDA arrays (``pyattn.DeviceArray``, CuPy, PyTorch,
        JAX, anything with ``__cuda_array_interface__`` or ``__dlpack__``) are read in place and
        may be strided, as long as the head_dim axis is contiguous.
    k, v : array, shape (batch, seqlen_k, heads_kv, head_dim)
        Keys and values, same layout. ``heads_q`` must be a multiple of ``heads_kv`` (GQA/MQA):
        query head ``h`` attends with key/value head ``h // (heads_q // heads_kv)``.
    causal : bool, default False
        Causal mask aligned to the bottom-right corner: query ``i`` sees keys
        ``j <= i + seqlen_k - seqlen_q`` (FlashAttention >= 2.1). When ``seqlen_q > seqlen_k`` the
        first ``seqlen_q - seqlen_k`` rows see no key.
    scale : float, optional
        Score scale, default ``1 / sqrt(head_dim)``.
    layout : {"bshd", "bhsd"}
    return_lse : bool, default False
        Also return the log-sum-exp of the scaled scores, natural log, float32,
        shape (batch, heads_q, seqlen_q).
    stream : optional
        Stream for all work (a ``pyattn.Stream``, an object with ``__cuda_stream__``, or an int
        ``CUstream``). Default: pyattn's own stream. Device results are ordered on it.

    Returns
    -------
    out : array, q's shape and dtype
        A NumPy array for NumPy inputs, a ``pyattn.DeviceArray`` for device inputs.
    lse : array, optional
        Only with ``return_lse=True``.

    Notes
    -----
    q, k, v must share one dtype: float32, float16 or bfloat16 (``ml_dtypes.bfloat16`` on the
    host). Scores, softmax and accumulation are float32; the output is rounded to the input dtype.
    A query row that sees no key (fully masked) gets output 0 and LSE ``-inf``, never NaN.
    Head dims are multiples of 8 up to 256.

    All validation happens before any GPU work: bad input raises ``ValueError`` or ``TypeError``
    naming the argument. The call is thread-safe; results on one stream are ordered.

    Examples
    --------
    >>> import numpy as np, pyattn
    >>> q = np.random.randn(1, 128, 8, 64).astype(np.float16)
    >>> out = pyattn.attention(q, q, q, causal=True)  # doctest: +SKIP
    """
    if type(q) is DeviceArray and type(k) is DeviceArray and type(v) is DeviceArray:
        try:
            key = (q.shape, q.elem_strides, q.dtype, q.device, k.shape, k.elem_strides, k.dtype, k.device,
                   v.shape, v.elem_strides, v.dtype, v.device, causal, scale, layout, _ptx_requested())
            plan = _plans.get(key)
        except TypeError:  # an unhashable argument: validation below names it
            key = plan = None
        if plan is not None:
            s = stream if type(stream) is Stream else as_stream(stream, q.device)
            q.device.activate()
            out, lse = _run(plan, q, k, v, return_lse, s)
            return (out, lse) if return_lse else out
    else:
        key = None

    problem, _ = make_problem(q, k, v, causal=causal, scale=scale, layout=layout)
    if problem.on_device:
        dq = asarray(q, stream=stream)  # a zero-copy view; its device comes from the pointer
        device = dq.device
    else:
        device = get_device()
    s = as_stream(stream, device)
    device.activate()

    # Compile (or fetch) before copying data, so a compile error costs no transfer.
    spec = _spec_for(problem.dtype, problem.head_dim, device.arch, _ptx_requested())
    kernel = get_kernel(spec, device)

    if not problem.on_device:
        dq = asarray(q, device=device, stream=s)
    dk, dv = (asarray(x, device=device, stream=s) for x in (k, v))
    if problem.on_device and not (dq.device is dk.device is dv.device):
        raise ValueError("q, k, v: expected arrays on one device, got devices "
                         f"{dq.device.ordinal}, {dk.device.ordinal}, {dv.device.ordinal}")
    plan = _make_plan(problem, spec, kernel, dq, dk, dv)
    if key is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    out, lse = _run(plan, dq, dk, dv, return_lse, s)

    if problem.on_device:
        return (out, lse) if return_lse else out
    host_out = out.numpy(s)
    return (host_out, lse.numpy(s)) if return_lse else host_out

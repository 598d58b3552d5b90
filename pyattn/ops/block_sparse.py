"""``pyattn.block_sparse_attention``: attention over a block-sparse (BSR) layout.

The tensor-core prefill kernels walk a per-(query head, query tile) list of key tiles instead of
every tile of the band (``kernels_src/block_sparse.cuh``). The host turns the user's layout of
``R x C`` blocks into those lists at the kernel's tile shape, with a 64-bit mask of 16 x 16
sub-blocks per tile, so any block size that is a multiple of 16 works with any tile shape, and
blocks no row can see under ``causal``/``window`` are dropped before launch (work is proportional
to the visible non-zero blocks).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from ..array import DeviceArray, asarray
from ..kernels.registry import get_kernel
from ..runtime.stream import as_stream
from ._plan import make_plan, ptx_requested, run_plan, spec_for
from ._problem import describe_input, make_problem
from ._sparse_layout import check_block_layout, check_block_size, tile_lists

__all__ = ["block_sparse_attention", "sparse_spec"]

_DTYPES = ("float16", "bfloat16")
# Converted tile lists on the device, keyed by the layout's bytes and everything the conversion
# read: converting a 16-head 16k layout takes ~25 ms of NumPy, hashing it ~0.2 ms, and a model
# calls with the same layout every step.
_MAX_LISTS = 16
_lists: dict = {}


def sparse_spec(dtype: str, head_dim: int, arch: str, softcap: bool, alibi: bool, block_size: tuple):
    """The block-sparse kernel spec: attention's spec for the problem, reading tile lists.

    Blocks the standard tiles cover whole keep them (``sparse=1``); smaller blocks take 64 x 64
    tiles (``sparse=2``): a random 10% layout of 64 x 64 blocks touches 34% of the 128 x 128 tiles.
    """
    spec = spec_for(dtype, head_dim, arch, ptx_requested(), "none", softcap, alibi)
    std = dataclasses.replace(spec, sparse=1)
    R, C = block_size
    return std if R % std.tiles.block_m == 0 and C % std.tiles.block_n == 0 else dataclasses.replace(spec, sparse=2)


def _device_lists(mask, block, tiles, P, device, s):
    """(ptr, idx, bits) DeviceArrays and stride_h of ``mask`` at the kernel's tile shape (cached)."""
    key = (hashlib.blake2b(mask.tobytes(), digest_size=16).digest(), mask.shape, block, tiles, P.seqlen_q,
           P.seqlen_k, P.causal, P.window, device.ordinal)
    hit = _lists.get(key)
    if hit is not None:
        return hit
    lists = tile_lists(mask, block, tiles[0], tiles[1], P.seqlen_q, P.seqlen_k, causal=P.causal, window=P.window)
    arrays = (lists.ptr, lists.idx if lists.nnz else np.zeros(1, np.int32),
              lists.bits if lists.nnz else np.zeros(1, np.uint64))
    hit = tuple(asarray(np.ascontiguousarray(a), device=device, stream=s) for a in arrays) + (lists.stride_h,)
    if len(_lists) >= _MAX_LISTS:
        _lists.pop(next(iter(_lists)))
    _lists[key] = hit
    return hit


def block_sparse_attention(q, k, v, layout, block_size, *, causal=False, window=None, softcap=None,
                           alibi_slopes=None, scale=None, tensor_layout="bshd", return_lse=False, out=None,
                           stream=None):
    """Attention restricted to the non-zero blocks of a block-sparse layout.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim) (``tensor_layout="bshd"``)
        float16 or bfloat16, NumPy or device (as :func:`pyattn.attention`).
    k, v : array, shape (batch, seqlen_k, heads_kv, head_dim)
        GQA/MQA as in :func:`pyattn.attention`.
    layout : bool array or (indptr, indices)
        Which ``R x C`` blocks are computed, for all heads or per query head: a bool block mask of
        shape (Mb, Nb) or (heads_q, Mb, Nb) with ``Mb = ceil(seqlen_q / R)``,
        ``Nb = ceil(seqlen_k / C)``; or BSR ``(indptr, indices)`` with indptr of shape (Mb + 1,)
        or (heads_q, Mb + 1) and indices the column-block ids (absolute positions into the one
        ``indices`` array). Host NumPy arrays; duplicates and out-of-range ids are rejected.
    block_size : (int, int)
        ``(R, C)``, each a positive multiple of 16 (finer patterns: :func:`pyattn.sparse_attention`).
    causal, window, softcap, alibi_slopes, scale
        As in :func:`pyattn.attention`, applied inside the blocks (bottom-right alignment).
    tensor_layout : {"bshd", "bhsd"}
        Axis order of q, k, v and the output.
    return_lse : bool
        Also return the natural-log LSE, float32, (batch, heads_q, seqlen_q).
    out : array, optional
        Destination with the output's shape and dtype (device for device inputs, NumPy for NumPy).
    stream : optional

    Returns
    -------
    out : array, q's shape and dtype (NumPy for NumPy inputs)
    lse : array, only with ``return_lse``

    Notes
    -----
    Equal to :func:`pyattn.attention` with the boolean mask that expands ``layout`` (and
    ``causal``/``window``); a query row that sees no key gets output 0 and LSE ``-inf``. Converting a
    layout to the kernel's tile lists takes ~25 ms for 16 heads at seqlen 16k; the last 16
    conversions stay on the device, keyed by the layout's bytes, so repeating a layout costs a hash.

    Examples
    --------
    >>> import numpy as np, pyattn
    >>> q = np.random.randn(1, 1024, 8, 64).astype(np.float16)
    >>> blocks = pyattn.patterns.local(1024, window=256, causal=True, block_size=(64, 64))
    >>> out = pyattn.block_sparse_attention(q, q, q, blocks, (64, 64), causal=True)  # doctest: +SKIP
    """
    R, C = check_block_size(block_size)
    for name, x in (("q", q), ("k", k), ("v", v)):
        dt = describe_input(name, x).dtype
        if dt.name not in _DTYPES:
            raise TypeError(f"{name}: block_sparse_attention takes float16 or bfloat16 (tensor cores), got {dt}")
    host = isinstance(q, np.ndarray)
    problem, _ = make_problem(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                              scale=scale, layout=tensor_layout, out=None if host else out)
    mask = check_block_layout(layout, block_size=(R, C), heads_q=problem.heads_q, seqlen_q=problem.seqlen_q,
                              seqlen_k=problem.seqlen_k)
    if host:  # stage contiguous copies; the plan then reads their (C-order) strides
        if out is not None and not (isinstance(out, np.ndarray) and out.shape == problem.out_shape()
                                    and out.dtype == np.dtype(q.dtype)):
            raise ValueError(f"out: expected a NumPy array of shape {problem.out_shape()} and dtype {q.dtype}")
        dq = asarray(np.ascontiguousarray(q), stream=stream)
        s = as_stream(stream, dq.device)
        dk, dv = (asarray(np.ascontiguousarray(x), device=dq.device, stream=s) for x in (k, v))
        problem, _ = make_problem(dq, dk, dv, causal=causal, window=window, softcap=softcap,
                                  alibi_slopes=alibi_slopes, scale=scale, layout=tensor_layout)
    else:
        dq = asarray(q, stream=stream)
        s = as_stream(stream, dq.device)
        dk, dv = (asarray(x, stream=s) for x in (k, v))
    device = dq.device
    device.activate()
    if not (dq.device is dk.device is dv.device):
        raise ValueError("q, k, v: expected arrays on one device, got devices "
                         f"{dq.device.ordinal}, {dk.device.ordinal}, {dv.device.ordinal}")

    spec = sparse_spec(problem.dtype, problem.head_dim, device.arch, problem.softcap > 0, problem.alibi is not None,
                       (R, C))
    kernel = get_kernel(spec, device)
    t = spec.tiles
    d_ptr, d_idx, d_bits, stride_h = _device_lists(mask, (R, C), (t.block_m, t.block_n), problem, device, s)
    from .attention import upload_extras

    _, dalibi = upload_extras(problem, None, alibi_slopes, device, s)
    dout = asarray(out, stream=s) if (out is not None and not host) else None
    plan = make_plan(problem, spec, kernel, (dq, dk, dv), tile_stride_h=stride_h)
    o, lse = run_plan(plan, (dq, dk, dv), (None, dalibi, None, None, d_ptr, d_idx, d_bits), s,
                      return_lse=return_lse, out=dout)
    if host:
        o_host = o.numpy(s)
        if out is not None:
            out[...] = o_host
            o_host = out
        o = o_host
        lse = lse.numpy(s) if lse is not None else None
    elif out is not None and type(out) is not DeviceArray:
        o = out
    return (o, lse) if return_lse else o

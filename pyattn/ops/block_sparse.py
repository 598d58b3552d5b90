"""``pyattn.block_sparse_attention``: attention over a block-sparse (BSR) layout.

The tensor-core prefill kernels walk a per-(query head, query tile) list of key tiles instead of
every tile of the band (``kernels_src/block_sparse.cuh``). The host turns the user's layout of
``R x C`` blocks into those lists at the kernel's tile shape, with a 64-bit mask of 16 x 16
sub-blocks per tile, so any block size that is a multiple of 16 works with any tile shape, and
blocks no row can see under ``causal``/``window`` are dropped before launch (work is proportional
to the visible non-zero blocks).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from ..interop.inputs import read_args
from ..interop.streams import order_inputs
from ..kernels.specs import select_attention_spec
from ..pipeline import host
from ..pipeline.device import finish, start
from ..pipeline.host import upload
from ..pipeline.plans import get_plan, ptx_requested
from ..runtime.device import keeps_context
from ..runtime.stream import check_stream_arg
from ..validate.attention import check_pointers, make_problem
from ..validate.block_layout import check_block_layout, check_block_size, tile_lists
from ..validate.options import check_bool
from ._fwd import SparseFwd, build_fwd_plan, device_extras, run_fwd

__all__ = ["block_sparse_attention", "sparse_mode", "sparse_problem"]

_DTYPES = ("float16", "bfloat16")
_ARRAYS = ("q", "k", "v", "alibi_slopes", "out")
_REQUIRED = ("q", "k", "v")
# Converted tile lists on the device, keyed by the layout's bytes and everything the conversion
# read: converting a 16-head 16k layout takes ~25 ms of NumPy, hashing it ~0.2 ms, and a model
# calls with the same layout every step.
_MAX_LISTS = 16
_lists: dict = {}


@functools.lru_cache(maxsize=256)
def sparse_mode(dtype: str, head_dim: int, arch: str, softcap: bool, alibi: bool, block_size: tuple) -> int:
    """The kernel's sparse mode: blocks the standard tiles cover whole keep them (1); smaller blocks
    take 64 x 64 tiles (2): a random 10% layout of 64 x 64 blocks touches 34% of the 128 x 128 tiles."""
    t = select_attention_spec(dtype, head_dim, arch, ptx=ptx_requested(), softcap=softcap, alibi=alibi,
                              sparse=1).tiles
    R, C = block_size
    return 1 if R % t.block_m == 0 and C % t.block_n == 0 else 2


def sparse_problem(P, mask, block_size: tuple, arch: str) -> SparseFwd:
    """The kernel problem of a block-sparse call: the mode, and one tile list per query head exactly
    when the validated layout ``mask`` (H, Mb, Nb) has H > 1, as ``tile_lists`` lays the rows out
    (its ``stride_h`` is 0 for a shared layout: the plan's ``tile_stride_h`` must agree)."""
    mode = sparse_mode(P.dtype, P.head_dim, arch, P.softcap > 0, P.alibi is not None, tuple(block_size))
    return SparseFwd(P, mode, mask.shape[0] > 1)


def _device_lists(mask, block, tiles, P, device, s):
    """(ptr, idx, bits) DeviceArrays of ``mask``'s tile lists at the kernel's tile shape (cached)."""
    key = (hashlib.blake2b(mask.tobytes(), digest_size=16).digest(), mask.shape, block, tiles, P.seqlen_q,
           P.seqlen_k, P.causal, P.window, device.ordinal)
    hit = _lists.get(key)
    if hit is not None:
        return hit
    lists = tile_lists(mask, block, tiles[0], tiles[1], P.seqlen_q, P.seqlen_k, causal=P.causal, window=P.window)
    arrays = (lists.ptr, lists.idx if lists.nnz else np.zeros(1, np.int32),
              lists.bits if lists.nnz else np.zeros(1, np.uint64))
    hit = tuple(upload([np.ascontiguousarray(a) for a in arrays], device, s))
    if len(_lists) >= _MAX_LISTS:
        _lists.pop(next(iter(_lists)))
    _lists[key] = hit
    return hit


@keeps_context
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
    check_stream_arg(stream)
    R, C = check_block_size(block_size)
    params = locals()
    args = read_args(params, _ARRAYS, _REQUIRED)
    for name in ("q", "k", "v"):
        if args[name].dtype.name not in _DTYPES:
            raise TypeError(f"{name}: block_sparse_attention takes float16 or bfloat16 (tensor cores), "
                            f"got {args[name].dtype}")
    return_lse = check_bool("return_lse", return_lse)
    P = make_problem(args["q"], args["k"], args["v"], causal=causal, window=window, softcap=softcap,
                     alibi=args["alibi_slopes"], scale=scale, layout=tensor_layout, out=args["out"])
    mask = check_block_layout(layout, block_size=(R, C), heads_q=P.heads_q, seqlen_q=P.seqlen_q,
                              seqlen_k=P.seqlen_k)
    alibi = args["alibi_slopes"]

    def run(device, s, dq, dk, dv, alibi_ptr, dout):
        plan = get_plan(build_fwd_plan, sparse_problem(P, mask, (R, C), device.arch), device)
        t = plan.spec.tiles
        d_ptr, d_idx, d_bits = _device_lists(mask, (R, C), (t.block_m, t.block_n), P, device, s)
        return run_fwd(plan, device, s, dq.ptr, dk.ptr, dv.ptr, out=None if dout is None else dout.ptr,
                       return_lse=return_lse, extras=(0, alibi_ptr, 0, 0, d_ptr.ptr, d_idx.ptr, d_bits.ptr))

    if not P.on_device:  # NumPy in, NumPy out (device ALiBi slopes are passed through)
        host_alibi = np.asarray(alibi.obj, np.float32) if alibi is not None and not alibi.on_device else None

        def on_device(dev, s):
            dq, dk, dv, dal = dev
            if alibi is not None and alibi.on_device:
                order_inputs(s, dq.device, [alibi])
            return run(dq.device, s, dq, dk, dv, dal.ptr if dal is not None else (alibi.ptr if alibi else 0), None)

        o, lse = host.call(on_device, [args["q"].obj, args["k"].obj, args["v"].obj, host_alibi],
                           [args["out"].obj if args["out"] is not None else None], stream)
        return (o, lse) if return_lse else o
    check_pointers(P, args["q"], args["k"], args["v"], args["out"])
    device, s, (dq, dk, dv, dal, dout) = start(stream, [args[n] for n in _ARRAYS],
                                               lambda a: check_pointers(P, a[0], a[1], a[2], a[4]))
    _, alibi_ptr, keep = device_extras(None, dal, device, s)
    o, lse = run(device, s, dq, dk, dv, alibi_ptr, dout)
    finish(s, (dq, dk, dv, dal, dout))
    if out is not None:
        o = out
    return (o, lse) if return_lse else o

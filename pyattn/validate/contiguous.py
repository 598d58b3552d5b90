"""Validate :func:`pyattn.contiguous_decode`'s inputs: per-sequence K/V caches and their lengths.

Inputs are :class:`~pyattn.interop.inputs.Arg` objects (or an int length). No driver call here:
a device ``cache_seqlens`` comes back through the caller's ``fetch`` after every other check.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from .options import check_int
from .paged import PoolInfo, check_layout, check_pools, check_token_chunks

__all__ = ["CACHE_AXES", "check_caches", "check_seqlens", "check_new_tokens"]

CACHE_AXES = {"nhd": "batch, max_len, heads_kv, head_dim", "hnd": "batch, heads_kv, max_len, head_dim"}


def check_caches(k_cache, v_cache, layout: str) -> PoolInfo:
    """Validate the K/V caches (Args) as pools of one page of ``max_len`` slots per sequence:
    device arrays, fp16/bf16, head_dim contiguous, 16-byte rows (as :func:`check_pools`)."""
    check_layout(layout)  # (first: the messages below name the layout's axes)
    for i in (k_cache, v_cache):
        if not i.on_device:
            raise TypeError(f"{i.name}: expected a device array (the KV cache lives on the GPU), got a host array")
        if len(i.shape) != 4:
            raise ValueError(f"{i.name}: expected 4 dims ({CACHE_AXES[layout]}), got shape {i.shape}")
    return check_pools(k_cache, v_cache, layout)


def check_new_tokens(k_new, v_new, pool: PoolInfo, batch: int) -> tuple:
    """Validate the new tokens' K/V Args (or both None): (batch, n_new, heads_kv, head_dim) in the
    caches' dtype; device ones with 16-byte rows (the append kernel copies 16-byte chunks) and the
    same (batch, token) strides for K and V, the batch stride a whole number of token strides, so
    that token i of sequence b is one row index for both. Returns ``(n_new, rows, strides)``:
    token i of sequence b is row ``b * rows + i`` of the element ``strides`` (token, head) of K and
    V alike (host tokens: as uploaded, C-contiguous); ``(0, 0, None)`` without them."""
    if (k_new is None) != (v_new is None):
        raise ValueError(f"k_new, v_new: give both or neither, got {'k_new' if v_new is None else 'v_new'} alone")
    if k_new is None:
        return 0, 0, None
    want = f"({batch}, n_new >= 1, {pool.heads_kv}, {pool.head_dim})"
    for i in (k_new, v_new):
        if i.dtype != pool.dtype:
            raise TypeError(f"{i.name}: expected dtype {pool.dtype} (the caches'), got {i.dtype}")
        if len(i.shape) != 4 or i.shape[0] != batch or i.shape[1] < 1 or i.shape[2:] != (pool.heads_kv, pool.head_dim):
            raise ValueError(f"{i.name}: expected shape {want}, got {i.shape}")
        if i.on_device:
            check_token_chunks(i)
    if k_new.shape != v_new.shape:
        raise ValueError(f"v_new: expected shape {k_new.shape} (k_new's), got {v_new.shape}")
    if k_new.on_device != v_new.on_device:
        where = "a device" if k_new.on_device else "a host"
        raise TypeError(f"v_new: expected {where} array as k_new is, got {'a host' if k_new.on_device else 'a device'} "
                        "array")
    n = k_new.shape[1]
    if not k_new.on_device:
        return n, n, (pool.heads_kv * pool.head_dim, pool.head_dim)
    sb, st, sh = k_new.strides[:3]
    if (sb, st, sh) != tuple(v_new.strides[:3]):
        raise ValueError(f"v_new: expected k_new's element strides {k_new.strides}, got {v_new.strides}")
    if n == 1:  # one token a sequence: rows are sequences
        return n, 1, (sb, sh)
    if st <= 0 or sb % st:
        raise ValueError(f"k_new: the batch stride must be a whole number of token strides, got element strides "
                         f"{k_new.strides}")
    return n, sb // st, (st, sh)


def check_seqlens(cache_seqlens, batch: int, max_len: int, fetch, n_new: int = 0):
    """The cached lengths: an int (every sequence), or an int32 (batch,) Arg whose values come back
    as a NumPy array (a device one through ``fetch``: one synchronisation). Every length must lie
    in ``[0, max_len - n_new]``: the kernels write and read keys up to it plus ``n_new``. ``fetch``
    None (``max_seqlen``'s device lengths, read unchecked): the array's metadata alone, and None."""
    top = max_len - n_new
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError("cache_seqlens: expected an int or an int32 array, got bool")
    if isinstance(cache_seqlens, Integral):
        if n_new and not 0 <= cache_seqlens <= top:
            raise ValueError(f"cache_seqlens: expected an int in [0, {top}] (max_len {max_len} - {n_new} new "
                             f"tokens), got {cache_seqlens}")
        return check_int("cache_seqlens", cache_seqlens, 0, top)
    a = cache_seqlens
    if a.dtype != np.int32:
        raise TypeError(f"cache_seqlens: expected an int or an int32 array, got dtype {a.dtype}")
    if a.shape != (batch,):
        raise ValueError(f"cache_seqlens: expected shape ({batch},) (q's batch), got {a.shape}")
    if a.on_device and batch > 1 and a.strides[0] != 1:
        raise ValueError(f"cache_seqlens: expected a contiguous array, got element strides {a.strides}")
    if fetch is None:
        return None
    lens = fetch(a) if a.on_device else np.asarray(a.obj)
    bad = np.flatnonzero((lens < 0) | (lens > top))
    if bad.size:
        room = "the caches' max_len" if not n_new else f"max_len {max_len} - {n_new} new tokens"
        raise ValueError(f"cache_seqlens: expected 0 <= cache_seqlens[i] <= {top} ({room}), "
                         f"got cache_seqlens[{int(bad[0])}] = {int(lens[bad[0]])}")
    return lens

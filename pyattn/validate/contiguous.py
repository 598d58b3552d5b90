"""Validate :func:`pyattn.contiguous_decode`'s inputs: per-sequence K/V caches and their lengths.

Inputs are :class:`~pyattn.interop.inputs.Arg` objects (or an int length). No driver call here:
a device ``cache_seqlens`` comes back through the caller's ``fetch`` after every other check.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from .options import check_int
from .paged import POOL_LAYOUTS, PoolInfo, check_pools

__all__ = ["CACHE_AXES", "check_caches", "check_seqlens"]

CACHE_AXES = {"nhd": "batch, max_len, heads_kv, head_dim", "hnd": "batch, heads_kv, max_len, head_dim"}


def check_caches(k_cache, v_cache, layout: str) -> PoolInfo:
    """Validate the K/V caches (Args) as pools of one page of ``max_len`` slots per sequence:
    device arrays, fp16/bf16, head_dim contiguous, 16-byte rows (as :func:`check_pools`)."""
    if layout not in POOL_LAYOUTS:
        raise ValueError(f"layout: expected one of {POOL_LAYOUTS}, got {layout!r}")
    for i in (k_cache, v_cache):
        if not i.on_device:
            raise TypeError(f"{i.name}: expected a device array (the KV cache lives on the GPU), got a host array")
        if len(i.shape) != 4:
            raise ValueError(f"{i.name}: expected 4 dims ({CACHE_AXES[layout]}), got shape {i.shape}")
    return check_pools(k_cache, v_cache, layout)


def check_seqlens(cache_seqlens, batch: int, max_len: int, fetch):
    """The cached lengths: an int (every sequence), or an int32 (batch,) Arg whose values come back
    as a NumPy array (a device one through ``fetch``: one synchronisation). Every length must lie
    in ``[0, max_len]``: the kernel reads keys up to it."""
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError("cache_seqlens: expected an int or an int32 array, got bool")
    if isinstance(cache_seqlens, Integral):
        return check_int("cache_seqlens", cache_seqlens, 0, max_len)
    a = cache_seqlens
    if a.dtype != np.int32:
        raise TypeError(f"cache_seqlens: expected an int or an int32 array, got dtype {a.dtype}")
    if a.shape != (batch,):
        raise ValueError(f"cache_seqlens: expected shape ({batch},) (q's batch), got {a.shape}")
    if a.on_device and batch > 1 and a.strides[0] != 1:
        raise ValueError(f"cache_seqlens: expected a contiguous array, got element strides {a.strides}")
    lens = fetch(a) if a.on_device else np.asarray(a.obj)
    bad = np.flatnonzero((lens < 0) | (lens > max_len))
    if bad.size:
        raise ValueError(f"cache_seqlens: expected 0 <= cache_seqlens[i] <= {max_len} (the caches' max_len), "
                         f"got cache_seqlens[{int(bad[0])}] = {int(lens[bad[0]])}")
    return lens

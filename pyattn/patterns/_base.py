"""What the pattern builders and conversions share: argument checks and CSR helpers (see
:mod:`pyattn.patterns` for the conventions)."""

from __future__ import annotations

import numpy as np

_MAX_NNZ = 2**31 - 1  # int32 offsets


# --------------------------------------------------------------------------- argument checks


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int(name: str, x, minimum: int) -> int:
    if not _is_int(x):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x}")
    return int(x)


def _bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def _seqlens(seqlen_q, seqlen_k) -> tuple[int, int]:
    sq = _int("seqlen_q", seqlen_q, 1)
    return sq, sq if seqlen_k is None else _int("seqlen_k", seqlen_k, 1)


def _block_size(block_size) -> tuple[int, int] | None:
    if block_size is None:
        return None
    if _is_int(block_size):
        block_size = (block_size, block_size)
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2 or not all(map(_is_int, block_size)):
        raise TypeError(f"block_size: expected an int or a pair (R, C) of ints, got {block_size!r}")
    if min(block_size) < 1:
        raise ValueError(f"block_size: expected positive sizes, got {tuple(block_size)}")
    return int(block_size[0]), int(block_size[1])


def _int_array(name: str, x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    return a


def _check_csr(indices, offsets, name: str = "indices, offsets"):
    """Validated int64 (indices, offsets); offsets may have leading (batch, head) axes."""
    ix, off = _int_array(f"{name}: indices", indices), _int_array(f"{name}: offsets", offsets)
    if ix.ndim != 1 or off.ndim < 1 or off.shape[-1] < 1:
        raise ValueError(f"{name}: expected 1-D indices and offsets of shape (..., Sq + 1), got {ix.shape} and "
                         f"{off.shape}")
    off = off.astype(np.int64)
    if (off < 0).any() or (off > ix.size).any() or (np.diff(off, axis=-1) < 0).any():
        raise ValueError(f"{name}: offsets must be non-decreasing along the last axis and lie in "
                         f"[0, len(indices) = {ix.size}]")
    return ix.astype(np.int64), off


def _csr_entries(ix: np.ndarray, off: np.ndarray, seqlen_k: int, name: str):
    """(flat row id, key) of every listed entry; rows run over offsets' leading axes and Sq."""
    counts = np.diff(off, axis=-1).ravel()
    starts = np.cumsum(counts) - counts
    pos = np.repeat(off[..., :-1].ravel(), counts) + np.arange(counts.sum()) - np.repeat(starts, counts)
    cols = ix[pos]
    if ((cols < 0) | (cols >= seqlen_k)).any():
        bad = int(cols[(cols < 0) | (cols >= seqlen_k)][0])
        raise ValueError(f"{name}: indices must lie in [0, seqlen_k = {seqlen_k}), got {bad}")
    return np.repeat(np.arange(counts.size), counts), cols


def _from_rows(rows: np.ndarray, cols: np.ndarray, sq: int):
    """CSR from (row, key) pairs already sorted by row then key, without duplicates."""
    offsets = np.zeros(sq + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=sq), out=offsets[1:])
    return cols.astype(np.int32), offsets.astype(np.int32)


# --------------------------------------------------------------------------- query positions and bands


def _query_pos(sq: int, sk: int) -> np.ndarray:
    return np.arange(sq, dtype=np.int64) + (sk - sq)


def _band(t, sk: int, left: int, right: int, causal: bool):
    """Interval part of keys ``t - left <= j <= t + right`` (-1 = unbounded), causal ``j <= t``."""
    lo = t - left if left >= 0 else np.zeros_like(t)
    hi = t + right if right >= 0 else np.full_like(t, sk - 1)
    return ("iv", lo, np.minimum(hi, t) if causal else hi)

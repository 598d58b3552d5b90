"""Conversions between the patterns' forms: CSR lists, bool masks and block masks, and the union
of CSR lists (see :mod:`pyattn.patterns` for the conventions)."""

from __future__ import annotations

import numpy as np

from ._base import _block_size, _check_csr, _csr_entries, _from_rows, _int

__all__ = ["csr_to_mask", "mask_to_csr", "csr_to_bsr", "union"]


# --------------------------------------------------------------------------- conversions


def csr_to_mask(indices, offsets, seqlen_k):
    """Expand CSR to a bool mask of shape ``offsets.shape[:-1] + (Sq, seqlen_k)``.

    ``offsets`` of shape (Sq + 1,), (H, Sq + 1) or (B, H, Sq + 1) holds absolute positions into
    the one flat ``indices`` array. Duplicate keys are allowed.

    Examples
    --------
    >>> csr_to_mask([1, 0], [0, 1, 2], 2).tolist()
    [[False, True], [True, False]]
    """
    sk = _int("seqlen_k", seqlen_k, 1)
    ix, off = _check_csr(indices, offsets)
    rows, cols = _csr_entries(ix, off, sk, "indices")
    out = np.zeros((off[..., :-1].size, sk), dtype=bool)
    out[rows, cols] = True
    return out.reshape(off.shape[:-1] + (off.shape[-1] - 1, sk))


def mask_to_csr(mask):
    """CSR ``(indices, offsets)`` (int32) of a 2-D bool mask (Sq, Sk).

    Examples
    --------
    >>> [a.tolist() for a in mask_to_csr(np.array([[True, True], [False, True]]))]
    [[0, 1, 1], [0, 2, 3]]
    """
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"mask: expected dtype bool, got {m.dtype}")
    if m.ndim != 2:
        raise ValueError(f"mask: expected 2 dims (Sq, Sk), got shape {m.shape}")
    rows, cols = np.nonzero(m)
    return _from_rows(rows, cols, m.shape[0])


def csr_to_bsr(indices, offsets, seqlen_k, block_size):
    """Coarsen CSR to a bool block mask ``offsets.shape[:-1] + (ceil(Sq / R), ceil(seqlen_k / C))``.

    A block is set iff at least one listed (row, key) pair falls inside it.

    Examples
    --------
    >>> csr_to_bsr([3], [0, 0, 1, 1], 4, (2, 2)).tolist()
    [[False, True], [False, False]]
    """
    sk = _int("seqlen_k", seqlen_k, 1)
    r, c = _block_size(block_size)
    ix, off = _check_csr(indices, offsets)
    sq = off.shape[-1] - 1
    rows, cols = _csr_entries(ix, off, sk, "indices")
    mb, nb = -(-sq // r), -(-sk // c)
    out = np.zeros((off[..., :-1].size // max(sq, 1), mb, nb), dtype=bool)
    out[rows // max(sq, 1), rows % max(sq, 1) // r, cols // c] = True
    return out.reshape(off.shape[:-1] + (mb, nb))


def union(*csrs, seqlen_k):
    """Union of CSR patterns over the same rows, sorted and without duplicates.

    Examples
    --------
    >>> idx, off = union(local(4, window=0), global_tokens(4, tokens=[0]), seqlen_k=4)
    >>> [idx[off[i]:off[i + 1]].tolist() for i in range(4)]
    [[0, 1, 2, 3], [0, 1], [0, 2], [0, 3]]
    """
    sk = _int("seqlen_k", seqlen_k, 1)
    if not csrs:
        raise ValueError("csrs: expected at least one (indices, offsets) pair")
    keys, sq = [], None
    for n, pair in enumerate(csrs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"csrs[{n}]: expected an (indices, offsets) pair, got {type(pair).__name__}")
        ix, off = _check_csr(pair[0], pair[1], f"csrs[{n}]")
        if off.ndim != 1 or (sq is not None and off.size - 1 != sq):
            want = "(Sq + 1,)" if sq is None else f"({sq + 1},) like the first pattern's"
            raise ValueError(f"csrs[{n}]: expected offsets of shape {want}, got {off.shape}")
        sq = off.size - 1
        rows, cols = _csr_entries(ix, off, sk, f"csrs[{n}]")
        keys.append(rows * sk + cols)
    # Each pattern is usually sorted already: a stable (merge) sort of its runs beats np.unique.
    key = np.sort(np.concatenate(keys), kind="stable")
    key = key[np.concatenate([[True], key[1:] != key[:-1]])]
    return _from_rows(key // sk, key % sk, sq)

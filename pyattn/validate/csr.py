"""Validate CSR key lists for ``sparse_attention``: every index in range, no key twice in a row.

The kernel (``kernels_src/attention_sparse.cuh``) trusts that every listed index is in range and
that no row lists a key twice; everything here runs on the host before any GPU work. Host NumPy
index arrays only (device ones would need their values copied back; not supported yet).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..array import c_strides

__all__ = ["CsrInfo", "check_csr", "check_row_access"]

_I32 = np.dtype(np.int32)
_INT32_MAX = 2**31 - 1
_ALIGN = 16  # the kernel reads and writes rows in (up to) 16-byte accesses
_CHUNK = 1 << 22  # listed entries expanded at once by the host checks (a few 8-byte arrays of this size)


class CsrInfo(NamedTuple):
    """Validated key lists, ready to upload.

    ``offsets`` is C-contiguous int32 (rows_b, rows_h, seqlen_q + 1) with rows_b in {1, batch} and
    rows_h in {1, heads_q}; ``stride_b`` / ``stride_h`` are its element strides (0 on a broadcast
    axis), as ``SparseParams`` reads them.
    """

    indices: np.ndarray
    offsets: np.ndarray
    stride_b: int
    stride_h: int


def _int_array(name: str, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
            raise TypeError(f"{name}: device index arrays are not supported yet; pass a host NumPy int32 array "
                            f"(got {type(x).__name__})")
        raise TypeError(f"{name}: expected a host NumPy int32 array, got {type(x).__name__}")
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
    return x


def _offsets_view(offsets: np.ndarray, batch: int, heads_q: int, seqlen_q: int) -> np.ndarray:
    """``offsets`` as a (rows_b, rows_h, seqlen_q + 1) view; a wrong shape is a ValueError."""
    n = seqlen_q + 1
    shape = offsets.shape
    ok = 1 <= len(shape) <= 3 and shape[-1] == n
    if len(shape) >= 2:
        ok = ok and shape[-2] in (1, heads_q)
    if len(shape) == 3:
        ok = ok and shape[0] in (1, batch)
    if not ok:
        raise ValueError(f"offsets: expected shape ({n},), ({heads_q}, {n}) or ({batch}, {heads_q}, {n}) "
                         f"(seqlen_q + 1 = {n} per query-row list; axes of size 1 broadcast), got {shape}")
    return offsets.reshape((1,) * (3 - len(shape)) + shape)


def _where(ndim: int, row: int, rows_h: int, i: int) -> str:
    """The caller's ``offsets[...]`` index of flat list row ``row``, query row ``i``."""
    b, h = divmod(row, rows_h)
    return f"offsets[{', '.join(str(x) for x in (b, h, i)[3 - ndim:])}]"


def check_csr(indices, offsets, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int) -> CsrInfo:
    """Validate CSR key lists (host only; no GPU work).

    Parameters
    ----------
    indices : numpy.ndarray of int, shape (nnz,)
    offsets : numpy.ndarray of int, shape (seqlen_q + 1,), (heads_q, seqlen_q + 1) or
        (batch, heads_q, seqlen_q + 1)
    batch, heads_q, seqlen_q, seqlen_k : int

    Returns
    -------
    CsrInfo

    Raises
    ------
    TypeError
        Not a NumPy array (device arrays: not supported yet), or not an integer dtype.
    ValueError
        A wrong shape; an offset outside ``[0, len(indices)]``; offsets decreasing within a row's
        list; a listed index outside ``[0, seqlen_k)``; a key listed twice by one row. The first
        offending row (in row-major order) is named, with the value.
    """
    indices, offsets = _int_array("indices", indices), _int_array("offsets", offsets)
    if indices.ndim != 1:
        raise ValueError(f"indices: expected a 1-D array (nnz,), got shape {indices.shape}")
    nnz = indices.shape[0]
    if nnz > _INT32_MAX:
        raise ValueError(f"indices: at most 2**31 - 1 entries (int32 positions), got {nnz}")
    off3 = _offsets_view(offsets, batch, heads_q, seqlen_q)
    rows_b, rows_h, n = off3.shape
    off = off3.reshape(rows_b * rows_h, n)

    # -- offsets inside [0, nnz] (compared in their own dtype: no wrap-around of huge values)
    bad = np.flatnonzero((off < 0) | (off > nnz))
    if bad.size:
        r, i = divmod(int(bad[0]), n)
        raise ValueError(f"offsets: {_where(offsets.ndim, r, rows_h, i)} = {off[r, i]} is outside "
                         f"[0, len(indices)] = [0, {nnz}]")
    off = off.astype(np.int64)
    lengths = off[:, 1:] - off[:, :-1]
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        r, i = divmod(int(bad[0]), n - 1)
        raise ValueError(f"offsets: decreasing within a row list: {_where(offsets.ndim, r, rows_h, i)} = "
                         f"{off[r, i]} > {_where(offsets.ndim, r, rows_h, i + 1)} = {off[r, i + 1]} "
                         f"(query row {i} would list a negative number of keys)")

    _check_entries(indices, off[:, :-1].ravel(), lengths.ravel(), seqlen_k,
                   lambda lst: (lst % (n - 1), _where(offsets.ndim, lst // (n - 1), rows_h, lst % (n - 1))))
    strides = c_strides(off3.shape, 1)
    return CsrInfo(np.ascontiguousarray(indices, dtype=_I32), np.ascontiguousarray(off3, dtype=_I32),
                   strides[0] if rows_b > 1 else 0, strides[1] if rows_h > 1 else 0)


def _chunks(lengths: np.ndarray):
    """Ranges [lo, hi) of lists holding about _CHUNK entries each (bounds the checks' memory)."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    cuts = np.searchsorted(ends, np.arange(_CHUNK, total, _CHUNK), side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [lengths.size]]))
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _expand(indices, starts, lengths, lo: int, hi: int):
    """Every entry of lists lo..hi-1 as (list id, position in indices, value), in list order."""
    ln = lengths[lo:hi]
    list_id = np.repeat(np.arange(lo, hi), ln)
    first = np.cumsum(ln) - ln  # each list's first entry in the expansion
    pos = np.arange(list_id.size) + np.repeat(starts[lo:hi] - first, ln)
    return list_id, pos, indices[pos]


def _check_entries(indices, starts, lengths, seqlen_k: int, describe) -> None:
    """Range-check every listed index, then look for a key listed twice by one list; each reports the
    first offending list in row-major order. ``describe(list id)`` gives (query row, offsets[...])."""
    duplicate = None  # the first one found; raised only once every index is known to be in range
    for lo, hi in _chunks(lengths):
        list_id, pos, vals = _expand(indices, starts, lengths, lo, hi)
        bad = np.flatnonzero((vals < 0) | (vals >= seqlen_k))  # in their own dtype: huge values do not wrap
        if bad.size:
            j = int(bad[0])
            i, where = describe(int(list_id[j]))
            raise ValueError(f"indices: indices[{pos[j]}] = {vals[j]}, listed by query row {i} ({where}), "
                             f"is outside [0, seqlen_k) = [0, {seqlen_k})")
        if duplicate is None:
            duplicate = _first_duplicate(list_id, pos, vals.astype(np.int64), lo, hi, seqlen_k)
    if duplicate is not None:
        lst, val, a, b = duplicate
        i, where = describe(lst)
        raise ValueError(f"indices: query row {i} ({where}) lists key {val} twice, at indices[{a}] and indices[{b}]")


def _first_duplicate(list_id, pos, vals, lo: int, hi: int, seqlen_k: int):
    """(list, key, position, position) of the lowest list listing a key twice (its smallest such key), or None."""
    # A strictly increasing list has no duplicate: only the lists that are not get sorted.
    same = list_id[1:] == list_id[:-1]
    unsorted = np.zeros(hi - lo, bool)
    unsorted[list_id[1:][same & (vals[1:] <= vals[:-1])] - lo] = True
    sel = np.flatnonzero(unsorted[list_id - lo])
    if not sel.size:
        return None
    lid, v = list_id[sel], vals[sel]
    rank = np.concatenate([[0], np.cumsum(lid[1:] != lid[:-1])])  # dense list rank: the key cannot overflow
    key = np.sort(rank * seqlen_k + v)
    dup = np.flatnonzero(key[1:] == key[:-1])
    if not dup.size:
        return None
    r, val = divmod(int(key[dup[0]]), seqlen_k)
    lst = int(lid[np.searchsorted(rank, r)])
    a, b = pos[(list_id == lst) & (vals == val)][:2]
    return lst, val, int(a), int(b)


def check_row_access(a) -> None:
    """The sparse kernel's row accesses need a 16-byte aligned base and 16-byte multiple strides
    (``a``: a device Arg)."""
    itemsize = a.dtype.itemsize
    steps = [st * itemsize for st, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1]
    if a.ptr % _ALIGN or any(st % _ALIGN for st in steps):
        raise ValueError(f"{a.name}: the sparse kernel accesses rows in 16-byte aligned pieces; expected a "
                         f"16-byte aligned address and strides that are multiples of {_ALIGN // itemsize} "
                         f"elements, got address {a.ptr:#x} and element strides {a.strides} (copy the "
                         f"array to make it contiguous)")

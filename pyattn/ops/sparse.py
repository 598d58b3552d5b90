"""``sparse_attention``: attention where every query row attends to its own list of keys (CSR).

The key lists are a flat int32 ``indices`` array and ``offsets`` into it, one row of offsets per
query row, shared by every (batch, head), per query head, or per (batch, query head). Everything
about the lists is checked on the host before any GPU work (``check_csr``): the kernel
(``kernels_src/attention_sparse.cuh``) trusts that every listed index is in range and that no row
lists a key twice.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..array import _c_strides, allocate, asarray, is_device_array
from ..kernels.registry import get_kernel
from ..kernels.specs import DTYPES, HEAD_DIM_BUCKETS, KernelSpec
from ..runtime.device import get_device
from ..runtime.launch import launch
from ..runtime.memory import Allocation
from ..runtime.stream import as_stream
from ._plan import ptx_requested
from ._problem import make_problem

__all__ = ["sparse_attention", "check_csr", "CsrInfo"]

_LOG2E = 1.4426950408889634
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_INT32_MAX = 2**31 - 1
_ALIGN = 16  # the kernel reads and writes rows in (up to) 16-byte accesses
_CHUNK = 1 << 22  # listed entries expanded at once by the host checks (a few 8-byte arrays of this size)


@functools.lru_cache(maxsize=64)
def _spec_for(dtype_name: str, head_dim: int, arch: str, ptx: bool) -> KernelSpec:
    bucket = next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)
    return KernelSpec("attn_sparse", DTYPES[dtype_name][0], bucket, arch, ptx)


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


# --------------------------------------------------------------------------- validation


def _int_array(name: str, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if is_device_array(x):
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
    strides = _c_strides(off3.shape, 1)
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


def _check_aligned(name: str, a) -> None:
    """The kernel's row accesses need a 16-byte aligned base and 16-byte multiple strides."""
    itemsize = a.dtype.itemsize
    steps = [st * itemsize for st, n in zip(a.elem_strides[:-1], a.shape[:-1]) if n > 1]
    if a.ptr % _ALIGN or any(st % _ALIGN for st in steps):
        raise ValueError(f"{name}: the sparse kernel accesses rows in 16-byte aligned pieces; expected a "
                         f"16-byte aligned address and strides that are multiples of {_ALIGN // itemsize} "
                         f"elements, got address {a.ptr:#x} and element strides {a.elem_strides} (copy the "
                         f"array to make it contiguous)")


# --------------------------------------------------------------------------- the op


def sparse_attention(q, k, v, indices, offsets, *, scale=None, layout="bshd", return_lse=False, out=None,
                     stream=None):
    """Attention in which each query row attends to its own list of keys (CSR sparsity).

    Query row ``i`` of batch ``b`` and query head ``h`` attends to the keys
    ``indices[offsets[..., i] : offsets[..., i + 1]]`` (positions into k/v's sequence axis); the
    softmax runs over exactly the listed keys, in any order.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim) for ``layout="bshd"``
        Queries; ``layout="bhsd"`` takes (batch, heads_q, seqlen_q, head_dim). NumPy arrays are
        copied to the GPU; CUDA arrays (``pyattn.DeviceArray``, CuPy, PyTorch, ...) are read in
        place (head_dim axis contiguous, 16-byte aligned, other strides multiples of 16 bytes).
    k, v : array, shape (batch, seqlen_k, heads_kv, head_dim)
        Keys and values, same layout and dtype. ``heads_q`` must be a multiple of ``heads_kv``:
        query head ``h`` reads key/value head ``h // (heads_q // heads_kv)``.
    indices : numpy.ndarray of int, shape (nnz,)
        Key positions in ``[0, seqlen_k)``, all lists in one flat array. Converted to int32.
        Entries no list covers are never read (nor checked).
    offsets : numpy.ndarray of int
        Absolute positions into ``indices``, non-decreasing along the last axis, in
        ``[0, nnz]``. Shape ``(seqlen_q + 1,)``: one pattern for every batch entry and head;
        ``(heads_q, seqlen_q + 1)``: per query head; ``(batch, heads_q, seqlen_q + 1)``: per
        (batch, query head). Axes of size 1 broadcast.
    scale : float, optional
        Score scale, default ``1 / sqrt(head_dim)``.
    layout : {"bshd", "bhsd"}
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of the scores, float32 (batch, heads_q, seqlen_q).
    out : array, optional
        Destination of the output's exact shape and dtype: a device array for device inputs, a
        writable NumPy array for NumPy inputs.
    stream : optional
        Stream for all work (``pyattn.Stream``, ``__cuda_stream__`` object or int ``CUstream``).

    Returns
    -------
    out : array, q's shape and dtype
        NumPy for NumPy inputs, ``pyattn.DeviceArray`` for device inputs (``out`` when given).
    lse : array, optional
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        Bad dtypes; ``indices``/``offsets`` not host NumPy integer arrays (device index arrays
        are not supported yet).
    ValueError
        Bad shapes; offsets outside ``[0, nnz]`` or decreasing within a row; an index outside
        ``[0, seqlen_k)``; a key listed twice by one row; misaligned device arrays. All before
        any GPU work; the message names the argument, the row and the value.

    Notes
    -----
    One warp per query row gathers the listed K/V rows from global memory; scores, softmax and
    accumulation are float32 and the output is rounded to q's dtype. A row with an empty list
    gets output 0 and LSE ``-inf``. Each output element is written by exactly one thread (no
    atomics), so results are deterministic. The host checks cost time linear in the number of
    listed entries per call (tens of ns each), plus a sort of the lists that are not strictly
    increasing (the duplicate check); sorted lists are the fast case.
    """
    problem, _ = make_problem(q, k, v, scale=scale, layout=layout, out=out)
    B, Hq, Sq, D = problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim
    csr = check_csr(indices, offsets, B, Hq, Sq, problem.seqlen_k)
    if problem.on_device:
        dq = asarray(q, stream=stream)  # a zero-copy view; its device comes from the pointer
        device = dq.device
    else:
        dq, device = None, get_device()
    s = as_stream(stream, device)
    device.activate()
    # Compile (or fetch) before copying data, so a compile error costs no transfer.
    spec = _spec_for(problem.dtype, D, device.arch, ptx_requested())
    kernel = get_kernel(spec, device)

    if dq is None:
        dq = asarray(q, device=device, stream=s)
    dk, dv = (asarray(x, device=device, stream=s) for x in (k, v))
    dout = asarray(out, stream=s) if (out is not None and problem.on_device) else None
    arrays = [("q", dq), ("k", dk), ("v", dv)] + ([("out", dout)] if dout is not None else [])
    for name, a in arrays:
        if a.device is not device:
            raise ValueError(f"{name}: expected an array on device {device.ordinal} (with q), "
                             f"got device {a.device.ordinal}")
        _check_aligned(name, a)
    d_idx = asarray(csr.indices, device=device, stream=s)
    d_off = asarray(csr.offsets, device=device, stream=s)

    out_shape = problem.out_shape()
    itemsize = dq.dtype.itemsize
    if dout is None:
        dout = allocate(device, s, out_shape, dq.dtype, _c_strides(out_shape, itemsize), _c_strides(out_shape, 1),
                        int(np.prod(out_shape)) * itemsize)
    lse = None
    if return_lse:
        lse_shape = (B, Hq, Sq)
        lse = allocate(device, s, lse_shape, _F32, _c_strides(lse_shape, 4), _c_strides(lse_shape, 1),
                       4 * B * Hq * Sq)
    if B * Hq * Sq:
        sb, s1, s2, _ = dout.elem_strides
        o_bsh = (sb, s1, s2) if layout == "bshd" else (sb, s2, s1)
        values = {"q": dq.ptr, "k": dk.ptr, "v": dv.ptr, "o": dout.ptr, "lse": lse.ptr if lse is not None else 0,
                  "indices": d_idx.ptr, "offsets": d_off.ptr,
                  "off_stride_b": csr.stride_b, "off_stride_h": csr.stride_h,
                  "lse_stride_b": Hq * Sq, "lse_stride_h": Sq,
                  "batch": B, "heads_q": Hq, "group": problem.group, "seqlen_q": Sq, "seqlen_k": problem.seqlen_k,
                  "head_dim": D, "scale_log2": problem.scale * _LOG2E}
        for prefix, st in (("q", problem.q_strides), ("k", problem.k_strides), ("v", problem.v_strides),
                           ("o", o_bsh)):
            values.update({f"{prefix}_stride_{axis}": x for axis, x in zip("bsh", st)})
        launch(kernel, spec.grid(B, Hq, Sq), (spec.threads, 1, 1), spec.shared_bytes, s, spec.params.pack(values))
        for a in (dq, dk, dv, dout, d_idx, d_off):
            owner = a.owner
            if type(owner) is Allocation and owner.stream is not s:
                owner.record_stream(s)  # the block's free must wait for this stream's use

    if not problem.on_device:  # NumPy in, NumPy out
        o = dout.numpy(s)
        if out is not None:
            np.copyto(out, o)
            o = out
        lse = lse.numpy(s) if lse is not None else None
    else:
        o = out if out is not None else dout  # the caller's own array object
    return (o, lse) if return_lse else o

"""Block-sparse (BSR) layouts: validation, expansion, and conversion to the kernels' tile lists.

Pure NumPy, no driver import: every mistake in a layout is a ``ValueError``/``TypeError`` naming
the argument before any GPU work, and all of it is testable on a CPU.

A layout marks which (R x C) blocks of the (seqlen_q x seqlen_k) score matrix are computed; R and
C are multiples of 16 because the kernels mask at 16 x 16 sub-block granularity. The kernels walk,
per query tile of ``tile_m`` rows, a list of key tiles of ``tile_n`` keys, each with a 64-bit
mask of its visible 16 x 16 sub-blocks (:func:`tile_lists`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["TileLists", "check_block_size", "check_block_layout", "block_mask_to_dense", "band_limits",
           "tile_lists", "tiles_to_dense", "SUB"]

SUB = 16  # the kernels' masking granularity (one mma row/column block)
_UNBOUNDED = 1 << 62  # "no bound" side of a band; Python int, compared only, never summed


class TileLists(NamedTuple):
    """Per (head, query tile) CSR lists of visible key tiles, as the kernels read them.

    Row ``h * stride_h + m`` (query head h, query tile m) lists key tiles ``idx[ptr[r]:ptr[r + 1]]``
    (ascending) with ``bits[...]``: bit ``a * (tile_n // 16) + b`` set iff sub-block (a, b) of the
    tile is visible.
    """

    ptr: np.ndarray  # int32 (n_rows + 1,)
    idx: np.ndarray  # int32 (nnz,)
    bits: np.ndarray  # uint64 (nnz,)
    stride_h: int  # MT when the layout has one list per head, else 0 (all heads share the rows)
    n_rows: int  # H_l * MT
    nnz: int


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_arg(name: str, x, minimum: int = 0) -> int:
    if not _is_int(x):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x}")
    return int(x)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_block_size(block_size) -> tuple[int, int]:
    """Validate a block size ``(R, C)``: two positive multiples of 16.

    Parameters
    ----------
    block_size : tuple of int (R, C)
        Rows (queries) and columns (keys) of one block.

    Returns
    -------
    (int, int)
        ``(R, C)`` as Python ints.

    Raises
    ------
    TypeError, ValueError
        Not a pair of ints (bools refused), or not positive multiples of 16 (the kernels mask at
        16 x 16 sub-block granularity; finer patterns belong to ``pyattn.sparse_attention``).
    """
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise TypeError(f"block_size: expected a pair (R, C) of ints, got {block_size!r}")
    if not all(_is_int(b) for b in block_size):
        raise TypeError(f"block_size: expected a pair of ints, got types "
                        f"({type(block_size[0]).__name__}, {type(block_size[1]).__name__})")
    r, c = int(block_size[0]), int(block_size[1])
    if r <= 0 or c <= 0 or r % SUB or c % SUB:
        raise ValueError(f"block_size: expected positive multiples of {SUB} (the kernels mask at {SUB} x {SUB} "
                         f"sub-block granularity; use pyattn.sparse_attention for finer patterns), got ({r}, {c})")
    return r, c


def _int_array(what: str, x) -> np.ndarray:
    """Host integer array (bool refused) for one part of a BSR layout."""
    if hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"layout: {what} must be a host (NumPy) array, got a device array")
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"layout: {what} must have an integer dtype, got {a.dtype}")
    return a


def _bsr_to_mask(indptr, indices, heads_q: int, mb: int, nb: int) -> np.ndarray:
    ip = _int_array("indptr", indptr)
    ix = _int_array("indices", indices)
    if ip.ndim == 1:
        ip = ip[None]
    if ip.ndim != 2 or ip.shape[1] != mb + 1 or ip.shape[0] not in (1, heads_q):
        raise ValueError(f"layout: indptr must have shape (Mb + 1,) = ({mb + 1},) or (H, Mb + 1) with H in "
                         f"{{1, heads_q = {heads_q}}}, got {np.shape(indptr)}")
    if ix.ndim != 1:
        raise ValueError(f"layout: indices must be 1-D, got shape {ix.shape}")
    ip = ip.astype(np.int64)
    n = ix.shape[0]
    bad = (ip < 0) | (ip > n)
    if bad.any():
        h, r = np.argwhere(bad)[0]
        raise ValueError(f"layout: indptr must lie in [0, len(indices) = {n}], got indptr[{h}, {r}] = {ip[h, r]}")
    counts = np.diff(ip, axis=1)  # (H_l, Mb)
    if (counts < 0).any():
        h, r = np.argwhere(counts < 0)[0]
        raise ValueError(f"layout: indptr must be non-decreasing along the rows, got indptr[{h}, {r}] = "
                         f"{ip[h, r]} > indptr[{h}, {r + 1}] = {ip[h, r + 1]} (head {h}, block row {r})")
    # Flat positions of every listed entry: row start + offset within the row (no Python loop).
    counts = counts.ravel()
    total = int(counts.sum())
    row = np.repeat(np.arange(counts.size), counts)
    starts = np.cumsum(counts) - counts
    pos = np.repeat(ip[:, :-1].ravel(), counts) + (np.arange(total) - np.repeat(starts, counts))
    cols = ix[pos].astype(np.int64)
    bad = (cols < 0) | (cols >= nb)
    if bad.any():
        e = int(np.flatnonzero(bad)[0])
        h, r = divmod(int(row[e]), mb)
        raise ValueError(f"layout: column-block ids must be in [0, Nb = {nb}), got indices[{pos[e]}] = {cols[e]} "
                         f"in block row {r} of head {h}")
    hits = np.bincount(row * nb + cols, minlength=counts.size * nb)
    if (hits > 1).any():
        key = int(np.flatnonzero(hits > 1)[0])
        h, r, c = key // (mb * nb), key // nb % mb, key % nb
        raise ValueError(f"layout: duplicate column-block id {c} in block row {r} of head {h}")
    return (hits > 0).reshape(ip.shape[0], mb, nb)


def check_block_layout(layout, *, block_size, heads_q: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Validate a block-sparse layout and return it as a bool block mask.

    Parameters
    ----------
    layout : ndarray of bool, or tuple (indptr, indices)
        Bool mask of shape (Mb, Nb) (shared by all heads) or (H, Mb, Nb), True = compute the block;
        or BSR ``(indptr, indices)``: integer indptr of shape (Mb + 1,) or (H, Mb + 1), a 1-D
        integer ``indices``; block row r of head h lists column blocks
        ``indices[indptr[h, r]:indptr[h, r + 1]]`` (absolute positions into the one flat array,
        like scipy CSR per head), no duplicates within a row. ``Mb = ceil(seqlen_q / R)``,
        ``Nb = ceil(seqlen_k / C)``, H in {1, heads_q}.
    block_size : tuple of int (R, C)
        See :func:`check_block_size`.
    heads_q, seqlen_q, seqlen_k : int
        Query heads and sequence lengths of the problem.

    Returns
    -------
    ndarray of bool, shape (H, Mb, Nb), C-contiguous

    Raises
    ------
    TypeError, ValueError
        On a wrong form, dtype, shape, or an out-of-range, duplicate or decreasing index; the
        message names ``layout`` (or ``block_size``) and the bad row or value.

    Examples
    --------
    >>> m = check_block_layout((np.array([0, 1, 3]), np.array([0, 0, 1])), block_size=(64, 64),
    ...                        heads_q=2, seqlen_q=128, seqlen_k=100)
    >>> m.shape, m[0].tolist()
    ((1, 2, 2), [[True, False], [True, True]])
    """
    r, c = check_block_size(block_size)
    heads_q = _int_arg("heads_q", heads_q, 1)
    sq, sk = _int_arg("seqlen_q", seqlen_q), _int_arg("seqlen_k", seqlen_k)
    mb, nb = _cdiv(sq, r), _cdiv(sk, c)
    if isinstance(layout, tuple):
        if len(layout) != 2:
            raise TypeError(f"layout: a BSR layout is a pair (indptr, indices), got a tuple of {len(layout)}")
        return np.ascontiguousarray(_bsr_to_mask(layout[0], layout[1], heads_q, mb, nb))
    if hasattr(layout, "__cuda_array_interface__"):
        raise TypeError("layout: must be a host (NumPy) bool array or a BSR (indptr, indices) tuple, "
                        "got a device array")
    try:
        m = np.asarray(layout)
    except Exception as e:  # e.g. a device tensor refusing host conversion
        raise TypeError(f"layout: expected a NumPy bool array or a BSR (indptr, indices) tuple, got "
                        f"{type(layout).__name__}") from e
    if m.dtype != np.bool_:
        raise TypeError(f"layout: a mask layout must have dtype bool, got {m.dtype} (for BSR pass a tuple "
                        f"(indptr, indices))")
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3 or m.shape[1:] != (mb, nb) or m.shape[0] not in (1, heads_q):
        raise ValueError(f"layout: expected shape (Mb, Nb) = ({mb}, {nb}) or (H, {mb}, {nb}) with H in "
                         f"{{1, heads_q = {heads_q}}} for block_size ({r}, {c}), got {np.shape(layout)}")
    return np.ascontiguousarray(m)


def block_mask_to_dense(block_mask, block_size, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Expand a bool block mask (Mb, Nb) or (H, Mb, Nb) to elements, shape (H, seqlen_q, seqlen_k).

    Parameters
    ----------
    block_mask : ndarray of bool
        As returned by :func:`check_block_layout` (a 2-D mask counts as H = 1).
    block_size : tuple of int (R, C)
    seqlen_q, seqlen_k : int

    Returns
    -------
    ndarray of bool, shape (H, seqlen_q, seqlen_k)
        Element (h, i, j) is ``block_mask[h, i // R, j // C]``.
    """
    r, c = (int(b) for b in block_size)
    m = np.asarray(block_mask, dtype=bool)
    m = m[None] if m.ndim == 2 else m
    rows, cols = np.arange(seqlen_q) // r, np.arange(seqlen_k) // c
    return m[:, rows[:, None], cols[None, :]]


def band_limits(causal, window, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The causal / sliding-window band as ``(lo, hi)``: row i sees key j iff ``lo <= j - i <= hi``.

    Mirrors ``make_band`` in kernels_src/band.cuh (bottom-right aligned, diag = seqlen_k - seqlen_q).

    Parameters
    ----------
    causal : int
        0 none, 1 bottom-right (``hi = diag``), 2 top-left (``hi = 0``).
    window : tuple of int (left, right)
        -1 = unbounded; ``right >= 0`` caps ``hi`` at ``diag + right``, ``left >= 0`` sets
        ``lo = diag - left``.
    seqlen_q, seqlen_k : int

    Returns
    -------
    (int, int)
        Unbounded sides are +-2**62.
    """
    diag = int(seqlen_k) - int(seqlen_q)
    lo, hi = -_UNBOUNDED, _UNBOUNDED
    if int(causal) == 1:
        hi = diag
    elif int(causal) == 2:
        hi = 0
    left, right = (int(w) for w in window)
    if right >= 0:
        hi = min(hi, diag + right)
    if left >= 0:
        lo = diag - left
    return lo, hi


def _check_tile(tile_m, tile_n) -> tuple[int, int]:
    tm, tn = _int_arg("tile_m", tile_m, 1), _int_arg("tile_n", tile_n, 1)
    if tm % SUB or tn % SUB or (tm // SUB) * (tn // SUB) > 64:
        raise ValueError(f"tile_m, tile_n: expected multiples of {SUB} with at most 64 sub-blocks of {SUB} x {SUB} "
                         f"(one uint64 mask per tile), got ({tm}, {tn})")
    return tm, tn


def _sub_band(mt16: int, nt16: int, sq: int, sk: int, lo: int, hi: int) -> np.ndarray | None:
    """Bool (mt16, nt16): sub-block (a, b) holds a (row, key) pair inside the band; None = all do."""
    if lo <= 1 - sq and hi >= sk - 1:  # every difference key - row in [1 - sq, sk - 1] is allowed
        return None
    if lo > hi:  # e.g. top-left causal with a left window of 0 and seqlen_k > seqlen_q: no pair at all
        return np.zeros((mt16, nt16), dtype=bool)
    r0 = np.arange(mt16, dtype=np.int64) * SUB
    c0 = np.arange(nt16, dtype=np.int64) * SUB
    r1, c1 = np.minimum(r0 + SUB - 1, sq - 1), np.minimum(c0 + SUB - 1, sk - 1)
    # The differences over [r0, r1] x [c0, c1] are the interval [c0 - r1, c1 - r0]; it meets the
    # non-empty [lo, hi] iff neither lies wholly past the other.
    return (c1[None, :] - r0[:, None] >= lo) & (c0[None, :] - r1[:, None] <= hi)


def tile_lists(block_mask, block_size, tile_m: int, tile_n: int, seqlen_q: int, seqlen_k: int, *,
               causal=0, window=(-1, -1)) -> TileLists:
    """Convert a bool block mask to per (head, query tile) lists of visible key tiles.

    A key tile is listed when at least one of its 16 x 16 sub-blocks is visible: inside a set
    block, inside the sequence, and holding a (row, key) pair the causal/window band allows.
    Tiles with no visible sub-block are dropped, so the kernel's work is proportional to the
    non-zero blocks and block sparsity composes with causal masking.

    Parameters
    ----------
    block_mask : ndarray of bool, shape (H, Mb, Nb)
        From :func:`check_block_layout`.
    block_size : tuple of int (R, C)
        Multiples of 16.
    tile_m, tile_n : int
        The kernel's tile shape: multiples of 16 with ``(tile_m / 16) * (tile_n / 16) <= 64``.
    seqlen_q, seqlen_k : int
    causal : int, optional
        0, 1 (bottom-right) or 2 (top-left), as in :func:`band_limits`.
    window : tuple of int (left, right), optional
        -1 = unbounded.

    Returns
    -------
    TileLists
        ``stride_h`` is MT = ceil(seqlen_q / tile_m) when H > 1, else 0.

    Examples
    --------
    >>> tl = tile_lists(np.ones((1, 2, 2), bool), (64, 64), 64, 64, 128, 128, causal=1)
    >>> tl.ptr.tolist(), tl.idx.tolist(), [hex(b) for b in tl.bits]
    ([0, 1, 3], [0, 0, 1], ['0xf731', '0xffff', '0xf731'])
    """
    r, c = check_block_size(block_size)
    tm, tn = _check_tile(tile_m, tile_n)
    sq, sk = _int_arg("seqlen_q", seqlen_q), _int_arg("seqlen_k", seqlen_k)
    mask = np.asarray(block_mask)
    mb, nb = _cdiv(sq, r), _cdiv(sk, c)
    if mask.dtype != np.bool_ or mask.ndim != 3 or mask.shape[1:] != (mb, nb):
        raise ValueError(f"block_mask: expected a bool array of shape (H, {mb}, {nb}), got {mask.dtype} "
                         f"{mask.shape}")
    h_l = mask.shape[0]
    tm16, tn16 = tm // SUB, tn // SUB
    mt, nt = _cdiv(sq, tm), _cdiv(sk, tn)
    rows16, cols16 = mt * tm16, nt * tn16  # sub-block grid, padded to whole tiles
    used_r, used_c = _cdiv(sq, SUB), _cdiv(sk, SUB)  # sub-blocks that start inside the sequence
    # -- block mask at 16-granularity (R, C are multiples of 16: each sub-block is in one block)
    sub = np.zeros((h_l, rows16, cols16), dtype=bool)
    sub[:, :used_r, :used_c] = mask.repeat(r // SUB, axis=1)[:, :used_r].repeat(c // SUB, axis=2)[:, :, :used_c]
    lo, hi = band_limits(causal, window, sq, sk)
    band = _sub_band(rows16, cols16, sq, sk, lo, hi)
    if band is not None:
        sub &= band
    # -- one uint64 per tile: bit a * tn16 + b = sub-block (a, b); packbits little-endian, 8 bytes
    # The transpose moves each row's tn16 flags as one element (8x faster than moving bools).
    row_t = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}.get(tn16, np.dtype((np.void, tn16)))
    rows = sub.reshape(h_l, mt, tm16, nt, tn16).view(row_t).reshape(h_l, mt, tm16, nt)
    tiles = np.ascontiguousarray(rows.transpose(0, 1, 3, 2)).view(bool).reshape(h_l, mt, nt, tm16 * tn16)
    packed = np.packbits(tiles, axis=-1, bitorder="little")
    words8 = np.zeros((h_l, mt, nt, 8), dtype=np.uint8)
    words8[..., : packed.shape[-1]] = packed
    words = words8.view("<u8")[..., 0]  # (H, MT, NT)
    nz = words != 0
    counts = nz.sum(axis=-1).ravel()
    ptr = np.zeros(h_l * mt + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    if ptr[-1] >= 2**31:
        raise ValueError(f"block_mask: {ptr[-1]} listed tiles do not fit int32 offsets")
    idx = np.nonzero(nz)[2]  # C order: ascending key tile within each (head, query tile) row
    return TileLists(ptr.astype(np.int32), idx.astype(np.int32), words[nz].astype(np.uint64),
                     mt if h_l > 1 else 0, h_l * mt, int(ptr[-1]))


def tiles_to_dense(lists: TileLists, tile_m: int, tile_n: int, seqlen_q: int, seqlen_k: int,
                   heads: int) -> np.ndarray:
    """Expand tile lists to elements: the kernel's view of the pattern, before its band mask.

    Parameters
    ----------
    lists : TileLists
    tile_m, tile_n, seqlen_q, seqlen_k : int
        As given to :func:`tile_lists`.
    heads : int
        Query heads to expand; head h reads row ``h * lists.stride_h + m``, so with
        ``stride_h == 0`` any count is allowed (all heads share the lists).

    Returns
    -------
    ndarray of bool, shape (heads, seqlen_q, seqlen_k)
    """
    tm, tn = _check_tile(tile_m, tile_n)
    heads = _int_arg("heads", heads, 1)
    tm16, tn16 = tm // SUB, tn // SUB
    mt, nt = _cdiv(seqlen_q, tm), _cdiv(seqlen_k, tn)
    h_rows = heads if lists.stride_h else 1
    if lists.n_rows != h_rows * mt or lists.ptr.shape != (lists.n_rows + 1,):
        raise ValueError(f"lists: {lists.n_rows} rows do not match {h_rows} head(s) x {mt} query tiles")
    counts = np.diff(lists.ptr.astype(np.int64))
    row = np.repeat(np.arange(lists.n_rows), counts)
    bits = np.unpackbits(lists.bits.astype("<u8").view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    tiles = np.zeros((h_rows * mt, nt, tm16, tn16), dtype=bool)
    tiles[row, lists.idx] = bits[:, : tm16 * tn16].reshape(-1, tm16, tn16).astype(bool)
    sub = tiles.reshape(h_rows, mt, nt, tm16, tn16).transpose(0, 1, 3, 2, 4).reshape(h_rows, mt * tm16, nt * tn16)
    dense = sub.repeat(SUB, axis=1).repeat(SUB, axis=2)[:, :seqlen_q, :seqlen_k]
    return np.broadcast_to(dense, (heads, seqlen_q, seqlen_k)).copy()

"""Sparse attention patterns: token-level CSR lists or block masks, built on the CPU with NumPy.

Every builder takes ``seqlen_q``, an optional ``seqlen_k`` (default ``seqlen_q``), ``causal`` and
``block_size`` (an int B for (B, B), or a pair (R, C)). Query row i sits at position
``t = i + seqlen_k - seqlen_q`` of the key sequence (bottom-right alignment, as
``pyattn.attention``'s causal and window); ``causal=True`` keeps keys ``j <= t``.

Without ``block_size`` a builder returns the CSR pair ``(indices, offsets)``: int32, offsets of
shape (seqlen_q + 1,) starting at 0, row i's keys ``indices[offsets[i]:offsets[i + 1]]`` sorted
and unique. With ``block_size=(R, C)`` it returns the bool block mask of shape
(ceil(seqlen_q / R), ceil(seqlen_k / C)) in which a block is set iff the token pattern has at
least one (row, key) pair inside it: a coarsening, so a superset of the token pattern (combine it
with ``causal`` in the attention call to drop the extra keys of diagonal blocks). The
block-sparse kernels need R and C to be multiples of 16.
"""

from __future__ import annotations

import numpy as np

__all__ = ["local", "strided", "dilated", "global_tokens", "random_k", "bigbird", "csr_to_mask", "mask_to_csr",
           "csr_to_bsr", "union"]

_MAX_NNZ = 2**31 - 1  # int32 offsets
_DENSE_DRAW_ELEMS = 1 << 22  # random_k draws at most this many scores at once (32 MiB of float64)


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


# --------------------------------------------------------------------------- pattern parts
# A builder describes its pattern as parts: ("iv", lo, hi) = one key interval [lo, hi] per row, or
# ("ap", first, step, count) = one arithmetic progression per row, or ("csr", indices, offsets).
# _emit turns the union of the parts into CSR or coarsens each part straight to blocks (a
# coarsening of a union is the union of the coarsenings), never expanding a band to tokens there.


def _query_pos(sq: int, sk: int) -> np.ndarray:
    return np.arange(sq, dtype=np.int64) + (sk - sq)


def _band(t, sk: int, left: int, right: int, causal: bool):
    """Interval part of keys ``t - left <= j <= t + right`` (-1 = unbounded), causal ``j <= t``."""
    lo = t - left if left >= 0 else np.zeros_like(t)
    hi = t + right if right >= 0 else np.full_like(t, sk - 1)
    return ("iv", lo, np.minimum(hi, t) if causal else hi)


def _part_csr(part, sq: int, sk: int):
    if part[0] == "csr":
        return part[1].astype(np.int32), part[2].astype(np.int32)
    if part[0] == "iv":
        first, step = np.maximum(part[1], 0), 1
        count = np.maximum(np.minimum(part[2], sk - 1) - first + 1, 0)
    else:
        _, first, step, count = part
    offsets = np.zeros(sq + 1, dtype=np.int64)
    np.cumsum(count, out=offsets[1:])
    if offsets[-1] > _MAX_NNZ:
        raise ValueError(f"block_size: the token pattern has {offsets[-1]} entries, more than int32 offsets "
                         f"hold; ask for a block mask (block_size=...)")
    # Entry e of row i is first[i] + step * (e - offsets[i]): a single repeat over the entries.
    base = (first - step * offsets[:-1]).astype(np.int64)
    cols = np.repeat(base, count) + step * np.arange(offsets[-1], dtype=np.int64)
    return cols.astype(np.int32), offsets.astype(np.int32)


def _part_blocks(part, sq: int, sk: int, r: int, c: int) -> np.ndarray:
    mb, nb = -(-sq // r), -(-sk // c)
    if part[0] != "iv":  # progressions and lists: coarsen their entries (as many as the tokens)
        ix, off = _part_csr(part, sq, sk)
        return csr_to_bsr(ix, off, sk, (r, c))
    lo, hi = np.maximum(part[1], 0), np.minimum(part[2], sk - 1)
    keep = lo <= hi
    rows = np.flatnonzero(keep) // r
    # Coverage count per block via a difference array along the key blocks.
    diff = np.zeros((mb, nb + 1), dtype=np.int64)
    np.add.at(diff, (rows, lo[keep] // c), 1)
    np.add.at(diff, (rows, hi[keep] // c + 1), -1)
    return np.cumsum(diff[:, :-1], axis=1) > 0


def _emit(parts, sq: int, sk: int, block):
    if block is not None:
        out = np.zeros((-(-sq // block[0]), -(-sk // block[1])), dtype=bool)
        for p in parts:
            out |= _part_blocks(p, sq, sk, *block)
        return out
    csrs = [_part_csr(p, sq, sk) for p in parts]
    return csrs[0] if len(csrs) == 1 else union(*csrs, seqlen_k=sk)


# --------------------------------------------------------------------------- builders


def local(seqlen_q, seqlen_k=None, *, window, causal=False, block_size=None):
    """Sliding window: query i sees keys ``t - left <= j <= t + right``, ``t = i + Sk - Sq``.

    Parameters
    ----------
    seqlen_q, seqlen_k, causal, block_size
        As for every builder (module docstring): lengths >= 1 (``seqlen_k`` defaults to
        ``seqlen_q``); keep only keys ``j <= t``; return the block mask of (R, C) blocks.
    window : int or tuple of int (left, right)
        -1 = unbounded side, as ``pyattn.attention``'s ``window``. An int w means (w, w), or
        (w, 0) with ``causal=True``.

    Returns
    -------
    (indices, offsets) : int32 ndarrays, or ndarray of bool (Mb, Nb) with ``block_size``

    Examples
    --------
    >>> idx, off = local(3, window=1)
    >>> idx.tolist(), off.tolist()
    ([0, 1, 0, 1, 2, 1, 2], [0, 2, 5, 7])
    >>> local(64, window=16, block_size=32).tolist()
    [[True, True], [True, True]]
    """
    sq, sk = _seqlens(seqlen_q, seqlen_k)
    causal, block = _bool("causal", causal), _block_size(block_size)
    if _is_int(window):
        w = _int("window", window, -1)
        window = (w, 0 if causal else w)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected an int or a pair (left, right), got {window!r}")
    left, right = (_int(f"window[{i}]", w, -1) for i, w in enumerate(window))
    return _emit([_band(_query_pos(sq, sk), sk, left, right, causal)], sq, sk, block)


def strided(seqlen_q, seqlen_k=None, *, stride, local=0, causal=False, block_size=None):
    """Sparse Transformer "strided": keys j with ``(t - j) % stride == 0`` plus ``|t - j| <= local``.

    Parameters
    ----------
    seqlen_q, seqlen_k, causal, block_size
        As for every builder (module docstring): lengths >= 1 (``seqlen_k`` defaults to
        ``seqlen_q``); keep only keys ``j <= t``; return the block mask of (R, C) blocks.
    stride : int >= 1
    local : int >= 0, optional
        Half-width of the local band added to the strided keys.

    Returns
    -------
    (indices, offsets) : int32 ndarrays, or ndarray of bool (Mb, Nb) with ``block_size``

    Examples
    --------
    >>> idx, off = strided(5, stride=2, causal=True)
    >>> [idx[off[i]:off[i + 1]].tolist() for i in range(5)]
    [[0], [1], [0, 2], [1, 3], [0, 2, 4]]
    """
    sq, sk = _seqlens(seqlen_q, seqlen_k)
    stride, width = _int("stride", stride, 1), _int("local", local, 0)
    causal, block = _bool("causal", causal), _block_size(block_size)
    t = _query_pos(sq, sk)
    first, last = t % stride, (np.minimum(t, sk - 1) if causal else np.full_like(t, sk - 1))
    count = np.where(last >= first, (last - first) // stride + 1, 0)
    return _emit([("ap", first, stride, count), _band(t, sk, width, width, causal)], sq, sk, block)


def dilated(seqlen_q, seqlen_k=None, *, window, dilation, causal=False, block_size=None):
    """Dilated window: keys ``j = t + k * dilation`` for integers ``|k| <= window`` (``k <= 0`` if causal).

    Parameters
    ----------
    seqlen_q, seqlen_k, causal, block_size
        As for every builder (module docstring): lengths >= 1 (``seqlen_k`` defaults to
        ``seqlen_q``); keep only keys ``j <= t``; return the block mask of (R, C) blocks.
    window : int >= 0
        Largest ``|k|``.
    dilation : int >= 1
        Gap between consecutive keys (1 gives :func:`local`).

    Returns
    -------
    (indices, offsets) : int32 ndarrays, or ndarray of bool (Mb, Nb) with ``block_size``

    Examples
    --------
    >>> idx, off = dilated(6, window=1, dilation=2)
    >>> idx[off[3]:off[4]].tolist()
    [1, 3, 5]
    """
    sq, sk = _seqlens(seqlen_q, seqlen_k)
    window, dil = _int("window", window, 0), _int("dilation", dilation, 1)
    causal, block = _bool("causal", causal), _block_size(block_size)
    t = _query_pos(sq, sk)
    k_lo = np.maximum(-window, -(t // dil))  # smallest k with t + k * dil >= 0
    k_hi = np.minimum(0 if causal else window, (sk - 1 - t) // dil)
    count = np.maximum(k_hi - k_lo + 1, 0)
    return _emit([("ap", t + k_lo * dil, dil, count)], sq, sk, block)


def global_tokens(seqlen_q, seqlen_k=None, *, tokens, window=0, causal=False, block_size=None):
    """Longformer / BigBird-ITC: a local band plus global tokens that see, and are seen by, everyone.

    Key position p in ``tokens`` is seen by every query; the query at position p (row
    ``p - (seqlen_k - seqlen_q)``, i.e. row p when the lengths are equal) sees every key.
    ``causal`` applies on top of both.

    Parameters
    ----------
    seqlen_q, seqlen_k, causal, block_size
        As for every builder (module docstring): lengths >= 1 (``seqlen_k`` defaults to
        ``seqlen_q``); keep only keys ``j <= t``; return the block mask of (R, C) blocks.
    tokens : array_like of int
        Global positions in [0, seqlen_k); duplicates are ignored.
    window : int >= 0, optional
        Half-width of the local band ``|t - j| <= window``.

    Returns
    -------
    (indices, offsets) : int32 ndarrays, or ndarray of bool (Mb, Nb) with ``block_size``

    Examples
    --------
    >>> idx, off = global_tokens(4, tokens=[0])
    >>> [idx[off[i]:off[i + 1]].tolist() for i in range(4)]
    [[0, 1, 2, 3], [0, 1], [0, 2], [0, 3]]
    """
    sq, sk = _seqlens(seqlen_q, seqlen_k)
    window, causal, block = _int("window", window, 0), _bool("causal", causal), _block_size(block_size)
    tok = _int_array("tokens", tokens)
    if tok.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D array of positions, got shape {tok.shape}")
    if ((tok < 0) | (tok >= sk)).any():
        raise ValueError(f"tokens: positions must lie in [0, seqlen_k = {sk}), got {tok.min()}..{tok.max()}")
    tok = np.unique(tok).astype(np.int64)
    t = _query_pos(sq, sk)
    last = np.minimum(t, sk - 1) if causal else np.full_like(t, sk - 1)
    n_keys = np.searchsorted(tok, last, side="right")  # global keys j <= last
    starts = np.cumsum(n_keys) - n_keys
    keys = tok[np.arange(n_keys.sum()) - np.repeat(starts, n_keys)]
    offsets = np.concatenate([[0], np.cumsum(n_keys)])
    is_global = np.isin(t, tok)
    rows = ("iv", np.where(is_global, 0, 1), np.where(is_global, last, 0))  # [0, last] or empty
    return _emit([_band(t, sk, window, window, causal), ("csr", keys, offsets), rows], sq, sk, block)


def random_k(seqlen_q, seqlen_k=None, *, k, seed, causal=False, include_diagonal=True, block_size=None):
    """Each query sees k distinct keys drawn uniformly without replacement among its allowed keys.

    Allowed keys are all keys, or ``j <= t`` with ``causal`` (``t = i + seqlen_k - seqlen_q``); a
    row with fewer than k allowed keys sees all of them. The draw uses
    ``np.random.default_rng(seed)`` and is a deterministic function of all the arguments.

    Parameters
    ----------
    seqlen_q, seqlen_k, causal, block_size
        As for every builder (module docstring): lengths >= 1 (``seqlen_k`` defaults to
        ``seqlen_q``); keep only keys ``j <= t``; return the block mask of (R, C) blocks.
    k : int >= 0
    seed : int >= 0
    include_diagonal : bool, optional
        Also add key t when ``0 <= t < seqlen_k`` (if not drawn already); the drawn keys are the
        same either way.

    Returns
    -------
    (indices, offsets) : int32 ndarrays, or ndarray of bool (Mb, Nb) with ``block_size``

    Examples
    --------
    >>> idx, off = random_k(4, k=2, seed=0, causal=True, include_diagonal=False)
    >>> np.diff(off).tolist()
    [1, 2, 2, 2]
    """
    sq, sk = _seqlens(seqlen_q, seqlen_k)
    k, seed = _int("k", k, 0), _int("seed", seed, 0)
    causal, diag = _bool("causal", causal), _bool("include_diagonal", include_diagonal)
    block = _block_size(block_size)
    rng = np.random.default_rng(seed)
    t = _query_pos(sq, sk)
    n = np.clip(t + 1, 0, sk) if causal else np.full(sq, sk, dtype=np.int64)  # allowed keys: [0, n)
    kk = np.minimum(k, n)
    picks = np.full((sq, min(k, sk) + 1), -1, dtype=np.int64)  # -1 = empty slot; last column: diagonal
    if k * k <= 8 * sk:  # Floyd's algorithm, vectorised over rows: O(Sq k^2) instead of O(Sq Sk)
        for j in range(min(k, sk)):
            top = n - kk + j  # draw from [0, top]; take top itself when the draw is already in
            active = j < kk
            draw = rng.integers(0, np.maximum(top, 0) + 1)
            dup = (picks[:, :j] == draw[:, None]).any(axis=1)
            picks[:, j] = np.where(active, np.where(dup, top, draw), -1)
    else:  # the kk keys with the smallest random scores, a block of rows at a time (bounded memory)
        step = max(1, _DENSE_DRAW_ELEMS // sk)
        for r0 in range(0, sq, step):
            rs = slice(r0, min(r0 + step, sq))
            score = rng.random((rs.stop - r0, sk))
            score[np.arange(sk)[None, :] >= n[rs, None]] = 2.0  # disallowed keys lose
            sel = np.argpartition(score, min(k, sk) - 1, axis=1)[:, : min(k, sk)]
            picks[rs, :-1] = np.where(sel < n[rs, None], sel, -1)
    if diag:
        picks[:, -1] = np.where((t >= 0) & (t < sk), t, -1)
    picks.sort(axis=1)
    keep = picks >= 0
    keep[:, 1:] &= picks[:, 1:] != picks[:, :-1]  # the diagonal may have been drawn too
    ix, off = _from_rows(np.nonzero(keep)[0], picks[keep], sq)
    return _emit([("csr", ix, off)], sq, sk, block)


def bigbird(seqlen, *, block_size, window_blocks=1, global_blocks=1, random_blocks=2, seed=0):
    """Block-level BigBird (not causal): window, global and random blocks, as a bool block mask.

    Block (r, c) is set when ``|r - c| <= window_blocks``, when r or c is one of the first
    ``global_blocks`` blocks, or when c is one of the ``random_blocks`` columns drawn uniformly
    without replacement (``np.random.default_rng(seed)``) for row r among the columns not
    already set; rows with fewer such columns get all of them.

    Parameters
    ----------
    seqlen : int
        Sequence length (queries and keys).
    block_size : int or tuple of int (B, B)
        Square blocks.
    window_blocks, global_blocks, random_blocks, seed : int >= 0, optional

    Returns
    -------
    ndarray of bool, shape (ceil(seqlen / B), ceil(seqlen / B))

    Examples
    --------
    >>> bigbird(256, block_size=64, random_blocks=0).astype(int).tolist()
    [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]]
    """
    s = _int("seqlen", seqlen, 1)
    r, c = _block_size(block_size) if block_size is not None else (None, None)
    if r is None or r != c:
        raise ValueError(f"block_size: expected square blocks (an int B or (B, B)), got {block_size!r}")
    w, g = _int("window_blocks", window_blocks, 0), _int("global_blocks", global_blocks, 0)
    n_rand, seed = _int("random_blocks", random_blocks, 0), _int("seed", seed, 0)
    nb = -(-s // r)
    idx = np.arange(nb)
    mask = np.abs(idx[:, None] - idx[None, :]) <= w
    mask[:g, :] = mask[:, :g] = True
    if n_rand and nb:
        score = np.random.default_rng(seed).random((nb, nb))
        score[mask] = 2.0  # taken columns are never drawn
        kk = min(n_rand, nb)
        sel = np.argpartition(score, kk - 1, axis=1)[:, :kk]
        mask[idx[:, None], sel] |= np.take_along_axis(score, sel, axis=1) < 1.0
    return mask


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

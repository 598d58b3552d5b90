"""The pattern builders: local windows, strided, dilated, global tokens, random keys and BigBird,
each as a CSR list or a block mask (see :mod:`pyattn.patterns` for the conventions)."""

from __future__ import annotations

import numpy as np

from ._base import (_MAX_NNZ, _band, _block_size, _bool, _from_rows, _int, _int_array, _is_int, _query_pos,
                    _seqlens)
from .convert import csr_to_bsr, union

__all__ = ["local", "strided", "dilated", "global_tokens", "random_k", "bigbird"]

_DENSE_DRAW_ELEMS = 1 << 22  # random_k draws at most this many scores at once (32 MiB of float64)


# --------------------------------------------------------------------------- pattern parts
# A builder describes its pattern as parts: ("iv", lo, hi) = one key interval [lo, hi] per row, or
# ("ap", first, step, count) = one arithmetic progression per row, or ("csr", indices, offsets).
# _emit turns the union of the parts into CSR or coarsens each part straight to blocks (a
# coarsening of a union is the union of the coarsenings), never expanding a band to tokens there.


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

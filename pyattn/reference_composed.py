"""Float64 references of the ops built on :func:`pyattn.reference.attention_ref`: packed
variable-length sequences (each sequence alone), token-tree verification (a mask of ancestors) and
the merge of partial states over disjoint key sets.

Re-exported by :mod:`pyattn.reference` (import them from there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .reference_dense import _as_float_array, _check_alibi, attention_ref

__all__ = ["attention_varlen_ref", "tree_ancestor_mask", "tree_attention_ref", "merge_states_ref"]


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, return_lse=False, **options):
    """Reference attention over packed variable-length sequences.

    Parameters
    ----------
    q, k, v : array_like, shapes (total_q, Hq, D), (total_k, Hkv, D), (total_k, Hkv, Dv)
        All sequences concatenated along the first axis.
    cu_seqlens_q, cu_seqlens_k : ndarray of int32, shape (N + 1,)
        Sequence n owns rows ``cu[n]:cu[n + 1]``; 0 first, non-decreasing, packed length last.
    return_lse : bool, optional
        Also return the log-sum-exp, shape (Hq, total_q) (FlashAttention's varlen layout).
    **options
        ``causal``, ``window``, ``softcap``, ``alibi_slopes`` ((Hq,) or (N, Hq)), ``scale`` as
        in :func:`attention_ref`, per sequence (causal/window align to its bottom-right).

    Returns
    -------
    out : ndarray of float64, shape (total_q, Hq, Dv)
    lse : ndarray of float64, shape (Hq, total_q)
        Only when ``return_lse`` is True.
    """
    if "mask" in options or "layout" in options:
        raise TypeError("mask, layout: not accepted by attention_varlen_ref")
    arrs = {n: _as_float_array(x, n) for n, x in (("q", q), ("k", k), ("v", v))}
    for name, a in arrs.items():
        if a.ndim != 3:
            raise ValueError(f"{name}: expected 3 dims (total_tokens, heads, dim), "
                             f"got shape {a.shape}")
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    cus = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
                            ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        cu = np.asarray(cu)
        if cu.dtype != np.int32:
            raise TypeError(f"{name}: expected dtype int32, got {cu.dtype}")
        if cu.ndim != 1 or cu.size < 1:
            raise ValueError(f"{name}: expected shape (N + 1,), got {cu.shape}")
        if cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
            raise ValueError(f"{name}: must start at 0, be non-decreasing and end at the "
                             f"packed length {total}, got {cu.tolist()}")
        cus.append(cu)
    cu_q, cu_k = cus
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: {cu_k.size - 1} sequences, cu_seqlens_q has "
                         f"{cu_q.size - 1}")
    slopes = options.pop("alibi_slopes", None)
    if slopes is not None:
        slopes = _check_alibi(slopes, cu_q.size - 1, q.shape[1])
    outs, lses = [], []
    for n in range(cu_q.size - 1):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        o, lse = attention_ref(q[None, qs], k[None, ks], v[None, ks], layout="bshd",
                               return_lse=True, alibi_slopes=None if slopes is None else
                               slopes[n] if slopes.ndim == 2 else slopes, **options)
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:  # zero sequences: the empty packed problem gives the empty results
        o, lse = attention_ref(q[None], k[None], v[None], return_lse=True, **options)
        outs, lses = [o[0]], [lse[0]]
    out, lse = np.concatenate(outs, axis=0), np.concatenate(lses, axis=1)
    return (out, lse) if return_lse else out


def tree_ancestor_mask(parents) -> np.ndarray:
    """Bool (n, n) mask of a draft tree: ``[i, j]`` is True when token j is token i or one of its
    ancestors.

    Parameters
    ----------
    parents : array_like of int, shape (n,)
        ``parents[i]`` is an earlier token of the tree (``0 <= parents[i] < i``) or -1 (a root).
    """
    par = np.asarray(parents)
    if par.ndim != 1 or (par.size and par.dtype.kind not in "iu"):
        raise TypeError(f"parents: expected a 1-D integer array, got {par.dtype} of shape {par.shape}")
    n = par.size
    if n and ((par < -1) | (par >= np.arange(n))).any():
        raise ValueError(f"parents: each must be -1 or an earlier index, got {par.tolist()}")
    anc = np.eye(n, dtype=bool)
    for i in range(n):
        if par[i] >= 0:
            anc[i] |= anc[par[i]]
    return anc


def tree_attention_ref(q, k, v, parents, *, return_lse=False, **options):
    """Reference token-tree verification of one sequence: its cache ends with the tree.

    Parameters
    ----------
    q : array_like, shape (n, Hq, D)
        The tree tokens' queries.
    k, v : array_like, shape (L, Hkv, D)
        The sequence's keys and values, the last n of which are the tree's (in tree order).
    parents : array_like of int, shape (n,)
        As :func:`tree_ancestor_mask`.
    return_lse : bool, optional
        Also return the log-sum-exp, shape (Hq, n).
    **options
        ``softcap``, ``scale`` as in :func:`attention_ref`.

    Returns
    -------
    out : ndarray of float64, shape (n, Hq, D)
        Token i attends to keys ``0 .. L - n - 1`` and to tree key ``L - n + j`` for every ancestor
        (or itself) j.
    lse : ndarray of float64, shape (Hq, n)
        Only when ``return_lse`` is True.
    """
    q, k, v = (_as_float_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    n, L = q.shape[0], k.shape[0]
    if n > L:
        raise ValueError(f"k: the cache ({L} keys) must end with the tree's {n} tokens")
    mask = np.concatenate([np.ones((n, L - n), bool), tree_ancestor_mask(parents)], axis=1)
    out, lse = attention_ref(q[None], k[None], v[None], mask=mask, return_lse=True, **options)
    return (out[0], lse[0]) if return_lse else out[0]


_LSE_ROWS = {  # an op's LSE -> the shape of its output's leading axes, and back
    "bshd": (lambda x: np.swapaxes(x, -1, -2), lambda x: np.swapaxes(x, -1, -2)),
    "bhsd": (lambda x: x, lambda x: x),
    "thd": (lambda x: x.T, lambda x: x.T),
}


def merge_states_ref(outputs: Sequence, lses: Sequence, layout: str = "bshd"):
    """Combine partial attention states computed over disjoint key sets.

    ``lse = logaddexp_i(lse_i)``, ``o = sum_i exp(lse_i - lse) * o_i``. Parts with
    ``lse_i = -inf`` contribute nothing (even if their output holds garbage); if every
    part is ``-inf``, ``o = 0`` and ``lse = -inf``.

    Parameters
    ----------
    outputs : sequence of array_like
        Partial outputs, all of one shape, in ``layout``: (B, S, H, D), (B, H, S, D) or (T, H, D).
    lses : sequence of array_like
        Matching log-sum-exps in the shape every op returns: (B, H, S) for both 4-D layouts,
        (H, T) for ``"thd"``, so ``attention_ref(..., return_lse=True)`` results merge as they are.
    layout : {"bshd", "bhsd", "thd"}

    Returns
    -------
    out : ndarray of float64, shape of ``outputs[0]``
    lse : ndarray of float64, shape of ``lses[0]``
    """
    if layout not in _LSE_ROWS:
        raise ValueError(f"layout: expected one of {tuple(_LSE_ROWS)}, got {layout!r}")
    to_rows, from_rows = _LSE_ROWS[layout]
    if len(outputs) == 0 or len(outputs) != len(lses):
        raise ValueError(f"outputs, lses: expected equally long non-empty sequences, got "
                         f"{len(outputs)} and {len(lses)}")
    os_ = [_as_float_array(o, f"outputs[{i}]").astype(np.float64, copy=False)
           for i, o in enumerate(outputs)]
    ls_ = [_as_float_array(x, f"lses[{i}]").astype(np.float64, copy=False)
           for i, x in enumerate(lses)]
    for i, (o, lse) in enumerate(zip(os_, ls_)):
        if o.ndim != (3 if layout == "thd" else 4) or o.shape != os_[0].shape:
            raise ValueError(f"outputs[{i}]: expected shape {os_[0].shape} of layout {layout}, got {o.shape}")
        if lse.ndim != o.ndim - 1 or to_rows(lse).shape != o.shape[:-1]:
            want = from_rows(np.empty(o.shape[:-1])).shape
            raise ValueError(f"lses[{i}]: expected shape {want} (the LSE of a {layout} output), got {lse.shape}")
        if np.isnan(lse).any() or np.isposinf(lse).any():
            raise ValueError(f"lses[{i}]: must be finite or -inf")
    ls_ = [to_rows(x) for x in ls_]
    lse = np.logaddexp.reduce(np.stack(ls_), axis=0)  # logaddexp(-inf, -inf) = -inf
    ref = np.where(lse == -np.inf, 0.0, lse)  # avoids -inf - -inf = NaN
    out = np.zeros_like(os_[0])
    for o, li in zip(os_, ls_):
        w = np.exp(li - ref)[..., None]
        out += np.where(w > 0, w * o, 0.0)  # where: a dead part's NaN must not leak
    return out, from_rows(lse)

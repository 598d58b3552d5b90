"""float64 reference of SparQ attention (Ribar et al., "SparQ Attention: Bandwidth-Efficient LLM
Inference", ICML 2024) as :func:`pyattn.sparq_decode` defines it, and its naive same-precision twin
(the yardstick of the 2x tolerance rule).

For one query token of sequence b and one kv head, with its group of G query heads ``q_h`` (G = 1
is the paper's multi-head case), keys K and values V (L tokens):

1. ``i1``: the r channels with the largest ``sum_h |q_h[c]|`` (ties: the lower channel).
2. Per head the softmax temperature correction ``t_h = 1 / sqrt(sum_i1 |q_h| / sum |q_h|)`` (0 when
   ``q_h`` is 0 on those channels) and the approximate query ``q~_h = t_h * q_h[i1]``.
3. ``i2``: the ``k' = min(k, L)`` keys with the largest ``sum_h q~_h . K[i, i1]`` (ties: the lower
   position). Why a sum over the group: the group's heads share K, so choosing per head would read
   up to G times the channels and keys, which is the bandwidth SparQ exists to save; the sum of
   logits ranks keys by the product of the heads' approximate probabilities (the softmax
   normalisers are per-head constants) and is exactly the paper's rule for G = 1.
4. Per head ``s^_h = softmax(scale * q~_h . K[:, i1])`` over all L keys and ``alpha_h = sum_i2 s^_h``
   (1 when every key is chosen).
5. ``y_h = alpha_h * softmax(scale * q_h . K[i2]) V[i2] + (1 - alpha_h) * mean(V)``.

``select="head"`` runs all of it for each query head alone (G = 1: the paper's algorithm per head,
as a GQA model's K/V repeated per query head), at up to G times the bytes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["sparq_ref", "sparq_selection_scores"]


def _rows(q, keys, values):
    """q as float64 (B, Hq, D) and the per-sequence (L_b, Hkv, D) float64 keys / values."""
    q = np.asarray(q)
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(f"q: expected shape (batch, 1, heads_q, head_dim), got {q.shape}")
    if len(keys) != q.shape[0] or len(values) != q.shape[0]:
        raise ValueError(f"keys, values: expected {q.shape[0]} sequences (q's batch), got {len(keys)}, {len(values)}")
    ks = [np.asarray(x) for x in keys]
    vs = [np.asarray(x) for x in values]
    for b, (k, v) in enumerate(zip(ks, vs)):
        if k.ndim != 3 or k.shape != v.shape or k.shape[2] != q.shape[3] or q.shape[2] % k.shape[1] or not len(k):
            raise ValueError(f"keys[{b}], values[{b}]: expected equal shapes (L >= 1, heads_kv, {q.shape[3]}) with "
                             f"heads_q % heads_kv == 0, got {k.shape} and {v.shape}")
    return q, ks, vs


def _channels(Q: np.ndarray, r: int) -> np.ndarray:
    """Step 1: the chosen channels of a group's queries Q (G, D), ascending."""
    w = np.abs(Q).sum(0)
    order = np.lexsort((np.arange(len(w)), -w))  # by -w, then channel
    return np.sort(order[:r])


def _approx_queries(Q: np.ndarray, i1: np.ndarray, rnd) -> np.ndarray:
    """Step 2: q~ (G, r) = rnd(t_h * q_h[i1])."""
    a = np.abs(Q)
    total, chosen = a.sum(1), a[:, i1].sum(1)
    ok = (total > 0) & (chosen > 0)
    t = np.where(ok, 1.0 / np.sqrt(np.where(ok, chosen / np.where(total > 0, total, 1), 1)), 0.0)
    return rnd(Q[:, i1] * t[:, None])


def _per_head(q, keys, values, select):
    """``select="head"``: K/V repeated per query head, so every head is its own group."""
    if select not in ("group", "head"):
        raise ValueError(f"select: expected 'group' or 'head', got {select!r}")
    if select == "group":
        return keys, values
    rep = [np.repeat(np.asarray(x), np.asarray(q).shape[2] // np.asarray(x).shape[1], axis=1) for x in keys]
    return rep, [np.repeat(np.asarray(x), np.asarray(q).shape[2] // np.asarray(x).shape[1], axis=1) for x in values]


def sparq_selection_scores(q, keys, r: int, *, rounding=None, select: str = "group") -> list:
    """Step 3's scores ``sum_h q~_h . K[i, i1]`` in float64, and their magnitudes for tolerances.

    Parameters
    ----------
    q, keys
        As in :func:`sparq_ref`.
    r : int
    rounding : numpy dtype, optional
        Round q~ to this dtype first (what the kernel does with the query dtype).

    select : {"group", "head"}

    Returns
    -------
    list of (scores, magnitude)
        Per sequence, float64 arrays (row heads, L): the scores and ``sum_h sum_j |q~_hj K[i, j]|``.
    """
    keys, _ = _per_head(q, keys, keys, select)
    q, ks, _ = _rows(q, keys, keys)
    rnd = (lambda x: x.astype(rounding).astype(np.float64)) if rounding is not None else (lambda x: x)
    out = []
    for b, K in enumerate(ks):
        Hkv, G = K.shape[1], q.shape[2] // K.shape[1]
        sc, mag = np.empty((Hkv, len(K))), np.empty((Hkv, len(K)))
        for h in range(Hkv):
            Q = q[b, 0, h * G:(h + 1) * G].astype(np.float64)
            i1 = _channels(Q, r)
            qt = _approx_queries(Q, i1, rnd)
            Kc = K[:, h, i1].astype(np.float64)
            sc[h] = Kc @ qt.sum(0)
            mag[h] = np.abs(Kc) @ np.abs(qt).sum(0)
        out.append((sc, mag))
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def sparq_ref(q, keys, values, *, r: int, k: int, scale=None, select: str = "group", chosen=None,
              lowp: bool = False, return_details: bool = False):
    """SparQ attention of one query token per sequence (see the module docstring).

    Parameters
    ----------
    q : array, (batch, 1, heads_q, head_dim)
    keys, values : sequence of arrays
        Per sequence, (L_b, heads_kv, head_dim) with L_b >= 1 (lengths may differ).
    r, k : int
        Channels of the approximate scores (1 <= r <= head_dim) and keys attended (k >= 1).
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    select : {"group", "head"}
        Who shares the choices: each kv head's group of query heads, or nobody (see the module docstring).
    chosen : sequence, optional
        Per sequence, per row head (kv head, or query head with ``select="head"``), the positions to attend instead of step 3's choice (e.g. what a
        kernel chose: its output is then checked against the same set).
    lowp : bool
        The naive same-precision computation in q's dtype T: q~ and the approximate logits rounded
        to T, softmaxes and alpha in float32, the attention as ``reference.attention_lowp``, mean(V)
        in float32, the blend rounded to T.
    return_details : bool
        Also return a dict: ``channels`` (batch, row heads, r), ``chosen`` (per sequence (row heads,
        k') positions, ascending), ``alpha`` (batch, heads_q).

    Returns
    -------
    out : ndarray of float64, (batch, 1, heads_q, head_dim)
    details : dict, only with ``return_details``
    """
    from .reference_dense import attention_lowp, attention_ref

    keys, values = _per_head(q, keys, values, select)
    q, ks, vs = _rows(q, keys, values)
    D = q.shape[3]
    if isinstance(r, bool) or not 1 <= int(r) <= D or isinstance(k, bool) or int(k) < 1:
        raise ValueError(f"r, k: expected 1 <= r <= {D} and k >= 1, got {r} and {k}")
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    t_dtype = q.dtype
    rnd = (lambda x: x.astype(t_dtype).astype(np.float64)) if lowp else (lambda x: x)
    out = np.empty((q.shape[0], 1, q.shape[2], D))
    chans, picks, alphas = [], [], np.empty(q.shape[:1] + q.shape[2:3])
    for b, (K, V) in enumerate(zip(ks, vs)):
        L, Hkv = K.shape[:2]
        G = q.shape[2] // Hkv
        k_eff = min(int(k), L)
        chans.append([])
        picks.append(np.empty((Hkv, k_eff), np.int64))
        for h in range(Hkv):
            Q = q[b, 0, h * G:(h + 1) * G].astype(np.float64)
            Kh, Vh = K[:, h].astype(np.float64), V[:, h].astype(np.float64)
            i1 = _channels(Q, int(r))
            qt = _approx_queries(Q, i1, rnd)
            if chosen is not None:
                i2 = np.sort(np.asarray(chosen[b][h], np.int64))
                if len(i2) != k_eff or len(np.unique(i2)) != k_eff or i2.min() < 0 or i2.max() >= L:
                    raise ValueError(f"chosen[{b}][{h}]: expected {k_eff} distinct positions in [0, {L})")
            else:
                sel = Kh[:, i1] @ qt.sum(0)
                i2 = np.sort(np.lexsort((np.arange(L), -sel))[:k_eff])
            logits = scale * rnd(Kh[:, i1] @ qt.T).T  # (G, L)
            if lowp:
                logits = logits.astype(np.float32)
            alpha = np.array([1.0 if k_eff == L else _softmax(x)[i2].sum() for x in logits])
            if lowp:
                alpha = alpha.astype(np.float32).astype(np.float64)
            qb, kb, vb = q[b:b + 1, :, h * G:(h + 1) * G], K[None, i2, h:h + 1], V[None, i2, h:h + 1]
            o = (attention_lowp(qb, kb.astype(t_dtype), vb.astype(t_dtype), scale=scale) if lowp
                 else attention_ref(qb, kb, vb, scale=scale))[0, 0]  # (G, D)
            mean = Vh.astype(np.float32).sum(0, dtype=np.float32) / np.float32(L) if lowp else Vh.mean(0)
            y = alpha[:, None] * o + (1 - alpha[:, None]) * mean[None]
            out[b, 0, h * G:(h + 1) * G] = rnd(y.astype(np.float32)) if lowp else y
            chans[-1].append(i1)
            picks[-1][h] = i2
            alphas[b, h * G:(h + 1) * G] = alpha
    if return_details:
        return out, {"channels": np.asarray(chans), "chosen": picks, "alpha": alphas}
    return out

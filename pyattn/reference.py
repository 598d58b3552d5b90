"""Float64 NumPy reference of every pyattn attention op: the semantics kernels must match.

Clarity over speed: the full (B, Hq, Sq, Sk) score tensor is materialised in float64.
Inputs may be float16, bfloat16 (ml_dtypes), float32 or float64; all results are float64.
Scores are built in this order: ``s = scale * q.k``; soft-cap ``cap * tanh(s / cap)``;
``+ alibi``; ``+ float mask``; keys not allowed (causal, window, bool mask) -> ``-inf``.
A query row with no finite score yields output 0 and LSE ``-inf``, never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["attention_ref", "attention_varlen_ref", "merge_states_ref", "attention_lowp",
           "error_bound", "tree_ancestor_mask", "tree_attention_ref", "attention_backward_ref",
           "attention_backward_lowp", "attention_varlen_backward_ref", "backward_error_bounds"]

_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64,
                                               ml_dtypes.bfloat16))
_LAYOUTS = ("bshd", "bhsd")
_CAUSAL_MODES = ("bottom_right", "top_left")
# Default error_bound floors, about one output ulp near |o| ~ 1 for the 16-bit
# types (the kernel's final rounding to T alone costs up to half an ulp, and on
# a tiny problem the naive error can happen to be 0).  For fp32 the floor of
# ~80 ulps covers summation-order and exp2-vs-exp differences that a naive
# implementation may not exhibit.  fp64 only needs to absorb rounding noise.
_DEFAULT_FLOOR = {
    np.dtype(np.float16): 1e-3,  # eps(fp16) = 2**-10 ~ 9.8e-4
    np.dtype(ml_dtypes.bfloat16): 8e-3,  # eps(bf16) = 2**-7 ~ 7.8e-3
    np.dtype(np.float32): 1e-5,  # eps(fp32) = 2**-23 ~ 1.2e-7
    np.dtype(np.float64): 1e-12,
}


class _Problem(NamedTuple):
    """Validated dense problem; q, k, v are (B, H, S, D) views in their own dtype."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    layout: str
    causal: str | None  # None, "bottom_right" or "top_left"
    window: tuple[int, int] | None
    mask_bool: np.ndarray | None
    mask_add: np.ndarray | None  # float64
    softcap: float | None
    alibi: np.ndarray | None  # float64, (Hq,) or (B, Hq)
    scale: float


# --------------------------------------------------------------------------- validation


def _as_float_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float16, bfloat16, float32 or float64, "
                        f"got {arr.dtype}")
    return arr


def _check_causal(causal) -> str | None:
    if isinstance(causal, (bool, np.bool_)):
        return "bottom_right" if causal else None
    if isinstance(causal, str):
        if causal in _CAUSAL_MODES:
            return causal
        raise ValueError(f"causal: expected False, True, 'bottom_right' or 'top_left', "
                         f"got {causal!r}")
    raise TypeError(f"causal: expected a bool or a str, got {type(causal).__name__}")


def _check_window(window) -> tuple[int, int] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected a (left, right) pair or None, got {window!r}")
    for side, w in zip(("left", "right"), window):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window: {side} must be an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"window: {side} must be >= 0 or -1 (unbounded), got {w}")
    return int(window[0]), int(window[1])


def _check_real(x, name: str) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, Real):
        raise TypeError(f"{name}: expected a real number or None, got {type(x).__name__}")
    x = float(x)
    if not np.isfinite(x):
        raise ValueError(f"{name}: must be finite, got {x}")
    return x


def _check_mask(mask, shape):
    """Split ``mask`` into (bool mask, float64 additive mask); at most one is not None."""
    if mask is None:
        return None, None
    mask = np.asarray(mask)
    if mask.ndim > 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], shape[::-1])):
        raise ValueError(f"mask: expected a shape broadcastable to (B, Hq, Sq, Sk) = {shape}, "
                         f"got {mask.shape}")
    if mask.dtype == np.bool_:
        return mask, None
    if mask.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"mask: expected a bool or float dtype, got {mask.dtype}")
    mask = mask.astype(np.float64, copy=False)
    # +inf or NaN would turn whole rows into NaN; -inf is the additive "masked" value.
    if np.isnan(mask).any() or np.isposinf(mask).any():
        raise ValueError("mask: a float mask may hold finite values or -inf, not NaN or +inf")
    return None, mask


def _check_alibi(alibi_slopes, batch: int, hq: int) -> np.ndarray | None:
    if alibi_slopes is None:
        return None
    slopes = _as_float_array(alibi_slopes, "alibi_slopes").astype(np.float64, copy=False)
    if slopes.shape not in ((hq,), (batch, hq)):
        raise ValueError(f"alibi_slopes: expected shape (Hq,) = ({hq},) or (B, Hq) = "
                         f"({batch}, {hq}), got {slopes.shape}")
    if not np.isfinite(slopes).all():
        raise ValueError("alibi_slopes: must be finite")
    return slopes


def _prepare(q, k, v, *, causal=False, mask=None, window=None, softcap=None,
             alibi_slopes=None, scale=None, layout="bshd") -> _Problem:
    """Validate the arguments of a dense op and bring q, k, v to (B, H, S, D) views."""
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'bshd' or 'bhsd', got {layout!r}")
    arrs = {n: _as_float_array(x, n) for n, x in (("q", q), ("k", k), ("v", v))}
    for name, a in arrs.items():
        if a.ndim != 4:
            raise ValueError(f"{name}: expected 4 dims ({layout.upper()}), got shape {a.shape}")
        if min(a.shape[-1], a.shape[1 if layout == "bhsd" else 2]) < 1:
            raise ValueError(f"{name}: heads and head_dim must be >= 1, got shape {a.shape}")
    if layout == "bshd":  # views only: no copy yet
        arrs = {n: a.transpose(0, 2, 1, 3) for n, a in arrs.items()}
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    (b, hq, sq, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if bk != b:
        raise ValueError(f"k: batch size {bk} does not match q's {b}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} does not match q's {d}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: (batch, heads, seq) {v.shape[:3]} must match k's {k.shape[:3]} "
                         f"(in (B, H, S) order)")
    if hq % hkv:
        raise ValueError(f"k: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    mask_bool, mask_add = _check_mask(mask, (b, hq, sq, sk))
    if softcap is not None:
        softcap = _check_real(softcap, "softcap")
        if softcap <= 0:
            raise ValueError(f"softcap: must be > 0 (use None to disable), got {softcap}")
    scale = 1.0 / np.sqrt(d) if scale is None else _check_real(scale, "scale")
    return _Problem(q, k, v, layout, _check_causal(causal), _check_window(window), mask_bool,
                    mask_add, softcap, _check_alibi(alibi_slopes, b, hq), scale)


# --------------------------------------------------------------------------- shared math


def _allowed(shape, causal, window, mask_bool) -> np.ndarray:
    """Bool (B, Hq, Sq, Sk) "query i may attend key j"; a read-only broadcast view (no copy)."""
    _, _, sq, sk = shape
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq  # bottom-right aligned diagonal (FlashAttention 2.1+)
    ok = np.ones((sq, sk), dtype=bool)
    if causal == "bottom_right":
        ok &= j <= diag
    elif causal == "top_left":
        ok &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
    if mask_bool is not None:
        ok = ok & mask_bool
    return np.broadcast_to(ok, shape)


def _bias(p: _Problem, shape, dtype) -> np.ndarray | None:
    """ALiBi plus additive mask, broadcastable to (B, Hq, Sq, Sk), or None."""
    bias = None
    if p.alibi is not None:
        _, _, sq, sk = shape
        dist = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
        slopes = p.alibi.reshape(-1, shape[1], 1, 1)  # (1 or B, Hq, 1, 1)
        bias = (-slopes * dist).astype(dtype, copy=False)
    if p.mask_add is not None:
        add = p.mask_add.astype(dtype, copy=False)
        bias = add if bias is None else bias + add
    return bias


def _grouped(x: np.ndarray, hkv: int) -> np.ndarray:
    """(B, Hq, ...) -> (B, Hkv, G, ...): query head h = kv head h // G, member h % G."""
    return x.reshape(x.shape[0], hkv, x.shape[1] // hkv, *x.shape[2:])


def _qk(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q (B, Hq, Sq, D) @ k (B, Hkv, Sk, D)^T -> (B, Hq, Sq, Sk) without repeating KV heads."""
    s = _grouped(q, k.shape[1]) @ k[:, :, None].swapaxes(-1, -2)
    return s.reshape(q.shape[:3] + (k.shape[2],))


def _pv(pr: np.ndarray, v: np.ndarray) -> np.ndarray:
    """pr (B, Hq, Sq, Sk) @ v (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv)."""
    o = _grouped(pr, v.shape[1]) @ v[:, :, None]
    return o.reshape(pr.shape[:3] + (v.shape[3],))


def _safe_softmax(s: np.ndarray):
    """(P, lse) of a row softmax in the dtype of ``s``; rows with no finite score -> 0, -inf."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # initial: Sk may be 0
    dead = m == -np.inf
    m = np.where(dead, 0.0, m).astype(s.dtype, copy=False)
    e = np.exp(s - m)  # exp(-inf) = 0 for masked keys, and for every key of a dead row
    den = np.sum(e, axis=-1, keepdims=True)
    den = np.where(dead, 1.0, den).astype(s.dtype, copy=False)  # >= 1 on live rows
    lse = np.where(dead, -np.inf, m + np.log(den)).astype(s.dtype, copy=False)
    return e / den, lse[..., 0]


def _finish(o: np.ndarray, lse: np.ndarray, layout: str, return_lse: bool):
    if layout == "bshd":
        o = o.transpose(0, 2, 1, 3)
    o = np.ascontiguousarray(o, dtype=np.float64)
    return (o, lse.astype(np.float64, copy=False)) if return_lse else o


# --------------------------------------------------------------------------- public ops


def attention_ref(q, k, v, *, causal=False, mask=None, window=None, softcap=None,
                  alibi_slopes=None, scale=None, layout="bshd", return_lse=False):
    """Float64 reference scaled-dot-product attention.

    Parameters
    ----------
    q : array_like, shape (B, Sq, Hq, D) for ``"bshd"`` or (B, Hq, Sq, D) for ``"bhsd"``
        Queries; float16, bfloat16, float32 or float64 (upcast to float64).
    k : array_like, shape (B, Sk, Hkv, D) or (B, Hkv, Sk, D)
        Keys. ``Hq % Hkv == 0`` (GQA/MQA): query head h uses kv head ``h // (Hq // Hkv)``.
    v : array_like, shape (B, Sk, Hkv, Dv) or (B, Hkv, Sk, Dv)
        Values; ``Dv`` may differ from ``D``.
    causal : {False, True, "bottom_right", "top_left"}, optional
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Sk - Sq``
        (FlashAttention 2.1+). ``"top_left"``: ``j <= i`` (torch SDPA ``is_causal``).
    mask : array_like of bool or float, broadcastable to (B, Hq, Sq, Sk), optional
        Axes are (B, Hq, Sq, Sk) in both layouts. bool: True = may attend. float: added
        to the scores after soft-cap; finite values or ``-inf`` only.
    window : tuple of int (left, right), optional
        Sliding window, -1 = unbounded: key j allowed iff
        ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``(-1, 0)`` equals causal.
        Combines with ``causal`` and ``mask`` by AND.
    softcap : float > 0, optional
        Replace the scaled score s by ``softcap * tanh(s / softcap)`` before ALiBi/mask.
    alibi_slopes : array_like, shape (Hq,) or (B, Hq), optional
        Adds ``-slope * |i + Sk - Sq - j|`` to the scores (FlashAttention's convention; the
        distance is bottom-right aligned whatever ``causal`` is). On the keys a bottom-right
        causal mask allows this equals ``slope * (j - i - Sk + Sq)``.
    scale : float, optional
        Score scale; default ``1 / sqrt(D)``.
    layout : {"bshd", "bhsd"}, optional
        Layout of q, k, v and of the output.
    return_lse : bool, optional
        Also return the log-sum-exp of the final scores.

    Returns
    -------
    out : ndarray of float64, layout of q with last dim Dv
        Rows with no allowed key (or only ``-inf`` scores) are 0.
    lse : ndarray of float64, shape (B, Hq, Sq)
        Natural-log ``log(sum_j exp(s_ij))``; ``-inf`` for fully masked rows. Only when
        ``return_lse`` is True.

    Raises
    ------
    ValueError, TypeError
        On a bad shape, dtype or option; the message names the argument.
    """
    p = _prepare(q, k, v, causal=causal, mask=mask, window=window, softcap=softcap,
                 alibi_slopes=alibi_slopes, scale=scale, layout=layout)
    s = _qk(p.q.astype(np.float64), p.k.astype(np.float64))
    s *= p.scale
    if p.softcap is not None:
        s = p.softcap * np.tanh(s / p.softcap)
    bias = _bias(p, s.shape, np.float64)
    if bias is not None:
        s += bias
    s = np.where(_allowed(s.shape, p.causal, p.window, p.mask_bool), s, -np.inf)
    pr, lse = _safe_softmax(s)
    return _finish(_pv(pr, p.v.astype(np.float64)), lse, p.layout, return_lse)


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


def attention_lowp(q, k, v, *, return_lse=False, **options):
    """Naive same-precision attention, the yardstick of the tolerance rule.

    With ``T = q.dtype`` (k and v must share it) and ``C`` = float32 (float64 when T is
    float64): ``S = q @ k^T`` accumulated in C, ``S * scale`` rounded to T; soft-cap and
    bias (ALiBi + float mask) each computed in C and rounded to T; softmax in C, ``P``
    rounded to T; ``O = P @ v`` accumulated in C and rounded to T. This mimics a plain
    framework implementation in T, as FlashAttention's tests do.

    Parameters
    ----------
    q, k, v : ndarray
        As in :func:`attention_ref`; all three of one dtype.
    return_lse : bool, optional
        Also return the log-sum-exp (computed in C), shape (B, Hq, Sq).
    **options
        Any keyword option of :func:`attention_ref`.

    Returns
    -------
    out : ndarray of float64
        The T-rounded output values, in the layout of q.
    lse : ndarray of float64, shape (B, Hq, Sq)
        Only when ``return_lse`` is True.
    """
    p = _prepare(q, k, v, **options)
    t = p.q.dtype
    if p.k.dtype != t or p.v.dtype != t:
        raise TypeError(f"k, v: attention_lowp needs q, k, v of one dtype, got {t}, "
                        f"{p.k.dtype}, {p.v.dtype}")
    c = np.dtype(np.float64) if t == np.float64 else np.dtype(np.float32)

    def rnd(x):  # store in T, keep computing in C
        return x.astype(t).astype(c)

    s = rnd(_qk(p.q.astype(c), p.k.astype(c)) * c.type(p.scale))
    if p.softcap is not None:
        cap = c.type(p.softcap)
        s = rnd(cap * np.tanh(s / cap))
    bias = _bias(p, s.shape, c)
    if bias is not None:
        s = rnd(s + bias)
    s = np.where(_allowed(s.shape, p.causal, p.window, p.mask_bool), s, c.type(-np.inf))
    pr, lse = _safe_softmax(s)
    return _finish(rnd(_pv(rnd(pr), p.v.astype(c))), lse, p.layout, return_lse)


def error_bound(q, k, v, *, floor=None, **options) -> float:
    """Tolerance for a kernel's output: ``2 * max|attention_lowp - attention_ref| + floor``.

    FlashAttention's rule: a kernel passes when its max abs error against the float64
    reference is at most twice that of a naive same-precision implementation, plus a floor.

    Parameters
    ----------
    q, k, v : ndarray
        The kernel's inputs (one dtype).
    floor : float, optional
        Absolute floor; default by dtype: 1e-3 float16, 8e-3 bfloat16, 1e-5 float32,
        1e-12 float64 (about one output ulp for 16-bit types).
    **options
        Keyword options of :func:`attention_ref` except ``return_lse``.

    Returns
    -------
    float
        The bound on ``max|kernel - attention_ref|``.
    """
    if "return_lse" in options:
        raise TypeError("return_lse: error_bound bounds the output only")
    if floor is None:
        floor = _DEFAULT_FLOOR[_as_float_array(q, "q").dtype]
    floor = _check_real(floor, "floor")
    if floor < 0:
        raise ValueError(f"floor: must be >= 0, got {floor}")
    diff = np.abs(attention_lowp(q, k, v, **options) - attention_ref(q, k, v, **options))
    return float(2.0 * np.max(diff, initial=0.0) + floor)


# The backward's reference lives beside this module (this one is long enough); its names are part of
# pyattn.reference. Imported last: it builds on the helpers above.
from .reference_backward import (attention_backward_lowp, attention_backward_ref,  # noqa: E402
                                 attention_varlen_backward_ref, backward_error_bounds)

# SparQ attention (pyattn.sparq_decode): its own module, re-exported here with every op's reference.
from .reference_sparq import sparq_ref, sparq_selection_scores  # noqa: E402

__all__ += ["sparq_ref", "sparq_selection_scores"]

# fp8 e4m3 inputs (pyattn.attention on float8_e4m3fn): their reference and naive fp8 twin.
from .reference_fp8 import (attention_fp8_lowp, attention_fp8_ref, dequantize_fp8,  # noqa: E402
                            fp8_error_bound, quantize_fp8)

__all__ += ["attention_fp8_ref", "attention_fp8_lowp", "fp8_error_bound", "quantize_fp8", "dequantize_fp8"]

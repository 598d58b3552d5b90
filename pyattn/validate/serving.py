"""Validate prefill and tree-verification calls over a paged KV cache (no device touched).

Inputs are :class:`~pyattn.interop.inputs.Arg` objects plus the host values the checks need: the
cache's sequence lengths, and the values of ``cu_seqlens_q`` / ``parents`` (device ones copied
back by the caller's ``fetch`` after every metadata check, as ``attention_varlen`` does). Every
mistake is a ``ValueError`` / ``TypeError`` naming the argument, before any launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .options import check_alibi, check_causal, check_int, check_scale, check_softcap, check_window
from .paged import DECODE_DTYPES, MAX_SPLITS, PoolInfo

__all__ = ["PrefillProblem", "MAX_TREE", "check_prefill", "check_pool_rows", "check_new_tokens",
           "check_cu_seqlens_q", "check_parents", "tree_masks"]

MAX_TREE = 64  # tree tokens per sequence: one uint64 ancestor mask per token
_MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class PrefillProblem:
    """A validated prefill (or tree verification) over a cache's pools; lengths are per call.

    ``layout`` is ``"thd"`` for packed q (total, heads_q, head_dim) with ``cu_seqlens_q``, or
    ``"bshd"`` for (batch, t, heads_q, head_dim), every sequence ``t`` new tokens.
    ``q_strides`` are the element strides (token, head) of the packed rows.
    """

    layout: str
    batch: int
    total_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: np.dtype
    q_strides: tuple
    q_on_device: bool
    causal: int
    window: tuple
    softcap: float
    scale: float
    alibi: object  # options.AlibiInfo or None
    num_splits: int | None
    tree: bool
    pool: PoolInfo

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def out_shape(self, t: int = 0) -> tuple:
        return (self.total_q, self.heads_q, self.head_dim) if self.layout == "thd" else \
            (self.batch, t, self.heads_q, self.head_dim)


def check_pool_rows(pool: PoolInfo, name: str = "cache") -> None:
    """The prefill kernels address a pool row (one slot of one kv head) by a 32-bit index in slot
    strides, shared by K and V (``kernels_src/wgmma_paged_load.cuh``): the page stride must be a
    whole number of slot strides, the same number for K and V, the pool under 2**32 such rows and a
    slot stride under 4 GiB. A :class:`~pyattn.PagedKVCache`'s pools always are; refuse the rest."""
    (kp, ks, _), (vp, vs, _) = pool.k_strides, pool.v_strides
    rows = kp // ks if ks > 0 and kp % ks == 0 else 0
    if (rows < 1 or vs < 1 or vp != rows * vs or pool.num_pages * rows >= 2**32
            or max(ks, vs) * pool.dtype.itemsize >= 2**32):
        raise ValueError(f"{name}: prefill needs K/V pools whose page stride is the same whole number of slot "
                         f"strides in K and V, under 2**32 slot rows in all; got (page, slot) element strides "
                         f"K {(kp, ks)}, V {(vp, vs)} over {pool.num_pages} pages")


def check_prefill(q, pool: PoolInfo, n_seqs: int, *, has_cu: bool, causal, window, softcap, alibi_slopes, scale,
                  num_splits, tree: bool, seqs: str = "seq_ids", pools: str = "cache") -> PrefillProblem:
    """Validate q (an Arg) against the cache's pools and the options.

    ``has_cu``: whether ``cu_seqlens_q`` was given (then q is packed (total, heads_q, head_dim));
    ``n_seqs``: the number of sequences, named ``seqs`` in errors (the ids, or a page table's
    rows); ``pools``: the name errors give the pools.
    """
    if pool.kv:
        raise TypeError(f"{pools}: prefill reads float16 / bfloat16 caches; this one holds {pool.kv} codes "
                        f"(8-bit caches serve decode only)")
    check_pool_rows(pool, pools)
    if q.dtype != pool.dtype:
        raise TypeError(f"q: expected dtype {pool.dtype} (the KV cache's), got {q.dtype}")
    if q.dtype.name not in DECODE_DTYPES:
        raise TypeError(f"q: expected float16 or bfloat16, got {q.dtype}")
    if has_cu:
        if len(q.shape) != 3:
            raise ValueError(f"q: with cu_seqlens_q expected packed (total_tokens, heads_q, head_dim), got {q.shape}")
        total, heads_q, dim = q.shape
        batch, layout = n_seqs, "thd"
        strides = tuple(q.strides[:2]) if q.on_device else (heads_q * dim, dim)
    else:
        if len(q.shape) != 4:
            raise ValueError(f"q: expected (batch, t, heads_q, head_dim), or packed (total, heads_q, head_dim) "
                             f"with cu_seqlens_q; got {q.shape}")
        batch, t, heads_q, dim = q.shape
        if batch != n_seqs:
            raise ValueError(f"{seqs}: expected {batch} sequences (q's batch), got {n_seqs}")
        total, layout = batch * t, "bshd"
        strides = (q.strides[1], q.strides[2]) if q.on_device else (heads_q * dim, dim)
        if q.on_device and batch > 1 and t > 0 and q.strides[0] != t * q.strides[1]:
            raise ValueError(f"q: (batch, t) must collapse into one token axis (stride_b == t * stride_t), got "
                             f"element strides {q.strides}; pass a contiguous array")
    if dim != pool.head_dim:
        raise ValueError(f"q: expected head_dim {pool.head_dim} (the KV cache's), got {dim}")
    if heads_q < 1 or heads_q % pool.heads_kv:
        raise ValueError(f"q: query heads ({heads_q}) must be a multiple of the cache's kv heads ({pool.heads_kv})")
    if heads_q > _MAX_GRID_YZ:
        raise ValueError(f"q: at most {_MAX_GRID_YZ} query heads, got {heads_q}")
    if not 0 < batch <= _MAX_GRID_YZ:
        raise ValueError(f"{seqs}: expected 1 to {_MAX_GRID_YZ} sequences, got {batch}")
    if total >= 2**31 // max(heads_q, 1):
        raise ValueError(f"q: total tokens x heads must stay below 2**31, got {total} x {heads_q}")
    if q.on_device:
        if q.strides[-1] != 1 or any(st % 8 for st in q.strides[:-1]):
            raise ValueError(f"q: the head_dim axis must be contiguous and other strides multiples of 8 elements, "
                             f"got element strides {q.strides}")
        if q.ptr % 16:
            raise ValueError(f"q: the address must be 16-byte aligned, got {q.ptr:#x}")
    if num_splits is not None:
        num_splits = check_int("num_splits", num_splits, 1, MAX_SPLITS)
    c = check_causal(causal)
    w = check_window(window)
    alibi = check_alibi(alibi_slopes, batch, heads_q)
    if tree and (w != (-1, -1) or alibi is not None or c != 1):
        raise ValueError("window/alibi_slopes/causal: a tree's tokens sit at their depth, not their index, so "
                         "position-based masks do not apply to verify_tree (it is causal along the tree)")
    return PrefillProblem(layout, batch, total, heads_q, pool.heads_kv, dim, q.dtype, strides, q.on_device, c, w,
                          check_softcap(softcap), check_scale(scale, dim), alibi, num_splits, bool(tree), pool)


def check_cu_seqlens_q(cu, batch: int, total: int, fetch) -> np.ndarray:
    """Validate ``cu_seqlens_q`` (an Arg, int32 (batch + 1,)) and return its host values as int64;
    ``fetch`` None: its metadata only (a caller with other device values to read checks every
    argument's metadata first), returning None."""
    if cu.dtype != np.int32:
        raise TypeError(f"cu_seqlens_q: expected dtype int32, got {cu.dtype}")
    if cu.shape != (batch + 1,):
        raise ValueError(f"cu_seqlens_q: expected shape ({batch + 1},) (one more than the sequences), got {cu.shape}")
    if cu.on_device and cu.strides[0] != 1 and batch > 0:
        raise ValueError(f"cu_seqlens_q: expected a contiguous array, got element strides {cu.strides}")
    if fetch is None and cu.on_device:
        return None
    host = np.asarray(fetch(cu) if cu.on_device else cu.obj).astype(np.int64)
    if host[0] != 0 or host[-1] != total or (np.diff(host) < 0).any():
        raise ValueError(f"cu_seqlens_q: must start at 0, be non-decreasing and end at q's {total} tokens, "
                         f"got {host.tolist() if host.size <= 16 else host}")
    return host


def check_new_tokens(counts: np.ndarray, lengths: np.ndarray, tree: bool, pools: bool = False) -> None:
    """Each sequence's new tokens are the last ones it holds (their K/V appended first); ``pools``:
    the lengths are a caller's page table's, not a cache's."""
    over = np.flatnonzero(counts > lengths)
    if over.size:
        b = int(over[0])
        hint = ("seq_lens / the page table must count them: write the new tokens' K/V into the pools first"
                if pools else "append the new tokens' K/V to the cache first")
        raise ValueError(f"cu_seqlens_q: sequence {b} has {int(counts[b])} new tokens but its cache holds "
                         f"{int(lengths[b])} ({hint})")
    if tree and (counts > MAX_TREE).any():
        b = int(np.flatnonzero(counts > MAX_TREE)[0])
        raise ValueError(f"q: a tree of at most {MAX_TREE} tokens per sequence, got {int(counts[b])} for "
                         f"sequence {b}")


def check_parents(parents, cu: np.ndarray, layout: str, fetch) -> np.ndarray:
    """Validate ``parents`` (an Arg) and return it flat, int64 (total,), indices within each tree.

    ``layout="bshd"``: (batch, n); ``"thd"``: (total,). Token i's parent is an earlier token of
    its tree (``0 <= parents[i] < i``) or -1 (its parent is the last cached token).
    """
    total, batch = int(cu[-1]), len(cu) - 1
    shape = (batch, total // batch if batch else 0) if layout == "bshd" else (total,)
    if parents.dtype != np.int32:
        raise TypeError(f"parents: expected dtype int32, got {parents.dtype}")
    if parents.shape != shape:
        raise ValueError(f"parents: expected shape {shape} (one parent per tree token), got {parents.shape}")
    if parents.on_device and parents.shape[-1] > 1 and parents.strides[-1] != 1:
        raise ValueError(f"parents: expected a contiguous array, got element strides {parents.strides}")
    flat = np.asarray(fetch(parents) if parents.on_device else parents.obj).astype(np.int64).reshape(-1)
    idx = np.arange(total) - np.repeat(cu[:-1], np.diff(cu))  # each token's index in its tree
    bad = np.flatnonzero((flat < -1) | (flat >= idx))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"parents: each must be -1 or an earlier token of the same tree (0 <= parent < index), "
                         f"got parents[{i}] = {int(flat[i])} for tree token {int(idx[i])}")
    return flat


def tree_masks(flat_parents: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """uint64 ancestor masks (total,): bit j of token i's mask is set when tree token j is i or one
    of its ancestors (parents validated by :func:`check_parents`)."""
    counts = np.diff(cu)
    start = np.repeat(cu[:-1], counts)
    idx = np.arange(len(flat_parents)) - start
    masks = np.left_shift(np.uint64(1), idx.astype(np.uint64))
    has = flat_parents >= 0
    for j in range(1, int(counts.max(initial=0))):  # by index: a parent's mask is final before its children's
        sel = np.flatnonzero((idx == j) & has)
        masks[sel] |= masks[start[sel] + flat_parents[sel]]
    return masks

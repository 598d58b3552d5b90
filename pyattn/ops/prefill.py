"""``pyattn.prefill`` and ``pyattn.verify_tree``: new tokens against a paged KV cache on prefill tiles.

Chunked prefill: each sequence's new tokens (thousands allowed) attend to everything its cache
holds before them and, causally, to each other, on the tensor-core prefill kernels with paged
K/V loads. Token-tree verification (speculative decoding): each token of a draft tree attends to
the cache before the tree and to its ancestors in the tree; afterwards
:meth:`pyattn.PagedKVCache.accept` keeps the accepted branch. In both, the new tokens' K/V are
appended to the cache first (:meth:`~pyattn.PagedKVCache.append`, one launch for every
sequence), exactly as :func:`pyattn.decode` expects: query token ``i`` of a sequence with ``n``
new tokens sits at position ``length - n + i``.
"""

from __future__ import annotations

import functools

import numpy as np

from ..interop.inputs import read_args
from ..interop.streams import order_inputs
from ..paged.cache import PagedKVCache
from ..pipeline import host
from ..pipeline.device import fetch_values, finish, start
from ..pipeline.host import upload
from ..runtime.device import keeps_context
from ..runtime.stream import check_stream_arg
from ..validate.options import check_bool
from ..validate.serving import (check_cu_seqlens_q, check_new_tokens, check_parents, check_prefill,
                                tree_masks)
from ._prefill import KVTables, run_prefill

__all__ = ["prefill", "verify_tree"]


def _fetch(a):
    return fetch_values(a) if a.on_device else np.asarray(a.obj)


def _cache_tables(cache, ids, s) -> KVTables:
    """The cache's pools and its device page tables of sequences ``ids``, ordered on ``s``."""
    cache.order(s)
    (idx, indptr, _, kv_len, _), max_len, _ = cache.device_tables(ids, s)
    return KVTables(cache.k.ptr, cache.v.ptr, idx, indptr, kv_len, max_len)


def _run(P, cache, ids, a, cu, masks, stream, return_lse):
    """Host or device q: launch and return out (and lse) as the caller's kind."""
    alibi = a["alibi_slopes"]

    def launch_fn(device, s, q_ptr, alibi_ptr):
        if device is not cache.device:
            raise ValueError(f"q: expected an array on the cache's device {cache.device.ordinal}, "
                             f"got device {device.ordinal}")
        return run_prefill(P, device, s, q_ptr, functools.partial(_cache_tables, cache, ids), cu, masks, alibi_ptr,
                           return_lse)

    if not P.q_on_device:
        ins = [a["q"].obj, np.asarray(alibi.obj, np.float32) if alibi is not None and not alibi.on_device else None]

        def run(dev, s):
            dq, dal = dev
            if alibi is not None and alibi.on_device:
                order_inputs(s, dq.device, [alibi])
            return launch_fn(dq.device, s, dq.ptr, dal.ptr if dal is not None else (alibi.ptr if alibi else 0))

        o, lse = host.call(run, ins, [], stream)
        return (o, lse) if return_lse else o
    device, s, (dq, dal) = start(stream, [a["q"], alibi])
    keep = None
    if dal is not None and not dal.on_device:
        (keep,) = upload([np.asarray(dal.obj, np.float32)], device, s)
    out, lse = launch_fn(device, s, dq.ptr, keep.ptr if keep is not None else (dal.ptr if dal is not None else 0))
    finish(s, (dq, dal))
    return (out, lse) if return_lse else out


def _prepare(cache, seq_ids, q, cu_seqlens_q, alibi_slopes, options, tree: bool):
    """Read and validate the common arguments: (problem, ids, args, host cu_seqlens_q)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a pyattn.PagedKVCache, got {type(cache).__name__}")
    ids = cache.check_ids(seq_ids)
    a = read_args({"q": q, "cu_seqlens_q": cu_seqlens_q, "alibi_slopes": alibi_slopes},
                  ("q", "cu_seqlens_q", "alibi_slopes"), ("q",))
    P = check_prefill(a["q"], cache.pool_info, len(ids), has_cu=cu_seqlens_q is not None, tree=tree,
                      alibi_slopes=a["alibi_slopes"], **options)
    if a["q"].on_device and a["q"].ordinal not in (None, cache.device.ordinal):
        raise ValueError(f"q: expected an array on the cache's device {cache.device.ordinal}, "
                         f"got device {a['q'].ordinal}")
    if cu_seqlens_q is not None:
        cu = check_cu_seqlens_q(a["cu_seqlens_q"], P.batch, P.total_q, _fetch)
    else:
        cu = np.arange(P.batch + 1, dtype=np.int64) * (P.total_q // P.batch)
    check_new_tokens(np.diff(cu), cache.book.lengths(ids).astype(np.int64), tree)
    return P, ids, a, cu


@keeps_context
def prefill(q, cache, seq_ids, cu_seqlens_q=None, *, causal=True, window=None, softcap=None, alibi_slopes=None,
            scale=None, num_splits=None, return_lse=False, stream=None):
    """Attention of each sequence's new tokens over its paged KV cache (chunked prefill).

    Parameters
    ----------
    q : array
        ``(total, heads_q, head_dim)``: the new tokens of all sequences packed, with
        ``cu_seqlens_q``; or ``(batch, t, heads_q, head_dim)``: ``t`` new tokens per sequence.
        The cache's dtype (float16 / bfloat16), NumPy or device (DeviceArray, torch, CuPy, ...).
    cache : PagedKVCache
        A float16 / bfloat16 cache holding the new tokens' K/V already (append them first):
        sequence ``b``'s ``n_b`` new tokens are its last ``n_b`` tokens.
    seq_ids : sequence of int
        One live sequence per batch entry, no repeats; prefix-sharing forks are read in place.
    cu_seqlens_q : int32 array (batch + 1,), optional
        Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; starts at 0, is
        non-decreasing, ends at ``total``. Host or device (a device one is copied back for the
        range check).
    causal : bool or {"bottom_right", "top_left"}, default True
        Bottom-right: new token ``i`` sees keys ``0 .. length - n_b + i`` (everything cached before
        the chunk, and the chunk causally).
    window : (int, int), optional
        Sliding window ``(left, right)`` around that diagonal; -1 unbounded.
    softcap : float, optional
    alibi_slopes : array (heads_q,) or (batch, heads_q), optional
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    num_splits : int, optional
        Key splits per block; default: split only when the grid would not fill the GPU.
    return_lse : bool
        Also return the natural-log LSE, float32: ``(heads_q, total)`` for packed q (the varlen
        layout), ``(batch, heads_q, t)`` for 4-D q.
    stream : optional

    Returns
    -------
    out : array, q's shape and dtype; NumPy for NumPy q
    lse : array, only with ``return_lse``

    Notes
    -----
    Equal to :func:`pyattn.attention_varlen` over each sequence's gathered keys. The K/V tiles
    are loaded through the sequence's page list by the prefill kernels (wgmma on sm_90a, mma.sync
    elsewhere); query heads of one GQA group share a block's rows (not with ALiBi). 8-bit caches
    are refused (decode only). Rows of sequences with no new tokens cost nothing.
    """
    check_stream_arg(stream)
    return_lse = check_bool("return_lse", return_lse)
    options = dict(causal=causal, window=window, softcap=softcap, scale=scale, num_splits=num_splits)
    P, ids, a, cu = _prepare(cache, seq_ids, q, cu_seqlens_q, alibi_slopes, options, tree=False)
    return _run(P, cache, ids, a, cu, None, stream, return_lse)


@keeps_context
def verify_tree(q, cache, seq_ids, parents, cu_seqlens_q=None, *, softcap=None, scale=None, num_splits=None,
                return_lse=False, stream=None):
    """Attention of draft-tree tokens over the cache before the tree and their tree ancestors.

    Speculative decoding's verification step (SpecInfer, Medusa, EAGLE): each sequence's draft
    tree of up to 64 tokens, appended to the cache in tree order (parents before children), is
    scored in one launch; then :meth:`pyattn.PagedKVCache.accept` keeps the accepted branch.

    Parameters
    ----------
    q : array
        ``(batch, n, heads_q, head_dim)`` (trees of ``n`` tokens), or packed ``(total, heads_q,
        head_dim)`` with ``cu_seqlens_q`` (trees of different sizes).
    cache : PagedKVCache
        Holding the trees' K/V as each sequence's last tokens (append them first).
    seq_ids : sequence of int
    parents : int32 array
        ``(batch, n)``, or ``(total,)`` with ``cu_seqlens_q``: token ``i``'s parent index within
        its tree, ``0 <= parents[i] < i``, or -1 for a token whose parent is the last token before
        the tree. Host or device.
    cu_seqlens_q : int32 array (batch + 1,), optional
    softcap, scale, num_splits, return_lse, stream
        As in :func:`prefill`.

    Returns
    -------
    out : array, q's shape; lse : only with ``return_lse`` (layouts as :func:`prefill`)

    Notes
    -----
    Token ``i`` sees the keys before its tree and tree keys ``j`` that are ``i`` or an ancestor of
    ``i`` (one 64-bit mask per token, computed on the host from ``parents``). No window or ALiBi:
    a tree token's position is its depth, not its index, so position-based masks are the
    caller's to apply (e.g. to RoPE the queries and keys by depth before appending).
    """
    check_stream_arg(stream)
    return_lse = check_bool("return_lse", return_lse)
    options = dict(causal=True, window=None, softcap=softcap, scale=scale, num_splits=num_splits)
    P, ids, a, cu = _prepare(cache, seq_ids, q, cu_seqlens_q, None, options, tree=True)
    flat = check_parents(read_args({"parents": parents}, ("parents",), ("parents",))["parents"], cu, P.layout, _fetch)
    return _run(P, cache, ids, a, cu, tree_masks(flat, cu), stream, return_lse)

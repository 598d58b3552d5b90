"""A cache's ``kv_append`` launches: its kernels, its parameter struct packed once, its mailbox,
and each append's plan, decode-table patches, items and launches (:meth:`Appender.write`).

A serving loop appends one token to each sequence per step, so everything an append needs that
does not change between calls is made once per cache: the kernel for each new-token dtype (a
spec and a registry lookup cost ~10 us of a step), the parameter struct with the cache's own
fields packed (:meth:`pyattn.kernels.params.ParamStruct.partial`), and the
:class:`~pyattn.runtime.mailbox.Mailbox` that hands each append's items to its kernel.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..kernels.registry import get_kernel
from ..kernels.specs import DTYPES, KernelSpec
from ..pipeline.host import upload
from ..pipeline.plans import ptx_requested
from ..runtime.launch import launch
from ..runtime.mailbox import Mailbox
from ..runtime.stream import refuse_capture

__all__ = ["Appender", "pool_fields", "post_items", "launch_kv_append"]

_BLOCKS_PER_SM = 8


def pool_fields(pool, k: int, v: int, k_scale: int = 0, v_scale: int = 0, ks=(0, 0, 0), vs=(0, 0, 0)) -> dict:
    """kv_append's per-pool fields (``KV_APPEND_PARAMS`` after the per-call ones) of the pools
    ``pool`` (a :class:`~pyattn.validate.paged.PoolInfo`) at device addresses ``k``, ``v``; the
    scale pools' addresses and (page, slot, head) strides for 8-bit pools."""
    pk, pv = pool.k_strides, pool.v_strides
    return {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale,
            "k_stride_page": pk[0], "k_stride_slot": pk[1], "k_stride_h": pk[2],
            "v_stride_page": pv[0], "v_stride_slot": pv[1], "v_stride_h": pv[2],
            "ks_stride_page": ks[0], "ks_stride_slot": ks[1], "ks_stride_h": ks[2],
            "vs_stride_page": vs[0], "vs_stride_slot": vs[1], "vs_stride_h": vs[2],
            "heads_kv": pool.heads_kv, "head_dim": pool.head_dim, "page_size": pool.page_size}


def post_items(box: Mailbox, parts: list, device, s) -> tuple:
    """The int32 ``parts``, concatenated, where kv_append reads them: a slot of ``box`` (pinned host
    memory the kernel reads in place, as a decode step's items go) when they fit one, else uploaded.
    Returns ``(device address, slot or None, keep-alive)``; once every kernel that reads them is
    queued, the caller hands a slot back with ``box.sent(slot, s)``."""
    refuse_capture(s, "this append sends its destination slots through pinned host memory, which later "
                      "calls rewrite before a replay would read it: append outside the graph")
    posted = box.take(sum(len(p) for p in parts))
    if posted is not None:
        items, view, slot = posted
        np.concatenate(parts, out=view)
        return items, slot, None
    (d_items,) = upload([np.concatenate(parts)], device, s)
    return d_items.ptr, None, d_items


def launch_kv_append(kernel, packer, threads_per_item: int, block: int, sm_count: int, s, items: int,
                     n_items: int, k_new=(0, (0, 0)), v_new=(0, (0, 0)), patch=(0, 0, 0),
                     base=(0, 0, 1, 0)) -> None:
    """One kv_append launch over ``n_items`` (destination slot, source) pairs at device address
    ``items`` (int32, all destinations then all sources): a source s >= 0 is row s of the new
    tokens ``k_new`` / ``v_new`` = (address, (token stride, head stride)), -1 - x is pool slot x.
    ``patch`` = (address of n int32 offsets then n values, int32 block they index, n): the decode
    table's patches (:class:`~pyattn.paged.decode_table.DecodeTable`), written too. ``base`` =
    (address of int32 device lengths, address of int32 lengths out, items a sequence, the lengths'
    bound): each item's slot shifted by its sequence's length as the kernel finds it, and the
    lengths after the append written (``KV_APPEND_PARAMS``); (0, 0, 1, 0): slots as they are.
    ``packer``: the struct with the pools' fields packed (:func:`pool_fields`); a few blocks an SM
    at most (the kernel strides over the rest)."""
    (k_src, ks), (v_src, vs) = k_new, v_new
    params = packer.pack(k_src, v_src, items, items + 4 * n_items, patch[0], patch[1], ks[0], ks[1], vs[0], vs[1],
                         n_items, patch[2], *base)
    threads = max(n_items * threads_per_item, patch[2])
    grid = max(1, min(-(-threads // block), sm_count * _BLOCKS_PER_SM))
    launch(kernel, (grid, 1, 1), (block, 1, 1), 0, s, params)


class Appender:
    """The append launches of one :class:`~pyattn.paged.cache.PagedKVCache` (not thread-safe, as the
    cache is not)."""

    def __init__(self, cache):
        # A weak proxy: cache -> appender -> cache was a cycle, so a dropped cache (its mailbox's
        # pinned memory, its pool blocks) waited for the garbage collector, whose cuMemFreeHost then
        # synchronised the device at a moment of its choosing.
        self._cache = weakref.proxy(cache)
        self._kernels: dict = {}  # new tokens' dtype name -> (kernel, spec)
        self._packer = None  # (struct with the cache's fields packed, threads an item, threads a block)
        self._mailbox = None

    def box(self) -> Mailbox:
        """The mailbox for the appends' items (made at the first append)."""
        if self._mailbox is None:
            self._mailbox = Mailbox()
        return self._mailbox

    def kernel(self, dtype: str) -> tuple:
        """(kernel, spec) of kv_append for new tokens of ``dtype`` (a NumPy dtype name)."""
        hit = self._kernels.get(dtype)
        if hit is None:
            c = self._cache
            # The spec's dtype is the new tokens' type (the pool's, for a 16-bit cache).
            spec = KernelSpec("kv_append", DTYPES[dtype][0], 32, c.device.arch, ptx_requested(), kv=c.kv)
            hit = self._kernels[dtype] = (get_kernel(spec, c.device), spec)
        return hit

    def write(self, seq_ids, seqs, counts, total, s, rows, kernel, spec, dk=None) -> None:
        """An append's plan and launches: the book's slots, the decode table's patches, the items
        (through the mailbox), kv_append, and the per-channel key pages / SparQ rows that follow.
        ``rows``: ((address, (token stride, head stride)) of the new K and V tokens); ``dk``: the
        device K tokens (per-channel keys re-read them)."""
        cache = self._cache
        book = cache.book
        before = cache._keys.before(book, seq_ids, counts) if cache._keys is not None else None
        grown = [(sid, book.length(sid), c) for sid, c in zip(seq_ids, counts)] if cache._sq is not None else None
        table = cache._dtab if cache._dtab is not None and cache._dtab.version == book.version else None
        lengths = [q.length for q in seqs] if table is not None else None
        plan = book.plan_append(seq_ids, counts)  # raises before any change when pages run out
        patches = table.patches(seq_ids, lengths, counts, plan.dst, cache.page_size) if table is not None else None
        n_items, n_patches = len(plan.dst) + len(plan.copy_dst), 0 if patches is None else patches[0]
        if n_items == 0:  # nothing written (every count 0): the book's version moved all the same
            if table is not None:
                table.version = book.version
            return
        parts = [plan.dst, np.arange(total, dtype=np.int32)]  # destinations, then sources (row s of the new tokens)
        if len(plan.copy_dst):  # copy-on-write: pool slot x as source -1 - x
            parts = [plan.dst, plan.copy_dst, parts[1], -1 - plan.copy_src]
        if n_patches:
            parts.append(patches[1])
        items, slot, keep = post_items(self.box(), parts, cache.device, s)
        patch = (items + 8 * n_items, table.buf.ptr, n_patches) if n_patches else (0, 0, 0)
        self.launch(spec, kernel, s, items, n_items, rows[0], rows[1], patch)
        if patches is not None:  # the decode table followed this append (its patches ride in this launch)
            table.version = book.version
            if n_patches:
                table.use(s)
        if cache._keys is not None:
            cache._append_key_pages(spec.dtype, dk, rows[0][1], counts, before, plan.dst, s)
        if cache._sq is not None:
            cache._append_sparq(grown, items, n_items, s)
        if slot is not None:  # (after every kernel that reads the items)
            self.box().sent(slot, s)

    def launch(self, spec, kernel, s, items: int, n_items: int, k_new=(0, (0, 0)), v_new=(0, (0, 0)),
               patch=(0, 0, 0)) -> None:
        """:func:`launch_kv_append` on the cache's pools (their fields packed once)."""
        packer, threads_per_item, block = self._packer or self._pack_cache_fields(spec)
        launch_kv_append(kernel, packer, threads_per_item, block, self._cache.device.sm_count, s, items, n_items,
                         k_new, v_new, patch)

    def _pack_cache_fields(self, spec) -> tuple:
        """The struct with the cache's fields packed, threads an item, and threads a block (every
        kv_append variant has one struct and one block size)."""
        c = self._cache
        H, D = c.num_kv_heads, c.head_dim
        pi = c.pool_info
        k_scale, pks = (c.k_scale.ptr, pi.ks_strides) if c.kv else (0, (0, 0, 0))
        if c.key_scales == "channel":  # kv_key_pages rewrites them; per-token K scales go nowhere
            k_scale, pks = c._kscratch.ptr, (0, 0, 0)
        static = pool_fields(pi, c.k.ptr, c.v.ptr, k_scale, c.v_scale.ptr if c.kv else 0, pks, pi.vs_strides)
        # 16-bit pools: one thread per 16-byte chunk; quantized: one warp per (item, kv head) row.
        self._packer = (spec.params.partial(static), H * (32 if c.kv else D // 8), spec.threads)
        return self._packer

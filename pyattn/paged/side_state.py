"""The launches behind a ``PagedKVCache``'s optional side state, after ``kv_append`` on its stream.

Per-channel key scales (``key_scales="channel"``): ``kv_key_pages`` requantizes the pages an append
wrote, from the jobs :class:`~pyattn.paged.keypages.KeyStager` plans, growing the float32 staging
copy of the open pages when more are open than ever before. SparQ (``sparq=True``): ``kv_sparq``
copies the written key rows into the transposed pool ``kt`` and extends (or rebuilds) the
per-sequence V sums of :class:`~pyattn.paged.sparq_state.SparqRows`, whose device array grows as
rows are handed out. Functions of the cache, which owns every array they touch.

:class:`SideStateMethods`, a mixin of ``PagedKVCache``, makes them the cache's methods (the private
ones are what :class:`~pyattn.paged.appender.Appender` and ``fork`` call) and adds the public
:meth:`~SideStateMethods.read_key_scales` and :meth:`~SideStateMethods.sparq_rows`.
"""

from __future__ import annotations

import numpy as np

from ..array import empty
from ..interop.streams import note_use
from ..kernels.registry import get_kernel
from ..kernels.specs import DTYPES, KernelSpec
from ..pipeline.host import upload
from ..pipeline.plans import ptx_requested
from ..quant import KEPT_CHANNELS
from ..runtime.launch import launch
from ..runtime.memory import copy_device

__all__ = ["append_key_pages", "grow_sums", "launch_sparq", "append_sparq", "sparq_rows", "SideStateMethods"]

_BLOCKS_PER_SM = 8  # grid-stride launches: enough blocks to cover the GPU, no more


def _launch_fixed(cache, spec, values: dict, units: int, s) -> None:
    """A grid-stride launch of a one-warp-per-unit family (kv_key_pages, kv_sparq)."""
    kernel = get_kernel(spec, cache.device)
    warps = spec.threads // 32
    grid = max(1, min(-(-units // warps), cache.device.sm_count * _BLOCKS_PER_SM))
    launch(kernel, (grid, 1, 1), (spec.threads, 1, 1), 0, s, spec.params.pack(values))


def append_key_pages(cache, tag: str, dk, kst, counts, before, dst, s) -> None:
    """Requantize every page the append wrote with per-channel key scales (``kv_key_pages``)."""
    work = cache._keys.plan(counts, before, dst)
    H, D, ps = cache.num_kv_heads, cache.head_dim, cache.page_size
    have = 0 if cache._stage is None else cache._stage.shape[0]
    if work.capacity > have:  # more open pages than ever: a larger staging array, the old rows kept
        grown = empty((max(work.capacity, 2 * have, 4), ps, H, D), np.float32, device=cache.device, stream=s)
        if cache._stage is not None:
            copy_device(grown.ptr, cache._stage.ptr, cache._stage.nbytes, s)
            note_use(s, [cache._stage])
        cache._stage = grown
    (d,) = upload([np.concatenate([work.jobs.ravel(), work.src])], cache.device, s)
    pk, rs = cache.pool_info.k_strides, cache.k_scale.elem_strides
    stage = cache._stage.ptr if cache._stage is not None else 0  # (no page has been left open yet)
    values = {"k_src": dk.ptr, "k": cache.k.ptr, "rec": cache.k_scale.ptr, "stage": stage,
              "jobs": d.ptr, "src": d.ptr + 4 * work.jobs.size, "k_src_stride_t": kst[0], "k_src_stride_h": kst[1],
              "k_stride_page": pk[0], "k_stride_slot": pk[1], "k_stride_h": pk[2], "rec_stride_page": rs[0],
              "rec_stride_h": rs[1], "n_jobs": len(work.jobs), "heads_kv": H, "head_dim": D, "page_size": ps,
              "stage_rows": work.stage_rows}
    spec = KernelSpec("kv_key_pages", tag, 32, cache.device.arch, ptx_requested(), kv=cache.kv)
    _launch_fixed(cache, spec, values, len(work.jobs) * H, s)
    cache._keys.commit(work, cache.book)


def grow_sums(cache, s) -> None:
    """The V-sum array, large enough for every row handed out."""
    have = 0 if cache.v_sum is None else cache.v_sum.shape[0]
    if cache._sq.capacity > have:
        grown = empty((max(cache._sq.capacity, 2 * have, 8), cache.num_kv_heads, cache.head_dim), np.float32,
                      device=cache.device, stream=s)
        if cache.v_sum is not None:
            copy_device(grown.ptr, cache.v_sum.ptr, cache.v_sum.nbytes, s)
            note_use(s, [cache.v_sum])
        cache.v_sum = grown


def launch_sparq(cache, jobs, slots, items_ptr, n_items: int, s) -> None:
    """``kv_sparq``: transposed copies of ``n_items`` key rows (slots at ``items_ptr``) and V-sum jobs."""
    (d,) = upload([np.concatenate([jobs.ravel(), slots, np.zeros(1, np.int32)])], cache.device, s)
    pk, pv, kt = cache.pool_info.k_strides, cache.pool_info.v_strides, cache.kt.elem_strides
    spec = KernelSpec("kv_sparq", DTYPES[cache.dtype.name][0], 32, cache.device.arch, ptx_requested())
    values = {"k": cache.k.ptr, "v": cache.v.ptr, "kt": cache.kt.ptr, "vsum": cache.v_sum.ptr,
              "items": items_ptr or d.ptr, "jobs": d.ptr, "slots": d.ptr + 4 * jobs.size,
              "k_stride_page": pk[0], "k_stride_slot": pk[1], "k_stride_h": pk[2],
              "v_stride_page": pv[0], "v_stride_slot": pv[1], "v_stride_h": pv[2],
              "kt_stride_page": kt[0], "kt_stride_h": kt[1], "vsum_stride_row": cache.v_sum.elem_strides[0],
              "n_items": n_items, "n_jobs": len(jobs), "heads_kv": cache.num_kv_heads, "head_dim": cache.head_dim,
              "page_size": cache.page_size}
    _launch_fixed(cache, spec, values, (n_items + len(jobs)) * cache.num_kv_heads, s)


def append_sparq(cache, grown, items_ptr: int, n_items: int, s) -> None:
    """After an append: the written slots' transposed keys, and the grown (or dirty) V sums."""
    sq = cache._sq
    jobs, slots = sq.jobs(cache.book, [(sid, first, c) for sid, first, c in grown if c or sid in sq.dirty])
    grow_sums(cache, s)
    launch_sparq(cache, jobs, slots, items_ptr, n_items, s)


def sparq_rows(cache, seq_ids, s):
    """Rows of the V sums of ``seq_ids`` as a device int32 array (dirty ones rebuilt first)."""
    sq = cache._sq
    if sq is None:
        raise ValueError("cache: sparq_decode needs a PagedKVCache(..., sparq=True)")
    stale = [(sid, 0, 0) for sid in seq_ids if sid in sq.dirty or sid not in sq.row_of]
    if stale:
        jobs, slots = sq.jobs(cache.book, stale)
        grow_sums(cache, s)
        launch_sparq(cache, jobs, slots, None, 0, s)
    rows = tuple(sq.row_of[sid] for sid in seq_ids)
    if cache._vrows is None or cache._vrows[0] != rows:  # an upload per call would wait on pinned staging
        (d,) = upload([np.array(rows, np.int32)], cache.device, s)
        cache._vrows = (rows, d)
    else:
        note_use(s, [cache._vrows[1]])
    return cache._vrows[1]


class SideStateMethods:
    """The per-channel key-scale and SparQ methods of :class:`~pyattn.paged.cache.PagedKVCache` (the
    functions above, on the cache's arrays)."""

    def _append_key_pages(self, tag, dk, kst, counts, before, dst, s) -> None:
        append_key_pages(self, tag, dk, kst, counts, before, dst, s)

    def _grow_sums(self, s) -> None:
        grow_sums(self, s)

    def _launch_sparq(self, jobs, slots, items_ptr, n_items: int, s) -> None:
        launch_sparq(self, jobs, slots, items_ptr, n_items, s)

    def _append_sparq(self, grown, items_ptr: int, n_items: int, s) -> None:
        append_sparq(self, grown, items_ptr, n_items, s)

    def read_key_scales(self) -> tuple:
        """The per-channel key scales and kept channels, copied to the host (``key_scales="channel"``).

        Returns
        -------
        page_scale : numpy.ndarray
            float32 (num_pages, num_kv_heads): ``S``.
        chan : numpy.ndarray
            float16 (num_pages, num_kv_heads, head_dim): ``r``; a key's value is code * S * r[channel].
        idx : numpy.ndarray
            uint8 (num_pages, num_kv_heads, 4): each page's kept channels, largest first.
        kept : numpy.ndarray
            float16 (num_pages, page_size, num_kv_heads, 4): their values over ``S`` (value = kept * S).
        (:func:`pyattn.quant.dequantize_page` takes them per kv head.)
        """
        if self._keys is None:
            raise ValueError(f"key_scales: this cache scales keys per {self.key_scales}, not per channel")
        rec = self.k_scale.numpy(self._stream)
        D, ps = self.head_dim, self.page_size
        idx = np.ascontiguousarray(rec[..., 1]).view(np.uint8).reshape(rec.shape[:2] + (KEPT_CHANNELS,))
        halves = np.ascontiguousarray(rec[..., 4:]).view(np.float16)
        kept = halves[..., D:].reshape(rec.shape[:2] + (ps, KEPT_CHANNELS)).transpose(0, 2, 1, 3)
        return rec[..., 0].copy(), np.ascontiguousarray(halves[..., :D]), idx, np.ascontiguousarray(kept)

    def sparq_rows(self, seq_ids, s):
        """Rows of the V sums of ``seq_ids`` (rebuilding dirty ones first) as a device int32 array,
        for :func:`pyattn.sparq_decode`; the cache must have been made with ``sparq=True``."""
        return sparq_rows(self, seq_ids, s)  # the module's function: a class body is no enclosing scope

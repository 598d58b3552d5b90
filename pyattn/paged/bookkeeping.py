"""The bookkeeping calls of ``pyattn.PagedKVCache``: its sizes, the sequence lifecycle (add, fork,
truncate, free), lengths, the NumPy page tables, and the ordering of its streams.

:class:`CacheBookkeeping` is a mixin the cache inherits, so that ``cache.py`` keeps the constructor
and the device work (appends, accepts, device page tables) and stays short enough to read at once.
Most calls forward to the cache's :class:`~pyattn.paged.book.PageBook`; the lifecycle ones also keep
the optional side state in step (per-channel key staging, SparQ's V sums:
:mod:`pyattn.paged.side_state`), and a SparQ cache's ``fork`` copies the parent's V sum on the device.
"""

from __future__ import annotations

import numpy as np

from ..runtime.device import keeps_context
from ..runtime.stream import order_after, refuse_capture

__all__ = ["CacheBookkeeping"]


class CacheBookkeeping:
    """The bookkeeping methods of :class:`~pyattn.paged.cache.PagedKVCache` (its attributes: ``book``,
    ``device``, ``_kv``, ``_keys``, ``_sq``, ``_stream``, and the side-state methods; see there)."""

    @property
    def kv(self) -> str:
        """``""`` for a float16 / bfloat16 cache, else ``"int8"`` or ``"fp8e4m3"``."""
        return self._kv

    @property
    def num_pages(self) -> int:
        return self.book.num_pages

    @property
    def page_size(self) -> int:
        return self.book.page_size

    @property
    def num_free_pages(self) -> int:
        return self.book.num_free

    @property
    def seq_ids(self) -> list:
        """Live sequence ids, in creation order."""
        return self.book.seq_ids

    def add_sequence(self) -> int:
        """Start an empty sequence; returns its id."""
        return self.book.add_sequence()

    @keeps_context
    def fork(self, seq_id, length=None) -> int:
        """A new sequence sharing the first ``length`` tokens (default all) of ``seq_id`` (a shared
        prefix, parallel sampling, beam search); pages are copied only when written."""
        child = self.book.fork(seq_id, length)
        if self._sq is not None:
            job = self._sq.fork(seq_id, child, self.book.length(child) == self.book.length(seq_id))
            if job is not None:  # the parent's V sum, copied now (the parent may grow before the child)
                self.device.activate()
                self._grow_sums(self._stream)
                self._launch_sparq(np.array([[job[0], job[1], 0, 0]], np.int32), np.empty(0, np.int32), None, 0,
                                   self._stream)
        return child

    def truncate(self, seq_id, length) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` (speculative-decoding rollback)."""
        self.book.truncate(seq_id, length)
        if self._keys is not None:
            self._keys.release_unreferenced(self.book)
        if self._sq is not None:
            self._sq.dirty.add(seq_id)  # rebuilt by its next append or SparQ decode

    def free(self, seq_id) -> None:
        """Release ``seq_id``; pages no other sequence shares return to the pool."""
        self.book.free(seq_id)
        if self._keys is not None:
            self._keys.release_unreferenced(self.book)
        if self._sq is not None:
            self._sq.drop(seq_id)

    def length(self, seq_id) -> int:
        """Tokens held by ``seq_id``."""
        return self.book.length(seq_id)

    def page_table(self, seq_ids) -> tuple:
        """FlashInfer's CSR page table of ``seq_ids``: int32 NumPy ``(indptr, indices, last_page_len)``."""
        return self.book.csr(seq_ids)

    def block_table(self, seq_ids, pad: int = -1) -> tuple:
        """vLLM's padded block table of ``seq_ids``: int32 NumPy ``(table, lengths)``."""
        return self.book.block_table(seq_ids, pad)

    def check_ids(self, seq_ids) -> list:
        """``seq_ids`` as a list of distinct live ids (an int is one id); raises before any device work."""
        ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
        self.book.seq_list(ids)  # (live, and no repeats: it checks both)
        return ids

    def order(self, s) -> int:
        """Order stream ``s`` after the cache's last op and make ``s`` the cache's stream: an append
        on one stream and a decode on another never race (neither a read of tokens not yet written,
        nor a copy-on-write or append over slots an earlier decode still reads).

        Refused while ``s`` captures a CUDA graph: the cache keeps its page lists and lengths on
        the host, so a replay would run with this call's tables after the cache had changed.
        Returns ``s``'s capture id, 0, for the call's allocations to take."""
        capture = refuse_capture(s, "a PagedKVCache's calls read its page lists and lengths on the host when "
                                    "made, and a replay would use them after the cache had changed: capture "
                                    "paged_decode or contiguous_decode over device lengths with max_seqlen= instead")
        if s.ptr != self._stream.ptr:
            order_after(s, self._stream.ptr)
            self._stream = s
        return capture

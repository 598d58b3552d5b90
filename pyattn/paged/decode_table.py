"""The decode's device page table, kept current by the one-token appends of a serving loop.

A serving loop's step is ``cache.append(ids, k, v)`` (one new token a sequence), then
``decode(q, cache, ids)``. Rebuilding the decode's page table from the book and uploading it at
every decode cost more host time than the decode itself: on an H200 host a step of 8 sequences
took ~300 us against ~30 us for the decode on a cached table (``dev/probe_decode_step.py``).

So the cache keeps the last decode's table on the device in vLLM's block-table form, and the
append of one token to each of its sequences patches it inside its own ``kv_append`` launch: for
every appended sequence of the table, its new length and the page its token landed in (a fresh
page, a copy-on-write replacement, or the same page again: always written, so no case is missed),
two int32 writes riding with the items the append hands its kernel anyway (through the cache's
:class:`~pyattn.runtime.mailbox.Mailbox`). A host mirror takes the same
patches, so the host always knows what the device holds (the split choice reads the lengths; the
tests compare the mirror against a table built fresh from the book).

Any other change of the book (an append of several tokens to a sequence, fork, truncate, free,
accept, a new sequence, a row outgrowing its capacity) leaves the table stale: the book's version
moves past the table's, and the next decode builds a new one. The batch order (longest first,
:func:`~pyattn.paged.book.longest_first`) is kept from the build: it only orders the blocks' start,
so a stale order is still a correct one.
"""

from __future__ import annotations

import numpy as np

from ..array import DeviceArray
from ..interop.streams import note_use
from ..pipeline.host import upload
from .book import longest_first

__all__ = ["DecodeTable"]

_HEADROOM = 64  # page entries a row may grow by before a rebuild (1024 tokens of 16-token pages)


class DecodeTable:
    """One decode batch's device page table: ``[lengths (B) | order (B, absent when None) |
    pages (B x cap)]`` int32 in one device block, and its host mirror.

    ``tables`` is what :func:`pyattn.ops._decode.run_decode` takes: ``(pages, None, cap, lengths,
    order)``, block-table form (row ``b`` at ``pages + b * cap``).
    """

    __slots__ = ("ids", "rows", "cap", "host", "buf", "tables", "version", "span", "_pages_at")

    def __init__(self, book, ids: tuple, device, s):
        seqs = book.seq_list(ids)
        n = len(ids)
        lens = np.fromiter((q.length for q in seqs), np.int32, n)
        order = longest_first(lens)
        widest = max((q.n_pages for q in seqs), default=0)
        self.cap = cap = -(-(widest + _HEADROOM) // 64) * 64
        self._pages_at = at = n + (n if order is not None else 0)
        host = np.zeros(at + n * cap, np.int32)  # unused entries 0: a valid page, never read past a length
        host[:n] = lens
        if order is not None:
            host[n:2 * n] = order
        table = host[at:].reshape(n, cap)
        for row, q in zip(table, seqs):
            row[: q.n_pages] = q.page_list()
        (self.buf,) = upload([host], device, s)
        view = lambda off, k: DeviceArray(self.buf.ptr + 4 * off, (k,), np.int32, device, owner=self.buf,  # noqa: E731
                                          stream=s)
        self.tables = (view(at, n * cap), None, cap, view(0, n), view(n, n) if order is not None else None)
        self.ids, self.host, self.version = ids, host, book.version
        self.rows = {sid: i for i, sid in enumerate(ids)}
        self.span = self._span()

    def _span(self) -> tuple:
        """(longest, total) length of the batch, from the mirror (the decode's split choice)."""
        lens = self.host[: len(self.ids)]
        return int(lens.max(initial=0)), int(lens.sum(dtype=np.int64))

    def patches(self, seq_ids, before: list, counts: list, dst: np.ndarray, page_size: int):
        """The patches of an append, or None when it leaves the table stale.

        Called after the book planned the append, and only when the table was current before it.
        ``before``: the sequences' lengths before the append; ``counts``: tokens appended to each
        (only 0 and 1 are patched: a longer append may fill several pages); ``dst``: the plan's
        destination slots, one per appended sequence in order. Returns ``(n, int32 array)``: n
        offsets into the device block, then their n values; the mirror takes them too. In Python
        ints: a decode step patches a few to a few hundred entries, where NumPy's per-call cost
        would dominate.
        """
        if any(c != 0 and c != 1 for c in counts):
            return None
        rows, cap, at = self.rows, self.cap, self._pages_at
        longest, total = self.span
        offsets, values = [], []
        slots = iter(dst.tolist())
        for sid, b, c in zip(seq_ids, before, counts):
            if not c:
                continue
            slot = next(slots)
            r = rows.get(sid)
            if r is None:  # a sequence outside this decode batch
                continue
            i = b // page_size  # the page its token landed in: fresh, a copy-on-write one, or the same
            if i >= cap:
                return None
            offsets += (r, at + r * cap + i)
            values += (b + 1, slot // page_size)
            longest, total = max(longest, b + 1), total + 1
        if offsets:
            self.host[offsets] = values
            self.span = (longest, total)
        return len(offsets), np.array(offsets + values, np.int32)

    def use(self, s) -> None:
        """Note ``s``'s use of the table's block (its free waits for it)."""
        note_use(s, (self.buf,))

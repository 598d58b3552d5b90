"""Host bookkeeping of SparQ's per-sequence state (``PagedKVCache(..., sparq=True)``).

SparQ blends its attention over the chosen keys with the mean of *all* the sequence's values, so the
cache keeps, per sequence, the float32 sum of its V rows (per kv head and channel), added one token
after another in token order by the ``kv_sparq`` kernel: appending extends the sum, and a sum
rebuilt from scratch (after ``truncate``, or for a ``fork`` of part of a sequence) adds the same
values in the same order, so it equals, bit for bit, the sum the appends would have made.

:class:`SparqRows` maps live sequences to rows of the device sum array and decides the jobs
(``KV_SPARQ_PARAMS``): ``(row, source row or -1, offset, count)`` over a list of pool slots. A
sequence whose sum is out of date (truncated, or a partial fork) is *dirty* and rebuilt by its next
append or SparQ decode, so rollbacks that are appended to right away cost one pass, not two. No GPU here.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SparqRows"]


class SparqRows:
    """Rows of the per-sequence V sums, and which sequences must rebuild theirs."""

    def __init__(self):
        self.row_of: dict = {}  # sequence id -> row
        self._free: list = []
        self.capacity = 0
        self.dirty: set = set()  # sequences whose row must be rebuilt from all their tokens

    def row(self, sid: int) -> int:
        """The row of ``sid``, allocated on first use (``capacity`` grows; the caller grows the array)."""
        r = self.row_of.get(sid)
        if r is None:
            if self._free:
                r = self._free.pop()
            else:
                r, self.capacity = self.capacity, self.capacity + 1
            self.row_of[sid] = r
        return r

    def drop(self, sid: int) -> None:
        """Forget ``sid`` (freed)."""
        r = self.row_of.pop(sid, None)
        if r is not None:
            self._free.append(r)
        self.dirty.discard(sid)

    def fork(self, parent: int, child: int, whole: bool):
        """The child's job: a copy of the parent's row when it forks the whole (up-to-date)
        sequence, else nothing now (the child is dirty). Returns ``(row, parent row)`` or None."""
        if whole and parent not in self.dirty and parent in self.row_of:
            return self.row(child), self.row_of[parent]
        self.dirty.add(child)
        return None

    def jobs(self, book, entries) -> tuple:
        """Jobs and slot list for ``entries`` = ``[(sid, first token, n tokens)]``: sum the tokens
        [first, first + n) of ``sid`` onto its row (dirty sequences: all their tokens, from 0).

        Returns ``(jobs int32 (m, 4), slots int32)``; marks the sequences clean.
        """
        ps = book.page_size
        jobs, slots, off = [], [], 0
        for sid, first, n in entries:
            r = self.row(sid)
            if sid in self.dirty:
                first, n = 0, book.length(sid)
                self.dirty.discard(sid)
            src = r if first > 0 else -1
            pos = np.arange(first, first + n, dtype=np.int64)
            pages = book.pages(sid)
            slots.append((pages[pos // ps].astype(np.int64) * ps + pos % ps).astype(np.int32))
            jobs.append((r, src, off, n))
            off += n
        cat = np.concatenate(slots) if slots else np.empty(0, np.int32)
        return np.asarray(jobs, np.int32).reshape(-1, 4), cat

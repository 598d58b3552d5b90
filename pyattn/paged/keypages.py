"""Host bookkeeping of per-channel key scales (``PagedKVCache(..., key_scales="channel")``).

A page's keys share one scale per channel, so a page cannot be quantized one token at a time: its
scales depend on every key it holds. The rule (see :func:`pyattn.quant.quantize_page`): whenever an
append writes into a page, the ``kv_key_pages`` kernel requantizes the page's filled slots together
from their exact 16-bit values, and a page's scales are fixed once its last slot is written.

Why keep the open page's exact values rather than rescale its codes as it fills: requantizing codes
rounds twice (every time a channel's maximum grows the old codes move to a coarser grid), so a
page's error would depend on the order its keys arrived; keeping the open page's keys exact (a
float32 *staging* copy, one page per open page, freed when the page fills) makes every page the
exact per-channel quantization of the keys it holds, and decode reads every page, open or full, the
same way. Only a page reopened after the fact (``truncate`` into a full page, or ``fork`` of a
prefix that ends inside one, then an append) has no exact copy: its kept keys are dequantized from
their codes (and, in the page's float16 channels, their kept values) and requantized with the new
ones, one more rounding for those keys.

:class:`KeyStager` decides, per append, the jobs of that kernel (which page, which sources for each
slot, which staging slot) and owns the staging-slot map. No GPU here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["KeyStager", "KeyJobs"]


class KeyJobs(NamedTuple):
    """One append's ``kv_key_pages`` work (see ``KV_PAGES_PARAMS``).

    ``jobs`` is int32 (n, 5): dst page, filled slots, offset into ``src``, staging slot (-1: the page
    is full), source page (-1: none). ``src`` holds each job's slot sources in slot order: a new
    token's index (>= 0), ``-1 - row`` for staging row ``row`` (< ``stage_rows``), or
    ``-1 - (stage_rows + slot)`` for a slot of the job's source page. ``capacity`` is the number of
    staging pages the launch needs; ``opened`` / ``closed`` the staging map's changes, applied by
    :meth:`KeyStager.commit` once the launch is queued.
    """

    jobs: np.ndarray
    src: np.ndarray
    stage_rows: int
    capacity: int
    opened: dict
    closed: list


class KeyStager:
    """Which pages have a staging copy, and the jobs of each append.

    Parameters
    ----------
    page_size : int
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.stage_of: dict = {}  # page -> staging slot
        self._free: list = []  # staging slots not in use
        self.capacity = 0  # staging slots allocated on the device

    def before(self, book, seq_ids, counts) -> list:
        """Per sequence, ``(length, last page or -1)`` now: call before ``book.plan_append``."""
        out = []
        for sid, c in zip(seq_ids, counts):
            n = book.length(sid)
            out.append((n, int(book.pages(sid)[-1]) if c and n % self.page_size else -1))
        return out

    def plan(self, counts, before, dst) -> KeyJobs:
        """The jobs of an append that wrote ``counts[i]`` tokens per sequence to slots ``dst``
        (``AppendPlan.dst``: sequences in call order), the sequences having been as ``before`` said.
        Changes nothing: see :meth:`commit`."""
        ps = self.page_size
        entries = []  # (dst page, slots before, slots after, first new token, source page)
        at = 0
        for c, (length, old_page) in zip(counts, before):
            if c:
                pages = (dst[at: at + c] // ps).astype(np.int64)
                cuts = np.concatenate([[0], np.flatnonzero(np.diff(pages)) + 1, [c]])
                fill = length % ps
                for k in range(len(cuts) - 1):
                    s0, s1 = int(cuts[k]), int(cuts[k + 1])
                    nb = fill if k == 0 else 0
                    entries.append((int(pages[s0]), nb, nb + s1 - s0, at + s0, old_page if nb else -1))
            at += c
        # Staging slots for pages left open: a page keeps its own (appended to in place), others get
        # a free one. Slots freed by this call are reused only by later calls: this launch may still
        # read them.
        free, grown, opened, stage = list(self._free), 0, {}, []
        for page, nb, na, _, src_page in entries:
            slot = -1
            if na < ps:
                slot = self.stage_of.get(page, -1) if src_page == page else -1
                if slot < 0:
                    if free:
                        slot = free.pop()
                    else:
                        slot, grown = self.capacity + grown, grown + 1
                opened[page] = slot
            stage.append(slot)
        capacity = self.capacity + grown
        stage_rows = capacity * ps
        jobs = np.empty((len(entries), 5), np.int32)
        src = np.empty(sum(na for _, _, na, _, _ in entries), np.int32)
        off = 0
        for j, ((page, nb, na, tok, src_page), slot) in enumerate(zip(entries, stage)):
            staged = self.stage_of.get(src_page, -1) if src_page >= 0 else -1
            kept = np.arange(nb, dtype=np.int64)
            src[off: off + nb] = -1 - (staged * ps + kept if staged >= 0 else stage_rows + kept)
            src[off + nb: off + na] = np.arange(tok, tok + na - nb)
            jobs[j] = (page, na, off, slot, src_page if nb and staged < 0 else -1)
            off += na
        closed = [page for page, nb, na, _, src_page in entries if na == ps and src_page == page
                  and page in self.stage_of]
        return KeyJobs(jobs, src, stage_rows, capacity, opened, closed)

    def commit(self, work: KeyJobs, book) -> None:
        """Apply ``work``'s staging changes after its launch was queued; drop unreferenced pages'."""
        taken = set(work.opened.values())
        self._free = [s for s in self._free if s not in taken]
        self.capacity = max(self.capacity, work.capacity)
        for page in work.closed:
            self._free.append(self.stage_of.pop(page))
        self.stage_of.update(work.opened)
        self.release_unreferenced(book)

    def release_unreferenced(self, book) -> None:
        """Staging slots of pages no sequence holds any more (freed, truncated, copied away)."""
        for page in [p for p in self.stage_of if book.refcount[p] == 0]:
            self._free.append(self.stage_of.pop(page))

    def check(self) -> None:
        """Assert that the map and the free list partition the slots (for tests)."""
        used = sorted(self.stage_of.values())
        assert len(set(used)) == len(used), "a staging slot held by two pages"
        assert sorted(used + self._free) == list(range(self.capacity)), "staging slots lost or duplicated"

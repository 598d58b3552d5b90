"""The plans of :class:`~pyattn.paged.book.PageBook`'s calls that take pages from the free list:
appends (with their copy-on-write copies) and the acceptance of a draft tree's tokens; the plans'
types; and :class:`OutOfPagesError`, which only these calls raise.

Functions of the book, which owns the sequences, reference counts and free list they change, and
keeps the public methods (``PageBook.plan_append``, ``check_accept``, ``plan_accept``);
:mod:`pyattn.paged.book` imports the names here that callers use, so ``from pyattn.paged.book
import OutOfPagesError, AppendPlan, AcceptPlan`` works as before. As every call of the book, each
function either completes or raises before changing anything.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime.errors import PyattnError

__all__ = ["AppendPlan", "AcceptPlan", "OutOfPagesError", "append_general", "append_small", "check_accept",
           "plan_accept"]


class OutOfPagesError(PyattnError):
    """The cache has too few free pages for a request; the cache was left unchanged.

    Attributes
    ----------
    needed, free : int
        Pages the request needed (new pages plus copy-on-write copies) and pages free.
    """

    def __init__(self, needed: int, free: int, what: str):
        self.needed, self.free = needed, free
        super().__init__(f"out of KV-cache pages: {what} needs {needed} new page(s), {free} free; "
                         f"nothing was changed (free sequences or create a larger cache)")


class AppendPlan(NamedTuple):
    """Where an append writes, as global slot indices ``page * page_size + offset`` (int32).

    ``dst`` has one slot per new token, sequences in call order. ``copy_src``/``copy_dst`` are the
    copy-on-write copies (slot to slot) that must happen with the append: distinct slots from
    ``dst``, so one kernel may do both in any order.
    """

    dst: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray


class AcceptPlan(NamedTuple):
    """The slot-to-slot copies (int32 global slots) that move accepted draft tokens into place.

    Every ``copy_dst`` slot lies in a page newly taken from the free list and no ``copy_src``
    slot does, so one launch may do all copies in any order.
    """

    copy_src: np.ndarray
    copy_dst: np.ndarray


def append_general(book, seqs: list, counts) -> AppendPlan:
    """:meth:`PageBook.plan_append <pyattn.paged.book.PageBook.plan_append>` for any ``counts``:
    validates them (raising as the method documents), then plans with NumPy arrays."""
    if any(isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)) for c in counts):
        raise TypeError(f"counts: expected ints, got {list(counts)}")
    counts = [int(c) for c in counts]
    if len(counts) != len(seqs) or any(c < 0 for c in counts):
        raise ValueError(f"counts: expected {len(seqs)} non-negative token counts, got {counts}")
    # Copy-on-write is decided on the reference counts at the call's start: a page shared then
    # is copied by every sequence that writes into it, so no launch both reads a page as a
    # copy source and writes it in place. A page all of whose sharers copied away is freed
    # after the call's pages are handed out, so no slot is reused within one launch.
    ps = book.page_size
    cows = [bool(c) and _cow_needed(book, seq) for seq, c in zip(seqs, counts)]
    need = sum(-(-(seq.length + c) // ps) - seq.n_pages + cow for seq, c, cow in zip(seqs, counts, cows) if c)
    if need > len(book._free):
        raise OutOfPagesError(need, len(book._free), f"appending {sum(counts)} token(s)")

    dst, copy_src, copy_dst, orphans = [], [], [], []
    for seq, c, cow in zip(seqs, counts, cows):
        if not c:
            continue
        if cow:
            old, new = int(seq.pages[seq.n_pages - 1]), book._free.pop()
            filled = seq.length % ps
            copy_src.append(np.arange(old * ps, old * ps + filled, dtype=np.int32))
            copy_dst.append(np.arange(new * ps, new * ps + filled, dtype=np.int32))
            book.refcount[old] -= 1
            if book.refcount[old] == 0:
                orphans.append(old)
            book.refcount[new] = 1
            seq.pages[seq.n_pages - 1] = new
        end = seq.length + c
        n_new = -(-end // ps) - seq.n_pages
        seq.reserve(seq.n_pages + n_new)
        for _ in range(n_new):
            page = book._free.pop()
            book.refcount[page] = 1
            seq.pages[seq.n_pages] = page
            seq.n_pages += 1
        if c == 1:  # the decode loop's case, without NumPy temporaries
            dst.append(np.int32(int(seq.pages[seq.length // ps]) * ps + seq.length % ps))
        else:
            pos = np.arange(seq.length, end, dtype=np.int64)
            dst.append((seq.pages[pos // ps].astype(np.int64) * ps + pos % ps).astype(np.int32))
        seq.length = end
    book._free.extend(orphans)
    book.version += 1
    cat = (lambda parts: np.concatenate([np.atleast_1d(x) for x in parts]).astype(np.int32, copy=False)
           if parts else np.empty(0, np.int32))
    return AppendPlan(cat(dst), cat(copy_src), cat(copy_dst))


def append_small(book, seqs: list, counts) -> AppendPlan:
    """:meth:`~pyattn.paged.book.PageBook.plan_append` for valid counts, each a plain int in
    [0, page_size] (its fast path, called through ``PageBook._append_small``): the same plan and
    the same book afterwards (pages taken in the same order, the same free list and reference
    counts), in plain Python ints. The decode loop calls this for up to hundreds of sequences a
    step, where the general path's per-sequence NumPy scalars and small arrays cost more than
    the rest of the step's host work.
    """
    ps, rc, free = book.page_size, book.refcount, book._free
    # Pass 1 changes nothing (running out of pages must leave the book untouched). A sequence
    # whose tokens all fit in its private, partly filled last page (the decode loop's case:
    # page_size - 1 steps in page_size) gets its slots now; the others (an empty sequence or a
    # full last page, a shared last page, a spill into a new page: at most one, as counts are
    # <= page_size) get placeholders, filled once pages are taken. Copy-on-write is decided on
    # the reference counts at the call's start, as in the general path.
    dst, later, need = [], [], 0
    for seq, c in zip(seqs, counts):
        off = seq.length % ps
        if off and c:
            p = seq.pages.item(seq.n_pages - 1)  # .item: a Python int, no NumPy scalar
            cow = rc.item(p) > 1
            if not cow and off + c <= ps:
                slot = p * ps + off
                if c == 1:
                    dst.append(slot)
                else:
                    dst.extend(range(slot, slot + c))
                continue
            need += cow + (off + c > ps)
        elif c:
            p, cow = -1, False
            need += 1
        else:
            continue
        later.append((len(dst), seq, c, off, p, cow))
        dst.extend(range(c))  # placeholders
    if need > len(free):
        raise OutOfPagesError(need, len(free), f"appending {sum(counts)} token(s)")

    for seq, c in zip(seqs, counts):
        seq.length += c
    copy_src, copy_dst, orphans = [], [], []
    # In call order, so pages leave the free list in the general path's order: per sequence
    # its copy first, then its new page.
    for i, seq, c, off, p, cow in later:
        if cow:
            old, p = p, free.pop()
            copy_src.extend(range(old * ps, old * ps + off))
            copy_dst.extend(range(p * ps, p * ps + off))
            r = rc.item(old) - 1
            rc[old] = r
            if r == 0:  # all its sharers copied away: freed after the call (no slot reused in a launch)
                orphans.append(old)
            rc[p] = 1
            seq.pages[seq.n_pages - 1] = p
        if off:  # the rest of the last page (its copy, if shared) first
            k = min(c, ps - off)
            dst[i: i + k] = range(p * ps + off, p * ps + off + k)
            i, c = i + k, c - k
        if c:
            page, n = free.pop(), seq.n_pages
            rc[page] = 1
            seq.reserve(n + 1)
            seq.pages[n] = page
            seq.n_pages = n + 1
            dst[i: i + c] = range(page * ps, page * ps + c)
    free.extend(orphans)
    book.version += 1
    return AppendPlan(np.array(dst, np.int32), np.array(copy_src, np.int32), np.array(copy_dst, np.int32))


def _cow_needed(book, seq) -> bool:
    """True when the next write to ``seq`` lands in a shared, partly filled last page."""
    return seq.length % book.page_size != 0 and book.refcount[seq.pages[seq.n_pages - 1]] > 1


def check_accept(book, seq_ids, paths, tree_sizes) -> list:
    """:meth:`PageBook.check_accept <pyattn.paged.book.PageBook.check_accept>`: changing nothing,
    raises as :func:`plan_accept` would (``OutOfPagesError`` included), else returns the
    per-sequence plans ``(seq, base, path, k, first, fresh)``: the tree starts at token ``base``,
    path entry ``k`` is the first kept token that must move, and from page ``first`` on the
    sequence takes ``fresh`` new pages (0: nothing moves)."""
    seqs = book.seq_list(seq_ids)
    try:
        sizes = [tree_sizes] * len(seqs) if isinstance(tree_sizes, (int, np.integer)) else list(tree_sizes)
    except TypeError:
        raise TypeError(f"tree_sizes: expected an int or a sequence of ints, got {tree_sizes!r}") from None
    try:
        paths = list(paths)
    except TypeError:
        raise TypeError(f"paths: expected a sequence of paths (one per sequence), got {paths!r}") from None
    if len(sizes) != len(seqs) or len(paths) != len(seqs):
        raise ValueError(f"paths, tree_sizes: expected one per sequence ({len(seqs)}), got {len(paths)} paths "
                         f"and {len(sizes)} tree sizes")
    ps, plans, need = book.page_size, [], 0
    for i, (seq, n, path) in enumerate(zip(seqs, sizes, paths)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"tree_sizes: expected ints, got {n!r} for sequence {i}")
        if not 0 <= n <= seq.length:
            raise ValueError(f"tree_sizes: expected 0 <= tree size <= the sequence's length {seq.length}, got "
                             f"{n} for sequence {i}")
        p = np.asarray(path)
        if p.ndim != 1 or (p.size and p.dtype.kind not in "iu"):
            raise TypeError(f"paths: expected a 1-D sequence of ints per sequence, got {path!r} for sequence {i}")
        p = p.astype(np.int64)
        if p.size and (p[0] < 0 or p[-1] >= n or (np.diff(p) <= 0).any()):
            raise ValueError(f"paths: expected ascending tree indices in [0, {n}), got {p.tolist()} for "
                             f"sequence {i}")
        base, m = seq.length - int(n), int(p.size)
        moved = np.flatnonzero(p != np.arange(m))
        k = int(moved[0]) if moved.size else m  # the first kept token that must move
        first = (base + k) // ps  # the first page replaced (moved.size only)
        fresh = -(-(base + m) // ps) - first if moved.size else 0
        plans.append((seq, base, p, k, first, fresh))
        need += fresh
    if need > len(book._free):
        raise OutOfPagesError(need, len(book._free), f"accepting the draft tokens of {len(seqs)} sequence(s)")
    return plans


def plan_accept(book, plans: list) -> AcceptPlan:
    """Carry out :func:`check_accept`'s per-sequence ``plans``: take the fresh pages, list the slot
    copies, release the replaced pages (after every new page was taken)."""
    ps = book.page_size
    src, dst, released = [], [], []
    for seq, base, p, k, first, fresh in plans:
        m = p.size
        end = base + m
        if fresh:
            old = seq.page_list()
            new = np.array([book._free.pop() for _ in range(fresh)], np.int32)
            book.refcount[new] = 1
            # new positions [first * ps, end): the kept slots below base + k, then the moved tokens
            pos = np.arange(first * ps, end, dtype=np.int64)
            from_pos = np.where(pos < base + k, pos, base + p[np.clip(pos - base, 0, m - 1)])
            src.append(old[from_pos // ps].astype(np.int64) * ps + from_pos % ps)
            dst.append(new[pos // ps - first].astype(np.int64) * ps + pos % ps)
            released.append(old[first:].copy())
            seq.reserve(first + fresh)
            seq.pages[first: first + fresh] = new
            seq.n_pages = first + fresh
        else:  # everything kept is in place: drop the rest
            keep = -(-end // ps)
            released.append(seq.pages[keep: seq.n_pages].copy())
            seq.n_pages = keep
        seq.length = end
    for pages in released:  # after every new page was taken: no slot is reused within the launch
        book._release(pages)
    book.version += 1
    cat = (lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32))
    return AcceptPlan(cat(src), cat(dst))

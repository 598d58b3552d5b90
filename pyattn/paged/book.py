"""Host-side bookkeeping of a paged KV cache: which pages each sequence owns, reference counts,
copy-on-write, and the page-table exports. No GPU here: :class:`PageBook` only decides *where*
tokens go; ``pyattn.PagedKVCache`` moves the bytes.

Invariants (checked by :meth:`PageBook.check`, and by the tests after every operation):

- a sequence of ``length`` tokens owns exactly ``ceil(length / page_size)`` pages, in order;
- ``refcount[p]`` is the number of sequences whose page list contains ``p``;
- the free list holds exactly the pages whose reference count is 0, each once.

Every mutating call either completes or raises before changing anything (out of pages included).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime.errors import PyattnError

__all__ = ["PageBook", "AppendPlan", "AcceptPlan", "OutOfPagesError", "MAX_PAGE_SIZE", "longest_first"]

MAX_PAGE_SIZE = 256
_INT32_MAX = 2**31 - 1
# Exact types (not subclasses: np.bool_ can be subclassed) of the sequence ids that
# PageBook.seq_list may look up without a per-id bool check.
_ID_TYPES = frozenset({int, *(np.dtype(c).type for c in "bBhHiIlLqQ")})
# PageBook.plan_append's fast path for small counts (the decode loop's); the tests switch it off
# to compare it with the general path.
_FAST_APPEND = True
_INT_ONLY = frozenset({int})


def longest_first(lens) -> np.ndarray | None:
    """The batch order of a decode's blocks: int32 entries longest first, or None (the batch's own
    order) when every length is equal. The block scheduler starts blocks in grid order; a long
    sequence whose blocks start last is the tail of a ragged batch's decode."""
    if len(lens) < 2 or int(lens.min()) == int(lens.max()):
        return None
    return np.argsort(-np.asarray(lens, np.int64), kind="stable").astype(np.int32)


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


class _Seq:
    __slots__ = ("pages", "n_pages", "length")

    def __init__(self, pages: np.ndarray, n_pages: int, length: int):
        self.pages, self.n_pages, self.length = pages, n_pages, length

    def page_list(self) -> np.ndarray:
        return self.pages[: self.n_pages]

    def reserve(self, n: int) -> None:
        if n > len(self.pages):  # amortised growth: decode loops append one token at a time
            grown = np.empty(max(n, 2 * len(self.pages), 4), np.int32)
            grown[: self.n_pages] = self.pages[: self.n_pages]
            self.pages = grown


class PageBook:
    """Page ownership for a pool of ``num_pages`` pages of ``page_size`` token slots.

    Parameters
    ----------
    num_pages : int
    page_size : int
        Tokens per page, 1 to :data:`MAX_PAGE_SIZE`.
    """

    def __init__(self, num_pages: int, page_size: int):
        for name, val in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(val).__name__}")
        num_pages, page_size = int(num_pages), int(page_size)  # NumPy ints would overflow the product below
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size: expected 1 to {MAX_PAGE_SIZE}, got {page_size}")
        if num_pages < 1 or num_pages * page_size > _INT32_MAX:
            raise ValueError(f"num_pages: expected >= 1 with num_pages * page_size < 2**31 (slots are int32), "
                             f"got {num_pages} pages of {page_size}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.refcount = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: pages are handed out 0, 1, 2, ...
        self._seqs: dict = {}
        self._next_id = 0
        self.version = 0  # bumped by every change; callers key derived tables on it

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    def _seq(self, seq_id, name: str = "seq_id") -> _Seq:
        if isinstance(seq_id, (bool, np.bool_)):  # True == 1 would silently name sequence 1
            raise TypeError(f"{name}: expected an int sequence id, got {seq_id!r}")
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise ValueError(f"{name}: no live sequence {seq_id!r} in this cache") from None

    def length(self, seq_id) -> int:
        """Tokens held by sequence ``seq_id``."""
        return self._seq(seq_id).length

    def pages(self, seq_id) -> np.ndarray:
        """A copy of the pages of ``seq_id``, in token order."""
        return self._seq(seq_id).page_list().copy()

    def seq_list(self, seq_ids, name: str = "seq_ids") -> list:
        """Validate ``seq_ids`` (live, no repeats) and return their records."""
        ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
        try:
            distinct = len(set(ids)) == len(ids)
        except TypeError:  # an unhashable id (a list, an array): no sequence id at all
            raise TypeError(f"{name}: expected int sequence ids, got {ids!r}") from None
        if not distinct:
            raise ValueError(f"{name}: expected distinct sequence ids, got {ids}")
        # Called several times per decode step: when every id is of a plain integer type (so no
        # bool, which would hash as sequence 0 or 1), one C-level pass of dict lookups does it.
        # Anything else, or a lookup that fails, takes the per-id path below, which raises the
        # error of the first bad id exactly as before.
        if _ID_TYPES.issuperset(map(type, ids)):
            try:
                return list(map(self._seqs.__getitem__, ids))
            except KeyError:
                pass
        return [self._seq(i, name) for i in ids]

    # -- lifecycle ---------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Start an empty sequence and return its id (ids are never reused)."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq(np.empty(4, np.int32), 0, 0)
        self.version += 1
        return sid

    def fork(self, seq_id, length=None) -> int:
        """A new sequence sharing the pages of the first ``length`` tokens of ``seq_id`` (default all).

        No page is copied now: shared pages are reference counted and copied when either
        sequence next writes into one (only a partly filled last page can be written).
        """
        src = self._seq(seq_id)
        length = src.length if length is None else self._check_length(length, src.length, "length")
        n = -(-length // self.page_size)
        shared = src.page_list()[:n]
        self.refcount[shared] += 1
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq(shared.copy() if n else np.empty(4, np.int32), n, length)
        self.version += 1
        return sid

    def truncate(self, seq_id, length) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` (speculative-decoding rollback).

        Pages past the new end lose a reference; the bytes of kept slots are untouched, and slots
        past ``length`` in the kept last page are overwritten by the next append.
        """
        seq = self._seq(seq_id)
        length = self._check_length(length, seq.length, "length")
        keep = -(-length // self.page_size)
        self._release(seq.pages[keep: seq.n_pages])
        seq.n_pages, seq.length = keep, length
        self.version += 1

    def free(self, seq_id) -> None:
        """Drop sequence ``seq_id``; its pages return to the pool once no other sequence shares them."""
        seq = self._seq(seq_id)
        self._release(seq.page_list())
        del self._seqs[seq_id]
        self.version += 1

    def _check_length(self, length, limit: int, name: str) -> int:
        if isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(length).__name__}")
        if not 0 <= length <= limit:
            raise ValueError(f"{name}: expected 0 <= {name} <= {limit} (the sequence's length), got {length}")
        return int(length)

    def _release(self, pages: np.ndarray) -> None:
        for p in pages.tolist():
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    # -- appends -----------------------------------------------------------------------------
    def plan_append(self, seq_ids, counts) -> AppendPlan:
        """Reserve slots for ``counts[i]`` new tokens at the end of each ``seq_ids[i]``.

        Copy-on-write: a sequence whose partly filled last page is shared gets a private copy
        of that page first (its filled slots are listed in the plan's copies). Raises
        :class:`OutOfPagesError` without changing anything when the pages do not suffice.
        """
        seqs = self.seq_list(seq_ids)
        # The serving loop's call (one token, or a few, for each of many sequences) takes the fast
        # path when every count is a plain int in [0, page_size]: those are valid as they are, and
        # each sequence then takes at most one new page. Anything else (NumPy ints, bools, an
        # iterator, a prefill longer than a page, a bad count) goes the general way, which
        # validates and raises as always.
        if (_FAST_APPEND and type(counts) in (list, tuple) and len(counts) == len(seqs)
                and _INT_ONLY == set(map(type, counts)) and min(counts) >= 0 and max(counts) <= self.page_size):
            return self._append_small(seqs, counts)
        if any(isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)) for c in counts):
            raise TypeError(f"counts: expected ints, got {list(counts)}")
        counts = [int(c) for c in counts]
        if len(counts) != len(seqs) or any(c < 0 for c in counts):
            raise ValueError(f"counts: expected {len(seqs)} non-negative token counts, got {counts}")
        # Copy-on-write is decided on the reference counts at the call's start: a page shared then
        # is copied by every sequence that writes into it, so no launch both reads a page as a
        # copy source and writes it in place. A page all of whose sharers copied away is freed
        # after the call's pages are handed out, so no slot is reused within one launch.
        ps = self.page_size
        cows = [bool(c) and self._cow_needed(seq) for seq, c in zip(seqs, counts)]
        need = sum(-(-(seq.length + c) // ps) - seq.n_pages + cow for seq, c, cow in zip(seqs, counts, cows) if c)
        if need > len(self._free):
            raise OutOfPagesError(need, len(self._free), f"appending {sum(counts)} token(s)")

        dst, copy_src, copy_dst, orphans = [], [], [], []
        for seq, c, cow in zip(seqs, counts, cows):
            if not c:
                continue
            if cow:
                old, new = int(seq.pages[seq.n_pages - 1]), self._free.pop()
                filled = seq.length % ps
                copy_src.append(np.arange(old * ps, old * ps + filled, dtype=np.int32))
                copy_dst.append(np.arange(new * ps, new * ps + filled, dtype=np.int32))
                self.refcount[old] -= 1
                if self.refcount[old] == 0:
                    orphans.append(old)
                self.refcount[new] = 1
                seq.pages[seq.n_pages - 1] = new
            end = seq.length + c
            n_new = -(-end // ps) - seq.n_pages
            seq.reserve(seq.n_pages + n_new)
            for _ in range(n_new):
                page = self._free.pop()
                self.refcount[page] = 1
                seq.pages[seq.n_pages] = page
                seq.n_pages += 1
            if c == 1:  # the decode loop's case, without NumPy temporaries
                dst.append(np.int32(int(seq.pages[seq.length // ps]) * ps + seq.length % ps))
            else:
                pos = np.arange(seq.length, end, dtype=np.int64)
                dst.append((seq.pages[pos // ps].astype(np.int64) * ps + pos % ps).astype(np.int32))
            seq.length = end
        self._free.extend(orphans)
        self.version += 1
        cat = (lambda parts: np.concatenate([np.atleast_1d(x) for x in parts]).astype(np.int32, copy=False)
               if parts else np.empty(0, np.int32))
        return AppendPlan(cat(dst), cat(copy_src), cat(copy_dst))

    def _append_small(self, seqs: list, counts) -> AppendPlan:
        """:meth:`plan_append` for valid counts, each a plain int in [0, page_size]: the same plan and
        the same book afterwards (pages taken in the same order, the same free list and reference
        counts), in plain Python ints. The decode loop calls this for up to hundreds of sequences a
        step, where the general path's per-sequence NumPy scalars and small arrays cost more than
        the rest of the step's host work.
        """
        ps, rc, free = self.page_size, self.refcount, self._free
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
        self.version += 1
        return AppendPlan(np.array(dst, np.int32), np.array(copy_src, np.int32), np.array(copy_dst, np.int32))

    def _cow_needed(self, seq: _Seq) -> bool:
        """True when the next write to ``seq`` lands in a shared, partly filled last page."""
        return seq.length % self.page_size != 0 and self.refcount[seq.pages[seq.n_pages - 1]] > 1

    # -- speculative decoding: keep an accepted branch of a draft tree ---------------------
    def plan_accept(self, seq_ids, paths, tree_sizes, *, checked=None) -> AcceptPlan:
        """Keep the accepted tokens ``paths[i]`` of the draft tree at the end of each ``seq_ids[i]``.

        Sequence ``i`` ends with a tree of ``tree_sizes[i]`` tokens (appended in tree order);
        ``paths[i]`` lists the tree indices to keep, ascending (a root-to-leaf branch, or any
        ascending subset). Afterwards the sequence holds its tokens before the tree followed by
        the kept ones, in order.

        Where the kept tokens already sit in place (a path ``0, 1, ..., m - 1``) nothing moves;
        from the first one that must move, the sequence gets fresh pages, filled by slot copies
        (the plan) from its old pages, which it then releases. Fresh pages make copy-on-write
        automatic (a page shared with a fork is never written) and keep the copies of one launch
        free of overlaps (no slot is both read and written). Raises before changing anything,
        :class:`OutOfPagesError` included. ``checked``: :meth:`check_accept`'s result for these
        arguments on the book as it is now (its checks are then not repeated).
        """
        plans = checked if checked is not None else self.check_accept(seq_ids, paths, tree_sizes)
        ps = self.page_size
        src, dst, released = [], [], []
        for seq, base, p, k, first, fresh in plans:
            m = p.size
            end = base + m
            if fresh:
                old = seq.page_list()
                new = np.array([self._free.pop() for _ in range(fresh)], np.int32)
                self.refcount[new] = 1
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
            self._release(pages)
        self.version += 1
        cat = (lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32))
        return AcceptPlan(cat(src), cat(dst))

    def check_accept(self, seq_ids, paths, tree_sizes) -> list:
        """:meth:`plan_accept`'s checks, changing nothing: raises as it would (``OutOfPagesError``
        included), else returns its per-sequence plans. ``PagedKVCache.accept`` calls it before any
        device work, then hands them to plan_accept once its kernel is ready."""
        seqs = self.seq_list(seq_ids)
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
        ps, plans, need = self.page_size, [], 0
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
        if need > len(self._free):
            raise OutOfPagesError(need, len(self._free), f"accepting the draft tokens of {len(seqs)} sequence(s)")
        return plans

    # -- exports -----------------------------------------------------------------------------
    def csr(self, seq_ids) -> tuple:
        """FlashInfer's page table for ``seq_ids``: int32 ``(indptr, indices, last_page_len)``.

        Sequence ``i`` owns pages ``indices[indptr[i]:indptr[i+1]]``; its last page holds
        ``last_page_len[i]`` tokens (1 to page_size; 0 for an empty sequence).
        """
        seqs = self.seq_list(seq_ids)
        n_pages = np.fromiter((s.n_pages for s in seqs), np.int64, len(seqs))
        indptr = np.zeros(len(seqs) + 1, np.int32)
        np.cumsum(n_pages, out=indptr[1:])
        indices = np.concatenate([s.page_list() for s in seqs]) if seqs else np.empty(0, np.int32)
        lengths = np.fromiter((s.length for s in seqs), np.int64, len(seqs))
        last = np.where(lengths > 0, lengths - (n_pages - 1) * self.page_size, 0).astype(np.int32)
        return indptr, indices.astype(np.int32, copy=False), last

    def block_table(self, seq_ids, pad: int = -1) -> tuple:
        """vLLM's page table for ``seq_ids``: int32 ``(table, lengths)``.

        ``table`` is (len(seq_ids), max pages) with row ``i`` holding sequence ``i``'s pages,
        padded with ``pad``; ``lengths[i]`` is its token count.
        """
        seqs = self.seq_list(seq_ids)
        if isinstance(pad, (bool, np.bool_)) or not isinstance(pad, (int, np.integer)):
            raise TypeError(f"pad: expected an int, got {type(pad).__name__}")
        if not -2**31 <= pad < 2**31:
            raise ValueError(f"pad: expected an int32, got {pad}")
        width = max((s.n_pages for s in seqs), default=0)
        table = np.full((len(seqs), width), pad, np.int32)
        for row, s in zip(table, seqs):
            row[: s.n_pages] = s.page_list()
        return table, np.fromiter((s.length for s in seqs), np.int32, len(seqs))

    def lengths(self, seq_ids) -> np.ndarray:
        """int32 token counts of ``seq_ids``."""
        return np.fromiter((s.length for s in self.seq_list(seq_ids)), np.int32)

    def check(self) -> None:
        """Assert the invariants in the module docstring (for tests and debugging)."""
        expected = np.zeros(self.num_pages, np.int64)
        for sid, s in self._seqs.items():
            assert s.n_pages == -(-s.length // self.page_size), f"sequence {sid}: page count vs length"
            pages = s.page_list()
            assert len(set(pages.tolist())) == len(pages), f"sequence {sid}: a page listed twice"
            np.add.at(expected, pages, 1)
        assert np.array_equal(expected, self.refcount), "reference counts differ from the page lists"
        assert sorted(self._free) == np.flatnonzero(expected == 0).tolist(), "free list != unreferenced pages"

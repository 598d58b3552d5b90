"""Host-side bookkeeping of a paged KV cache: which pages each sequence owns, reference counts,
copy-on-write, and the page-table exports. No GPU here: :class:`PageBook` only decides *where*
tokens go; ``pyattn.PagedKVCache`` moves the bytes.

Invariants (checked by :meth:`PageBook.check`, and by the tests after every operation):

- a sequence of ``length`` tokens owns exactly ``ceil(length / page_size)`` pages, in order;
- ``refcount[p]`` is the number of sequences whose page list contains ``p``;
- the free list holds exactly the pages whose reference count is 0, each once.

Every mutating call either completes or raises before changing anything (out of pages included).

The calls that take pages (appends, accepting a draft tree's tokens) plan in
:mod:`pyattn.paged.book_plans`, which also defines :class:`OutOfPagesError` and the plan types
(imported here: ``pyattn.paged.book`` is where callers find them).
"""

from __future__ import annotations

import numpy as np

from . import book_plans
from .book_plans import AcceptPlan, AppendPlan, OutOfPagesError

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
        return book_plans.append_general(self, seqs, counts)

    def _append_small(self, seqs: list, counts) -> AppendPlan:
        """:meth:`plan_append`'s fast path (:func:`~pyattn.paged.book_plans.append_small`); a method,
        so that tests can swap it on the class to count its calls."""
        return book_plans.append_small(self, seqs, counts)

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
        return book_plans.plan_accept(self, plans)

    def check_accept(self, seq_ids, paths, tree_sizes) -> list:
        """:meth:`plan_accept`'s checks, changing nothing: raises as it would (``OutOfPagesError``
        included), else returns its per-sequence plans. ``PagedKVCache.accept`` calls it before any
        device work, then hands them to plan_accept once its kernel is ready."""
        return book_plans.check_accept(self, seq_ids, paths, tree_sizes)

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

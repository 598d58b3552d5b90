"""CPU tests of :meth:`PageBook.plan_append`'s fast path (plain int counts in [0, page_size], the
decode loop's call) and of :meth:`PageBook.seq_list`'s fast lookup: two books driven by the same
operations, one with the fast path and one forced down the general path, must give identical plans,
identical page tables and identical books (pages, reference counts, free-list order, version), and
raise the same errors with the book unchanged.
"""

from __future__ import annotations

import enum
import random
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pyattn.paged.book as book_mod
from pyattn.paged.book import AppendPlan, OutOfPagesError, PageBook


@contextmanager
def fast(on: bool):
    """Run with plan_append's fast path on or off, counting the fast path's calls."""
    calls = []
    orig_flag, orig_small = book_mod._FAST_APPEND, PageBook._append_small

    def spy(self, seqs, counts):
        calls.append(len(seqs))
        return orig_small(self, seqs, counts)

    book_mod._FAST_APPEND, PageBook._append_small = on, spy
    try:
        yield calls
    finally:
        book_mod._FAST_APPEND, PageBook._append_small = orig_flag, orig_small


def state(book):
    """Everything plan_append may change, exactly (the free list in order)."""
    ids = book.seq_ids
    seqs = {s: (book.pages(s).tolist(), book.length(s)) for s in ids}
    csr = [a.tolist() for a in book.csr(ids)]
    table = [a.tolist() for a in book.block_table(ids)]
    return book.refcount.tolist(), list(book._free), seqs, csr, table, book.version, book._next_id


def same_plan(a: AppendPlan, b: AppendPlan):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == np.int32 and x.ndim == y.ndim == 1
        assert x.tolist() == y.tolist()


def fast_eligible(book, ids, counts) -> bool:
    return (type(counts) in (list, tuple) and len(counts) == len(ids)
            and all(type(c) is int and 0 <= c <= book.page_size for c in counts))


def append_both(fast_book, slow_book, ids, counts):
    """plan_append on both books; the same plan or the same error, and the same books after."""
    results = []
    for book, on in ((fast_book, True), (slow_book, False)):
        before = state(book)
        with fast(on) as calls:
            try:
                results.append(book.plan_append(ids, counts))
            except (OutOfPagesError, TypeError, ValueError) as e:
                results.append(e)
                assert state(book) == before, f"a failed append changed the book ({type(e).__name__})"
        if on:
            ran_fast = bool(calls)
        else:
            assert not calls
    got, want = results
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
        if isinstance(want, OutOfPagesError):  # raised by the fast path itself when the counts qualify
            assert (got.needed, got.free) == (want.needed, want.free)
            assert ran_fast == fast_eligible(fast_book, ids, counts)
    else:
        same_plan(got, want)
        # the fast path runs exactly when the counts qualify (ids valid: the call succeeded)
        assert ran_fast == fast_eligible(fast_book, ids, counts)
    assert state(fast_book) == state(slow_book)
    fast_book.check()
    slow_book.check()
    return got


class Pair(RuleBasedStateMachine):
    """The same random operations on two books: fast path on, fast path off."""

    NUM_PAGES = st.integers(1, 40)
    PAGE_SIZE = st.sampled_from([1, 2, 3, 4, 8, 16])

    @initialize(data=st.data())
    def init(self, data):
        n, ps = data.draw(self.NUM_PAGES), data.draw(self.PAGE_SIZE)
        self.a, self.b = PageBook(n, ps), PageBook(n, ps)
        self.ps = ps

    def both(self, name, *args):
        ra, rb = getattr(self.a, name)(*args), getattr(self.b, name)(*args)
        assert ra == rb
        return ra

    def live(self):
        return sorted(self.a.seq_ids)

    def counts(self, data, n):
        ps = self.ps
        kind = data.draw(st.sampled_from(["ones", "ones", "ones", "small", "zeros", "mixed", "big", "tuple",
                                          "numpy"]))
        if kind == "ones":
            return [1] * n
        if kind == "zeros":
            return [0] * n
        if kind == "small":
            return [data.draw(st.integers(0, ps)) for _ in range(n)]
        if kind == "tuple":
            return tuple(data.draw(st.integers(0, ps)) for _ in range(n))
        if kind == "numpy":  # NumPy ints: the general path on both books
            return [np.int64(data.draw(st.integers(0, ps))) for _ in range(n)]
        if kind == "mixed":  # decode tokens and a prefill chunk or two, up to past a page
            return [data.draw(st.sampled_from([0, 1, 1, 1, ps - 1, ps, ps + 1, 2 * ps + 3])) for _ in range(n)]
        return [data.draw(st.integers(0, 3 * ps + 2)) for _ in range(n)]

    @rule(data=st.data())
    def add_sequence(self, data):
        sid = self.both("add_sequence")
        if data.draw(st.booleans()):  # a prompt
            append_both(self.a, self.b, [sid], [data.draw(st.integers(0, 3 * self.ps + 2))])

    @precondition(lambda self: self.a.seq_ids)
    @rule(data=st.data())
    def append(self, data):
        live = self.live()
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=8, unique=True))
        if data.draw(st.integers(0, 3)) == 0:  # all live sequences: the decode step
            ids = data.draw(st.permutations(live))
        append_both(self.a, self.b, ids, self.counts(data, len(ids)))

    @precondition(lambda self: self.a.seq_ids)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(self.live()))
        length = data.draw(st.none() | st.integers(0, self.a.length(src)))
        sid = self.both("fork", src) if length is None else self.both("fork", src, length)
        if data.draw(st.booleans()):  # parent and child (and maybe others) write at once
            ids = data.draw(st.permutations([src, sid]))
            append_both(self.a, self.b, ids, self.counts(data, 2))

    @precondition(lambda self: self.a.seq_ids)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        self.both("truncate", sid, data.draw(st.integers(0, self.a.length(sid))))

    @precondition(lambda self: self.a.seq_ids)
    @rule(data=st.data())
    def free(self, data):
        self.both("free", data.draw(st.sampled_from(self.live())))

    @precondition(lambda self: self.a.seq_ids)
    @rule(data=st.data())
    def invalid_append(self, data):
        """Rejected calls: the same error from both paths, nothing changed (append_both checks)."""
        live = self.live()
        sid = data.draw(st.sampled_from(live))
        dead = self.a._next_id  # not handed out yet
        ids, counts = data.draw(st.sampled_from([
            ([sid, sid], [1, 1]),
            ([sid, dead], [1, 1]),
            ([dead, sid], [1, 1]),
            ([sid], [-1]),
            ([sid], [1, 1]),
            ([sid], []),
            ([sid], [True]),
            ([sid], [np.bool_(True)]),
            ([sid], [1.0]),
            ([sid], ["1"]),
            ([sid], [None]),
            ([True], [1]),
            ([np.bool_(False)], [1]),
            (live, [1] * (len(live) - 1) + [-1]),
            (live, [1] * (len(live) - 1) + [True]),
        ]))
        append_both(self.a, self.b, ids, counts)

    @invariant()
    def same(self):
        if hasattr(self, "a"):
            assert state(self.a) == state(self.b)


Pair.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                  report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])
TestPair = Pair.TestCase


@pytest.mark.parametrize("page_size, num_pages", [(1, 300), (2, 200), (16, 60), (16, 400), (256, 40)])
@pytest.mark.parametrize("seed", range(3))
def test_random_decode_loop_matches_general_path(page_size, num_pages, seed):
    """A serving loop at scale (tens of sequences, beams forked at random lengths, counts all 1
    most steps, prefill chunks and rollbacks between), run to out of pages and beyond."""
    rng = random.Random(seed * 1000 + page_size)
    a, b = PageBook(num_pages, page_size), PageBook(num_pages, page_size)
    fast_calls = 0
    for step in range(300):
        live = a.seq_ids
        r = rng.random()
        if r < 0.08 or not live:
            sid = a.add_sequence()
            assert b.add_sequence() == sid
            append_both(a, b, [sid], [rng.randrange(0, 4 * page_size)])
        elif r < 0.16:
            src = rng.choice(live)
            n = rng.randrange(0, a.length(src) + 1)
            assert a.fork(src, n) == b.fork(src, n)
        elif r < 0.2:
            sid = rng.choice(live)
            n = rng.randrange(0, a.length(sid) + 1)
            a.truncate(sid, n)
            b.truncate(sid, n)
        elif r < 0.25:
            sid = rng.choice(live)
            a.free(sid)
            b.free(sid)
        else:
            ids = rng.sample(live, rng.randrange(1, len(live) + 1))
            if rng.random() < 0.7:
                counts = [1] * len(ids)
            else:
                counts = [rng.choice([0, 1, 1, 2, page_size, page_size + 1]) for _ in ids]
            append_both(a, b, ids, counts)
            fast_calls += fast_eligible(a, ids, counts)
        assert state(a) == state(b)
    assert fast_calls > 50


# -- deterministic cases on the fast path ---------------------------------------------------------
def pair(num_pages, page_size, prompts):
    books = PageBook(num_pages, page_size), PageBook(num_pages, page_size)
    for bk in books:
        ids = [bk.add_sequence() for _ in prompts]
        with fast(False):
            bk.plan_append(ids, list(prompts))
    return books, ids


def test_decode_step_plan():
    (a, b), ids = pair(64, 4, [3, 4, 0, 6])  # pages [0], [1], [], [2, 3]
    plan = append_both(a, b, ids, [1, 1, 1, 1])
    assert plan.dst.tolist() == [3, 16, 20, 14] and plan.copy_src.size == plan.copy_dst.size == 0
    assert a.lengths(ids).tolist() == [4, 5, 1, 7] and a.pages(ids[1]).tolist() == [1, 4]


def test_cow_on_fast_path_orphans_and_order():
    (a, b), ids = pair(16, 4, [2])
    for bk in (a, b):
        c, k = bk.fork(ids[0]), bk.fork(ids[0])
    plan = append_both(a, b, [c, ids[0], k], [1, 1, 1])   # all three sharers copy away: page 0 freed
    assert plan.copy_src.tolist() == [0, 1] * 3
    assert plan.copy_dst.tolist() == [4, 5, 8, 9, 12, 13] and plan.dst.tolist() == [6, 10, 14]
    assert a.refcount[0] == 0 and a._free[-1] == 0
    # The orphaned page 0 went back on top of the free list after that call: taken first now.
    plan = append_both(a, b, [k, c], [4, 2])               # both spill into a new page, in order
    assert plan.dst.tolist() == [15, 0, 1, 2, 7, 16] and plan.copy_src.size == 0
    assert a.pages(k).tolist() == [3, 0] and a.pages(c).tolist() == [1, 4]


def test_cow_with_spill_into_new_page():
    (a, b), ids = pair(16, 4, [3])
    for bk in (a, b):
        c = bk.fork(ids[0])
    plan = append_both(a, b, [c], [3])                     # copy page 0 -> 1, then new page 2
    assert plan.copy_src.tolist() == [0, 1, 2] and plan.copy_dst.tolist() == [4, 5, 6]
    assert plan.dst.tolist() == [7, 8, 9] and a.pages(c).tolist() == [1, 2]


def test_out_of_pages_on_fast_path_changes_nothing():
    (a, b), ids = pair(4, 4, [4, 2])                       # pages [0], [1]
    for bk in (a, b):
        f = bk.fork(ids[1])                                # shares page 1, partly filled
        bk.plan_append([bk.add_sequence()], [1])           # page 2; one page left
    before = state(a)
    # ids[0] needs a new page, f a copy of page 1: 2 needed, 1 free
    with fast(True) as calls, pytest.raises(OutOfPagesError, match="appending 2 token") as ei:
        a.plan_append([ids[0], f], [1, 1])
    assert calls and (ei.value.needed, ei.value.free) == (2, 1) and state(a) == before
    append_both(a, b, [ids[0], f], [1, 1])
    append_both(a, b, [f, ids[1]], [1, 1])                 # f copies (the last page), ids[1] writes in place


def test_errors_on_fast_path_change_nothing():
    (a, b), ids = pair(8, 4, [1, 2])
    before = state(a)
    with fast(True) as calls:
        with pytest.raises(ValueError, match="distinct"):
            a.plan_append([ids[0], ids[0]], [1, 1])
        with pytest.raises(ValueError, match="no live sequence 99"):
            a.plan_append([ids[0], 99], [1, 1])
        with pytest.raises(TypeError, match="^seq_ids: expected an int sequence id, got True"):
            a.plan_append([True], [1])
        with pytest.raises(TypeError, match="^counts: expected ints"):
            a.plan_append(ids, [1, True])
        with pytest.raises(TypeError, match="^counts: expected ints"):
            a.plan_append(ids, [1, np.bool_(True)])
        with pytest.raises(ValueError, match="counts: expected 2 non-negative"):
            a.plan_append(ids, [1, -1])
        with pytest.raises(ValueError, match="counts: expected 2 non-negative"):
            a.plan_append(ids, [1])
    assert not calls and state(a) == before


@pytest.mark.parametrize("make, is_fast", [
    (lambda: [5, 1], False),                  # past a page
    (lambda: [np.int64(1), 1], False),        # a NumPy int
    (lambda: (1, np.int32(2)), False),
    (lambda: iter([1, 1]), False),            # not a list or tuple
    (lambda: np.array([1, 1]), False),
    (lambda: [Color.ONE, 1], False),          # an int subclass
    (lambda: [0, 4], True),
    (lambda: (2, 1), True),
])
def test_which_path(make, is_fast):
    (a, b), ids = pair(32, 4, [1, 2])
    got = []
    for bk, on in ((a, True), (b, False)):
        with fast(on) as calls:
            try:
                got.append(bk.plan_append(ids, make()))
            except ValueError as e:  # an iterator: the general path's type check uses it up
                got.append((type(e), str(e)))
        if on:
            assert bool(calls) == is_fast
    if isinstance(got[1], AppendPlan):
        same_plan(*got)
    else:
        assert got[0] == got[1]
    assert state(a) == state(b)


def test_empty_call():
    (a, b), _ = pair(8, 4, [1])
    for bk, on in ((a, True), (b, False)):
        with fast(on):
            plan = bk.plan_append([], [])
        assert all(x.dtype == np.int32 and x.shape == (0,) for x in plan)
    assert state(a) == state(b)
    append_both(a, b, a.seq_ids, [0])


# -- seq_list -------------------------------------------------------------------------------------
def seq_list_reference(book, seq_ids, name="seq_ids"):
    """seq_list as it was before the fast lookup (an unhashable id named as the argument since:
    it used to be a bare ``TypeError: unhashable type``, found by tests/test_append_validation.py)."""
    ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
    try:
        distinct = len(set(ids)) == len(ids)
    except TypeError:
        raise TypeError(f"{name}: expected int sequence ids, got {ids!r}") from None
    if not distinct:
        raise ValueError(f"{name}: expected distinct sequence ids, got {ids}")
    return [book._seq(i, name) for i in ids]


class Color(enum.IntEnum):
    ONE = 1


class MyBool(np.bool_):
    pass


def outcome(f):
    try:
        return [id(s) for s in f()]
    except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
        return type(e), str(e)


def test_seq_list_matches_reference():
    book = PageBook(8, 4)
    for _ in range(4):
        book.add_sequence()
    book.free(2)
    rng = random.Random(0)
    atoms = [0, 1, 2, 3, 5, -1, True, False, np.bool_(True), np.int64(3), np.int32(0), np.uint8(1),
             np.uint64(3), 1.0, 3.5, "1", None, Color.ONE, (1,)]
    cases = [0, 3, np.int64(1), 2, True, np.bool_(False), [], (0, 1), np.array([3, 0]), np.array([True]),
             [[1]], "01", range(2)]
    cases += [[rng.choice(atoms) for _ in range(rng.randrange(1, 5))] for _ in range(400)]
    try:
        cases.append([MyBool(True)])
    except TypeError:  # a NumPy whose bool_ cannot be subclassed
        pass
    for ids in cases:
        for name in ("seq_ids", "ids"):
            assert outcome(lambda: book.seq_list(ids, name)) == outcome(lambda: seq_list_reference(book, ids, name)), ids

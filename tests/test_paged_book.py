"""CPU tests of :class:`pyattn.paged.book.PageBook`: a hypothesis state machine checked against a
simple model (token lists plus a simulated slot memory updated from each AppendPlan the way the
GPU kernel would), and deterministic tests of out-of-pages atomicity, copy-on-write, the page
table exports, argument validation and sequence-id reuse.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pyattn.paged.book import OutOfPagesError, PageBook


def snapshot(book):
    seqs = {s: (book.pages(s).tolist(), book.length(s)) for s in book.seq_ids}
    return book.refcount.tolist(), list(book._free), seqs, book.version, book._next_id


def cdiv(a, b):
    return -(-a // b)


def check_plan(plan, n_tokens):
    """The plan's promise: int32 slots, no slot written twice, no slot both written and read."""
    for arr in plan:
        assert arr.dtype == np.int32 and arr.ndim == 1
    assert len(plan.dst) == n_tokens and len(plan.copy_src) == len(plan.copy_dst)
    written = plan.dst.tolist() + plan.copy_dst.tolist()
    assert len(set(written)) == len(written), "a slot is written twice in one call"
    assert not set(written) & set(plan.copy_src.tolist()), "a slot is both read and written"


class BookMachine(RuleBasedStateMachine):
    NUM_PAGES = st.integers(1, 24)
    PAGE_SIZE = st.integers(1, 8)

    @initialize(data=st.data())
    def init(self, data):
        self.book = PageBook(data.draw(self.NUM_PAGES), data.draw(self.PAGE_SIZE))
        self.ps = self.book.page_size
        self.model = {}   # seq id -> list of token ids
        self.mem = {}     # slot -> token id, the simulated KV memory
        self.ever = []    # every id handed out, in order
        self.next_tok = 0

    def new_id(self, sid):
        assert sid not in self.ever and all(sid > s for s in self.ever), "sequence id reused"
        self.ever.append(sid)

    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.model)))

    def counts(self, data, n):
        big = data.draw(st.integers(0, 7)) == 0  # mostly small counts; at times past the whole cache
        return [data.draw(st.integers(0, self.book.num_pages * self.ps if big else 2 * self.ps + 1))
                for _ in range(n)]

    @rule(data=st.data())
    def add_sequence(self, data):
        sid = self.book.add_sequence()
        self.new_id(sid)
        self.model[sid] = []
        self.do_append([sid], self.counts(data, 1))   # the prompt (may not fit)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append(self, data):
        live = sorted(self.model)
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
        ps, pages = self.ps, {s: self.book.pages(s).tolist() for s in live}
        shared = [pages[s][-1] for s in live if len(self.model[s]) % ps and self.book.refcount[pages[s][-1]] > 1]
        if shared and data.draw(st.booleans()):  # sharers of a partly filled page: COW copies meet
            page = data.draw(st.sampled_from(shared))
            ids = [s for s in live if page in pages[s]][:data.draw(st.integers(1, 4))] + ids
            ids = data.draw(st.permutations(list(dict.fromkeys(ids))))
        self.do_append(ids, self.counts(data, len(ids)))

    def do_append(self, ids, counts):
        ps, book = self.ps, self.book
        # Independent expectation: new pages plus one copy per write into a shared, partly filled page.
        refs = Counter(p for s in book.seq_ids for p in book.pages(s).tolist())
        cow = [c > 0 and len(self.model[s]) % ps != 0 and refs[book.pages(s)[-1]] > 1
               for s, c in zip(ids, counts)]
        need = sum(cdiv(len(self.model[s]) + c, ps) - cdiv(len(self.model[s]), ps) + w
                   for s, c, w in zip(ids, counts, cow))
        before = snapshot(book)
        free = book.num_free
        try:
            plan = book.plan_append(ids, counts)
        except OutOfPagesError as e:
            assert need > free and (e.needed, e.free) == (need, free)
            assert snapshot(book) == before, "failed append changed the book"
            return
        assert need <= free, "append succeeded although the pages did not suffice"
        assert book.version == before[3] + 1 and book.num_free <= free
        check_plan(plan, sum(counts))
        n_copy = sum(len(self.model[s]) % ps for s, w in zip(ids, cow) if w)
        assert len(plan.copy_src) == n_copy
        # Apply like the kernel: every copy reads the memory as it was before the call, then writes.
        old = [self.mem[s] for s in plan.copy_src.tolist()]
        self.mem.update(zip(plan.copy_dst.tolist(), old))
        dst = iter(plan.dst.tolist())
        for s, c in zip(ids, counts):
            for _ in range(c):
                self.mem[next(dst)] = self.next_tok
                self.model[s].append(self.next_tok)
                self.next_tok += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        src = self.pick(data)
        length = data.draw(st.none() | st.integers(0, len(self.model[src])))
        sid = self.book.fork(src) if length is None else self.book.fork(src, length)
        self.new_id(sid)
        self.model[sid] = list(self.model[src][:length])
        if data.draw(st.booleans()):  # a beam-search step: parent and child both write at once
            ids = data.draw(st.permutations([src, sid]))
            self.do_append(ids, self.counts(data, 2))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        sid = self.pick(data)
        length = data.draw(st.integers(0, len(self.model[sid])))
        self.book.truncate(sid, length)
        del self.model[sid][length:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = self.pick(data)
        self.book.free(sid)
        del self.model[sid]
        with pytest.raises(ValueError, match="seq_id"):
            self.book.length(sid)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def invalid_call(self, data):
        """Rejected calls leave the book exactly as it was."""
        sid = self.pick(data)
        n = len(self.model[sid])
        before = snapshot(self.book)
        with pytest.raises((ValueError, TypeError)):
            data.draw(st.sampled_from([
                lambda: self.book.plan_append([sid, sid], [1, 1]),
                lambda: self.book.plan_append([sid], [-1]),
                lambda: self.book.plan_append([sid], [1, 1]),
                lambda: self.book.plan_append([sid, max(self.ever) + 1], [1, 1]),
                lambda: self.book.truncate(sid, n + 1),
                lambda: self.book.fork(sid, -1),
                lambda: self.book.fork(sid, 1.0),
            ]))()
        assert snapshot(self.book) == before

    @invariant()
    def consistent(self):
        book, ps = self.book, self.ps
        book.check()
        assert sorted(book.seq_ids) == sorted(self.model)
        assert (book.refcount >= 0).all()
        used = set()
        for sid, toks in self.model.items():
            pages = book.pages(sid)
            assert book.length(sid) == len(toks) and len(pages) == cdiv(len(toks), ps)
            got = [self.mem.get(int(pages[t // ps]) * ps + t % ps) for t in range(len(toks))]
            assert got == toks, f"sequence {sid} lost its data"
            used.update(pages.tolist())
        assert book.num_free + len(used) == book.num_pages
        ids = sorted(self.model, reverse=True)
        indptr, indices, last = book.csr(ids)
        table, lengths = book.block_table(ids)
        for i, sid in enumerate(ids):
            pages, n = book.pages(sid), len(self.model[sid])
            assert indices[indptr[i]:indptr[i + 1]].tolist() == pages.tolist()
            assert last[i] == (n - (len(pages) - 1) * ps if n else 0)
            assert table[i, :len(pages)].tolist() == pages.tolist() and (table[i, len(pages):] == -1).all()
            assert lengths[i] == n

    def teardown(self):
        if not hasattr(self, "book"):
            return
        for sid in list(self.model):
            self.book.free(sid)
        self.book.check()
        assert self.book.num_free == self.book.num_pages and not self.book.refcount.any()
        assert sorted(self.book._free) == list(range(self.book.num_pages))


# report_multiple_bugs=False: on a failure, shrink one bug only (a broken book breaks many steps).
BookMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                         report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])
TestBookMachine = BookMachine.TestCase


@pytest.mark.parametrize("page_size", [16, 100, 256])
def test_state_machine_large_pages(page_size):
    machine = type(f"BookMachine{page_size}", (BookMachine,), {"PAGE_SIZE": st.just(page_size)})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=30, stateful_step_count=25, deadline=None, report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck)))


# -- out of pages ---------------------------------------------------------------------------------
def test_out_of_pages_is_atomic():
    b = PageBook(4, 4)
    a = b.add_sequence()
    b.plan_append([a], [6])            # pages 0, 1 (2 tokens in page 1)
    c = b.fork(a)                      # shares both pages
    d = b.add_sequence()
    before = snapshot(b)
    # a: copy of page 1 + one new page; d: two new pages -> 4 needed, 2 free.
    with pytest.raises(OutOfPagesError, match="needs 4 new page") as ei:
        b.plan_append([a, d], [3, 5])
    assert (ei.value.needed, ei.value.free) == (4, 2)
    assert snapshot(b) == before
    with pytest.raises(OutOfPagesError) as ei:   # the failing sequence first, too
        b.plan_append([d, c], [5, 1])
    assert (ei.value.needed, ei.value.free) == (3, 2) and snapshot(b) == before
    plan = b.plan_append([a, d], [2, 4])         # exactly fits: one copy + one new page
    assert b.num_free == 0 and len(plan.copy_src) == 2
    b.check()
    before = snapshot(b)
    with pytest.raises(OutOfPagesError) as ei:
        b.plan_append([d], [1])
    assert (ei.value.needed, ei.value.free) == (1, 0) and snapshot(b) == before
    assert b.plan_append([c], [2]).dst.tolist() == [6, 7]   # fits in c's now private page 1
    assert len(b.plan_append([d, a], [0, 0]).dst) == 0      # zero counts never need pages
    b.check()


# -- copy-on-write --------------------------------------------------------------------------------
def book_with(ps, n, num_pages=16):
    b = PageBook(num_pages, ps)
    s = b.add_sequence()
    b.plan_append([s], [n])
    return b, s


def test_cow_fork_then_append_copies_partial_last_page():
    b, p = book_with(4, 6)                       # pages [0, 1], 2 tokens in page 1
    c = b.fork(p)
    plan = b.plan_append([c], [1])
    assert plan.copy_src.tolist() == [4, 5] and plan.copy_dst.tolist() == [8, 9]
    assert plan.dst.tolist() == [10]
    assert b.pages(c).tolist() == [0, 2] and b.pages(p).tolist() == [0, 1]
    assert b.refcount[:3].tolist() == [2, 1, 1]
    plan = b.plan_append([p], [3])               # parent's page 1 is private now
    assert len(plan.copy_src) == 0 and plan.dst.tolist() == [6, 7, 12]
    b.check()


def test_cow_not_needed_at_page_boundary():
    b, p = book_with(4, 8)
    c = b.fork(p)
    plan = b.plan_append([c], [1])
    assert len(plan.copy_src) == 0 and plan.dst.tolist() == [8]
    c2 = b.fork(p, 4)                             # a prefix ending on a page boundary
    plan = b.plan_append([c2], [2])
    assert len(plan.copy_src) == 0 and plan.dst.tolist() == [12, 13]
    assert b.pages(c2).tolist() == [0, 3] and b.refcount[0] == 3
    b.check()


def test_cow_after_truncate_into_shared_page():
    b, p = book_with(4, 8)                        # pages [0, 1], both full
    c = b.fork(p)
    b.truncate(c, 5)                              # c's last page 1 now partly filled, still shared
    assert b.refcount[1] == 2
    plan = b.plan_append([c], [1])
    assert plan.copy_src.tolist() == [4] and plan.copy_dst.tolist() == [8] and plan.dst.tolist() == [9]
    b.truncate(p, 6)
    assert len(b.plan_append([p], [1]).copy_src) == 0     # page 1 is private to p again
    c2 = b.fork(p, 3)
    b.truncate(p, 4)                              # p keeps page 0 (full): no copy for p
    assert len(b.plan_append([p], [1]).copy_src) == 0
    assert b.plan_append([c2], [1]).copy_src.tolist() == [0, 1, 2]
    b.check()


def test_no_cow_for_private_sequence():
    b, s = book_with(4, 3)
    plan = b.plan_append([s], [3])
    assert plan.dst.tolist() == [3, 4, 5] and plan.copy_src.size == plan.copy_dst.size == 0
    assert plan.copy_src.dtype == np.int32


def test_orphaned_page_is_freed_after_the_call():
    b, p = book_with(4, 2, num_pages=4)           # page 0, 2 tokens
    c = b.fork(p)
    e = b.add_sequence()
    plan = b.plan_append([p, c, e], [1, 1, 4])    # both sharers copy away from page 0
    check_plan(plan, 6)
    assert plan.copy_src.tolist() == [0, 1, 0, 1] and 0 not in b.pages(e).tolist()
    assert plan.dst.tolist() == [6, 10, 12, 13, 14, 15]
    assert b._free == [0] and b.refcount[0] == 0
    b.check()


def test_cow_parent_and_child_in_one_call_and_third_sharer():
    b, p = book_with(4, 2)
    c, k = b.fork(p), b.fork(p)
    plan = b.plan_append([c, p], [1, 2])
    assert plan.copy_src.tolist() == [0, 1, 0, 1] and plan.copy_dst.tolist() == [4, 5, 8, 9]
    assert plan.dst.tolist() == [6, 10, 11]
    assert b.pages(k).tolist() == [0] and b.refcount[0] == 1   # the third sharer keeps page 0
    assert b.plan_append([k], [1]).dst.tolist() == [2]          # ... and writes it in place
    b.check()


# -- exports --------------------------------------------------------------------------------------
def test_csr_and_block_table():
    b = PageBook(16, 4)
    ids = [b.add_sequence() for _ in range(4)]
    b.plan_append(ids, [5, 0, 4, 9])
    f = b.fork(ids[3], 6)
    order = [f, ids[1], ids[3], ids[0], ids[2]]
    indptr, indices, last = b.csr(order)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    assert indptr.tolist() == [0, 2, 2, 5, 7, 8]
    assert last.tolist() == [2, 0, 1, 1, 4]
    for i, s in enumerate(order):
        assert indices[indptr[i]:indptr[i + 1]].tolist() == b.pages(s).tolist()
    table, lengths = b.block_table(order, pad=-7)
    assert table.dtype == lengths.dtype == np.int32 and table.shape == (5, 3)
    assert lengths.tolist() == [6, 0, 9, 5, 4] == b.lengths(order).tolist()
    for i, s in enumerate(order):
        pages = b.pages(s).tolist()
        assert table[i].tolist() == pages + [-7] * (3 - len(pages))
    ip, ix, la = b.csr([])
    assert ip.tolist() == [0] and ix.size == la.size == 0 and ip.dtype == ix.dtype == np.int32
    t, ln = b.block_table([ids[1]])
    assert t.shape == (1, 0) and ln.tolist() == [0]
    with pytest.raises(ValueError, match="seq_ids"):
        b.csr([f, f])
    with pytest.raises(ValueError, match="seq_ids"):
        b.block_table([f, 99])


# -- validation and ids ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_pages, page_size, exc, name", [
    (4, 0, ValueError, "page_size"), (4, 257, ValueError, "page_size"), (4, -1, ValueError, "page_size"),
    (4, 2.0, TypeError, "page_size"), (4, True, TypeError, "page_size"), (4, "8", TypeError, "page_size"),
    (0, 4, ValueError, "num_pages"), (-3, 4, ValueError, "num_pages"), (2**23, 256, ValueError, "num_pages"),
    (2**31, 1, ValueError, "num_pages"), (4.0, 4, TypeError, "num_pages"), (np.bool_(1), 4, TypeError, "num_pages"),
])
def test_constructor_validation(num_pages, page_size, exc, name):
    with pytest.raises(exc, match=name):
        PageBook(num_pages, page_size)


def test_constructor_slot_limit_with_numpy_int32():
    with pytest.raises(ValueError, match="num_pages"):
        PageBook(np.int32(2**23), 256)


def test_constructor_accepts_numpy_ints_and_limits():
    b = PageBook(np.int64(3), np.int32(256))
    assert (b.num_pages, b.page_size, b.num_free) == (3, 256, 3) and type(b.page_size) is int
    assert PageBook(1, 1).num_free == 1


def test_call_validation():
    b, s = book_with(4, 5)
    dead = b.add_sequence()
    b.free(dead)
    before = snapshot(b)
    cases = [(ValueError, "seq_id", f) for f in (
        lambda: b.length(dead), lambda: b.pages(123), lambda: b.free(dead), lambda: b.fork(dead),
        lambda: b.truncate(dead, 0), lambda: b.plan_append([s, dead], [1, 1]), lambda: b.csr([dead]))]
    cases += [(ValueError, "seq_ids.*distinct", lambda: b.plan_append([s, s], [1, 1]))]
    cases += [(ValueError, "counts", lambda c=c: b.plan_append([s], c)) for c in ([-1], [1, 2], [])]
    cases += [(ValueError, "length", lambda n=n, f=f: f(s, n)) for n in (-1, 6) for f in (b.truncate, b.fork)]
    cases += [(TypeError, "length", lambda n=n, f=f: f(s, n))
              for n in (2.0, "3", True, None, np.float64(1), np.bool_(0)) for f in (b.truncate, b.fork)
              if not (n is None and f == b.fork)]   # fork(s, None) means the whole sequence
    for exc, name, call in cases:
        with pytest.raises(exc, match=name):
            call()
    assert snapshot(b) == before
    b.truncate(s, np.int64(5))
    assert b.length(s) == 5 and b.length(b.fork(s, np.int32(5))) == 5


def test_sequence_ids_never_reused():
    b = PageBook(8, 2)
    seen = []
    for _ in range(3):
        a = b.add_sequence()
        b.plan_append([a], [3])
        f = b.fork(a, 1)
        seen += [a, f]
        b.free(a)
        b.free(f)
    assert seen == sorted(set(seen)) and b.seq_ids == [] and b.num_free == 8
    assert b.add_sequence() > max(seen)


def test_bool_ids_and_non_int_counts_are_rejected():
    book = PageBook(4, 4)
    sid = book.add_sequence()
    book.add_sequence()
    with pytest.raises(TypeError, match="^seq_id: expected an int"):
        book.length(True)
    with pytest.raises(TypeError, match="^counts: expected ints"):
        book.plan_append([sid], [2.9])
    with pytest.raises(TypeError, match="^counts: expected ints"):
        book.plan_append([sid], ["3"])
    assert book.length(sid) == 0 and book.num_free == 4


def test_longest_first_orders_a_ragged_batch_only():
    """A decode's blocks start longest sequence first (a stable order), and an even batch keeps its
    own order (no table at all, so its kernel runs as before)."""
    from pyattn.paged.book import longest_first

    assert longest_first(np.array([5, 5, 5], np.int32)) is None
    assert longest_first(np.array([7], np.int32)) is None
    order = longest_first(np.array([3, 9, 1, 9, 4], np.int32))
    assert order.dtype == np.int32 and order.tolist() == [1, 3, 4, 0, 2]

"""CPU tests of :class:`pyattn.paged.book.PageBook`: a hypothesis state machine checked against a
simple model (token lists plus a simulated slot memory updated from each AppendPlan the way the
GPU kernel would), with small and large pages. Deterministic tests of out-of-pages atomicity,
copy-on-write and the page table exports are in test_paged_book_pages.py; argument validation and
sequence-id reuse in test_paged_book_args.py. test_serving.py extends ``BookMachine``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from _book_helpers import check_plan, snapshot
from pyattn.paged.book import OutOfPagesError, PageBook


def cdiv(a, b):
    return -(-a // b)


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

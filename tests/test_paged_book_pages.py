"""Deterministic CPU tests of :class:`pyattn.paged.book.PageBook`'s pages: out-of-pages atomicity,
copy-on-write (forks, truncations, sharers writing in one call, orphaned pages), the CSR and block
table exports, and the longest-first decode order. The state machine is in test_paged_book.py."""

from __future__ import annotations

import numpy as np
import pytest

from _book_helpers import book_with, check_plan, snapshot
from pyattn.paged.book import OutOfPagesError, PageBook


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


# -- decode order ---------------------------------------------------------------------------------
def test_longest_first_orders_a_ragged_batch_only():
    """A decode's blocks start longest sequence first (a stable order), and an even batch keeps its
    own order (no table at all, so its kernel runs as before)."""
    from pyattn.paged.book import longest_first

    assert longest_first(np.array([5, 5, 5], np.int32)) is None
    assert longest_first(np.array([7], np.int32)) is None
    order = longest_first(np.array([3, 9, 1, 9, 4], np.int32))
    assert order.dtype == np.int32 and order.tolist() == [1, 3, 4, 0, 2]

"""Shared helpers of the :class:`pyattn.paged.book.PageBook` tests (test_paged_book.py,
test_paged_book_pages.py, test_paged_book_args.py; test_serving.py's accept machine): a book's full
state, an AppendPlan's promise, and a book holding one sequence."""

from __future__ import annotations

import numpy as np

from pyattn.paged.book import PageBook


def snapshot(book):
    seqs = {s: (book.pages(s).tolist(), book.length(s)) for s in book.seq_ids}
    return book.refcount.tolist(), list(book._free), seqs, book.version, book._next_id


def check_plan(plan, n_tokens):
    """The plan's promise: int32 slots, no slot written twice, no slot both written and read."""
    for arr in plan:
        assert arr.dtype == np.int32 and arr.ndim == 1
    assert len(plan.dst) == n_tokens and len(plan.copy_src) == len(plan.copy_dst)
    written = plan.dst.tolist() + plan.copy_dst.tolist()
    assert len(set(written)) == len(written), "a slot is written twice in one call"
    assert not set(written) & set(plan.copy_src.tolist()), "a slot is both read and written"


def book_with(ps, n, num_pages=16):
    b = PageBook(num_pages, ps)
    s = b.add_sequence()
    b.plan_append([s], [n])
    return b, s

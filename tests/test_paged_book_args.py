"""Deterministic CPU tests of :class:`pyattn.paged.book.PageBook`'s arguments and ids: constructor
and call validation (rejected calls leave the book unchanged) and sequence ids that are never
reused. The state machine is in test_paged_book.py."""

from __future__ import annotations

import numpy as np
import pytest

from _book_helpers import book_with, snapshot
from pyattn.paged.book import PageBook


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

"""The decode's page table kept current by one-token appends (pyattn.paged.decode_table), on the
fake driver: after any mix of serving operations, what the device holds (the host mirror, patched
with the same arrays the append hands its kernel) is what the book says, and a serving loop's
decode steps neither rebuild nor upload the table; the appends' items go through the cache's
mailbox (pyattn.runtime.mailbox), whose slots are reused only after their readers' events."""

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from pyattn.paged import cache as cache_mod

PS = 4  # small pages: appends cross page boundaries often


@pytest.fixture
def gpu(monkeypatch):
    with fake_driver.installed(monkeypatch) as fake:
        yield fake


def _agrees_with_book(c, ids) -> None:
    t = c._dtab
    n = len(ids)
    assert t.ids == tuple(ids)
    lens = t.host[:n]
    table = t.host[t._pages_at:].reshape(n, t.cap)
    for b, sid in enumerate(ids):
        assert lens[b] == c.book.length(sid)
        pages = c.book.pages(sid)
        assert table[b, :len(pages)].tolist() == pages.tolist()
    assert t.span == (int(lens.max(initial=0)), int(lens.sum()))


def _q(n):
    return pyattn.empty((n, 1, 4, 32), ml_dtypes.bfloat16)


def _kv(n, t=1):
    return pyattn.empty((n, t, 2, 32), ml_dtypes.bfloat16)


@pytest.mark.parametrize("seed", range(12))
def test_the_patched_table_is_the_books_after_random_serving_steps(gpu, monkeypatch, seed):
    rng = np.random.default_rng(seed)
    c = pyattn.PagedKVCache(4096, PS, 2, 32, "bfloat16")
    ids = [c.add_sequence() for _ in range(int(rng.integers(1, 6)))]
    for sid in ids:
        n = int(rng.integers(0, 9))
        if n:
            c.append([sid], _kv(1, n), _kv(1, n))
    posted = []  # what each append handed its kernels through the cache's mailbox
    box = c._appender.box()
    take = box.take
    monkeypatch.setattr(box, "take", lambda n: posted.append(take(n)) or posted[-1])
    for _ in range(40):
        op = rng.random()
        if op < 0.55:  # the loop's step: one token to every sequence, or to some (counts 0 / 1)
            counts = [1] * len(ids) if rng.random() < 0.6 else [int(x) for x in rng.integers(0, 2, len(ids))]
            if rng.random() < 0.1:
                counts = [0] * len(ids)  # a step where no sequence gets a token
            before = c._dtab
            posted.clear()
            if all(counts):
                c.append(ids, _kv(len(ids)), _kv(len(ids)))
            else:  # packed new tokens, some (or all) sequences without one
                packed = pyattn.empty((sum(counts), 2, 32), ml_dtypes.bfloat16)
                c.append(ids, packed, packed, counts=counts)
            if before is not None and before.ids == tuple(ids):  # a one-token step keeps the table current
                assert c._dtab is before and before.version == c.book.version
            if before is not None and before is c._dtab and c._dtab.version == c.book.version and any(counts):
                items = posted[-1][1]  # the patches ride with the append's items: offsets, then values
                k = 2 * sum(counts)
                np.testing.assert_array_equal(c._dtab.host[items[-2 * k:-k]], items[-k:])
        elif op < 0.65:  # a prefill chunk: several tokens to one sequence (the table goes stale)
            sid, n = ids[int(rng.integers(len(ids)))], int(rng.integers(2, 2 * PS + 2))
            c.append([sid], _kv(1, n), _kv(1, n))
        elif op < 0.72:  # a fork joins the batch (its first write is a copy-on-write)
            ids.append(c.fork(ids[int(rng.integers(len(ids)))]))
        elif op < 0.77 and len(ids) > 1:  # a sequence finishes
            c.free(ids.pop(int(rng.integers(len(ids)))))
        elif op < 0.82:  # speculative rollback
            sid = ids[int(rng.integers(len(ids)))]
            c.truncate(sid, int(rng.integers(0, c.length(sid) + 1)))
        pyattn.decode(_q(len(ids)), c, ids)
        _agrees_with_book(c, ids)
    c.book.check()


def test_decode_steps_neither_rebuild_nor_upload_the_table(gpu, monkeypatch):
    c = pyattn.PagedKVCache(4096, PS, 2, 32, "bfloat16")
    ids = [c.add_sequence() for _ in range(3)]
    for sid, n in zip(ids, (5, 9, 2)):
        c.append([sid], _kv(1, n), _kv(1, n))
    q, k = _q(3), _kv(3)
    pyattn.decode(q, c, ids)
    table = c._dtab
    made = []
    monkeypatch.setattr(cache_mod, "DecodeTable", lambda *a: made.append(a))
    for _ in range(3 * PS):  # every sequence crosses a page boundary on the way
        c.append(ids, k, k)
        fake_driver.CALLS.clear()
        pyattn.decode(q, c, ids)
        assert "cuMemcpyHtoDAsync" not in fake_driver.CALLS
        assert c._dtab is table and not made
        _agrees_with_book(c, ids)
    assert table.host[:3].tolist() == [5 + 3 * PS, 9 + 3 * PS, 2 + 3 * PS]


def test_a_copy_on_write_append_patches_the_replaced_page(gpu):
    c = pyattn.PagedKVCache(64, PS, 2, 32, "bfloat16")
    a = c.add_sequence()
    c.append([a], _kv(1, PS + 1), _kv(1, PS + 1))
    b = c.fork(a)
    ids = [a, b]
    pyattn.decode(_q(2), c, ids)
    shared = c.book.pages(b)[-1]
    c.append(ids, _kv(2), _kv(2))  # both write into the shared, partly filled last page: both copy
    assert c.book.pages(a)[-1] != shared and c.book.pages(b)[-1] != shared
    assert c._dtab.version == c.book.version
    _agrees_with_book(c, ids)


def test_a_row_outgrowing_its_capacity_makes_the_next_decode_rebuild(gpu):
    c = pyattn.PagedKVCache(4096, 1, 2, 32, "bfloat16")  # one token a page: a page entry a step
    ids = [c.add_sequence()]
    c.append(ids, _kv(1), _kv(1))
    pyattn.decode(_q(1), c, ids)
    first = c._dtab
    for _ in range(first.cap):
        c.append(ids, _kv(1), _kv(1))
    assert first.version != c.book.version  # the last append no longer fit: stale
    pyattn.decode(_q(1), c, ids)
    assert c._dtab is not first and c._dtab.cap > first.cap
    _agrees_with_book(c, ids)


def test_a_decode_step_uploads_nothing_and_the_mailbox_waits_before_reusing_a_slot(gpu, monkeypatch):
    from pyattn.runtime.mailbox import Mailbox

    c = pyattn.PagedKVCache(4096, PS, 2, 32, "bfloat16")
    ids = [c.add_sequence() for _ in range(2)]
    q, k = _q(2), _kv(2)
    c.append(ids, k, k)
    pyattn.decode(q, c, ids)
    box = c._appender.box()
    for step in range(2 * Mailbox.SLOTS + 1):
        fake_driver.CALLS.clear()
        c.append(ids, k, k)
        pyattn.decode(q, c, ids)
        calls = dict(fake_driver.CALLS)
        assert "cuMemcpyHtoDAsync" not in calls and "cuMemAllocFromPoolAsync" not in calls, calls
        assert calls.get("cuEventRecord") == 1  # the slot's readers, once
        # from the second lap on, each slot first waits for its readers of a lap before
        assert calls.get("cuEventSynchronize", 0) == (step >= Mailbox.SLOTS - 1), (step, calls)
    assert box._events.count(None) == 0
    big = 4096  # more tokens than a slot's items hold: uploaded as before
    kv = np.zeros((1, big, 2, 32), ml_dtypes.bfloat16)
    fake_driver.CALLS.clear()
    c.append(ids[:1], kv, kv)
    assert "cuMemcpyHtoDAsync" in fake_driver.CALLS


def test_a_repeat_append_skips_validation_but_not_its_address_check(gpu, monkeypatch):
    """The second append of device arrays of one layout is found by its quick key: no Arg is read
    and nothing validated again, but a misaligned address is still refused before any change."""
    from pyattn.array import DeviceArray

    c = pyattn.PagedKVCache(256, PS, 2, 32, "bfloat16")
    ids = [c.add_sequence() for _ in range(2)]
    k = _kv(2)
    calls = []
    real = cache_mod.check_append
    monkeypatch.setattr(cache_mod, "check_append", lambda *a: calls.append(a) or real(*a))
    c.append(ids, k, k)
    c.append(ids, k, k)
    c.append(ids, k, k)
    assert len(calls) == 1 and [c.length(s) for s in ids] == [3, 3]
    bad = DeviceArray(k.ptr + 8, k.shape, k.dtype, k.device, owner=k)  # same layout, 8-byte aligned
    version = c.book.version
    with pytest.raises(ValueError, match="k: .*16-byte aligned"):
        c.append(ids, bad, k)
    assert c.book.version == version and [c.length(s) for s in ids] == [3, 3] and len(calls) == 1
    c.append(ids, _kv(2, 2), _kv(2, 2))  # another layout: validated (then keyed) on its own
    assert len(calls) == 2 and [c.length(s) for s in ids] == [5, 5]
    with pytest.raises(ValueError, match="k: expected shape"):
        c.append(ids[:1], k, k)  # another sequence count: validated, and refused


@pytest.mark.parametrize("host_q", [False, True])
def test_an_empty_batch_decodes_to_empty_results_without_a_launch(gpu, host_q):
    """A serving step with no sequence to decode (every request in prefill) returns empty results;
    it raised ZeroDivisionError in the split choice before."""
    c = pyattn.PagedKVCache(64, PS, 2, 32, "bfloat16")
    q = np.zeros((0, 1, 4, 32), ml_dtypes.bfloat16) if host_q else _q(0)
    gpu.record_launches = True
    fake_driver.LAUNCHES.clear()
    out, lse = pyattn.decode(q, c, [], return_lse=True)
    assert out.shape == (0, 1, 4, 32) and lse.shape == (0, 4, 1)
    pools = pyattn.empty((4, PS, 2, 32), ml_dtypes.bfloat16)
    out = pyattn.paged_decode(q, pools, pools, block_table=np.zeros((0, 1), np.int32), seq_lens=np.zeros(0, np.int32))
    assert out.shape == (0, 1, 4, 32) and not fake_driver.LAUNCHES

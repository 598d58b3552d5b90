"""The NumPy path's staging workers set the flags that streams wait on, so they must make no driver
call that waits for the device. The garbage collector runs finalizers on whatever thread it runs
on: a pinned block freed there (``cuMemFreeHost`` synchronises the device) would wait for a stream
parked on a flag that the same worker has yet to set. So such releases are deferred off the
workers, and pyattn's objects form no cycles that leave them to the collector in the first place.
CPU tests through the fake driver."""

from __future__ import annotations

import gc
import threading
import weakref

import ml_dtypes
import numpy as np
import pytest
from cuda.bindings import driver

import fake_driver
import pyattn
from pyattn.pipeline import transfer
from pyattn.runtime import pinned
from pyattn.runtime._resource import STAGING_THREADS, off_staging_threads, run_deferred


@pytest.fixture
def fake(monkeypatch):
    with fake_driver.installed(monkeypatch) as f:
        freed = []  # (pointer, thread name) of each cuMemFreeHost
        real = driver.cuMemFreeHost

        def record(ptr):
            freed.append((int(ptr), threading.current_thread().name))
            return real(ptr)

        monkeypatch.setattr(driver, "cuMemFreeHost", record)
        f.freed = freed
        yield f


def test_pinned_memory_whose_last_holder_goes_on_a_staging_worker_is_freed_off_it(fake):
    """A buffer (with its cached NumPy view, as every staging buffer has) whose last reference goes
    on a staging worker: no free there; the next pinned allocation on the calling thread frees it.
    With the collector off, so the free comes from reference counts: the view forms no cycle."""
    executor, _ = transfer.executor()
    enabled = gc.isenabled()
    gc.disable()
    try:
        holder = [pinned.PinnedBuffer(4096)]
        ptr = holder[0].ptr
        view = holder[0].array(np.uint32, (4,))
        view[:] = 7
        holder.append(view)
        del view
        name = executor.submit(lambda: (holder.clear(), threading.current_thread().name)[1]).result()
        assert name.startswith(STAGING_THREADS)
        assert fake.freed == [] and ptr in fake.host  # not freed on the worker
        pinned.PinnedBuffer(4096)  # frees what the worker left, here; then its own goes (no view)
        assert fake.freed[0] == (ptr, threading.current_thread().name)
        assert ptr not in fake.host
    finally:
        if enabled:
            gc.enable()


def test_buffers_dropped_on_the_calling_thread_are_freed_at_once(fake):
    buf = pinned.PinnedBuffer(4096)
    buf.raw[:] = 1
    ptr = buf.ptr
    del buf
    assert fake.freed == [(ptr, threading.current_thread().name)]


def test_deferred_releases_run_once_and_never_on_a_worker(fake):
    executor, _ = transfer.executor()
    ran = []
    executor.submit(off_staging_threads, ran.append, "a").result()
    executor.submit(run_deferred).result()  # a worker does not run them
    assert ran == []
    run_deferred()
    run_deferred()
    assert ran == ["a"]
    off_staging_threads(ran.append, "b")  # off a worker: at once
    assert ran == ["a", "b"]


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
def test_a_dropped_cache_goes_at_once(fake, kind):
    """A PagedKVCache held in no cycle: dropped, it releases its mailbox (pinned memory, whose free
    synchronises the device) and its pool blocks there and then, not whenever (and on whichever
    thread) the garbage collector next runs. The collector is off to show it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        cache = pyattn.PagedKVCache(64, 16, 2, 64, kind)
        sid = cache.add_sequence()
        tokens = np.zeros((1, 20, 2, 64), ml_dtypes.bfloat16)
        cache.append([sid], tokens, tokens)
        alive = weakref.ref(cache)
        n_freed = len(fake.freed)
        del cache
        assert alive() is None
        assert len(fake.freed) > n_freed  # the mailbox's pinned block
    finally:
        if enabled:
            gc.enable()


def test_device_memory_dropped_on_a_staging_worker_is_freed_off_it(fake, monkeypatch):
    """A device array (1 MiB: freed through the driver, not kept by the pool) whose last reference
    goes on a staging worker: no driver call there (a stream-ordered free waits for nothing, but
    takes the driver's locks); the next allocation on the calling thread frees it."""
    calls = []  # (driver entry point, thread ident)
    for name in ("cuMemFreeAsync", "cuEventDestroy", "cuStreamDestroy"):
        real = getattr(driver, name)
        monkeypatch.setattr(driver, name, lambda *a, _n=name, _r=real: (calls.append((_n, threading.get_ident())),
                                                                       _r(*a))[1])
    executor, _ = transfer.executor()
    holder = [pyattn.asarray(np.zeros(1 << 18, np.float32))]
    worker = executor.submit(lambda: (holder.clear(), threading.get_ident())[1]).result()
    assert not any(ident == worker for _, ident in calls)
    assert "cuMemFreeAsync" not in [n for n, _ in calls]
    pyattn.asarray(np.zeros(4, np.float32))  # an allocation on this thread runs what was left
    assert ("cuMemFreeAsync", threading.get_ident()) in calls

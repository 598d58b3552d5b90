"""Blocks kept for their stream's next allocation (``runtime.memory.DevicePool``), on a CPU through
the fake driver of ``fake_driver.py``: which stream may reuse a kept block, which blocks go back
through the driver, the bounds, and their release (trim, out of memory).
"""

from __future__ import annotations


import pytest

import fake_driver
import pyattn
from pyattn.runtime.stream import Stream


@pytest.fixture
def gpu(monkeypatch):
    with fake_driver.installed(monkeypatch) as fake:
        yield fake


def test_a_freed_block_is_reused_only_by_its_stream(gpu):
    from pyattn.runtime.memory import get_pool

    dev = pyattn.get_device()
    pool = get_pool(dev)
    s1, s2 = Stream(dev), Stream(dev)
    a = pool.allocate(4096, s1)
    ptr = a.ptr
    fake_driver.CALLS.clear()
    del a
    assert pool.allocate(4096, s2).ptr != ptr  # another stream: a fresh block from the driver
    assert pool.allocate(2048, s1).ptr != ptr  # another size
    b = pool.allocate(4096, s1)
    assert b.ptr == ptr  # the stream that freed it, the same size: no driver call
    assert fake_driver.CALLS["cuMemAllocFromPoolAsync"] == 2 and "cuMemFreeAsync" not in fake_driver.CALLS


def test_a_block_another_stream_used_is_freed_through_the_driver(gpu):
    """The driver orders its reuse after that stream (an event); a kept block would skip that wait."""
    from pyattn.runtime.memory import get_pool

    dev = pyattn.get_device()
    pool = get_pool(dev)
    s1, s2 = Stream(dev), Stream(dev)
    a = pool.allocate(4096, s1)
    ptr = a.ptr
    a.record_stream(s2)
    fake_driver.CALLS.clear()
    del a
    assert fake_driver.CALLS["cuMemFreeAsync"] == 1 and fake_driver.CALLS["cuStreamWaitEvent"] == 1
    assert pool.allocate(4096, s1).ptr != ptr


def test_kept_blocks_are_bounded_and_released(gpu, monkeypatch):
    from pyattn.runtime.memory import DevicePool, get_pool

    monkeypatch.setattr(DevicePool, "SPARE_PER_SIZE", 3)
    monkeypatch.setattr(DevicePool, "SPARE_SIZES", 2)
    dev = pyattn.get_device()
    pool = get_pool(dev)
    s = Stream(dev)
    big = pool.allocate(DevicePool.SPARE_BLOCK_BYTES + 1, s)
    same = [pool.allocate(4096, s) for _ in range(4)]
    others = [pool.allocate(n, s) for n in (512, 1024)]
    fake_driver.CALLS.clear()
    del big, same
    assert fake_driver.CALLS["cuMemFreeAsync"] == 2  # the big block, and the fourth of one size
    del others
    assert fake_driver.CALLS["cuMemFreeAsync"] == 3  # a third size
    fake_driver.CALLS.clear()
    pool.trim()
    assert fake_driver.CALLS["cuMemFreeAsync"] == 4 and fake_driver.CALLS["cuMemPoolTrimTo"] == 1
    assert pool.allocate(4096, s).ptr not in (0,) and fake_driver.CALLS["cuMemAllocFromPoolAsync"] == 1


def test_out_of_memory_releases_kept_blocks_and_retries(gpu, monkeypatch):
    from cuda.bindings import driver

    from pyattn.runtime.memory import get_pool

    dev = pyattn.get_device()
    pool = get_pool(dev)
    s = Stream(dev)
    kept = pool.allocate(4096, s)
    del kept
    real = driver.cuMemAllocFromPoolAsync
    answers = [driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY]

    def alloc(nbytes, handle, stream):
        if answers:
            return answers.pop(), None
        return real(nbytes, handle, stream)

    monkeypatch.setattr(driver, "cuMemAllocFromPoolAsync", alloc)
    fake_driver.CALLS.clear()
    assert pool.allocate(8192, s).ptr
    assert fake_driver.CALLS["cuMemFreeAsync"] == 1  # the kept block went back first

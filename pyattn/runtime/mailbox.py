"""Small per-call arrays that kernels read straight from pinned host memory: no copy, no allocation.

A decode step's append sends a few dozen to a few thousand int32 (destination slots, sources, the
decode table's patches) to its kernel. Through :func:`pyattn.pipeline.host.upload` that is a pool
allocation, a staging buffer taken and given back with an event, and an H2D copy: ~15 us of host
time on an H200 host (``dev/probe_decode_step.py --micro``), more than the rest of the append.

A :class:`Mailbox` is a ring of slots in page-locked host memory, which the GPU reads in place over
the bus (mapped memory: cached on the host, so the CPU's stores are visible to the device's reads
without a fence, and never cached on the GPU across kernels). A slot is written only after the
kernels that read it last have finished: each use ends with an event recorded behind them, which the
slot's next use waits for (at once, as a rule: it was recorded ``SLOTS`` uses earlier).
"""

from __future__ import annotations

import weakref

import numpy as np

from ._resource import off_staging_threads, release_quietly
from .errors import check
from .pinned import PinnedBuffer, _drv

__all__ = ["Mailbox"]


class Mailbox:
    """A ring of ``slots`` pinned slots of ``slot_bytes`` each, for one user at a time (a
    :class:`pyattn.PagedKVCache`, which is not thread-safe either).

    Use: ``ptr, view, slot = box.take(n)``, fill ``view`` (n int32), launch kernels reading ``ptr``,
    then ``box.sent(slot, stream)``.
    """

    SLOTS = 8
    SLOT_BYTES = 16384

    def __init__(self):
        driver = _drv()
        self._buf = PinnedBuffer(self.SLOTS * self.SLOT_BYTES)  # cached (not write-combined): see above
        self._ints = self._buf.array(np.int32, (self.SLOTS, self.SLOT_BYTES // 4))
        # The device's address of the same bytes (equal to the host's under unified addressing).
        self._dev = int(check(driver.cuMemHostGetDevicePointer(self._buf.ptr, 0), "cuMemHostGetDevicePointer"))
        self._events = [None] * self.SLOTS  # the event behind each slot's last readers, once used
        self._next = 0
        weakref.finalize(self, off_staging_threads, _free, self._events, self._buf)  # (_resource says why)

    def take(self, n: int):
        """``(device address, int32 view of n elements, slot)`` of the next slot, or None when ``n``
        int32 do not fit in one (the caller uploads instead)."""
        if 4 * n > self.SLOT_BYTES:
            return None
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        ev = self._events[slot]
        if ev is not None:  # its last readers must be done before the CPU overwrites it
            check(_drv().cuEventSynchronize(ev), "cuEventSynchronize")
        return self._dev + slot * self.SLOT_BYTES, self._ints[slot, :n], slot

    def sent(self, slot: int, stream) -> None:
        """The kernels reading ``slot`` are queued on ``stream``: the slot is free once they finish."""
        driver = _drv()
        ev = self._events[slot]
        if ev is None:
            ev = self._events[slot] = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                                            "cuEventCreate")
        check(driver.cuEventRecord(ev, stream.handle), "cuEventRecord")


def _free(events, buf) -> None:
    """A mailbox's finalizer: wait for each slot's last readers (the memory must not go while a
    kernel reads it), destroy the events, free the memory."""
    for ev in events:
        if ev is not None:
            release_quietly("cuEventSynchronize", ev)
            release_quietly("cuEventDestroy", ev)
    buf.close()

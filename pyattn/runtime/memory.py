"""Device memory: a caching, stream-ordered pool, and device-side copies and fills.

Device allocations come from a private driver memory pool (``cuMemPoolCreate``) whose release
threshold is unbounded: freed blocks stay cached in the pool and are handed out again without a
``cudaMalloc``-style synchronisation. Allocation and free are stream-ordered, so a block freed on
stream S may be reused by later work on S at once and by other streams only after S reaches the
free. A private pool (rather than the device's default pool) leaves other libraries' memory
behaviour untouched.

Pinned host memory (staging buffers, NumPy results) is :mod:`pyattn.runtime.pinned`.

CUDA graph capture: an allocation on a stream that captures a graph becomes the graph's own
memory (an allocation node: ``cuMemAllocFromPoolAsync`` in the capture), never a block kept from
before the capture (whose address eager calls would share with the replays); a block freed in the
capture that allocated it becomes a free node of the graph; any other block freed while its
stream captures waits in a list until the capture has ended (the driver refuses its free there).
Frees on streams that capture nothing go through at once, in this thread's relaxed capture mode:
while another stream captures in the driver's global mode (torch's default) the driver refuses
them too, and invalidates that capture (``dev/probe_capture_frees.py``).

Thread safety: pools are guarded by locks; an :class:`Allocation` must not be freed by two
threads at once (its finalizer runs once).
"""

from __future__ import annotations

import os

from .device import Device
from ._resource import exiting, off_staging_threads, per_device, run_deferred, watch_exit
from .errors import check
from .stream import capture_id

__all__ = ["Allocation", "DevicePool", "get_pool", "memset_async", "copy_device"]

_pools: dict[int, "DevicePool"] = {}
# Fill every new device array with 0xFF bytes (NaN for floating types), so tests catch elements a
# kernel forgot to write. None: ``PYATTN_POISON_ALLOC=1`` decides, read at the first allocation
# (an environment read on every allocation costs ~1.5 us of a 20 us call); tests set True/False.
POISON_ALLOC = None


_driver = None


def poison_alloc() -> bool:
    """Whether new device arrays are poisoned (see ``POISON_ALLOC``)."""
    global POISON_ALLOC
    if POISON_ALLOC is None:
        POISON_ALLOC = os.environ.get("PYATTN_POISON_ALLOC") == "1"
    return POISON_ALLOC


def _drv():
    global _driver
    if _driver is None:
        from cuda.bindings import driver as _driver
    return _driver


class Allocation:
    """A block of device memory from a :class:`DevicePool`, freed (stream-ordered) when dropped.

    Attributes
    ----------
    ptr : int
        Device address (0 for a zero-byte allocation).
    nbytes : int
    stream : Stream
        The stream the block was allocated on; its free is ordered on this stream.
    graph : int
        The id of the CUDA graph capture the block was allocated in (the graph's memory), else 0.
    """

    __slots__ = ("ptr", "nbytes", "stream", "graph", "_used_on", "_pool")

    def __init__(self, ptr: int, nbytes: int, stream, pool=None, graph: int = 0):
        self.ptr, self.nbytes, self.stream, self._pool, self.graph = ptr, nbytes, stream, pool, graph
        self._used_on = None  # {stream ptr: Stream} of other streams that used the block

    def record_stream(self, stream) -> None:
        """Note that ``stream`` uses this block, so the free waits for that stream's work too."""
        if stream.ptr != self.stream.ptr:
            if self._used_on is None:
                self._used_on = {}
            self._used_on[stream.ptr] = stream

    def free(self) -> None:
        """Return the block to its pool now (ordered after the work queued on its streams)."""
        ptr, self.ptr = self.ptr, 0
        if ptr:
            pool = self._pool
            if self._used_on is None and pool is not None and pool.keep(ptr, self.nbytes, self.stream):
                return
            off_staging_threads(_free_async, ptr, self.stream, self._used_on, self.graph)  # (_resource says why)

    # __del__ rather than weakref.finalize: one of these is made per op call, and a finalizer
    # object costs more than the free itself.
    __del__ = free


# (ptr, stream, used_on, graph) of blocks freed while one of their streams captured a graph, freed
# by _free_async once none does (see the module's notes)
_after_capture: list = []


def _in_capture(stream, used_on, graph) -> bool:
    """Whether a block's free must wait for a capture to end: one of its streams captures, unless
    it is the block's own graph freeing it on the block's stream alone (a free node)."""
    capture = capture_id(stream.handle)
    if capture and (capture != graph or used_on):
        return True
    return any(capture_id(other.handle) for other in (used_on or {}).values())


def _free_async(ptr, stream, used_on, graph=0) -> None:
    if exiting():  # the streams may be gone; the driver frees the pool with the context
        return
    if _after_capture:
        waiting = _after_capture[:]
        del _after_capture[:]
        for item in waiting:  # (each either freed now or back on the list)
            _free_async(*item)
    try:
        if _in_capture(stream, used_on, graph):
            _after_capture.append((ptr, stream, used_on, graph))
            return
        driver = _drv()
        # The block's device's context, for the event made below (an event and the stream it is
        # recorded on must share a context) and the free: a block of device 1 is often dropped
        # while another device's context is current (a torch program on cuda:0 holding a pyattn
        # result of cuda:1; public calls put the thread's context back as they end).
        pushed = stream.device.push()
        # A free on a stream outside any capture is safe, but while a capture in the driver's global
        # mode runs (torch.cuda.graph's default), on any thread, the driver refuses it as "potentially
        # unsafe" and invalidates that capture (an eager block or an earlier graph's alike, H200:
        # dev/probe_capture_frees.py): so this thread's mode is relaxed for the free, and restored.
        mode = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)[1]
        try:
            for other in (used_on or {}).values():
                # Make the freeing stream wait for the other users before the block can be reused.
                _, ev = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
                driver.cuEventRecord(ev, other.handle)
                driver.cuStreamWaitEvent(stream.handle, ev, 0)
                driver.cuEventDestroy(ev)
            driver.cuMemFreeAsync(driver.CUdeviceptr(ptr), stream.handle)
        finally:
            driver.cuThreadExchangeStreamCaptureMode(mode)
            if pushed:
                stream.device.pop()
    except Exception:  # interpreter shutdown: the context may already be gone
        pass


class DevicePool:
    """A caching, stream-ordered device memory pool for one device.

    Parameters
    ----------
    device : Device

    Notes
    -----
    Small blocks (up to ``SPARE_BLOCK_BYTES``) freed on a stream are kept here, up to
    ``SPARE_PER_SIZE`` per (stream, size) and ``SPARE_SIZES`` such pairs, for that stream's next
    allocation of the same size: a repeat op call then makes neither its allocation nor the
    previous result's free as a driver call (two of the four driver calls of a tiny call, ~1-2 us
    each on a GPU host). Handing a block to later work on the stream that freed it is exactly what
    the driver's pool does with a stream-ordered free; a block that another stream used
    (:meth:`Allocation.record_stream`) is freed through the driver, which orders its reuse after
    that stream. :meth:`trim` and an allocation that finds the device out of memory give the kept
    blocks back to the driver first. No lock: the lists' ``pop``/``append`` are atomic, and a race
    can only keep a block or two over the bounds (at most 64 MiB are kept).
    """

    SPARE_BLOCK_BYTES = 256 << 10
    SPARE_PER_SIZE = 4
    SPARE_SIZES = 64

    def __init__(self, device: Device):
        driver = _drv()
        watch_exit()
        self.device = device
        props = driver.CUmemPoolProps()
        props.allocType = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = device.ordinal
        device.activate()
        self.handle = check(driver.cuMemPoolCreate(props), "cuMemPoolCreate")
        # Keep freed memory cached in the pool instead of returning it to the driver at each sync.
        threshold = driver.cuuint64_t(2**64 - 1)
        check(driver.cuMemPoolSetAttribute(
            self.handle, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, threshold),
            "cuMemPoolSetAttribute")
        self._spares: dict = {}  # (stream ptr, nbytes) -> [(ptr, Stream), ...]: kept blocks (see Notes)
        self._counters: dict = {}  # stream ptr -> Allocation of zeroed uint32 counters (see counters())

    def allocate(self, nbytes: int, stream, capture: int | None = None) -> Allocation:
        """Allocate ``nbytes`` ordered on ``stream``; the memory is uninitialised. ``capture``: the
        stream's :func:`~pyattn.runtime.stream.capture_id` if the caller asked in this call
        already (an op asks once), else None (asked here)."""
        if nbytes <= 0:
            return Allocation(0, 0, stream)
        graph = capture_id(stream.handle) if capture is None else capture
        if graph:  # the graph's own memory: see the module's notes
            return self._allocate_in_capture(nbytes, stream, graph)
        spare = self._spares.get((stream.ptr, nbytes))
        if spare:
            try:
                return Allocation(spare.pop()[0], nbytes, stream, self)
            except IndexError:  # another thread took the last one
                pass
        run_deferred()  # frees a staging worker left (see _resource): memory goes back before more is taken
        driver = _driver if _driver is not None else _drv()
        err, ptr = driver.cuMemAllocFromPoolAsync(nbytes, self.handle, stream.handle)
        if err:
            if self._spares and err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                self.release_spares()
                err, ptr = driver.cuMemAllocFromPoolAsync(nbytes, self.handle, stream.handle)
            if err:
                check((err,), f"cuMemAllocFromPoolAsync({nbytes} bytes)")
        return Allocation(int(ptr), nbytes, stream, self)

    def _allocate_in_capture(self, nbytes: int, stream, graph: int) -> Allocation:
        """An allocation node of the graph ``stream`` captures: never kept for reuse (``pool``
        None), freed in that graph or after the capture."""
        ptr = check(_drv().cuMemAllocFromPoolAsync(nbytes, self.handle, stream.handle),
                    f"cuMemAllocFromPoolAsync({nbytes} bytes, in a graph capture)")
        return Allocation(int(ptr), nbytes, stream, None, graph)

    def keep(self, ptr: int, nbytes: int, stream) -> bool:
        """Keep a block freed on ``stream`` for its next allocation of ``nbytes`` (see Notes);
        False when it is not kept (too big, or the bounds reached): free it then."""
        if nbytes > self.SPARE_BLOCK_BYTES:
            return False
        key = (stream.ptr, nbytes)
        spare = self._spares.get(key)
        if spare is None:
            if len(self._spares) >= self.SPARE_SIZES:
                return False
            spare = self._spares.setdefault(key, [])
        if len(spare) >= self.SPARE_PER_SIZE:
            return False
        spare.append((ptr, stream))
        return True

    COUNTER_STREAMS = 64

    def counters(self, count: int, stream, capture: int | None = None) -> tuple:
        """``(device address, keep)``: at least ``count`` uint32 counters for kernels on ``stream``,
        zero when that stream's next kernel starts; the caller holds ``keep`` until its launches
        are queued.

        A kernel that counts in them (decode's fused split combine) must leave them zero when it
        ends, so the block is zeroed once (``cuMemsetD8Async``) and then reused by every launch on
        the stream: kernels on one stream never overlap, and each stream has its own block.
        Growing replaces the block (the old one is freed in stream order); at most
        ``COUNTER_STREAMS`` streams keep one, the oldest giving its block back past that.
        While ``stream`` captures a graph, the counters are the graph's own, zeroed by a memset
        node and freed by a free node once ``keep`` is dropped: a replay may run on another stream
        beside the eager calls that use the stream's block. ``capture``: as :meth:`allocate`'s.
        """
        capture = capture_id(stream.handle) if capture is None else capture
        if capture:
            block = self.allocate(4 * count, stream, capture)
            memset_async(block.ptr, 0, 4 * count, stream)
            return block.ptr, block
        block = self._counters.get(stream.ptr)
        if block is not None and block.nbytes >= 4 * count:
            return block.ptr, None
        nbytes = 4 * max(1024, 1 << (count - 1).bit_length())
        block = self.allocate(nbytes, stream)
        memset_async(block.ptr, 0, nbytes, stream)
        self._counters.pop(stream.ptr, None)  # a smaller block: freed after this stream's earlier kernels
        if len(self._counters) >= self.COUNTER_STREAMS:
            self._counters.pop(next(iter(self._counters)))
        self._counters[stream.ptr] = block
        return block.ptr, None

    def release_spares(self) -> None:
        """Free the kept blocks through the driver (each ordered on the stream that freed it)."""
        spares, self._spares = self._spares, {}
        for blocks in spares.values():
            while blocks:
                ptr, stream = blocks.pop()
                _free_async(ptr, stream, None)

    def trim(self, keep_bytes: int = 0) -> None:
        """Release cached memory above ``keep_bytes`` back to the driver (kept blocks first)."""
        self.release_spares()
        check(_drv().cuMemPoolTrimTo(self.handle, keep_bytes), "cuMemPoolTrimTo")


def get_pool(device: Device) -> DevicePool:
    """Return the process's pool for ``device``, created on first use."""
    pool = _pools.get(device.ordinal)  # (the per-call path: one lookup, no further call)
    return pool if pool is not None else per_device(_pools, device, DevicePool)


def memset_async(ptr: int, byte: int, nbytes: int, stream) -> None:
    """Fill ``nbytes`` at ``ptr`` with ``byte`` on ``stream`` (tests poison outputs with 0xFF = NaN)."""
    if nbytes:
        check(_drv().cuMemsetD8Async(ptr, byte, nbytes, stream.handle), "cuMemsetD8Async")


def copy_device(dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
    """Copy ``nbytes`` device-to-device on ``stream`` (a paged cache growing its side arrays)."""
    if nbytes:
        check(_drv().cuMemcpyDtoDAsync(dst_ptr, src_ptr, nbytes, stream.handle), "cuMemcpyDtoDAsync")

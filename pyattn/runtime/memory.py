"""Device memory (a caching, stream-ordered pool), pinned host staging, and copies.

Device allocations come from a private driver memory pool (``cuMemPoolCreate``) whose release
threshold is unbounded: freed blocks stay cached in the pool and are handed out again without a
``cudaMalloc``-style synchronisation. Allocation and free are stream-ordered, so a block freed on
stream S may be reused by later work on S at once and by other streams only after S reaches the
free. A private pool (rather than the device's default pool) leaves other libraries' memory
behaviour untouched.

Host<->device copies go through page-locked (pinned) staging buffers, so the DMA engine reads
and writes them asynchronously; copies from pageable NumPy memory would be serialised by the
driver through its own small bounce buffer.

Thread safety: pools and the staging pool are guarded by locks; an :class:`Allocation` must not
be freed by two threads at once (its finalizer runs once).
"""

from __future__ import annotations

import math
import os
import threading
import weakref

import numpy as np

from .device import Device
from ._resource import exiting, per_device, release_quietly, watch_exit
from .errors import check

__all__ = ["Allocation", "DevicePool", "get_pool", "PinnedBuffer", "StagingPool", "get_staging",
           "copy_to_device", "copy_to_host", "memset_async", "pinned_empty", "copy_device"]

_pools: dict[int, "DevicePool"] = {}
_staging: dict[int, "StagingPool"] = {}
_results = None  # the process's _ResultBlocks, made on first use
# Fill every new device array with 0xFF bytes (NaN for floating types), so tests catch elements a
# kernel forgot to write. None: ``PYATTN_POISON_ALLOC=1`` decides, read at the first allocation
# (an environment read on every allocation costs ~1.5 us of a 20 us call); tests set True/False.
POISON_ALLOC = None
_results_lock = threading.Lock()


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
    """

    __slots__ = ("ptr", "nbytes", "stream", "_used_on", "_pool")

    def __init__(self, ptr: int, nbytes: int, stream, pool=None):
        self.ptr, self.nbytes, self.stream, self._pool = ptr, nbytes, stream, pool
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
            _free_async(ptr, self.stream, self._used_on)

    # __del__ rather than weakref.finalize: one of these is made per op call, and a finalizer
    # object costs more than the free itself.
    __del__ = free


def _free_async(ptr, stream, used_on) -> None:
    if exiting():  # the streams may be gone; the driver frees the pool with the context
        return
    try:
        driver = _drv()
        for other in (used_on or {}).values():
            # Make the freeing stream wait for the other users before the block can be reused.
            _, ev = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            driver.cuEventRecord(ev, other.handle)
            driver.cuStreamWaitEvent(stream.handle, ev, 0)
            driver.cuEventDestroy(ev)
        driver.cuMemFreeAsync(driver.CUdeviceptr(ptr), stream.handle)
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

    def allocate(self, nbytes: int, stream) -> Allocation:
        """Allocate ``nbytes`` ordered on ``stream``; the memory is uninitialised."""
        if nbytes <= 0:
            return Allocation(0, 0, stream)
        spare = self._spares.get((stream.ptr, nbytes))
        if spare:
            try:
                return Allocation(spare.pop()[0], nbytes, stream, self)
            except IndexError:  # another thread took the last one
                pass
        driver = _driver if _driver is not None else _drv()
        err, ptr = driver.cuMemAllocFromPoolAsync(nbytes, self.handle, stream.handle)
        if err:
            if self._spares and err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                self.release_spares()
                err, ptr = driver.cuMemAllocFromPoolAsync(nbytes, self.handle, stream.handle)
            if err:
                check((err,), f"cuMemAllocFromPoolAsync({nbytes} bytes)")
        return Allocation(int(ptr), nbytes, stream, self)

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

    def counters(self, count: int, stream) -> int:
        """Device address of at least ``count`` uint32 counters for kernels on ``stream``, zero
        when that stream's next kernel starts.

        A kernel that counts in them (decode's fused split combine) must leave them zero when it
        ends, so the block is zeroed once (``cuMemsetD8Async``) and then reused by every launch on
        the stream: kernels on one stream never overlap, and each stream has its own block.
        Growing replaces the block (the old one is freed in stream order); at most
        ``COUNTER_STREAMS`` streams keep one, the oldest giving its block back past that.
        """
        block = self._counters.get(stream.ptr)
        if block is not None and block.nbytes >= 4 * count:
            return block.ptr
        nbytes = 4 * max(1024, 1 << (count - 1).bit_length())
        block = self.allocate(nbytes, stream)
        memset_async(block.ptr, 0, nbytes, stream)
        self._counters.pop(stream.ptr, None)  # a smaller block: freed after this stream's earlier kernels
        if len(self._counters) >= self.COUNTER_STREAMS:
            self._counters.pop(next(iter(self._counters)))
        self._counters[stream.ptr] = block
        return block.ptr

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


class _HostView:
    """Exposes a raw host address to NumPy through ``__array_interface__`` (no ctypes needed)."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self._owner = owner  # keeps the pinned block alive as long as any NumPy view of it
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class PinnedBuffer:
    """Page-locked host memory, usable as a NumPy ``uint8`` array via :meth:`array`.

    Parameters
    ----------
    nbytes : int
    """

    def __init__(self, nbytes: int):
        driver = _drv()
        flags = driver.CU_MEMHOSTALLOC_PORTABLE  # usable from every context, not just the current one
        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(check(driver.cuMemHostAlloc(self.nbytes, flags), "cuMemHostAlloc"))
        self._finalizer = weakref.finalize(self, release_quietly, "cuMemFreeHost", self.ptr)

    def array(self, dtype, shape) -> np.ndarray:
        """A NumPy view of the first ``prod(shape) * itemsize`` bytes."""
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        if n > self.nbytes:
            raise ValueError(f"pinned buffer of {self.nbytes} bytes cannot hold {n}")
        return self.raw[:n].view(dtype).reshape(shape)

    @property
    def raw(self) -> np.ndarray:
        """The whole buffer as a NumPy ``uint8`` array, made once (a staging buffer is reused by
        every small NumPy call; making the view cost ~3 us of each)."""
        raw = self.__dict__.get("_raw")
        if raw is None:
            raw = self.__dict__["_raw"] = np.asarray(_HostView(self.ptr, self.nbytes, self))
        return raw

    def close(self) -> None:
        """Free the pinned memory (its NumPy views must not be used afterwards)."""
        self._finalizer()


class StagingPool:
    """Reusable pinned staging buffers; a buffer returns to the pool with an event that marks
    when its last copy finishes, and is not handed out again before that event completes.

    Parameters
    ----------
    device : Device
    """

    def __init__(self, device: Device):
        self.device = device
        self._free: list[tuple[PinnedBuffer, object]] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> PinnedBuffer:
        """Return a pinned buffer of at least ``nbytes`` whose previous copies have completed."""
        driver = _drv()
        with self._lock:
            for i, (buf, ev) in enumerate(self._free):
                if buf.nbytes >= nbytes and (ev is None or int(driver.cuEventQuery(ev)[0]) == 0):
                    del self._free[i]
                    if ev is not None:
                        driver.cuEventDestroy(ev)
                    return buf
        # Round up to a power of two so buffers get reused across slightly different sizes.
        return PinnedBuffer(1 << max(int(nbytes) - 1, 4095).bit_length())

    def release(self, buf: PinnedBuffer, stream=None) -> None:
        """Give ``buf`` back; with ``stream``, it is reusable once the work queued there is done."""
        driver = _drv()
        ev = None
        if stream is not None:
            ev = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            check(driver.cuEventRecord(ev, stream.handle), "cuEventRecord")
        with self._lock:
            self._free.append((buf, ev))
            if len(self._free) > 8:  # bound the pinned memory kept around
                old, old_ev = self._free.pop(0)
                if old_ev is not None:
                    driver.cuEventSynchronize(old_ev)
                    driver.cuEventDestroy(old_ev)
                old.close()


def get_staging(device: Device) -> StagingPool:
    """Return the process's staging pool for ``device``."""
    return per_device(_staging, device, StagingPool)


class _Lease:
    """The base object of a NumPy result that views a pooled pinned block; when the last view of
    it is gone, the block goes back to the pool (``__del__``: one per result, cheaper than a
    finalizer object)."""

    def __init__(self, buf: PinnedBuffer, nbytes: int, pool: "_ResultBlocks"):
        self.buf, self.pool = buf, pool
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (buf.ptr, False), "version": 3}

    def __del__(self):
        try:
            self.pool.give_back(self.buf)
        except Exception:  # interpreter shutdown
            pass


class _ResultBlocks:
    """Pinned blocks for NumPy results, pooled by power-of-two size class.

    A fresh pinned block costs ~4 ms per 16 MiB (cuMemHostAlloc + cuMemFreeHost, measured on an
    H200 host) and a pageable result costs its page faults plus a host copy; pooled pinned blocks
    let the device-to-host copy write the result array itself, at PCIe speed. At most
    ``_KEEP_BYTES`` of free blocks are kept; the rest are freed when they come back.
    """

    _KEEP_BYTES = 512 << 20

    def __init__(self):
        self._free: dict[int, list] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> PinnedBuffer:
        size = 1 << max(int(nbytes) - 1, 4095).bit_length()
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                self._free_bytes -= size
                return blocks.pop()
        return PinnedBuffer(size)

    def give_back(self, buf: PinnedBuffer) -> None:
        with self._lock:
            if self._free_bytes + buf.nbytes <= self._KEEP_BYTES:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes
                return
        buf.close()


def pinned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous NumPy array in page-locked (pinned) memory from a pool.

    The memory goes back to the pool when the array (and every view of it) is garbage-collected.
    Device-to-host copies into it run asynchronously at full PCIe speed.
    """
    global _results
    if _results is None:
        with _results_lock:
            if _results is None:
                _results = _ResultBlocks()
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = _results.take(max(nbytes, 1))
    raw = np.asarray(_Lease(buf, max(nbytes, 1), _results))
    return raw[:nbytes].view(dtype).reshape(shape)


def copy_to_device(dst_ptr: int, host: np.ndarray, stream) -> None:
    """Copy a C-contiguous host array to ``dst_ptr`` asynchronously on ``stream``.

    The host data is first copied into a pinned staging buffer, so ``host`` may be modified or
    freed as soon as this returns.
    """
    nbytes = host.nbytes
    if nbytes == 0:
        return
    staging = get_staging(stream.device)
    buf = staging.acquire(nbytes)
    np.copyto(buf.array(host.dtype, host.shape), host, casting="no")
    check(_drv().cuMemcpyHtoDAsync(dst_ptr, buf.ptr, nbytes, stream.handle), "cuMemcpyHtoDAsync")
    staging.release(buf, stream)


def copy_to_host(host: np.ndarray, src_ptr: int, stream) -> None:
    """Copy device memory at ``src_ptr`` into the C-contiguous array ``host``; returns when done."""
    nbytes = host.nbytes
    if nbytes == 0:
        return
    staging = get_staging(stream.device)
    buf = staging.acquire(nbytes)
    check(_drv().cuMemcpyDtoHAsync(buf.ptr, src_ptr, nbytes, stream.handle), "cuMemcpyDtoHAsync")
    stream.synchronize()
    np.copyto(host, buf.array(host.dtype, host.shape), casting="no")
    staging.release(buf)


def memset_async(ptr: int, byte: int, nbytes: int, stream) -> None:
    """Fill ``nbytes`` at ``ptr`` with ``byte`` on ``stream`` (tests poison outputs with 0xFF = NaN)."""
    if nbytes:
        check(_drv().cuMemsetD8Async(ptr, byte, nbytes, stream.handle), "cuMemsetD8Async")


def copy_device(dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
    """Copy ``nbytes`` device-to-device on ``stream`` (a paged cache growing its side arrays)."""
    if nbytes:
        check(_drv().cuMemcpyDtoDAsync(dst_ptr, src_ptr, nbytes, stream.handle), "cuMemcpyDtoDAsync")

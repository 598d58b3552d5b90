"""Pinned (page-locked) host memory: staging buffers for uploads and pooled NumPy results.

Host<->device copies go through pinned memory, so the DMA engine reads and writes it
asynchronously at PCIe speed; copies from pageable NumPy memory would be serialised by the driver
through its own small bounce buffer. Staging buffers (:class:`StagingPool`) are reused once the
copies that read them are done; NumPy results (:func:`pinned_empty`) are pooled by size class and
go back to the pool when their last view is collected.

Thread safety: both pools are guarded by locks.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

from ._resource import off_staging_threads, per_device, release_quietly, run_deferred
from .device import Device, get_device
from .errors import check

__all__ = ["PinnedBuffer", "StagingPool", "get_staging", "get_signals", "pinned_empty", "is_pinned",
           "copy_to_device", "copy_to_host"]

_staging: dict[int, "StagingPool"] = {}
_signals: dict[int, "StagingPool"] = {}
_results = None  # the process's _ResultBlocks, made on first use
_results_lock = threading.Lock()
_driver = None


def _drv():
    global _driver
    if _driver is None:
        from cuda.bindings import driver as _driver
    return _driver


class _HostView:
    """Exposes a raw host address to NumPy through ``__array_interface__`` (no ctypes needed)."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self._owner = owner  # keeps the pinned block alive as long as any NumPy view of it
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class _Memory:
    """A page-locked block, freed when its last holder (its PinnedBuffer, a NumPy view) goes.

    Apart from the PinnedBuffer, so that the buffer's cached view (buffer -> view -> memory) forms no
    reference cycle: a cycle left the free to the garbage collector, at a time and on a thread of
    its choosing. The free itself never runs on a staging worker (``off_staging_threads``):
    ``cuMemFreeHost`` synchronises the device, which may be waiting for that very worker.
    """

    __slots__ = ("finalizer", "__weakref__")

    def __init__(self, ptr: int):
        self.finalizer = weakref.finalize(self, off_staging_threads, release_quietly, "cuMemFreeHost", ptr)


def _need_context(driver) -> None:
    """Make the default device's context current unless some context is: ``cuMemHostAlloc`` needs
    one, and ``pinned_empty`` may be a process's first CUDA call (the caller's own context, on any
    device, is left as it is)."""
    err, ctx = driver.cuCtxGetCurrent()
    if err or not int(ctx):
        get_device().activate()


class PinnedBuffer:
    """Page-locked host memory, usable as a NumPy ``uint8`` array via :meth:`array`.

    Parameters
    ----------
    nbytes : int
    write_combined : bool
        Allocate it write-combined (``CU_MEMHOSTALLOC_WRITECOMBINED``): the CPU's stores bypass its
        caches (no read for ownership) and the DMA reads it without snooping them, but CPU reads of
        it are uncached and very slow. Only for buffers the CPU writes and the device reads.
    """

    def __init__(self, nbytes: int, write_combined: bool = False):
        driver = _drv()
        _need_context(driver)
        flags = driver.CU_MEMHOSTALLOC_PORTABLE  # usable from every context, not just the current one
        if write_combined:
            flags |= driver.CU_MEMHOSTALLOC_WRITECOMBINED
        self.write_combined = bool(write_combined)
        self.nbytes = max(int(nbytes), 1)
        self._raw = None  # the uint8 view of the whole buffer (raw), made on first use
        run_deferred()  # frees that staging workers left (a good time: nothing waits on this thread)
        self.ptr = int(check(driver.cuMemHostAlloc(self.nbytes, flags), "cuMemHostAlloc"))
        self._mem = _Memory(self.ptr)

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
        if self._raw is None:
            self._raw = np.asarray(_HostView(self.ptr, self.nbytes, self._mem))
        return self._raw

    def close(self) -> None:
        """Free the pinned memory (its NumPy views must not be used afterwards)."""
        self._mem.finalizer()


class StagingPool:
    """Reusable pinned staging buffers; a buffer returns to the pool with an event that marks
    when its last copy finishes, and is not handed out again before that event completes.

    Parameters
    ----------
    device : Device
    write_combined : bool
        Allocate new buffers write-combined (see :class:`PinnedBuffer`; the default): staging
        buffers are only written by the CPU and read by the DMA. Measured on an H200 host
        (``dev/probe_host_copy.py``): 8 threads stage 48 MiB of NumPy memory into write-combined
        memory in 1.08 ms against 1.62 ms cached (1.42 / 1.55 ms while the DMA reads), and a NumPy
        (1, 4096, 16, 128) fp16 attention call took 2.74-2.78 ms against 2.87-2.99 ms.
    """

    def __init__(self, device: Device, write_combined: bool = True):
        self.device = device
        self.write_combined = write_combined
        self._free: list[tuple[PinnedBuffer, object]] = []
        self._lock = threading.Lock()

    KEEP = 8  # buffers kept for reuse

    def acquire(self, nbytes: int) -> PinnedBuffer:
        """Return a pinned buffer of at least ``nbytes`` whose previous copies have completed.

        When every kept buffer is still in flight and the pool is full (a loop of small calls
        queued ahead of the GPU, each uploading a few bytes of tables), this waits for the oldest
        one that fits instead of allocating another: the extra buffer would later be freed, and
        ``cuMemFreeHost`` (like ``cuMemHostAlloc``) waits for the whole device, so the loop's
        queue drained at every call (H200, a B8 x 4k decode loop with ragged NumPy lengths: 74-104
        us a call before, 35 after, against 38 for the kernel alone; BENCHMARKS.md,
        thirty-eighth session)."""
        driver = _drv()
        fits = lambda b: b.nbytes >= nbytes and b.write_combined == self.write_combined  # noqa: E731
        taken = None
        with self._lock:
            for i, (buf, ev) in enumerate(self._free):
                if fits(buf) and (ev is None or int(driver.cuEventQuery(ev)[0]) == 0):
                    del self._free[i]
                    if ev is not None:
                        driver.cuEventDestroy(ev)
                    return buf
            if len(self._free) >= self.KEEP:
                taken = next(((i, b, e) for i, (b, e) in enumerate(self._free) if fits(b)), None)
                if taken is not None:
                    del self._free[taken[0]]
        if taken is not None:
            _, buf, ev = taken
            if ev is not None:  # (outside the lock: other threads may take other buffers meanwhile)
                check(driver.cuEventSynchronize(ev), "cuEventSynchronize")
                driver.cuEventDestroy(ev)
            return buf
        # Round up to a power of two so buffers get reused across slightly different sizes.
        return PinnedBuffer(1 << max(int(nbytes) - 1, 4095).bit_length(), self.write_combined)

    def release(self, buf: PinnedBuffer, stream=None) -> None:
        """Give ``buf`` back; with ``stream``, it is reusable once the work queued there is done."""
        driver = _drv()
        ev = None
        if stream is not None:
            ev = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            check(driver.cuEventRecord(ev, stream.handle), "cuEventRecord")
        with self._lock:
            self._free.append((buf, ev))
            if len(self._free) > self.KEEP:  # bound the pinned memory kept around
                old, old_ev = self._free.pop(0)
                if old_ev is not None:
                    driver.cuEventSynchronize(old_ev)
                    driver.cuEventDestroy(old_ev)
                old.close()


def get_staging(device: Device) -> StagingPool:
    """Return the process's staging pool for ``device``."""
    return per_device(_staging, device, StagingPool)


def _signal_pool(device: Device) -> StagingPool:
    return StagingPool(device, write_combined=False)


def get_signals(device: Device) -> StagingPool:
    """Return the process's pool of small cached (not write-combined) pinned buffers for ``device``:
    the flags that host threads set and a stream waits on (``cuStreamWaitValue32``). Cached, so a
    flag's store is ordered after the thread's earlier stores (x86-64) and the device's reads of it
    snoop the CPU's caches; write-combined stores could linger in the core's buffers."""
    return per_device(_signals, device, _signal_pool)


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


def is_pinned(a: np.ndarray) -> bool:
    """Whether NumPy array ``a`` views pyattn's pinned memory (:func:`pinned_empty` or a staging
    buffer), so that a DMA may read it in place."""
    owner = a
    while isinstance(owner, np.ndarray):
        owner = owner.base
    return isinstance(owner, (_Lease, _HostView))

"""Host copies and host <-> device transfers: the moving parts of the NumPy ending (``host``).

- Threaded host copies: a copy cut into pieces of about :data:`PIECE_BYTES` along its longest
  non-last axis, each piece a task for the staging workers (``runtime._resource`` names their
  threads), NumPy's plain memcpy loops on unsigned views so that every dtype drops the GIL.
- Transfers: one driver call each (H2D, D2H, a 2-D D2H into a strided host view, a stream wait
  on a pinned flag), and :func:`cuts`, which cuts an array into the contiguous pieces the
  staging workers take.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from typing import TYPE_CHECKING

import numpy as np

from ..runtime._resource import STAGING_THREADS, register_staging_thread
from ..runtime.errors import check

if TYPE_CHECKING:
    from ..array import DeviceArray

__all__ = ["PIECE_BYTES", "split_range", "copy_into", "executor", "start_copies", "finish_copies", "addr", "h2d",
           "wait_flag", "d2h", "d2h_region", "cuts"]

# Read at call time (tests and benchmarks may change it). Measured on an H200 host: 4 MiB pieces
# beat 2 MiB ones by ~15% when each worker queued its own H2D (fewer GIL hand-offs;
# dev/probe_upload.py), and with flags too (dev/probe_numpy_timeline.py --ab: 1-3 MiB 0.2-2.5 ms
# slower a (1, 4096, 16, 128) fp16 call, 6 MiB a tie, 8 MiB 2-8% slower).
PIECE_BYTES = 4 << 20  # a worker's unit: one host copy (~0.7 ms at ~6 GB/s per thread), then its H2D

_executor = None  # (ThreadPoolExecutor, worker count), made on the first big copy
_executor_lock = threading.Lock()


def split_range(n: int, parts: int) -> list:
    """``parts`` near-equal ranges ``(a, b)`` covering ``[0, n)``, the longer ones first."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    ends = np.cumsum([0] + [base + (i < extra) for i in range(parts)]).tolist()
    return list(zip(ends[:-1], ends[1:]))


# -- threaded host copies ---------------------------------------------------------------------------


def _bits(x: np.ndarray) -> np.ndarray:
    # An unsigned view of the same item size: NumPy then copies with its plain memcpy loops and
    # drops the GIL whatever the dtype (ml_dtypes' bfloat16 included).
    return x.view(f"u{x.itemsize}") if x.itemsize in (1, 2, 4, 8) else x


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape): bit for bit when the dtypes match, else a same-kind cast."""
    if dst.dtype == src.dtype:
        np.copyto(_bits(dst), _bits(src), casting="no")
    else:
        np.copyto(dst, src, casting="same_kind")


def _pieces(dst: np.ndarray, src: np.ndarray, parts: int) -> list:
    """Split the copy ``dst <- src`` (same shape) along its longest non-last axis."""
    if parts <= 1 or dst.ndim == 0:
        return [(dst, src)]
    ax = int(np.argmax(dst.shape[:-1])) if dst.ndim > 1 else 0
    pre = (slice(None),) * ax
    return [(dst[pre + (slice(a, b),)], src[pre + (slice(a, b),)]) for a, b in split_range(dst.shape[ax], parts)]


def executor() -> tuple:
    """``(ThreadPoolExecutor, worker count)``: the staging workers, made on first use."""
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
                # Four at most. Alone, 8 threads staged fastest (51 GB/s; 12 or 16 slower, memory-bound),
                # but inside a NumPy call the workers share the GIL with the calling thread, which
                # queues the device side meanwhile and waits for the GIL behind each worker between
                # its driver calls: a (1, 4096, 16, 128) fp16 attention call on NumPy took 2.35-2.70 ms
                # with 4 workers against 2.80-2.93 with 8 (causal 2.52-2.69 against 2.66-2.88), faster
                # in 39 of 48 alternating rounds; 3 workers 2.60-2.64, 6 2.57-2.69 (H200 host, 16 cores,
                # `dev/probe_staging_workers.py`; BENCHMARKS.md, forty-eighth session).
                n = min(4, max(2, cpus // 2))
                _executor = (ThreadPoolExecutor(n, thread_name_prefix=STAGING_THREADS,
                                                initializer=register_staging_thread), n)
    return _executor


def start_copies(pairs: list) -> list:
    """Start the host copies ``(dst, src)``; returns futures for :func:`finish_copies` (none when
    they were small enough to do here at once)."""
    if sum(d.nbytes for d, _ in pairs) < 2 * PIECE_BYTES:
        for d, s in pairs:
            copy_into(d, s)
        return []
    ex, workers = executor()
    return [ex.submit(copy_into, dd, ss) for d, s in pairs
            for dd, ss in _pieces(d, s, min(workers, max(1, d.nbytes // PIECE_BYTES)))]


def finish_copies(futures: list) -> None:
    # Let every copy end before raising: they write buffers the caller may reuse at once.
    _wait_futures(futures)
    for f in futures:
        f.result()


# -- transfers ------------------------------------------------------------------------------------


def addr(a: np.ndarray) -> int:
    """The host address of a NumPy array's first element (``ndarray.ctypes`` would import ctypes)."""
    return a.__array_interface__["data"][0]


def h2d(dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
    from cuda.bindings import driver

    if nbytes:
        check(driver.cuMemcpyHtoDAsync(dst_ptr, src_ptr, nbytes, stream.handle), "cuMemcpyHtoDAsync")


def wait_flag(stream, flag_ptr: int) -> None:
    """Make later work on ``stream`` wait until the pinned uint32 at ``flag_ptr`` is non-zero (a
    cyclic ``>= 1``; under unified addressing a pinned host address is its device address)."""
    from cuda.bindings import driver

    geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    check(driver.cuStreamWaitValue32(stream.handle, flag_ptr, 1, geq), "cuStreamWaitValue32")


def d2h(dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
    from cuda.bindings import driver

    if nbytes:
        check(driver.cuMemcpyDtoHAsync(dst_ptr, src_ptr, nbytes, stream.handle), "cuMemcpyDtoHAsync")


def _d2h_2d(dst_ptr: int, dst_pitch: int, src_ptr: int, src_pitch: int, width: int, height: int, stream) -> None:
    from cuda.bindings import driver

    p = driver.CUDA_MEMCPY2D()
    p.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice, p.srcPitch = src_ptr, src_pitch
    p.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_HOST
    p.dstHost, p.dstPitch = dst_ptr, dst_pitch
    p.WidthInBytes, p.Height = width, height
    check(driver.cuMemcpy2DAsync(p, stream.handle), "cuMemcpy2DAsync")


def d2h_region(dst: np.ndarray, src: DeviceArray, stream) -> None:
    """Copy the C-contiguous device array ``src`` into the host view ``dst`` (same shape): either
    contiguous, or (after leading length-1 axes) equal contiguous blocks at a fixed pitch, e.g.
    ``out[0, :, s0:s1]`` of a (1, H, S, D) result, which is one 2-D copy."""
    if dst.size == 0:
        return
    if dst.flags.c_contiguous:
        d2h(addr(dst), src.ptr, src.nbytes, stream)
        return
    v = dst
    while v.ndim > 1 and v.shape[0] == 1:
        v = v[0]
    if v.ndim < 2 or not v[0].flags.c_contiguous:
        raise RuntimeError(f"internal: no 2-D copy into a host view of shape {dst.shape}, strides {dst.strides}")
    width = v[0].nbytes
    _d2h_2d(addr(v), v.strides[0], src.ptr, width, width, v.shape[0], stream)


def cuts(shape: tuple, itemsize: int, target: int) -> list:
    """Cut a C-contiguous array of ``shape`` into contiguous pieces of about ``target`` bytes (and
    at most that, unless one element row is larger). Returns ``(index, byte offset, shape)`` per
    piece, in memory order; ``index`` selects the piece (integers on leading axes, then a slice)."""
    out = []
    n_dims = len(shape)

    def rec(prefix, ax, offset):
        if ax == n_dims:
            out.append((prefix, offset, ()))
            return
        row = math.prod(shape[ax + 1:]) * itemsize  # bytes of one index along ``ax``
        n = shape[ax]
        if n * row <= target or row == 0:
            out.append((prefix, offset, shape[ax:]))
        elif row > target and ax + 1 < n_dims:
            for i in range(n):
                rec(prefix + (i,), ax + 1, offset + i * row)
        else:
            per = max(1, target // row)
            for a in range(0, n, per):
                b = min(a + per, n)
                out.append((prefix + (slice(a, b),), offset + a * row, (b - a,) + shape[ax + 1:]))

    rec((), 0, 0)
    return out

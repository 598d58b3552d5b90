"""The NumPy ending shared by every op: host inputs in, host results out, at PCIe speed.

Inputs are copied by worker threads into pinned staging memory (one thread copies at ~12 GB/s,
eight at ~51 GB/s on an H200 host, so the copy is split) in segments, and each segment's H2D copy
is issued as soon as its host copy is done, so the DMA engine works while later segments are
staged. Results are copied device-to-host straight into NumPy arrays that live in pooled pinned
memory (``runtime.memory.pinned_empty``): no host copy after the DMA and no page faults on a fresh
array. ``call`` returns when the results are on the host; work the caller queued on ``stream``
before the call runs first.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures

import numpy as np

from ..array import DeviceArray
from ..runtime.device import get_device
from ..runtime.errors import check
from ..runtime.memory import get_pool, get_staging, pinned_empty
from ..runtime.stream import as_stream

__all__ = ["call", "upload", "download", "start_copies", "finish_copies", "split_range", "h2d", "d2h",
           "d2h_region", "addr"]

# Tuning constants (read at call time, so tests and benchmarks may change them).
_PIECE_BYTES = 512 << 10  # smallest host copy worth handing to a worker thread (~20 us of memcpy)
_SEGMENT_BYTES = 8 << 20  # staged bytes per H2D copy: a segment's DMA overlaps the next one's staging
_ALIGN = 256  # offset of each array in a staging block (the kernels need 16 bytes)

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


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
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


def _executor_get() -> tuple:
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
                n = min(8, max(2, cpus // 2))  # measured: 8 threads 51 GB/s, 12 or 16 slower (memory-bound)
                _executor = (ThreadPoolExecutor(n, thread_name_prefix="pyattn-host"), n)
    return _executor


def start_copies(pairs: list) -> list:
    """Start the host copies ``(dst, src)``; returns futures for :func:`finish_copies` (none when
    they were small enough to do here at once)."""
    if sum(d.nbytes for d, _ in pairs) < 2 * _PIECE_BYTES:
        for d, s in pairs:
            _copy(d, s)
        return []
    ex, workers = _executor_get()
    return [ex.submit(_copy, dd, ss) for d, s in pairs
            for dd, ss in _pieces(d, s, min(workers, max(1, d.nbytes // _PIECE_BYTES)))]


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


# -- the ending -------------------------------------------------------------------------------------


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _segments(dst: np.ndarray, src: np.ndarray) -> list:
    """``(dst, src)`` cut along the first axis longer than 1 into pieces of about ``_SEGMENT_BYTES``;
    ``dst`` is C-contiguous, and so is each of its pieces (the axes before the cut have length 1)."""
    n = -(-dst.nbytes // _SEGMENT_BYTES)
    ax = next((i for i, d in enumerate(dst.shape) if d > 1), None)
    if n <= 1 or ax is None:
        return [(dst, src)]
    pre = (0,) * ax
    return [(dst[pre + (slice(a, b),)], src[pre + (slice(a, b),)]) for a, b in split_range(dst.shape[ax], n)]


def upload(arrays, device, s) -> list:
    """Copy host arrays (None entries kept) to one device block through pinned staging, in segments
    whose H2D copies overlap the staging of the next. Returns C-contiguous DeviceArrays on ``s``."""
    offs, total = [], 0
    for a in arrays:
        offs.append(total)
        total += _aligned(a.nbytes) if a is not None else 0
    if total == 0:
        return [None if a is None else DeviceArray(0, a.shape, a.dtype, device, stream=s) for a in arrays]
    staging = get_staging(device)
    buf = staging.acquire(total)
    raw = buf.array(np.uint8, (buf.nbytes,))
    alloc = get_pool(device).allocate(total, s)
    jobs = []  # (staging byte end, futures), in staging order
    try:
        for a, o in zip(arrays, offs):
            if a is not None:
                dst = raw[o:o + a.nbytes].view(a.dtype).reshape(a.shape)
                jobs += [(addr(p) - buf.ptr + p.nbytes, start_copies([(p, q)])) for p, q in _segments(dst, a)]
        done = 0
        for i, (end, futures) in enumerate(jobs):
            finish_copies(futures)
            if end - done >= _SEGMENT_BYTES or i == len(jobs) - 1:
                h2d(alloc.ptr + done, buf.ptr + done, end - done, s)
                done = end
    finally:
        _wait_futures([f for _, futures in jobs for f in futures])  # nothing may write the buffer once released
        staging.release(buf, s)  # reusable once s has read it
    return [None if a is None else DeviceArray(alloc.ptr + o, a.shape, a.dtype, device, owner=alloc, stream=s)
            for a, o in zip(arrays, offs)]


def download(results, outs, s) -> list:
    """Device results (C-contiguous DeviceArrays or None) to NumPy: into pinned result arrays, or
    into the caller's ``outs`` (through pinned ones and a threaded copy). Synchronises ``s``."""
    hosts = []
    for d in results:
        if d is None:
            hosts.append(None)
            continue
        h = pinned_empty(d.shape, d.dtype)
        if d.is_c_contiguous:
            d2h(addr(h), d.ptr, d.nbytes, s)
        else:
            h[...] = d.numpy(s)
        hosts.append(h)
    s.synchronize()
    pairs = [(o, h) for o, h in zip(outs, hosts) if o is not None and h is not None]
    finish_copies(start_copies(pairs))
    return [o if o is not None else h for o, h in zip(outs, hosts)]


def call(fn, inputs, outs, stream):
    """Run ``fn(device_inputs, s)`` (returning a tuple of DeviceArrays) on NumPy ``inputs`` (None
    entries allowed) and return NumPy results (``outs[i]`` when given, else pinned arrays)."""
    device = get_device()
    device.activate()
    s = as_stream(stream, device)
    results = fn(upload(inputs, device, s), s)
    return download(results, list(outs) + [None] * (len(results) - len(outs)), s)

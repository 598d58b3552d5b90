"""The NumPy ending shared by every op: host inputs in, host results out, at PCIe speed.

Inputs go through pinned staging memory. Worker threads copy pieces of ~4 MiB into it; the DMA
engine sends each piece as soon as its copy is done. How it learns that depends on the CPU:

- x86-64: while the workers copy, the calling thread queues every piece's H2D copy (and each
  chunk's kernel once its arrays' copies are queued), each copy behind ``cuStreamWaitValue32`` on
  a flag in pinned memory that the worker sets after its copy. The workers make no driver call: on
  an H200 host a worker's ``cuMemcpyHtoDAsync`` returned in 2 us alone but waited 30-120 us for the
  GIL while seven other workers copied. (The calling thread still waits for the GIL between its
  own calls while the workers copy, which is why there are four workers, not eight:
  ``transfer.executor``.) The flag is set after a locked instruction (x86's write-combined stores
  drain at one), and x86 keeps stores in order, so the device sees the staged bytes before the flag.
- Elsewhere (Arm: GH200): each worker issues its own piece's H2D copy right after the copy
  (Python reaches no full memory fence there that would order the staged bytes before a flag).

Staging is bounded: pieces are grouped in waves of ``_WAVE_BYTES``, at most ``_WAVES_IN_FLIGHT``
waves in flight, a wave's buffer reused once its H2D copies are done. Small uploads skip the
threads. Results are copied device-to-host straight into NumPy arrays in pooled pinned memory
(``runtime.pinned.pinned_empty``): no host copy after the DMA and no page faults on a fresh array.
``call`` returns when the results are on the host; work the caller queued on ``stream`` before
the call runs first.
"""

from __future__ import annotations

import math
import platform
import threading
from concurrent.futures import wait as _wait_futures
from typing import NamedTuple

import numpy as np

from ..array import DeviceArray, c_strides
from ..runtime._resource import run_deferred
from ..runtime.device import get_device
from ..runtime.memory import get_pool
from ..runtime.pinned import get_signals, get_staging, is_pinned, pinned_empty
from ..runtime.stream import as_stream, refuse_capture
from . import transfer
# (the copies and driver calls by name: looked up in this module at call time, where the tests' fake
# GPU replaces them; transfer.PIECE_BYTES through the module, as tuning may change it)
from .transfer import addr, copy_into, d2h, executor, finish_copies, h2d, start_copies, wait_flag

__all__ = ["call", "upload", "download"]

# Tuning constants (read at call time, so tests and benchmarks may change them; the piece size is
# transfer.PIECE_BYTES, which the threaded copies share).
_SMALL_BYTES = 1 << 20  # uploads up to this size: one copy and one H2D on the calling thread
_WAVE_BYTES = 16 << 20  # staged bytes per pinned buffer: the granularity of on_ready
_WAVES_IN_FLIGHT = 3  # buffers staged ahead of the DMA
_ALIGN = 256  # offset of each array in a device block (the kernels need 16 bytes)
# Whether uploads order their H2D copies by flags (see the module notes): None = on x86-64.
_SIGNALS = None


# -- the ending -------------------------------------------------------------------------------------


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _send(device, dst, src, stage_ptr, dev_ptr, nbytes, s) -> None:
    """Worker: copy one piece into staging, then queue its H2D copy at once."""
    device.activate()  # the driver call needs the context current on this thread
    copy_into(dst, src)
    h2d(dev_ptr, stage_ptr, nbytes, s)


class _Piece(NamedTuple):
    array: int  # index into the upload's arrays
    src: np.ndarray
    dtype: np.dtype  # the staged dtype
    dev_off: int  # byte offset in the device block
    nbytes: int
    shape: tuple
    pinned: bool  # src is page-locked, C-contiguous and of the staged dtype: sent without staging


def _plan_pieces(items, offs) -> list:
    """The pieces of ``items`` (``(array, staged dtype)`` or None) placed at byte offsets ``offs``."""
    pieces = []
    for i, (item, o) in enumerate(zip(items, offs)):
        if item is None:
            continue
        src, dt = item
        pin = src.dtype == dt and is_pinned(src)
        for idx, off, shape in transfer.cuts(src.shape, dt.itemsize, transfer.PIECE_BYTES):
            part = src[idx] if idx else src
            pieces.append(_Piece(i, part, dt, o + off, math.prod(shape) * dt.itemsize, shape,
                                 pin and part.flags.c_contiguous))
    return pieces


def _waves(pieces) -> list:
    """Consecutive pieces grouped into waves of at most ``_WAVE_BYTES`` staged bytes (a single larger
    piece is a wave of its own), each piece with its staging offset (pinned pieces take none)."""
    waves, cur, used = [], [], 0
    for p in pieces:
        size = 0 if p.pinned else -(-p.nbytes // 64) * 64
        if cur and used + size > _WAVE_BYTES:
            waves.append((cur, used))
            cur, used = [], 0
        cur.append((p, used))
        used += size
    if cur:
        waves.append((cur, used))
    return waves


def upload(arrays, device, s, on_ready=None, held=None) -> list:
    """Copy host arrays to one device block, ordered on ``s``; returns C-contiguous DeviceArrays
    (None entries kept).

    An entry may be ``(array, dtype)`` to stage it converted (e.g. a float64 mask as float32).
    ``on_ready(i, views)``, if given, is called (on this thread, for each ``i`` in order) once every
    H2D copy of array ``i`` is queued on ``s``, with the list of all the DeviceArrays (those after
    ``i`` are not filled yet): a consumer on another stream may wait for an event recorded then.
    Arrays are sent in the order given, so the ones needed first should come first. ``held``, a
    list, takes a small upload's staging buffer instead of its release: a caller that synchronises
    ``s`` anyway (:func:`call`) releases it then, with no event (four driver calls fewer).
    """
    refuse_capture(s, "this call copies host data to the device (NumPy inputs, host tables or lengths, or "
                      "the tables a first call builds and keeps): a replay would read its staging buffer after "
                      "later calls reused it. Pass device arrays, and make one call of the same shapes before "
                      "the capture")
    run_deferred()  # what finalizers on the staging workers left (runtime._resource), before s waits here
    # Each entry as (array, staged dtype), once.
    items = [None if a is None else (a[0], np.dtype(a[1])) if isinstance(a, tuple) else (a, a.dtype) for a in arrays]
    offs, total = [], 0
    for item in items:
        offs.append(total)
        if item is not None:
            total += _aligned(item[0].size * item[1].itemsize)
    alloc = get_pool(device).allocate(total, s)
    views = [None if item is None else
             DeviceArray._wrap(alloc.ptr + o, item[0].shape, item[1], c_strides(item[0].shape, item[1].itemsize),
                               c_strides(item[0].shape), device, alloc, s)
             for item, o in zip(items, offs)]
    ready = None if on_ready is None else (lambda i: on_ready(i, views))
    if total:
        if total > _SMALL_BYTES:
            pieces = _plan_pieces(items, offs)
            signals = platform.machine() in ("x86_64", "AMD64") if _SIGNALS is None else _SIGNALS
            (_upload_signalled if signals else _upload_by_workers)(pieces, len(arrays), device, alloc.ptr, s, ready)
            return views
        _upload_here(items, offs, total, device, alloc.ptr, s, held)
    if ready is not None:
        for i in range(len(arrays)):
            ready(i)
    return views


def _upload_here(items, offs, total, device, dev_ptr, s, held) -> None:
    """A small upload: one staging buffer, laid out as the device block, copies on this thread, one
    H2D copy."""
    staging = get_staging(device)
    buf = staging.acquire(total)
    try:
        raw = buf.raw
        for item, o in zip(items, offs):
            if item is not None:
                src, dt = item
                copy_into(raw[o:o + src.size * dt.itemsize].view(dt).reshape(src.shape), src)
        h2d(dev_ptr, buf.ptr, total, s)
    except BaseException:
        staging.release(buf, s)
        raise
    if held is not None:
        held.append(buf)
    else:
        staging.release(buf, s)  # reusable once s has read it


class _Signaller:
    """Calls ``on_ready`` for each array in order, once the queue of pieces has reached its last."""

    def __init__(self, pieces, on_ready):
        last_of = {p.array: i for i, p in enumerate(pieces)}  # (arrays are planned in order)
        self.ends = {i: a for a, i in last_of.items()}  # piece index -> the array it completes
        self.on_ready, self.signalled = on_ready, 0

    def through(self, i) -> None:
        """Piece ``i`` (in order) is queued: signal the array it completes, and every one before."""
        a = self.ends.get(i)
        if a is not None:
            self.upto(a + 1)

    def upto(self, n) -> None:
        if self.on_ready is not None:
            while self.signalled < n:
                self.on_ready(self.signalled)
                self.signalled += 1


_FENCE = threading.Lock()  # taken by _stage only for the locked instruction it executes


def _stage(dst, src, flags, i) -> None:
    """Worker: copy one piece into staging, then set its flag (the stream's copy of it waits on it)."""
    copy_into(dst, src)
    with _FENCE:  # a locked instruction: the staged bytes (write-combined stores) drain before the flag
        flags[i] = 1


def _upload_signalled(pieces, n_arrays, device, dev_ptr, s, on_ready) -> None:
    """Stage ``pieces`` on the workers while this thread queues the whole device side at once:
    each staged piece's H2D copy behind a wait on its flag, and each array's ``on_ready`` (a chunk's
    kernel) right after its last piece. Later waves reuse the buffers of the waves ``depth`` before
    them, once those waves' copies are done.

    If anything fails, every flag is set before the buffers go back, so the stream never waits for
    a piece that no worker will stage (it then sends stale bytes to results nobody returns).
    """
    staging, signals = get_staging(device), get_signals(device)
    ex, _ = executor()
    waves = _waves(pieces)
    depth = min(_WAVES_IN_FLIGHT, len(waves))
    sizes = [0] * depth  # each buffer slot big enough for every wave it takes
    for w, (_, used) in enumerate(waves):
        sizes[w % depth] = max(sizes[w % depth], used)
    flag_buf = signals.acquire(4 * len(pieces))
    flags = flag_buf.raw[:4 * len(pieces)].view(np.uint32)
    flags[:] = 0
    bufs, futures, ok = [], [[] for _ in waves], False
    jobs = []  # per wave: the workers' (staging view, source, flag index)

    def submit(w):
        futures[w] = [ex.submit(_stage, dst, src, flags, i) for dst, src, i in jobs[w]]

    try:
        for n in sizes:  # (appended one by one: the ones acquired before a failure go back)
            bufs.append(staging.acquire(n) if n else None)
        i = 0
        for w, (wp, _) in enumerate(waves):
            buf, jobs_w = bufs[w % depth], []
            for p, off in wp:
                if not p.pinned:
                    jobs_w.append((buf.raw[off:off + p.nbytes].view(p.dtype).reshape(p.shape), p.src, i))
                i += 1
            jobs.append(jobs_w)
        # The workers start first, the device side is queued meanwhile: queueing it all first (chunk
        # launches included) started the copies ~1 ms later and measured 10-15% slower (H200 host).
        for w in range(depth):
            submit(w)
        sig, events, i = _Signaller(pieces, on_ready), {}, 0
        flag0 = addr(flags)
        for w, (wp, _) in enumerate(waves):
            for p, off in wp:
                if p.pinned:  # the DMA reads the caller's page-locked array itself
                    h2d(dev_ptr + p.dev_off, addr(p.src), p.nbytes, s)
                else:
                    wait_flag(s, flag0 + 4 * i)
                    h2d(dev_ptr + p.dev_off, bufs[w % depth].ptr + off, p.nbytes, s)
                sig.through(i)
                i += 1
            if w + depth < len(waves):
                events[w] = s.record()
        sig.upto(n_arrays)  # arrays without pieces (None, empty) after the last one
        for w in range(depth, len(waves)):  # refill a buffer once the DMA has read it
            finish_copies(futures[w - depth])  # (a failed piece's flag is never set: raise first)
            events.pop(w - depth).synchronize()
            submit(w)
        finish_copies([f for fs in futures for f in fs])
        ok = True
    finally:
        _wait_futures([f for fs in futures for f in fs])  # nothing may write a buffer once released
        if not ok:
            flags[:] = 1
        for buf in bufs:
            if buf is not None:
                staging.release(buf, s)  # reusable once s has read it
        signals.release(flag_buf, s)


def _upload_by_workers(pieces, n_arrays, device, dev_ptr, s, on_ready) -> None:
    """Stage ``pieces`` in waves, one worker task per piece, each worker queueing its own piece's
    H2D copy, and signal each array once its last piece's H2D copy is queued.

    Every wave that has a buffer is submitted at once (the workers take pieces in order), and the
    main thread waits for the pieces in order, signalling arrays as they land: a wave is never held
    back until the one before has finished, which left the workers idle ~0.9 ms of a 3.7 ms call
    (``dev/probe_numpy_timeline.py``, H200 host), and a chunk starts when its own pieces are sent,
    not its whole wave. A pinned piece (the caller's page-locked array, :func:`is_pinned`) needs no
    staging: this thread queues its H2D copy at once and, when nothing before it is pending,
    signals its array at once, so that a chunk's event precedes the copies queued after it.
    """
    staging = get_staging(device)
    ex, _ = executor()
    waves = _waves(pieces)
    # In order: (wave, piece, future or None for a pinned piece); arrays are planned in order.
    queue, done = [], 0
    sig = _Signaller(pieces, on_ready)
    wave_end = []  # index in ``queue`` past each wave's last piece
    bufs, events = {}, {}

    def wait_through(n):
        """Wait for the first ``n`` queued pieces in order, signalling every array they complete."""
        nonlocal done
        while done < n:
            _, _, fut = queue[done]
            if fut is not None:  # (None: a pinned piece, its H2D queued by this thread)
                fut.result()
            sig.through(done)
            done += 1

    def complete(w):
        """Every piece of wave ``w`` sent; its buffer reusable once ``events[w]`` is reached."""
        wait_through(wave_end[w])
        events[w] = s.record()

    first_size = min(_WAVE_BYTES, sum(p.nbytes for p in pieces if not p.pinned))  # the first buffers: one size
    try:
        depth = _WAVES_IN_FLIGHT
        for w, (wp, used) in enumerate(waves):
            if w >= depth:  # at most ``depth`` waves staged ahead of the DMA: reuse wave w-depth's buffer
                complete(w - depth)
                events.pop(w - depth).synchronize()
                buf = bufs.pop(w - depth)
                if buf.nbytes < used:
                    staging.release(buf)
                    buf = staging.acquire(used)
            else:
                buf = staging.acquire(max(used, first_size))
            bufs[w] = buf
            raw = buf.raw
            for p, off in wp:
                if p.pinned:  # the DMA reads the caller's page-locked array itself: no worker needed
                    h2d(dev_ptr + p.dev_off, addr(p.src), p.nbytes, s)
                    queue.append((w, p, None))
                    if done == len(queue) - 1:  # nothing before it pending: signal now, so that a
                        wait_through(len(queue))  # chunk's event is recorded before later copies
                    continue
                dst = raw[off:off + p.nbytes].view(p.dtype).reshape(p.shape)
                queue.append((w, p, ex.submit(_send, device, dst, p.src, buf.ptr + off, dev_ptr + p.dev_off,
                                              p.nbytes, s)))
            wave_end.append(len(queue))
        for w in range(max(0, len(waves) - depth), len(waves)):
            complete(w)
        sig.upto(n_arrays)  # arrays without pieces (None, empty) after the last one
    finally:
        _wait_futures([f for _, _, f in queue if f is not None])  # nothing may write a buffer once released
        for buf in bufs.values():
            staging.release(buf, s)  # reusable once s has read it


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
    if pairs:
        finish_copies(start_copies(pairs))
    return [o if o is not None else h for o, h in zip(outs, hosts)]


def call(fn, inputs, outs, stream):
    """Run ``fn(device_inputs, s)`` (returning a tuple of DeviceArrays) on NumPy ``inputs`` (None
    entries allowed) and return NumPy results (``outs[i]`` when given, else pinned arrays)."""
    device = get_device()
    device.activate()
    s = as_stream(stream, device)
    held, synced = [], False
    try:
        results = fn(upload(inputs, device, s, held=held), s)
        out = download(results, list(outs) + [None] * (len(results) - len(outs)), s)
        synced = True
        return out
    finally:
        for buf in held:  # after download's synchronisation nothing reads it; else s may still
            get_staging(device).release(buf, None if synced else s)

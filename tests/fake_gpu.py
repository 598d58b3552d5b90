"""A fake GPU for CPU tests of the NumPy pipeline: host memory stands for device and pinned memory,
and streams run their queued work only when something waits for them (like a GPU that is always
late), or at once when "eager" (like an idle one); a mix of both exposes a missing wait between
streams. ``fake_pipeline(monkeypatch)`` installs it under ``pyattn.pipeline.chunks`` and ``.host``.
Test code only: it views fake device memory through ctypes.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from pyattn import DeviceArray
from pyattn.pipeline import chunks, host, transfer
from pyattn.reference import attention_ref

COPIES: list = []  # "h2d" / "d2h" / "d2h_2d", in issue order


class FakeDevice:
    ordinal = 0
    arch = "sm_90a"

    def activate(self):
        pass


DEV = FakeDevice()


def _ready(op, block: bool) -> bool:
    """Whether stream op ``op`` may run now; with ``block``, wait (up to 10 s) until it may."""
    test = getattr(op, "ready", None)
    if test is None or test():
        return True
    if not block:
        return False
    deadline = time.monotonic() + 10
    while not test():
        assert time.monotonic() < deadline, "a stream waited on something that never happened"
        time.sleep(1e-4)
    return True


class FakeStream:
    eager_every = 0  # with n > 0, every n-th stream made is eager
    made = 0

    def __init__(self, device=None, name="pipeline"):
        self.device, self.name, self.ops, self.done = device, name, [], 0
        self.handle = self.ptr = id(self)
        FakeStream.made += 1
        self.eager = bool(self.eager_every) and FakeStream.made % self.eager_every == 0

    def enqueue(self, fn):
        self.ops.append(fn)
        if self.eager:
            self.flush(block=False)

    def flush(self, upto=None, block=True):
        """Run the queued ops up to ``upto``. An op with a ``ready`` test (a wait) that fails stops the
        stream there: a host wait (``block``) retries until it passes, an eager enqueue leaves it for later."""
        upto = len(self.ops) if upto is None else upto
        while self.done < upto:
            op = self.ops[self.done]
            if not _ready(op, block):
                return
            self.done += 1
            op()

    def record(self, event=None, *, timing=False):
        event = event if event is not None else FakeEvent()
        event.stream, event.pos = self, len(self.ops)
        return event

    def wait(self, event):
        if event.stream is not None:
            other, pos = event.stream, event.pos

            def run():
                other.flush(pos)
            run.ready = lambda: other.flush(pos, block=False) or other.done >= pos
            self.enqueue(run)

    def synchronize(self):
        self.flush()


class FakeEvent:
    def __init__(self, device=None, *, timing=False):
        self.stream, self.pos = None, 0

    def synchronize(self):
        if self.stream is not None:
            self.stream.flush(self.pos)


class FakeMemory:
    """Host memory standing for device and pinned memory, filled with garbage."""

    def __init__(self):
        self.blocks = []

    def block(self, nbytes):
        a = np.full(max(int(nbytes), 1) + 256, 0xA5, np.uint8)
        self.blocks.append(a)
        start = -a.__array_interface__["data"][0] % 256  # 256-byte aligned, as the driver's allocations are
        return a[start:start + max(int(nbytes), 1)]


MEM = FakeMemory()


class FakePinned:
    def __init__(self, nbytes):
        self.nbytes = int(nbytes)
        self._a = MEM.block(nbytes)
        self.ptr = self._a.__array_interface__["data"][0]
        self.closed = False

    def array(self, dtype, shape):
        assert not self.closed, "pinned buffer used after close"
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self._a[:n].view(dtype).reshape(shape)

    @property
    def raw(self):
        assert not self.closed, "pinned buffer used after close"
        return self._a

    def close(self):
        self.closed = True


class FakeStaging:
    """``runtime.pinned.StagingPool``: a buffer comes back only once its last copy has run."""

    def __init__(self):
        self.free = []

    def acquire(self, nbytes):
        for i, (buf, stream, pos) in enumerate(self.free):
            if buf.nbytes >= nbytes and (stream is None or stream.done >= pos):
                del self.free[i]
                return buf
        return FakePinned(nbytes)

    def release(self, buf, stream=None):
        self.free.append((buf, stream, len(stream.ops) if stream is not None else 0))


class FakeAllocation:
    def __init__(self, nbytes, stream=None):
        self._a = MEM.block(nbytes)
        self.ptr = self._a.__array_interface__["data"][0] if nbytes else 0
        self.nbytes, self.stream = nbytes, stream


class FakePool:
    def allocate(self, nbytes, stream):
        return FakeAllocation(nbytes, stream)


def host_view(d):
    """A NumPy view of a (fake) device array."""
    if d.nbytes == 0:
        return np.empty(d.shape, d.dtype)
    lo, hi = d._byte_extent()
    raw = (ctypes.c_char * (hi - lo)).from_address(d.ptr + lo)
    return np.ndarray(d.shape, d.dtype, buffer=raw, offset=-lo, strides=d.strides)


def _memcpy(kind):
    def copy(dst, src, n, stream):
        COPIES.append(kind)
        if n:
            stream.enqueue(lambda: ctypes.memmove(dst, src, n))
    return copy


def _wait_flag(stream, flag_ptr):
    """``cuStreamWaitValue32(>= 1)``: the stream stops there until a host thread sets the flag."""
    COPIES.append("wait")
    flag = np.ndarray((1,), np.uint32, buffer=(ctypes.c_char * 4).from_address(flag_ptr))

    def run():
        assert flag[0], "a stream passed a flag that nothing set"
    run.ready = lambda: bool(flag[0])
    stream.enqueue(run)


def _memcpy_2d(dst, dpitch, src, spitch, width, height, stream):
    COPIES.append("d2h_2d")

    def run():
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
    stream.enqueue(run)


class FakeAttention:
    """The device path: checks its arguments, queues the reference computation on the stream."""

    def __init__(self, fail_on_call=None):
        self.calls, self.fail_on_call = [], fail_on_call

    @staticmethod
    def array(shape, dtype, stream):
        a = FakeAllocation(int(np.prod(shape)) * np.dtype(dtype).itemsize, stream)
        return DeviceArray(a.ptr, shape, dtype, DEV, owner=a, stream=stream)

    def __call__(self, q, k, v, *, stream, layout, return_lse, **opts):
        self.calls.append((stream, q.shape, opts))
        if self.fail_on_call == len(self.calls):
            raise ValueError("mask: refused by the fake device path")
        assert isinstance(q, DeviceArray) and q.is_c_contiguous and q.ptr % 256 == 0
        for x in (opts.get("mask"), opts.get("alibi_slopes")):  # views of the whole, sent once
            assert x is None or isinstance(x, DeviceArray)
        assert isinstance(k, DeviceArray) and isinstance(v, DeviceArray)
        B, Hq, Sq = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:3]
        out, lse = self.array(q.shape, q.dtype, stream), self.array((B, Hq, Sq), np.float32, stream)
        ropts = {n: x for n, x in opts.items() if n != "allow_tf32"}

        def compute():  # runs when the stream gets there: reads whatever the inputs hold by then
            hopts = {n: (host_view(x) if isinstance(x, DeviceArray) else x) for n, x in ropts.items()}
            o, l_ = attention_ref(host_view(q), host_view(k), host_view(v), layout=layout, return_lse=True, **hopts)
            host_view(out)[...] = o.astype(q.dtype)
            host_view(lse)[...] = l_.astype(np.float32)

        stream.enqueue(compute)
        return (out, lse) if return_lse else out


def fake_pipeline(monkeypatch, eager_every=0):
    """Install the fake GPU; returns ``(caller stream, FakeAttention)``."""
    monkeypatch.setattr(FakeStream, "eager_every", eager_every)
    monkeypatch.setattr(FakeStream, "made", 0)
    caller = FakeStream(DEV, "caller")  # made first, lazy; then pipeline streams 0, 1, 2: lazy, eager, lazy
    fake, staging, signals = FakeAttention(), FakeStaging(), FakeStaging()
    as_stream = (lambda stream, device: caller if stream is None else stream)
    for name, value in {"Stream": FakeStream, "Event": FakeEvent, "get_device": lambda: DEV, "as_stream": as_stream,
                        "pinned_empty": np.empty, "_device_attention": fake, "_pipelines": {},
                        "refuse_capture": lambda s, what: None}.items():
        monkeypatch.setattr(chunks, name, value)
    for name, value in {"get_device": lambda: DEV, "as_stream": as_stream, "get_staging": lambda device: staging,
                        "get_signals": lambda device: signals, "wait_flag": _wait_flag,
                        "get_pool": lambda device: FakePool(), "pinned_empty": np.empty, "h2d": _memcpy("h2d"),
                        "d2h": _memcpy("d2h"), "refuse_capture": lambda s, what: None}.items():
        monkeypatch.setattr(host, name, value)
    # d2h_region (the chunks' result copies) lives in transfer and calls its own d2h / _d2h_2d
    for name, value in {"d2h": _memcpy("d2h"), "_d2h_2d": _memcpy_2d}.items():
        monkeypatch.setattr(transfer, name, value)
    # Exercise the worker threads, several waves and the reuse of wave buffers on small arrays.
    monkeypatch.setattr(transfer, "PIECE_BYTES", 1024)
    monkeypatch.setattr(host, "_SMALL_BYTES", 2048)
    monkeypatch.setattr(host, "_WAVE_BYTES", 8192)
    return caller, fake

"""Streams and events.

Every launch and copy in pyattn names a stream. Users may pass a :class:`Stream`, any object
with the ``__cuda_stream__`` protocol (cuda.core, CuPy, recent PyTorch), or a raw ``CUstream``
handle as an ``int``; :func:`as_stream` normalises them. ``None`` means pyattn's own
non-blocking stream for that device, created on first use.

Thread safety: a Stream may be used from several threads (the driver serialises work on
it); creating and closing one is not synchronised against concurrent use of the same object.
"""

from __future__ import annotations

import threading
import weakref

from .device import Device, get_device, keeps_context
from ._resource import Closeable, off_staging_threads, per_device, release_quietly, watch_exit
from .errors import CaptureError, check

__all__ = ["Stream", "Event", "as_stream", "default_stream", "borrowed", "check_stream_arg", "order_after",
           "LEGACY_STREAM", "capture_id", "refuse_capture"]

_default_streams: dict[int, "Stream"] = {}
# Borrowed wrappers of foreign handles (torch's current stream, CAI producer streams), keyed by
# (ordinal, handle): a wrapper costs ~1 us to make and a hot loop sees the same few handles.
_borrowed: dict = {}
_MAX_BORROWED = 256
_order_events = threading.local()  # one ordering event per thread and device
# CU_STREAM_LEGACY: the legacy default stream, a valid handle in every context. A Stream's ``ptr`` is
# never 0: a borrowed 0 and a closed stream are this handle, so equal ``ptr`` means the same stream.
LEGACY_STREAM = 1


def _drv():
    from cuda.bindings import driver

    return driver


class Stream(Closeable):
    """A CUDA stream, owned (created here) or borrowed (a handle from elsewhere).

    Parameters
    ----------
    device : Device, optional
        Device to create the stream on (default: :func:`get_device`).
    handle : int, optional
        Wrap an existing ``CUstream`` instead of creating one; it is then never destroyed here.
    owner : object, optional
        Object kept alive with a borrowed handle (e.g. the foreign stream object).

    Notes
    -----
    Owned streams are created non-blocking, so they never serialise against the legacy
    default stream used by other libraries. Use as a context manager or call :meth:`close`;
    a finalizer destroys a forgotten owned stream.
    """

    @keeps_context
    def __init__(self, device: Device | None = None, *, handle: int | None = None, owner=None):
        driver = _drv()
        watch_exit()
        self.device = device if device is not None else get_device()
        self._owner = owner
        if handle is None:
            self.device.activate()
            flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
            self.handle = check(driver.cuStreamCreate(flags), "cuStreamCreate")
            self._finalizer = weakref.finalize(self, off_staging_threads, release_quietly, "cuStreamDestroy",
                                               self.handle)
        else:
            # Handle 0 (the NULL stream) is the legacy default stream, as CU_STREAM_LEGACY is (pyattn's
            # documented rule; torch reports its default stream as 0): wrapping it as LEGACY_STREAM
            # here, the one place foreign handles come in, lets every later comparison of ``ptr``
            # see one stream, and CUDA array interface exports (where 0 is not allowed) name it.
            self.handle = driver.CUstream(int(handle) or LEGACY_STREAM)
            self._finalizer = None
        self.ptr = int(self.handle)

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished."""
        check(_drv().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: "Event") -> None:
        """Make later work on this stream wait for ``event`` (no host block)."""
        check(_drv().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def record(self, event: "Event | None" = None, *, timing: bool = False) -> "Event":
        """Record ``event`` (a new one if None) on this stream and return it."""
        event = event if event is not None else Event(self.device, timing=timing)
        check(_drv().cuEventRecord(event.handle, self.handle), "cuEventRecord")
        return event

    def __cuda_stream__(self):
        return (0, self.ptr)

    def close(self) -> None:
        """Wait for the stream's work, destroy it (owned streams only), and from then on stand
        for the legacy default stream (``LEGACY_STREAM``).

        Arrays allocated on this stream may outlive it: their frees, copies and protocol exports
        then go to the legacy default stream, which is safe because this stream's work has finished.
        Borrowed streams are left alone.
        """
        if self._finalizer is not None and self._finalizer.alive:
            self.synchronize()
            self._finalizer()
            self.handle = _drv().CUstream(LEGACY_STREAM)
            self.ptr = LEGACY_STREAM

    def __repr__(self) -> str:
        return f"<pyattn.Stream 0x{self.ptr:x} on device {self.device.ordinal}>"


class Event(Closeable):
    """A CUDA event, for ordering between streams and for timing.

    Parameters
    ----------
    device : Device, optional
    timing : bool
        Enable timing (slightly more expensive); required for :meth:`elapsed_ms`.
    """

    @keeps_context
    def __init__(self, device: Device | None = None, *, timing: bool = False):
        driver = _drv()
        self.device = device if device is not None else get_device()
        self.device.activate()
        flags = 0 if timing else driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(driver.cuEventCreate(flags), "cuEventCreate")
        self._finalizer = weakref.finalize(self, off_staging_threads, release_quietly, "cuEventDestroy", self.handle)

    def synchronize(self) -> None:
        """Block until the work before this event has completed."""
        check(_drv().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds between this event and ``end`` (both recorded, with ``timing=True``)."""
        end.synchronize()
        return float(check(_drv().cuEventElapsedTime(self.handle, end.handle), "cuEventElapsedTime"))

    def close(self) -> None:
        """Destroy the event."""
        self._finalizer()


def default_stream(device: Device) -> Stream:
    """Return pyattn's own non-blocking stream for ``device``, created on first use."""
    return per_device(_default_streams, device, Stream)


def borrowed(device: Device, handle: int, owner=None) -> Stream:
    """A cached :class:`Stream` wrapping the foreign ``CUstream`` ``handle`` (never destroyed here).

    ``owner`` (e.g. the user's stream object) is kept alive by the wrapper, so arrays allocated on
    the stream keep its handle valid until they are freed.
    """
    key = (device.ordinal, handle)
    s = _borrowed.get(key)
    if s is None or (owner is not None and s._owner is not owner):
        if len(_borrowed) >= _MAX_BORROWED:
            _borrowed.clear()
        s = _borrowed[key] = Stream(device, handle=handle, owner=owner)
    return s


def capture_id(handle) -> int:
    """The id of the CUDA graph capture that stream ``handle`` (a ``CUstream``) records into: 0
    when it captures nothing, -1 when it does but the driver gives no id (an invalidated capture,
    or the legacy stream while another stream captures: the driver refuses the same calls there).

    One driver call on a stream that captures nothing (``cuStreamIsCapturing``), two otherwise; an
    op asks once per call (its allocations take the answer: ``DevicePool.allocate``'s ``capture``).
    """
    driver = _capture_driver if _capture_driver is not None else _load_capture_driver()
    err, status = driver.cuStreamIsCapturing(handle)
    if err:
        return -1
    if not status:  # CU_STREAM_CAPTURE_STATUS_NONE (an int enum: 0)
        return 0
    info = driver.cuStreamGetCaptureInfo(handle)
    active = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    return int(info[2]) if not info[0] and info[1] == active and int(info[2]) else -1


_capture_driver = None  # cuda.bindings.driver, looked up once: capture_id is on every op call's path


def _load_capture_driver():
    global _capture_driver
    _capture_driver = _drv()
    return _capture_driver


def refuse_capture(s: Stream, what: str) -> int:
    """Raise :class:`~pyattn.runtime.errors.CaptureError` (``what`` says why) when ``s`` captures a
    CUDA graph: for the steps a graph cannot replay faithfully (a host buffer read at replay time,
    a synchronisation), before they reach the driver, whose refusal would invalidate the capture.
    Returns 0 (``s`` captures nothing), for the call's allocations to take."""
    if capture_id(s.handle):
        raise CaptureError(s.ptr, what)
    return 0


def order_after(consumer: Stream, producer_handle: int) -> None:
    """Make later work on ``consumer`` wait for the work queued so far on ``producer_handle``
    (an event recorded there and waited on; no host block). One reusable event per thread and
    device: ``cuStreamWaitEvent`` captures the event's state when it is called, so recording it
    again afterwards is safe.

    While ``consumer`` captures a CUDA graph, a producer outside that capture is not waited for:
    its work so far was queued before the capture, and a graph's launch is ordered by the stream
    it is launched on, as for every other input of a graph (the driver refuses such a wait:
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION). A producer in the same capture (a stream forked from it)
    is waited for, inside the graph.

    The caller has made ``consumer``'s device current: a handle of 0, 1 or 2 (either side) names a
    stream of the *current* context (every op's ``begin`` / ``start`` activates it first, as
    ``DeviceArray.__dlpack__`` does for a consumer's handle; asking here would add a driver call to
    every wait)."""
    driver = _drv()
    capture = capture_id(consumer.handle)
    if capture and (capture < 0 or capture_id(driver.CUstream(producer_handle)) != capture):
        return
    events = getattr(_order_events, "by_device", None)
    if events is None:
        events = _order_events.by_device = {}
    ev = events.get(consumer.device.ordinal)
    if ev is None:
        ev = events[consumer.device.ordinal] = Event(consumer.device)
    check(driver.cuEventRecord(ev.handle, driver.CUstream(producer_handle)), "cuEventRecord")
    check(driver.cuStreamWaitEvent(consumer.handle, ev.handle, 0), "cuStreamWaitEvent")


def check_stream_arg(stream) -> None:
    """Refuse a ``stream=`` argument of the wrong kind before any device work (TypeError)."""
    if stream is None or isinstance(stream, Stream):
        return
    if isinstance(stream, int) and not isinstance(stream, bool):
        if not 0 <= stream < 2**64:
            raise ValueError(f"stream: expected a CUstream handle in [0, 2**64), got {stream}")
        return
    if getattr(stream, "__cuda_stream__", None) is None:
        raise TypeError(f"stream: expected None, a pyattn.Stream, an int CUstream handle or an object with "
                        f"__cuda_stream__, got {type(stream).__name__}")


def as_stream(stream, device: Device) -> Stream:
    """Normalise a user's ``stream=`` argument.

    Parameters
    ----------
    stream : None, Stream, int, or object with ``__cuda_stream__``
        ``None`` selects :func:`default_stream`. An ``int`` is a raw ``CUstream`` handle
        (0 is the legacy default stream).
    device : Device
        The device the work runs on.

    Raises
    ------
    TypeError
        For anything else.
    """
    if stream is None:
        return default_stream(device)
    if isinstance(stream, Stream):
        if stream.device.ordinal != device.ordinal:
            raise ValueError(f"stream: expected a stream of device {device.ordinal} (the call's arrays are there), "
                             f"got a pyattn.Stream of device {stream.device.ordinal}")
        return stream
    check_stream_arg(stream)
    if isinstance(stream, int):
        return _same_device(borrowed(device, stream), device)
    proto = stream.__cuda_stream__
    _, ptr = proto() if callable(proto) else proto
    return _same_device(borrowed(device, int(ptr), owner=stream), device)


def _same_device(s: Stream, device: Device) -> Stream:
    """``s`` (a borrowed handle), once its context is known to be ``device``'s: a kernel loaded there
    cannot run on another context's stream, which the driver would tell only at the launch, after
    the call's allocations (its ``CUDA_ERROR_INVALID_HANDLE`` naming no argument). Asked of the driver
    once a wrapper (``cuStreamGetCtx``); 0, 1 and 2 name the current context's legacy and per-thread
    streams, which the call makes ``device``'s."""
    if s.ptr > 2 and not s.__dict__.get("_on_device"):
        driver = _drv()
        err, ctx = driver.cuStreamGetCtx(driver.CUstream(s.ptr))
        if not err and int(ctx) != int(device.context):
            raise ValueError(f"stream: expected a stream of device {device.ordinal} (the call's arrays are there), "
                             f"got the handle {s.ptr:#x} of another context")
        s._on_device = True
    return s

"""The stream-order rule: which stream an op runs on, and what it waits for first.

The rule (documented in the README, tested on the GPU with a late write by every producer kind):

1. ``stream=`` given: the op runs on it.
2. ``stream=None`` and any input is a torch tensor: the op runs on torch's current stream of that
   device, as Triton kernels do, so it is ordered with the torch work that wrote its inputs and
   with the torch work that will read its outputs. Otherwise, when any input is a CuPy array:
   CuPy's current stream of that device, where CuPy's own kernels run (its array interface names
   that same stream, and the interface allows consuming by queuing work on it). Waiting on it from
   pyattn's stream instead cost an event record and a wait a call (5.2 us of a 32.7 us tiny call on
   an H200 host; BENCHMARKS.md, sixty-fifth session).
3. Otherwise pyattn's own stream of the device.

Whatever stream the op runs on, before its first launch it waits (an event, never a host block)
for every input's producer that is another stream: a ``DeviceArray``'s stream; a torch tensor's
current torch stream (when the op does not already run on it); a CUDA array interface v3
``stream``; the legacy default stream for an interface without a stream (version < 3, or None),
which is where such data is assumed to have been written. DLPack inputs are imported with the
op's stream as the consumer stream, which makes the producer order itself (the protocol's
contract). Results carry the op's stream, which their own ``__cuda_array_interface__`` /
``__dlpack__`` exports hand on to consumers.
"""

from __future__ import annotations

import sys

from ..array import DeviceArray
from ..runtime.memory import Allocation
from ..runtime.stream import LEGACY_STREAM, Stream, as_stream, borrowed, default_stream, order_after
from .inputs import DLPACK, HOST, LEGACY_PRODUCER, TORCH_PRODUCER, Arg

__all__ = ["choose_stream", "wait_for", "order_inputs", "import_dlpack", "note_use", "torch_current_stream",
           "cupy_current_stream", "is_cupy"]


def torch_current_stream(device) -> Stream:
    """torch's current stream on ``device``, as a borrowed :class:`Stream`."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # 0.09 us; current_stream() costs 3.9 us
    handle = raw(device.ordinal) if raw is not None else torch.cuda.current_stream(device.ordinal).cuda_stream
    return borrowed(device, int(handle))


def cupy_current_stream(device) -> Stream:
    """CuPy's current stream on ``device``, as a borrowed :class:`Stream` that keeps CuPy's stream
    object alive (results allocated on it are freed on it, so its handle must outlive them: CuPy
    destroys a ``cupy.cuda.Stream`` when the object goes)."""
    current = sys.modules["cupy"].cuda.get_current_stream
    try:
        cs = current(device.ordinal)
    except TypeError:  # a CuPy without the device argument: the device was made current first
        cs = current()
    return borrowed(device, int(cs.ptr), owner=cs)


_cupy_types: dict = {}  # type -> whether it is CuPy's (its module's top package)


def is_cupy(x) -> bool:
    """Whether ``x`` is a CuPy array, told by its type's module (CuPy is never imported here)."""
    tp = type(x)
    hit = _cupy_types.get(tp)
    if hit is None:
        hit = _cupy_types[tp] = str(getattr(tp, "__module__", "")).partition(".")[0] == "cupy"
    return hit


def choose_stream(stream, device, torch_in: bool, cupy_in: bool = False) -> tuple:
    """The stream the op runs on (rules 1-3 above), and torch's current stream handle if that was
    read on the way (rule 2; else None), for :func:`wait_for`: read once per call.
    ``torch_in``: whether any input is a torch tensor; ``cupy_in``: a CuPy array."""
    if stream is not None:
        return as_stream(stream, device), None
    if torch_in:
        s = torch_current_stream(device)
        return s, s.ptr
    if cupy_in:
        return cupy_current_stream(device), None
    return default_stream(device), None


def wait_for(s: Stream, device, producers, torch_now=None) -> None:
    """Order ``s`` after each producer that is another stream, once per stream.

    ``producers``: an :class:`~pyattn.interop.inputs.Arg`'s ``producer`` values (a Stream, an int
    ``CUstream``, ``TORCH_PRODUCER``, ``LEGACY_PRODUCER``) or None (nothing to wait for).
    ``torch_now``: torch's current stream handle if the caller has it (see :func:`choose_stream`).
    """
    done = s.ptr  # handles already waited for: an int, then a set (a Stream's ptr is never 0, see Stream)
    for p in producers:
        if p is None:
            continue
        if p is TORCH_PRODUCER:
            if torch_now is None:  # read once per call, and only when a torch tensor is there
                torch_now = torch_current_stream(device).ptr
            handle = torch_now
        elif p is LEGACY_PRODUCER:
            handle = LEGACY_STREAM
        else:
            ptr = getattr(p, "ptr", None)  # a Stream (a DeviceArray's producer), else a CAI int (never 0)
            handle = int(p) if ptr is None else ptr
        if handle != done and (type(done) is int or handle not in done):
            order_after(s, handle)
            done = {done, handle} if type(done) is int else done | {handle}


def order_inputs(s: Stream, device, args, torch_now=None) -> list:
    """Order ``s`` after the producers of ``args`` (:func:`wait_for`) and import DLPack-only inputs
    on ``s``.

    Returns the args with DLPack imports resolved (their ``ptr`` and a keep-alive ``obj``); other
    args are returned as they are.
    """
    out, producers = [], []
    for a in args:
        if a is not None and a.kind != HOST:
            if a.kind == DLPACK:
                a = _import_dlpack(a, s)
            producers.append(a.producer)
        out.append(a)
    wait_for(s, device, producers, torch_now)
    return out


def _import_dlpack(a: Arg, s: Stream) -> Arg:
    """Import a DLPack-only array with ``s`` as the consumer stream; checks it is what was read."""
    ptr, view = import_dlpack(a.name, a.obj, a.shape, a.strides, s)
    return a._replace(ptr=ptr, obj=(view, a.obj), producer=None)


def import_dlpack(name: str, obj, shape: tuple, strides: tuple, s: Stream) -> tuple:
    """``(address, view)`` of DLPack-only array ``obj`` imported with ``s`` as the consumer stream (the
    producer orders ``s`` after its writes: the protocol's contract). Its export must have the
    ``shape`` and element ``strides`` its attributes said; the caller keeps ``view`` (it holds the
    export) until its launches are queued."""
    from cuda.core.utils import StridedMemoryView

    view = StridedMemoryView.from_dlpack(obj, stream_ptr=s.ptr)
    got_shape = tuple(view.shape)
    got_strides = tuple(view.strides) if view.strides is not None else strides
    if got_shape != shape or got_strides != strides:
        raise ValueError(f"{name}: its DLPack export has shape {got_shape} and element strides {got_strides}, not "
                         f"the {shape} / {strides} its attributes said")
    return int(view.ptr), view


def note_use(s: Stream, arrays) -> None:
    """Tell pyattn's pool that ``s`` uses the blocks behind ``arrays`` (DeviceArrays or Args), so a
    block's stream-ordered free also waits for ``s`` when it was allocated on another stream."""
    for x in arrays:
        if x is None:
            continue
        owner = x.obj if type(x) is Arg else x
        while isinstance(owner, DeviceArray):
            owner = owner.owner
        if type(owner) is Allocation and owner.stream is not s:
            owner.record_stream(s)

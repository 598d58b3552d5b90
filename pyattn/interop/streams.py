"""The stream-order rule: which stream an op runs on, and what it waits for first.

The rule (documented in the README, tested on the GPU with a late write by every producer kind):

1. ``stream=`` given: the op runs on it.
2. ``stream=None`` and any input is a torch tensor: the op runs on torch's current stream of that
   device, as Triton kernels do, so it is ordered with the torch work that wrote its inputs and
   with the torch work that will read its outputs.
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
from .inputs import DLPACK, HOST, LEGACY_PRODUCER, TORCH, TORCH_PRODUCER, Arg

__all__ = ["choose_stream", "order_inputs", "note_use", "torch_current_stream"]


def torch_current_stream(device) -> Stream:
    """torch's current stream on ``device``, as a borrowed :class:`Stream`."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # 0.09 us; current_stream() costs 3.9 us
    handle = raw(device.ordinal) if raw is not None else torch.cuda.current_stream(device.ordinal).cuda_stream
    return borrowed(device, int(handle))


def choose_stream(stream, device, args) -> Stream:
    """The stream the op runs on (rules 1-3 above); ``args`` are the call's :class:`Arg` (or None)."""
    if stream is not None:
        return as_stream(stream, device)
    for a in args:
        if a is not None and a.kind == TORCH:
            return torch_current_stream(device)
    return default_stream(device)


def order_inputs(s: Stream, device, args) -> list:
    """Order ``s`` after the producers of ``args`` and import DLPack-only inputs on ``s``.

    Returns the args with DLPack imports resolved (their ``ptr`` and a keep-alive ``obj``); other
    args are returned as they are.
    """
    done = s.ptr or LEGACY_STREAM  # handles already waited for (0 is the legacy stream, as 1): an int, then a set
    torch_handle = None
    out = []
    for a in args:
        if a is not None and a.kind != HOST:
            if a.kind == DLPACK:
                a = _import_dlpack(a, s)
            p = a.producer
            if p is not None:
                if p is TORCH_PRODUCER:
                    if torch_handle is None:  # read once per call, and only when a torch tensor is there
                        torch_handle = torch_current_stream(device).ptr or LEGACY_STREAM
                    handle = torch_handle
                elif p is LEGACY_PRODUCER:
                    handle = LEGACY_STREAM
                else:
                    ptr = getattr(p, "ptr", None)  # a Stream (a DeviceArray's producer), else a CAI int
                    handle = (int(p) if ptr is None else ptr) or LEGACY_STREAM
                if handle != done and (type(done) is int or handle not in done):
                    order_after(s, handle)
                    done = {done, handle} if type(done) is int else done | {handle}
        out.append(a)
    return out


def _import_dlpack(a: Arg, s: Stream) -> Arg:
    """Import a DLPack-only array with ``s`` as the consumer stream; checks it is what was read."""
    from cuda.core.utils import StridedMemoryView

    view = StridedMemoryView.from_dlpack(a.obj, stream_ptr=s.ptr)
    shape = tuple(view.shape)
    strides = tuple(view.strides) if view.strides is not None else a.strides
    if shape != a.shape or strides != a.strides:
        raise ValueError(f"{a.name}: its DLPack export has shape {shape} and element strides {strides}, not the "
                         f"{a.shape} / {a.strides} its attributes said")
    return a._replace(ptr=int(view.ptr), obj=(view, a.obj), producer=None)


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

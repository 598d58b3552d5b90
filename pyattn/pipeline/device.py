"""The device side of a call: its device, its stream (the stream-order rule), outputs, bookkeeping."""

from __future__ import annotations

import numpy as np

from ..array import DeviceArray, allocate, c_strides
from ..interop.convert import device_of
from ..interop.inputs import DLPACK, HOST, TORCH
from ..interop.streams import choose_stream, note_use, order_inputs

__all__ = ["start", "output", "finish", "fetch_values"]


def start(stream, args, recheck=None):
    """Device, stream and ordered args of a call on device arrays.

    ``args``: the call's :class:`~pyattn.interop.inputs.Arg` objects (None allowed), outputs given
    by the caller included (a write must wait for the array's earlier readers and writers too).
    Returns ``(device, stream, args)`` with DLPack-only args imported; their addresses are known
    only then, so ``recheck(args)`` (the op's per-call address checks) runs again on them.
    """
    first = next(a for a in args if a is not None and a.kind != HOST)
    device = device_of(first)
    ordinal, dlpack, torch_in = device.ordinal, False, False
    for a in args:
        if a is not None:
            if a.ordinal is not None and a.ordinal != ordinal:
                raise ValueError(f"{a.name}: expected an array on device {ordinal} (with {first.name}), "
                                 f"got device {a.ordinal}")
            dlpack = dlpack or a.kind == DLPACK
            torch_in = torch_in or a.kind == TORCH
    device.activate()
    s, torch_now = choose_stream(stream, device, torch_in)
    ordered = order_inputs(s, device, args, torch_now)
    if recheck is not None and dlpack:
        recheck(ordered)
    return device, s, ordered


_layouts: dict = {}  # (shape, dtype) -> (dtype, byte strides, element strides, nbytes): ~3 us saved per result


def output(device, s, shape: tuple, dtype) -> DeviceArray:
    """A C-contiguous result array from pyattn's pool, ordered on ``s``."""
    fields = _layouts.get((shape, dtype))
    if fields is None:
        dt = np.dtype(dtype)
        if len(_layouts) >= 4096:
            _layouts.clear()
        fields = _layouts[(shape, dtype)] = (dt, c_strides(shape, dt.itemsize), c_strides(shape, 1),
                                             int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
    return allocate(device, s, shape, *fields)


def finish(s, args) -> None:
    """After the launches: blocks from pyattn's pool used on ``s`` are freed only after ``s``'s use."""
    note_use(s, args)


def fetch_values(a) -> np.ndarray:
    """The values of a small device array Arg (index arrays whose values a check needs), after its
    producer: one device-to-host copy and a synchronisation."""
    from ..interop.convert import asarray

    return asarray(a.obj).numpy()

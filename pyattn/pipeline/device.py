"""The device side of a call: its device, its stream (the stream-order rule), outputs, bookkeeping.

Two ways in: :func:`start` for a call read into Args (any array kind), and :func:`begin` for a
repeat call found by its quick key (:func:`pyattn.interop.quick.quick_key`), whose arrays are
DeviceArrays, torch tensors, CUDA array interfaces or DLPack-only arrays of a known layout: it
reads only their pointers and producer streams (an interface's, read with the key; a DLPack-only
array is imported on the call's stream). Both apply the same stream-order rule
(``pyattn.interop.streams``).
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

import math
from typing import NamedTuple

import numpy as np

from ..array import DeviceArray, allocate, c_strides
from ..interop.convert import device_of
from ..interop.inputs import CAI, DEVICE, DLPACK, HOST, TORCH, TORCH_PRODUCER
from ..interop.streams import choose_stream, import_dlpack, is_cupy, note_use, order_inputs, wait_for
from ..runtime.stream import default_stream, refuse_capture

__all__ = ["start", "Bound", "bind", "begin", "layout", "output", "finish", "fetch_values"]


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
    s, torch_now = choose_stream(stream, device, torch_in, _cupy_in(args))
    ordered = order_inputs(s, device, args, torch_now)
    if recheck is not None and dlpack:
        recheck(ordered)
    return device, s, ordered


def _cupy_in(args) -> bool:
    """Whether a CuPy array is among ``args`` (stream rule 2; read through its array interface)."""
    return any(a is not None and a.kind == CAI and is_cupy(a.obj) for a in args)


class Bound(NamedTuple):
    """What the repeat calls of one quick key share: the problem validation made, the device, per
    array parameter its kind (None: absent; ``DEVICE``; ``TORCH``; ``CAI``; ``DLPACK``), name and,
    for DLPack-only arrays, the (shape, element strides) their import must have, and the op's
    per-call address checks, ``check(problem, pointers)``."""

    problem: object
    device: object
    kinds: tuple
    names: tuple
    layouts: tuple
    check: object
    torch_in: bool  # a torch tensor among them (stream rule 2)
    own: object  # pyattn's own stream of the device (rule 3), looked up once
    dlpack: bool  # a DLPack-only array among them: imported per call, on the call's stream
    cupy_in: bool  # a CuPy array among them (rule 2 when no torch tensor is)


def bind(problem, device, args, check):
    """The :class:`Bound` of a call that :func:`start` has just run, ``args`` its Args in parameter
    order, ``check`` its address checks; None when an array is of a kind :func:`begin` does not
    read, or its device was not told by the array (then the driver is asked per call)."""
    kinds = []
    for a in args:
        if a is not None and (a.kind not in (DEVICE, TORCH, CAI, DLPACK) or a.ordinal != device.ordinal):
            return None
        kinds.append(None if a is None else a.kind)
    names = tuple(None if a is None else a.name for a in args)
    layouts = tuple((a.shape, a.strides) if a is not None and a.kind == DLPACK else None for a in args)
    return Bound(problem, device, tuple(kinds), names, layouts, check, TORCH in kinds, default_stream(device),
                 DLPACK in kinds, _cupy_in(args))


def begin(bound: Bound, stream, arrays, reads=None) -> tuple:
    """:func:`start` and :func:`finish`'s bookkeeping for a repeat call: ``arrays`` are the call's
    array parameters (the user's objects, in the order of ``bound.kinds``), ``reads`` the pointers
    and producers :func:`~pyattn.interop.quick.quick_key` read of its CUDA array interfaces. Reads
    their pointers and runs the op's address checks (before any device work, as on the full path),
    then activates the device, picks the stream (the rule), orders it after the arrays' producers,
    and notes the stream's use of pyattn's pool blocks among them (now rather than after the
    launches: their frees cannot run before this call returns). DLPack-only arrays are imported
    once the stream is chosen (it is their consumer stream), and the addresses checked then, as
    :func:`start` does; their views go to ``reads["views"]``, for the caller to keep until its
    launches are queued. Returns ``(stream, pointers)``, 0 for absent arrays."""
    ptrs, producers, owned = [], [], []
    for kind, x, name in zip(bound.kinds, arrays, bound.names):
        if kind is DEVICE:
            ptrs.append(x.ptr)
            producers.append(x.stream)
            owned.append(x)
        elif kind is TORCH:
            ptrs.append(x.data_ptr())
            producers.append(TORCH_PRODUCER)
        elif kind is CAI:
            ptr, producer = reads[name]
            ptrs.append(ptr)
            producers.append(producer)
        else:
            ptrs.append(0)  # (absent, or a DLPack-only array: imported below)
    if not bound.dlpack:
        bound.check(bound.problem, ptrs)
    device = bound.device
    device.activate()
    if stream is None and not bound.torch_in and not bound.cupy_in:
        s, torch_now = bound.own, None  # rule 3, as choose_stream would say
    else:
        s, torch_now = choose_stream(stream, device, bound.torch_in, bound.cupy_in)
    if bound.dlpack:
        views = reads["views"] = []
        for i, (kind, x, name, layout) in enumerate(zip(bound.kinds, arrays, bound.names, bound.layouts)):
            if kind is DLPACK:
                ptrs[i], view = import_dlpack(name, x, *layout, s)
                views.append(view)
        bound.check(bound.problem, ptrs)
    wait_for(s, device, producers, torch_now)
    if owned:
        note_use(s, owned)
    return s, ptrs


_layouts: dict = {}  # (shape, dtype) -> (shape, dtype, byte strides, element strides, nbytes): ~3 us per result


def layout(shape: tuple, dtype) -> tuple:
    """The fields of a C-contiguous result, ``(shape, dtype, byte strides, element strides, nbytes)``,
    as :func:`pyattn.array.allocate` takes them (cached: computing them costs more than the allocation)."""
    fields = _layouts.get((shape, dtype))
    if fields is None:
        dt = np.dtype(dtype)
        if len(_layouts) >= 4096:
            _layouts.clear()
        fields = _layouts[(shape, dtype)] = (shape, dt, c_strides(shape, dt.itemsize), c_strides(shape, 1),
                                             math.prod(shape) * dt.itemsize)
    return fields


def output(device, s, shape: tuple, dtype, capture=None) -> DeviceArray:
    """A C-contiguous result array from pyattn's pool, ordered on ``s`` (``capture``: see
    :meth:`~pyattn.runtime.memory.DevicePool.allocate`)."""
    return allocate(device, s, *layout(shape, dtype), capture)


def finish(s, args) -> None:
    """After the launches: blocks from pyattn's pool used on ``s`` are freed only after ``s``'s use."""
    note_use(s, args)


def fetch_values(a) -> np.ndarray:
    """The values of a small device array Arg (index arrays whose values a check needs), after its
    producer: one device-to-host copy and a synchronisation (refused on a stream capturing a graph)."""
    from ..interop.convert import asarray

    view = asarray(a.obj)
    if view.stream is not None:
        refuse_capture(view.stream, f"{a.name} is copied back to the host for its checks, a synchronisation "
                                    f"that no capture can hold (paged_decode and contiguous_decode read their "
                                    f"lengths on the device with max_seqlen=, attention_varlen and its backward "
                                    f"their offsets with max_seqlen_q= and max_seqlen_k=)")
    return view.numpy()

"""``pyattn.asarray``: a DeviceArray from NumPy data (a copy) or from any CUDA array (zero-copy)."""

from __future__ import annotations

import numpy as np

from ..array import DeviceArray, empty
from ..runtime.device import Device, get_device, keeps_context
from ..runtime.errors import check
from ..runtime.pinned import copy_to_device
from .inputs import CAI, TORCH, read
from .streams import choose_stream, is_cupy, order_inputs

__all__ = ["asarray", "device_of"]


def device_of(a) -> Device:
    """The device of a device :class:`~pyattn.interop.inputs.Arg` (the driver is asked only for an
    array interface that does not say it)."""
    if a.ordinal is not None:
        return get_device(a.ordinal)
    current = get_device()  # first: initialises the driver (a clear NoDeviceError without one)
    if not a.ptr:
        return current
    from cuda.bindings import driver

    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return get_device(int(check(driver.cuPointerGetAttribute(attr, a.ptr), "cuPointerGetAttribute")))


@keeps_context
def asarray(x, *, device: Device | None = None, stream=None) -> DeviceArray:
    """Return ``x`` as a :class:`~pyattn.DeviceArray`.

    Parameters
    ----------
    x : array-like
        A NumPy array (or anything ``numpy.asarray`` accepts): copied to the device. A
        ``DeviceArray``: returned as is. A CUDA array (torch tensor, CuPy/Numba/JAX array, anything
        with ``__cuda_array_interface__`` or a CUDA ``__dlpack__``): wrapped without a copy; the
        result keeps ``x`` alive.
    device : Device, optional
        Target device for host data (default: the current device).
    stream : optional
        Stream for the copy, or the stream the view is ordered on (pyattn's stream-order rule:
        torch tensors default to torch's current stream, CuPy arrays to CuPy's; the view waits for the
        array's producer).

    Returns
    -------
    DeviceArray
    """
    if isinstance(x, DeviceArray):
        return x
    a = read("x", x)
    if not a.on_device:
        host = np.ascontiguousarray(a.obj)
        out = empty(host.shape, host.dtype, device=device, stream=stream)
        out.device.activate()
        copy_to_device(out.ptr, host, out.stream)
        return out
    dev = device_of(a)
    dev.activate()
    s, torch_now = choose_stream(stream, dev, a.kind == TORCH, a.kind == CAI and is_cupy(a.obj))
    (a,) = order_inputs(s, dev, [a], torch_now)
    return DeviceArray(a.ptr, a.shape, a.dtype, dev, strides=tuple(st * a.dtype.itemsize for st in a.strides),
                       owner=a.obj, stream=s)

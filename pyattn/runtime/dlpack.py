"""DLPack export of device memory for every dtype pyattn returns, bfloat16 and fp8 included.

Why not ``cuda.core``: its ``StridedMemoryView.__dlpack__`` (1.2, and its source to date) writes
only NumPy's kinds b/i/u/f/c, so bfloat16 and the fp8 types (``ml_dtypes``, NumPy kind ``V``)
cannot leave through it, and it costs several driver queries per export. Building a
``PyCapsule`` from Python needs ``PyCapsule_New`` (ctypes or a compiled extension, neither of
which pyattn uses). So the route is:

1. NumPy fills the DLPack struct. A NumPy array is made over the device address through
   ``__array_interface__`` (NumPy never touches the memory of an array it only describes), with
   the same shape and strides and a same-width *carrier* dtype NumPy can export (``uint16`` for
   bfloat16, ``uint8`` for fp8, the dtype itself for the standard kinds). ``ndarray.__dlpack__``
   returns a capsule whose deleter releases that array, and with it the owner of the memory.
2. Two fields are then rewritten in the struct NumPy allocated: the device (kDLCPU -> kDLCUDA and
   the ordinal) and, for bfloat16/fp8, the type code. The struct is found through the capsule
   object, whose C layout (``PyObject_HEAD``, then the pointer, then the name) is fixed by
   CPython; before anything is written, every field that can be checked is checked (the
   capsule's name, the data pointer, ndim, device, the carrier's type code, bits and lanes), and
   any mismatch raises ``BufferError`` without writing. The reads and writes go through NumPy
   views of those few host addresses: slices of one uint8 view over the user address space (made
   once; a slice costs ~0.2 us where a fresh view costs ~0.8), which NumPy never reads by itself.

The DLPack layouts used (dlpack.h v1.x, stable since 0.6 for ``DLTensor``)::

    DLTensor:                 data@0 (void*), device@8 {type int32, id int32}, ndim@16 (int32),
                              dtype@20 {code u8, bits u8, lanes u16}, shape@24, strides@32,
                              byte_offset@40
    DLManagedTensor:          dl_tensor@0
    DLManagedTensorVersioned: version@0 {major u32, minor u32}, manager_ctx@8, deleter@16,
                              flags@24 (u64), dl_tensor@32
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["export_capsule", "dlpack_code", "KDL_CPU", "KDL_CUDA"]

KDL_CPU = 1
KDL_CUDA = 2
_KDL_UINT = 1
# ml_dtypes names -> DLPack type codes (dlpack.h DLDataTypeCode, v1.1+ for the fp8 codes).
_EXTENDED = {"bfloat16": 4, "float8_e3m4": 7, "float8_e4m3": 8, "float8_e4m3b11fnuz": 9,
             "float8_e4m3fn": 10, "float8_e4m3fnuz": 11, "float8_e5m2": 12, "float8_e5m2fnuz": 13,
             "float8_e8m0fnu": 14}
_PTRS = struct.Struct("=QQ")  # PyCapsule after its head: pointer, name
_HEAD = struct.Struct("=QiiiBBH")  # DLTensor's first 24 bytes: data, device, ndim, dtype
_DL_TENSOR_AT = {b"dltensor_versioned\0": 32, b"dltensor\0": 0}


_codes: dict = {}  # dtype -> (carrier, code): dtype.name of an ml_dtypes type costs ~1 us


def dlpack_code(dtype: np.dtype):
    """``(carrier dtype, code to write or None)`` for exporting ``dtype``; raises BufferError if
    DLPack has no code for it (structured or object dtypes, unknown extension types)."""
    hit = _codes.get(dtype)
    if hit is not None:
        return hit
    code = _EXTENDED.get(dtype.name)
    if code is not None:
        hit = np.dtype(f"u{dtype.itemsize}"), code
    elif dtype.kind in "biufc" and dtype.isnative:
        hit = dtype, None
    else:
        raise BufferError(f"DLPack has no type code for dtype {dtype}")
    _codes[dtype] = hit
    return hit


class _Described:
    """An object NumPy turns into an array over ``ptr`` without reading or copying it."""

    def __init__(self, ptr: int, shape: tuple, strides, typestr: str, owner):
        self.owner = owner  # kept alive by the array, hence by the capsule, until the consumer is done
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "strides": strides,
                                    "typestr": typestr, "version": 3}


_WINDOW_BASE = 1 << 12  # no mapping below the first page
_WINDOW_END = 1 << 47  # the top of x86-64 / aarch64 user space with 4-level paging
_window = None  # a uint8 view of [_WINDOW_BASE, _WINDOW_END), made on first use


def _view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 NumPy view of ``nbytes`` of this process's memory at ``addr``."""
    global _window
    if _WINDOW_BASE <= addr and addr + nbytes <= _WINDOW_END:
        if _window is None:
            _window = np.asarray(_Described(_WINDOW_BASE, (_WINDOW_END - _WINDOW_BASE,), None, "|u1", None))
        return _window[addr - _WINDOW_BASE:addr - _WINDOW_BASE + nbytes]
    return np.asarray(_Described(addr, (nbytes,), None, "|u1", None))


def export_capsule(ptr: int, shape: tuple, strides: tuple, dtype: np.dtype, ordinal: int, owner, *,
                   versioned: bool):
    """A DLPack capsule for a CUDA array.

    Parameters
    ----------
    ptr : int
        Device address of element ``[0, ..., 0]``.
    shape, strides : tuple of int
        Shape and byte strides.
    dtype : numpy.dtype
        Any dtype :func:`dlpack_code` accepts.
    ordinal : int
        The CUDA device ordinal.
    owner : object
        Kept alive until the consumer releases the capsule.
    versioned : bool
        A DLPack >= 1.0 ``dltensor_versioned`` capsule, else the legacy ``dltensor``.

    Raises
    ------
    BufferError
        For a dtype DLPack cannot express, or when the struct NumPy wrote is not laid out as
        expected (nothing is written then).
    """
    carrier, code = dlpack_code(dtype)
    arr = np.asarray(_Described(ptr, tuple(shape), tuple(strides), carrier.str, owner))
    if versioned:
        try:
            capsule = arr.__dlpack__(max_version=(1, 0))
        except TypeError:  # NumPy < 2.1 writes only the legacy capsule
            capsule = arr.__dlpack__()
    else:
        capsule = arr.__dlpack__()
    _retag(capsule, ptr, len(shape), arr.size, carrier, code, ordinal)
    return capsule


_devices: dict = {}  # ordinal -> the 8 bytes of DLDevice {kDLCUDA, ordinal}


def _retag(capsule, ptr: int, ndim: int, size: int, carrier: np.dtype, code, ordinal: int) -> None:
    """Point the capsule's DLTensor at the CUDA device (and set ``code``), after checking it."""
    head = object.__basicsize__  # PyObject_HEAD: 16 bytes, 32 in free-threaded builds
    if type(capsule).__basicsize__ != head + 32:
        raise BufferError("DLPack export: unexpected PyCapsule layout in this Python build")
    struct_ptr, name_ptr = _PTRS.unpack(_view(id(capsule) + head, 16).tobytes())
    # The name from the capsule's repr ('<capsule object "dltensor" at 0x...>'): no memory read.
    text = repr(capsule)
    name = text.split('"')[1].encode() + b"\0" if name_ptr and text.count('"') == 2 else b""
    if name not in _DL_TENSOR_AT or not struct_ptr:
        raise BufferError("DLPack export: NumPy's capsule is not a DLPack tensor capsule")
    tensor = _view(struct_ptr + _DL_TENSOR_AT[name], 24)
    data, device_type, _, nd, dl_code, bits, lanes = _HEAD.unpack(tensor.tobytes())
    if (device_type != KDL_CPU or nd != ndim or bits != 8 * carrier.itemsize or lanes != 1
            or (size and data != ptr) or (code is not None and dl_code != _KDL_UINT)):
        raise BufferError("DLPack export: the struct NumPy wrote is not laid out as expected; nothing was changed")
    dev = _devices.get(ordinal)
    if dev is None:
        dev = _devices[ordinal] = np.array([KDL_CUDA, ordinal], np.int32).view(np.uint8)
    tensor[8:16] = dev
    if code is not None:
        tensor[20] = code

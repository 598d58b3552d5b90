"""Reading the arrays users pass, once per argument per call.

Kinds: NumPy arrays (host), :class:`pyattn.DeviceArray`, torch tensors, any object with
``__cuda_array_interface__`` (CuPy, Numba, JAX, ...) and any object with a CUDA ``__dlpack__``
(JAX bfloat16, ...). A reader is chosen once per Python type and cached, so a call costs one dict
lookup plus the reads themselves: for torch that is ``data_ptr()``, ``shape``, ``stride()``,
``dtype`` and ``get_device()`` (about 0.1 us each, measured on an H200 host) instead of its
``__cuda_array_interface__`` (1.6 us and no stream). pyattn never imports torch: a tensor is
recognised through ``sys.modules["torch"]``, which exists whenever a tensor does.

Nothing here touches the GPU, so every reading error is a TypeError/ValueError naming the argument,
on machines without a driver too.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

import sys
from typing import NamedTuple

import numpy as np

from ..array import DeviceArray, c_strides

__all__ = ["Arg", "read", "read_optional", "read_args", "type_kind", "dlpack_ordinal", "HOST", "DEVICE", "TORCH",
           "CAI", "DLPACK", "LEGACY_PRODUCER", "TORCH_PRODUCER", "numpy_dtype"]

# Kinds of argument.
HOST, DEVICE, TORCH, CAI, DLPACK = "host", "device", "torch", "cai", "dlpack"
# Producer markers (see interop.streams): the data was written on the legacy default stream (CAI
# without a stream, per the rule), or on torch's current stream.
LEGACY_PRODUCER = "legacy"
TORCH_PRODUCER = "torch"
_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13


class Arg(NamedTuple):
    """One array argument as read for this call.

    ``strides`` are in elements. ``ordinal`` is the CUDA device (None for host arrays, or for a
    CUDA array interface whose device can only be told by asking the driver). ``producer`` says
    which stream wrote the data: a pyattn Stream, an int ``CUstream`` handle (CAI v3), one of the
    markers above, or None (host data, DLPack imports ordered by the protocol itself).
    """

    name: str
    kind: str
    shape: tuple
    dtype: np.dtype
    strides: tuple
    ordinal: object
    ptr: int
    producer: object
    obj: object

    @property
    def on_device(self) -> bool:
        return self.kind != HOST


# -- readers ----------------------------------------------------------------------------------------


def _read_device_array(name, a):
    ordinal = a.device.ordinal if a.device is not None else None
    return Arg(name, DEVICE, a.shape, a.dtype, a.elem_strides, ordinal, a.ptr, a.stream, a)


def _read_numpy(name, x):
    return Arg(name, HOST, x.shape, x.dtype, c_strides(x.shape), None, 0, None, x)


_torch_dtypes: dict = {}


def _torch_dtype(name, dt) -> np.dtype:
    out = _torch_dtypes.get(dt)
    if out is None:
        out = _torch_dtypes[dt] = numpy_dtype(name, str(dt).replace("torch.", ""))
    return out


def _read_torch(name, t):
    ordinal = t.get_device()
    if ordinal < 0:  # a CPU (or meta) tensor: host data, read through NumPy
        try:
            host = t.numpy()
        except Exception as exc:  # requires_grad, bfloat16, meta, ...
            raise TypeError(f"{name}: a CPU torch tensor must convert to NumPy (.numpy()): {exc}") from None
        return _read_numpy(name, host)
    return Arg(name, TORCH, tuple(t.shape), _torch_dtype(name, t.dtype), tuple(t.stride()), ordinal, t.data_ptr(),
               TORCH_PRODUCER, t)


def _read_cai(name, x, cai):
    shape, dtype, strides, ptr, producer = _parse_cai(name, cai)
    if dtype.kind == "V":  # an opaque type ('<V2': bfloat16 from torch or CuPy): the dtype attribute names it
        named = _named_dtype(x, dtype.itemsize)
        if named is not None:
            dtype = named
        elif _has_cuda_dlpack(x):
            return _read_dlpack(name, x)
        else:
            raise TypeError(f"{name}: its __cuda_array_interface__ has the opaque type {cai['typestr']!r}, and "
                            f"neither a .dtype attribute nor __dlpack__ tells the real dtype")
    return Arg(name, CAI, shape, dtype, strides, dlpack_ordinal(x), ptr, producer, x)


def _named_dtype(x, itemsize: int):
    """The NumPy dtype the object's own ``.dtype`` names, if it has that item size."""
    try:
        dt = numpy_dtype("", x.dtype)
    except Exception:
        return None
    return dt if dt.itemsize == itemsize and dt.type is not np.void else None


def _parse_cai(name, cai):
    """Validate a CUDA array interface dict; returns shape, dtype, element strides, ptr, producer."""
    if not isinstance(cai, dict):
        raise TypeError(f"{name}: __cuda_array_interface__ must be a dict, got {type(cai).__name__}")
    for key in ("shape", "typestr", "data"):
        if key not in cai:
            raise TypeError(f"{name}: __cuda_array_interface__ has no {key!r} entry")
    shape = cai["shape"]
    if not isinstance(shape, (tuple, list)) or not all(_is_int(n) and n >= 0 for n in shape):
        raise ValueError(f"{name}: __cuda_array_interface__ shape must be non-negative ints, got {shape!r}")
    shape = tuple(int(n) for n in shape)
    try:
        dtype = np.dtype(cai["typestr"])
    except Exception:
        raise TypeError(f"{name}: __cuda_array_interface__ typestr {cai['typestr']!r} is not a NumPy type") from None
    data = cai["data"]
    if not isinstance(data, (tuple, list)) or len(data) != 2 or not _is_int(data[0]) or data[0] < 0:
        raise TypeError(f"{name}: __cuda_array_interface__ data must be (pointer, read_only), got {data!r}")
    if data[1]:
        raise ValueError(f"{name}: the array is read-only (__cuda_array_interface__ data[1] is True)")
    if cai.get("mask") is not None:
        raise ValueError(f"{name}: masked arrays are not supported (__cuda_array_interface__ mask)")
    strides = cai.get("strides")
    if strides is None:
        strides = _dense_strides(shape)
    else:
        if (not isinstance(strides, (tuple, list)) or len(strides) != len(shape)
                or not all(_is_int(s) for s in strides)):
            raise ValueError(f"{name}: __cuda_array_interface__ strides must be {len(shape)} ints, got {strides!r}")
        if any(s % dtype.itemsize for s in strides):
            raise ValueError(f"{name}: strides must be multiples of the item size {dtype.itemsize}, "
                             f"got byte strides {tuple(strides)}")
        strides = tuple(int(s) // dtype.itemsize for s in strides)
    if int(cai.get("version", 0)) >= 3:
        stream = cai.get("stream")
        if stream is not None and (not _is_int(stream) or stream == 0):
            raise ValueError(f"{name}: __cuda_array_interface__ stream must be None or a nonzero int, got {stream!r}")
        producer = LEGACY_PRODUCER if stream is None else int(stream)
    else:
        producer = LEGACY_PRODUCER
    return shape, dtype, strides, int(data[0]), producer


def _read_dlpack(name, x):
    """Metadata of a DLPack-only CUDA array, read without importing it: the import itself (which
    needs the consumer stream) happens at execution (``interop.streams``)."""
    shape, dt = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dt is None:
        raise TypeError(f"{name}: a DLPack-only array needs .shape and .dtype attributes, got {type(x).__name__}")
    if not all(_is_int(n) and n >= 0 for n in shape):
        raise ValueError(f"{name}: shape must be non-negative ints, got {tuple(shape)!r}")
    dtype = numpy_dtype(name, dt)
    shape = tuple(int(n) for n in shape)
    if callable(getattr(x, "stride", None)):
        strides = tuple(int(s) for s in x.stride())
    elif getattr(x, "strides", None) is not None:
        strides = tuple(int(s) // dtype.itemsize for s in x.strides)
    else:  # JAX arrays are dense row-major
        strides = c_strides(shape)
    return Arg(name, DLPACK, shape, dtype, strides, dlpack_ordinal(x), 0, None, x)


def _reject(name, x):
    raise TypeError(f"{name}: expected a NumPy array or a CUDA array (pyattn.DeviceArray, a torch/CuPy/JAX "
                    f"array: __cuda_array_interface__ or __dlpack__), got {type(x).__name__}")


def _is_int(x) -> bool:
    if type(x) is int:  # the common case first: interface dicts hold plain ints (18 checks a call)
        return True
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


_dense: dict = {}  # shape -> C-contiguous element strides (an interface without strides, every call)


def _dense_strides(shape: tuple) -> tuple:
    strides = _dense.get(shape)
    if strides is None:
        if len(_dense) >= 4096:
            _dense.clear()
        strides = _dense[shape] = c_strides(shape)
    return strides


def _has_cuda_dlpack(x) -> bool:
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None or getattr(x, "__dlpack__", None) is None:
        return False
    try:
        return dev()[0] in (_KDL_CUDA, _KDL_CUDA_MANAGED)
    except Exception:
        return False


def dlpack_ordinal(x):
    """The device ordinal from ``__dlpack_device__`` when the object has it (no driver call)."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return None
    try:
        kind, ordinal = dev()
    except Exception:
        return None
    return int(ordinal) if kind in (_KDL_CUDA, _KDL_CUDA_MANAGED) else None


def numpy_dtype(name: str, dt) -> np.dtype:
    """NumPy dtype of a foreign dtype object or name (``bfloat16`` and fp8 through ml_dtypes)."""
    if isinstance(dt, np.dtype):
        return dt
    text = str(dt).replace("torch.", "")
    if text in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, text))
    try:
        return np.dtype(text)
    except TypeError:
        raise TypeError(f"{name}: unsupported dtype {dt}") from None


def _choose(tp):
    """The reader for objects of type ``tp`` (decided once per type). Types pyattn does not know
    get the generic reader, which looks at each object: an array interface may be set per
    instance (a SimpleNamespace wrapper, as in Numba's examples)."""
    if issubclass(tp, DeviceArray):
        return _read_device_array
    if issubclass(tp, np.ndarray):
        return _read_numpy
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        return _read_torch
    return _read_generic


def _read_generic(name, x):
    # The interface is read once: CuPy builds its dict (and looks up its current stream) per access.
    try:
        cai = x.__cuda_array_interface__
    except AttributeError:
        cai = None
    except Exception as exc:  # a getter that raises (old torch with bfloat16 or requires_grad): present
        if _has_cuda_dlpack(x):
            return _read_dlpack(name, x)
        raise TypeError(f"{name}: reading its __cuda_array_interface__ failed: {exc}") from None
    if cai is not None:
        return _read_cai(name, x, cai)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _read_dlpack_or_host(name, x)
    if hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
        return _read_array_like(name, x)
    return _reject(name, x)


def _read_dlpack_or_host(name, x):
    if _has_cuda_dlpack(x):
        return _read_dlpack(name, x)
    return _read_array_like(name, x)


def _read_array_like(name, x):
    try:
        host = np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{name}: could not read it as a NumPy array: {exc}") from None
    if host.dtype == object:
        _reject(name, x)
    return _read_numpy(name, host)


_readers: dict = {}  # type -> its reader (_choose's answer, made once per type)


def _reader(tp):
    reader = _readers[tp] = _choose(tp)
    return reader


_TYPE_KINDS = {_read_device_array: DEVICE, _read_numpy: HOST, _read_torch: TORCH, _read_generic: CAI}


def read(name: str, x) -> Arg:
    """Read argument ``name``.

    Raises
    ------
    TypeError, ValueError
        For anything that is not an array pyattn can read, or a malformed array interface; the
        message starts with ``name``.
    """
    reader = _readers.get(type(x))
    return (reader or _reader(type(x)))(name, x)


def type_kind(tp) -> str:
    """What :func:`read` makes of objects of type ``tp``: ``DEVICE``, ``HOST`` (NumPy), ``TORCH``
    (a CPU tensor among them: host data), or ``CAI`` for any other type, whose objects are looked
    at one by one (an array interface, DLPack, or an array-like)."""
    return _TYPE_KINDS[_readers.get(tp) or _reader(tp)]


def read_optional(name: str, x):
    """:func:`read`, or None for None."""
    return None if x is None else read(name, x)


def read_args(params: dict, names, required) -> dict:
    """``{name: Arg or None}`` for the array parameters ``names`` of an op's ``params``: :func:`read`
    for the ``required`` ones, :func:`read_optional` for the others."""
    return {n: read(n, params[n]) if n in required else read_optional(n, params[n]) for n in names}

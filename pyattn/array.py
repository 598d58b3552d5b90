"""``pyattn.DeviceArray``: a strided view of device memory that other libraries can read zero-copy.

Exports ``__cuda_array_interface__`` (v3) and ``__dlpack__``/``__dlpack_device__``; imports NumPy
arrays (copied to the device), other ``DeviceArray`` objects, and any CUDA array with either
protocol (CuPy, PyTorch, JAX, Numba) without a copy. ``strides`` are in bytes, as in NumPy.

Thread safety: a DeviceArray is an immutable description of memory; concurrent reads of the
same array from several streams are fine, concurrent writes are the user's to order.
"""

from __future__ import annotations

import math
import os

import numpy as np

from .runtime.device import Device, get_device
from .runtime.errors import check
from .runtime.memory import copy_to_device, copy_to_host, get_pool, memset_async
from .runtime.stream import Stream, as_stream

__all__ = ["DeviceArray", "asarray", "empty", "is_device_array"]

_KDL_CUDA = 2  # DLPack device type for CUDA device memory


def _c_strides(shape, itemsize: int) -> tuple:
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


class DeviceArray:
    """An n-dimensional array in device memory.

    Parameters
    ----------
    ptr : int
        Device address of element ``[0, ..., 0]``.
    shape : tuple of int
    dtype : numpy.dtype-like
        ``float32``, ``float16``, ``ml_dtypes.bfloat16``, ... (any NumPy dtype).
    device : Device
    strides : tuple of int, optional
        Byte strides; C-contiguous if omitted.
    owner : object, optional
        What keeps the memory alive: a pool :class:`~pyattn.runtime.memory.Allocation` or the
        foreign array this is a view of.
    stream : Stream, optional
        The stream whose work produces the data; consumers of the protocols are synchronised with it.

    Notes
    -----
    Create arrays with :func:`asarray` or :func:`empty` rather than directly.
    """

    __slots__ = ("ptr", "shape", "dtype", "strides", "elem_strides", "device", "owner", "stream", "__weakref__")

    def __init__(self, ptr: int, shape, dtype, device: Device, *, strides=None, owner=None, stream=None):
        self.ptr = int(ptr)
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        itemsize = self.dtype.itemsize
        self.strides = tuple(int(s) for s in strides) if strides is not None else _c_strides(self.shape, itemsize)
        if any(s % itemsize for s in self.strides):
            raise ValueError(f"strides: expected multiples of the item size {itemsize}, got {self.strides}")
        # Element strides, computed once: kernels take them, and the hot path hashes them.
        self.elem_strides = tuple(s // itemsize for s in self.strides)
        self.device, self.owner, self.stream = device, owner, stream

    @classmethod
    def _wrap(cls, ptr, shape, dtype, strides, elem_strides, device, owner, stream) -> "DeviceArray":
        """Construct from already-normalised fields (the per-call output path skips the checks)."""
        a = cls.__new__(cls)
        a.ptr, a.shape, a.dtype, a.strides, a.elem_strides = ptr, shape, dtype, strides, elem_strides
        a.device, a.owner, a.stream = device, owner, stream
        return a

    # -- basic properties -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def is_c_contiguous(self) -> bool:
        c = _c_strides(self.shape, self.itemsize)
        return all(s == cs for s, cs, n in zip(self.strides, c, self.shape) if n > 1)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device.ordinal})"

    # -- interchange protocols ----------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        cai = {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self.ptr, False),
            "strides": None if self.is_c_contiguous else self.strides,
            "version": 3,
        }
        if self.stream is not None:
            cai["stream"] = self.stream.ptr  # consumers wait on the producing stream
        return cai

    def __dlpack_device__(self) -> tuple:
        return (_KDL_CUDA, self.device.ordinal)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export as a DLPack capsule (through ``cuda.core``'s ``StridedMemoryView``).

        ``stream`` is the consumer's stream: it is made to wait for the work that produced this
        array (DLPack's contract), without blocking the host.
        """
        from cuda.core import Buffer
        from cuda.core.utils import StridedMemoryView

        if copy:
            raise BufferError("DeviceArray.__dlpack__: copy=True is not supported; export is zero-copy")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray.__dlpack__: cannot export to device {dl_device}")
        # DLPack's stream ints are CUstream handles (1 = CU_STREAM_LEGACY, 2 = CU_STREAM_PER_THREAD
        # are valid driver handles too); -1 / None ask for no synchronisation.
        if isinstance(stream, int) and stream != -1 and self.stream is not None and stream != self.stream.ptr:
            Stream(self.device, handle=stream).wait(self.stream.record())
        lo, hi = self._byte_extent()
        buf = Buffer.from_handle(self.ptr + lo, max(hi - lo, 1), owner=self)
        view = StridedMemoryView.from_buffer(buf, self.shape, self.elem_strides, dtype=self.dtype)
        kwargs = {} if max_version is None else {"max_version": max_version}
        try:
            return view.__dlpack__(stream=-1, **kwargs)
        except BufferError as exc:
            if self.dtype.name != "bfloat16":
                raise
            # cuda.core (<= 1.2) cannot write a bfloat16 DLPack capsule, and building one by hand
            # would need ctypes. Reinterpreting the bits is zero-copy and exact.
            raise BufferError(
                "DeviceArray.__dlpack__: this cuda.core cannot export bfloat16 through DLPack; export "
                "the raw bits and reinterpret them, e.g. torch.from_dlpack(a.view(numpy.uint16))"
                ".view(torch.bfloat16)") from exc

    def view(self, dtype) -> "DeviceArray":
        """Reinterpret the same memory as another dtype of the same item size (zero-copy).

        Parameters
        ----------
        dtype : numpy.dtype-like
            E.g. ``numpy.uint16`` for a bfloat16 array, to pass it through DLPack.
        """
        dtype = np.dtype(dtype)
        if dtype.itemsize != self.itemsize:
            raise ValueError(f"dtype: expected an item size of {self.itemsize} bytes, got {dtype} ({dtype.itemsize})")
        return DeviceArray(self.ptr, self.shape, dtype, self.device, strides=self.strides, owner=self, stream=self.stream)

    def transpose(self, *axes) -> "DeviceArray":
        """Permute the axes without a copy (NumPy's ``transpose``): same memory, permuted strides.

        Parameters
        ----------
        *axes : int, or one tuple of int
            A permutation of ``range(ndim)`` (negative axes count from the end); none reverses
            the axes. E.g. ``lse.transpose(0, 2, 1)`` turns an attention LSE (B, H, S) into the
            (B, S, H) view that :func:`pyattn.merge_states` pairs with a ``bshd`` output.

        Returns
        -------
        DeviceArray
            Shares ``owner`` and ``stream`` with this array (the memory stays alive with it).
        """
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        n = self.ndim
        if not axes:
            axes = tuple(range(n - 1, -1, -1))
        if any(isinstance(a, bool) or not isinstance(a, (int, np.integer)) for a in axes):
            raise TypeError(f"axes: expected ints, got {axes!r}")
        perm = tuple(int(a) + n if -n <= a < 0 else int(a) for a in axes)
        if sorted(perm) != list(range(n)):
            raise ValueError(f"axes: expected a permutation of range({n}), got {axes!r}")
        return DeviceArray._wrap(self.ptr, tuple(self.shape[a] for a in perm), self.dtype,
                                 tuple(self.strides[a] for a in perm), tuple(self.elem_strides[a] for a in perm),
                                 self.device, self.owner, self.stream)

    def _byte_extent(self) -> tuple:
        """Byte range ``[lo, hi)`` relative to ``ptr`` that the view touches."""
        lo = hi = 0
        if self.size == 0:
            return 0, 0
        for n, s in zip(self.shape, self.strides):
            span = (n - 1) * s
            lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
        return lo, hi + self.itemsize

    # -- host transfer ------------------------------------------------------------------------
    def numpy(self, stream=None) -> np.ndarray:
        """Copy to a new NumPy array (blocks until the copy is done).

        Parameters
        ----------
        stream : optional
            Stream to copy on (default: the array's producing stream, else pyattn's stream).
        """
        s = as_stream(stream, self.device) if stream is not None else (self.stream or as_stream(None, self.device))
        self.device.activate()
        if self.is_c_contiguous:
            out = np.empty(self.shape, self.dtype)
            copy_to_host(out, self.ptr, s)
            return out
        # A strided view (e.g. a slice of a foreign array): fetch the byte span it covers, then
        # gather on the host.
        lo, hi = self._byte_extent()
        raw = np.empty(hi - lo, np.uint8)
        copy_to_host(raw, self.ptr + lo, s)
        view = np.ndarray(self.shape, dtype=self.dtype, buffer=raw, offset=-lo, strides=self.strides)
        return np.ascontiguousarray(view)


def has_cai(x) -> bool:
    """Whether ``x`` offers ``__cuda_array_interface__``: a getter that raises (torch with
    ``requires_grad``, old torch for bfloat16) still counts as present."""
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:
        return True


def is_device_array(x) -> bool:
    """True for a :class:`DeviceArray` or any object exposing CUDA memory via CAI or DLPack."""
    if isinstance(x, DeviceArray) or has_cai(x):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None or isinstance(x, np.ndarray):
        return False
    try:
        return dev()[0] in (_KDL_CUDA, 13)  # 13 = kDLCUDAManaged
    except Exception:
        return False


def empty(shape, dtype, *, device: Device | None = None, stream=None) -> DeviceArray:
    """Allocate an uninitialised C-contiguous device array from pyattn's memory pool.

    With the environment variable ``PYATTN_POISON_ALLOC=1`` every new array is filled with
    0xFF bytes (NaN for floating types), so tests catch elements a kernel forgot to write even
    when the pool hands back a block holding an earlier, valid result.
    """
    device = device if device is not None else get_device()
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    return allocate(device, as_stream(stream, device), shape, dtype, _c_strides(shape, dtype.itemsize),
                    _c_strides(shape, 1), math.prod(shape) * dtype.itemsize)


def allocate(device, stream, shape, dtype, strides, elem_strides, nbytes) -> DeviceArray:
    """:func:`empty` for callers that already hold normalised fields (the per-call op path)."""
    alloc = get_pool(device).allocate(nbytes, stream)
    if os.environ.get("PYATTN_POISON_ALLOC") == "1":
        memset_async(alloc.ptr, 0xFF, nbytes, stream)
    return DeviceArray._wrap(alloc.ptr, shape, dtype, strides, elem_strides, device, alloc, stream)


def _device_of_pointer(ptr: int) -> Device:
    from cuda.bindings import driver

    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    ordinal = check(driver.cuPointerGetAttribute(attr, ptr), "cuPointerGetAttribute")
    return get_device(int(ordinal))


def cai_dtype(cai: dict):
    """The dtype a CAI dict describes, or None when it is an opaque void type (torch exports
    bfloat16 as ``'<V2'``), in which case the caller must use DLPack instead."""
    dtype = np.dtype(cai["typestr"])
    return None if dtype.kind == "V" else dtype


def _from_cai(x, cai: dict, dtype, stream) -> DeviceArray:
    ptr = cai["data"][0]
    device = _device_of_pointer(ptr) if ptr else get_device()
    s = as_stream(stream, device)
    producer = cai.get("stream")
    if producer is not None and producer != s.ptr:
        # CAI v3: the consumer orders itself after the producer's stream (1 and 2 are the
        # legacy and per-thread default streams, which are also valid driver handles).
        s.wait(Stream(device, handle=producer).record())
    return DeviceArray(ptr, cai["shape"], dtype, device, strides=cai.get("strides"), owner=x, stream=s)


def _from_dlpack(x, stream) -> DeviceArray:
    from cuda.core.utils import StridedMemoryView

    _, ordinal = x.__dlpack_device__()
    device = get_device(int(ordinal))
    s = as_stream(stream, device)
    view = StridedMemoryView.from_dlpack(x, stream_ptr=s.ptr)
    itemsize = np.dtype(view.dtype).itemsize
    strides = None if view.strides is None else tuple(st * itemsize for st in view.strides)
    return DeviceArray(view.ptr, view.shape, view.dtype, device, strides=strides, owner=(view, x), stream=s)


def asarray(x, *, device: Device | None = None, stream=None) -> DeviceArray:
    """Return ``x`` as a :class:`DeviceArray`.

    Parameters
    ----------
    x : array-like
        A NumPy array (or anything ``numpy.asarray`` accepts): copied to the device.
        A ``DeviceArray``: returned as is. An object with ``__cuda_array_interface__`` or a
        CUDA ``__dlpack__``: wrapped without a copy (the result keeps ``x`` alive).
    device : Device, optional
        Target device for host data (default: the current device).
    stream : optional
        Stream for the copy, or the stream the view will be used on.

    Returns
    -------
    DeviceArray
    """
    if isinstance(x, DeviceArray):
        return x
    if has_cai(x):
        try:
            cai = x.__cuda_array_interface__
        except Exception:  # e.g. torch with requires_grad, or old torch for bfloat16: use DLPack
            cai = None
        dtype = cai_dtype(cai) if cai is not None else None
        if dtype is not None:
            return _from_cai(x, cai, dtype, stream)
    if is_device_array(x):
        return _from_dlpack(x, stream)
    host = np.ascontiguousarray(x)
    out = empty(host.shape, host.dtype, device=device, stream=stream)
    out.device.activate()
    copy_to_device(out.ptr, host, out.stream)
    return out

"""``pyattn.DeviceArray``: a strided view of device memory that other libraries can read zero-copy.

Exports ``__dlpack__``/``__dlpack_device__`` for every dtype (bfloat16 and fp8 included, see
:mod:`pyattn.runtime.dlpack`) and ``__cuda_array_interface__`` (v3) for the dtypes that interface
can name (NumPy's numeric kinds; bfloat16 and fp8 have no typestr, so consumers such as torch and
CuPy take those through DLPack). ``strides`` are in bytes, as in NumPy. :func:`pyattn.asarray`
(``pyattn.interop.convert``) makes DeviceArrays from NumPy and foreign CUDA arrays.

Thread safety: a DeviceArray is an immutable description of memory; concurrent reads of the
same array from several streams are fine, concurrent writes are the user's to order.
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np

from .runtime.device import Device, get_device, keeps_context
from .runtime.dlpack import KDL_CUDA, export_capsule
from .runtime import memory
from .runtime.memory import get_pool, memset_async, poison_alloc
from .runtime.pinned import copy_to_host
from .runtime.stream import LEGACY_STREAM, as_stream, borrowed, order_after

__all__ = ["DeviceArray", "empty", "allocate", "c_strides"]


def c_strides(shape, itemsize: int = 1) -> tuple:
    """C-contiguous strides of ``shape`` in units of ``itemsize`` (elements for 1)."""
    try:
        return _c_strides(shape, itemsize)
    except TypeError:  # an unhashable shape (a list)
        return _c_strides(tuple(shape), itemsize)


@functools.lru_cache(maxsize=1024)
def _c_strides(shape: tuple, itemsize: int) -> tuple:
    # Cached: a NumPy call takes them ~4 times for its few shapes (~2 us each computed).
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
        if any(n < 0 for n in self.shape):
            raise ValueError(f"shape: expected non-negative dims, got {self.shape}")
        self.dtype = np.dtype(dtype)
        itemsize = self.dtype.itemsize
        self.strides = tuple(int(s) for s in strides) if strides is not None else c_strides(self.shape, itemsize)
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
        return math.prod(self.shape)  # Python ints: exact, and ~10x cheaper than np.prod

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def is_c_contiguous(self) -> bool:
        c = c_strides(self.shape, self.itemsize)
        return all(s == cs for s, cs, n in zip(self.strides, c, self.shape) if n > 1)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device.ordinal})"

    # -- interchange protocols ----------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        if self.dtype.kind not in "biufc":
            # bfloat16 / fp8 ('<V2', '|V1') would reach consumers as opaque bytes: raising
            # AttributeError hides the interface, so torch, CuPy and others use __dlpack__.
            raise AttributeError(f"__cuda_array_interface__ cannot name dtype {self.dtype}; use __dlpack__")
        cai = {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self.ptr, False),
            "strides": None if self.is_c_contiguous else self.strides,
            "version": 3,
        }
        if self.stream is not None:
            cai["stream"] = self.stream.ptr  # consumers wait on the producing stream (never 0, see Stream)
        return cai

    def __dlpack_device__(self) -> tuple:
        return (KDL_CUDA, self.device.ordinal)

    @keeps_context
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export as a DLPack capsule, zero-copy, for any dtype (see :mod:`pyattn.runtime.dlpack`).

        ``stream`` is the consumer's stream (DLPack's contract): it is made to wait for the work that
        produced this array, without blocking the host. ``None`` means the legacy default stream,
        -1 no synchronisation, 1 and 2 the legacy and per-thread default streams, any other int a
        ``CUstream`` handle.
        """
        if copy:
            raise BufferError("DeviceArray.__dlpack__: copy=True is not supported; export is zero-copy")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray.__dlpack__: cannot export to device {dl_device}")
        consumer = LEGACY_STREAM if stream is None else stream
        if not isinstance(consumer, int) or isinstance(consumer, bool):
            raise TypeError(f"stream: expected None or an int CUstream handle, got {type(stream).__name__}")
        if consumer != -1 and self.stream is not None:
            if consumer <= 2:  # the legacy (0, 1) or per-thread (2) stream of the *current* context: ours
                self.device.activate()
            waiter = borrowed(self.device, consumer)  # (a consumer's 0 is the legacy stream, as 1: see Stream)
            if waiter.ptr != self.stream.ptr:
                order_after(waiter, self.stream.ptr)
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return export_capsule(self.ptr, self.shape, self.strides, self.dtype, self.device.ordinal, self,
                              versioned=versioned)

    def __cupy_get_ndarray__(self):
        """CuPy's hook for objects without a usable ``__cuda_array_interface__`` (bfloat16 here):
        ``cupy.asarray(a)`` then imports through DLPack. Only called by CuPy, which is imported then."""
        return sys.modules["cupy"].from_dlpack(self)

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
    @keeps_context
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


@keeps_context
def empty(shape, dtype, *, device: Device | None = None, stream=None) -> DeviceArray:
    """Allocate an uninitialised C-contiguous device array from pyattn's memory pool.

    With ``PYATTN_POISON_ALLOC=1`` in the environment at the first allocation (or
    ``pyattn.runtime.memory.POISON_ALLOC = True``) every new array is filled with
    0xFF bytes (NaN for floating types), so tests catch elements a kernel forgot to write even
    when the pool hands back a block holding an earlier, valid result.
    """
    device = device if device is not None else get_device()
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    return allocate(device, as_stream(stream, device), shape, dtype, c_strides(shape, dtype.itemsize),
                    c_strides(shape, 1), math.prod(shape) * dtype.itemsize)


def allocate(device, stream, shape, dtype, strides, elem_strides, nbytes, capture=None) -> DeviceArray:
    """:func:`empty` for callers that already hold normalised fields (the per-call op path, where
    each Python call counts: ``DeviceArray._wrap`` is inlined); ``capture`` as
    :meth:`~pyattn.runtime.memory.DevicePool.allocate`'s."""
    alloc = get_pool(device).allocate(nbytes, stream, capture)
    if memory.POISON_ALLOC is not False and poison_alloc():
        memset_async(alloc.ptr, 0xFF, nbytes, stream)
    a = _new(DeviceArray)
    a.ptr, a.shape, a.dtype, a.strides, a.elem_strides = alloc.ptr, shape, dtype, strides, elem_strides
    a.device, a.owner, a.stream = device, alloc, stream
    return a


_new = object.__new__

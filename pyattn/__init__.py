"""pyattn: fast GPU attention from pure Python.

CUDA C++ templates are compiled at run time with NVRTC for the GPU found, cached on disk, and
launched through NVIDIA's cuda-python bindings. Importing pyattn touches no GPU, creates no
directory and starts no thread; the driver is initialised by the first call that needs it.
"""

from ._version import __version__
from .array import DeviceArray, asarray, empty
from . import patterns
from .ops.attention import attention
from .ops.block_sparse import block_sparse_attention
from .ops.decode import decode, paged_decode
from .ops.merge import merge_states
from .ops.sparse import sparse_attention
from .ops.varlen import attention_varlen
from .paged.book import OutOfPagesError
from .paged.cache import PagedKVCache
from .runtime.device import Device, device_count, get_device
from .runtime.errors import CompileError, CudaError, NoDeviceError, NvrtcError, PyattnError
from .runtime.stream import Event, Stream

__all__ = [
    "__version__",
    "attention",
    "merge_states",
    "attention_varlen",
    "sparse_attention",
    "block_sparse_attention",
    "patterns",
    "decode",
    "paged_decode",
    "PagedKVCache",
    "OutOfPagesError",
    "DeviceArray",
    "asarray",
    "empty",
    "Device",
    "get_device",
    "device_count",
    "Stream",
    "Event",
    "PyattnError",
    "CudaError",
    "NoDeviceError",
    "NvrtcError",
    "CompileError",
]

"""pyattn: fast GPU attention from pure Python.

CUDA C++ templates are compiled at run time with NVRTC for the GPU found, cached on disk, and
launched through NVIDIA's cuda-python bindings. Importing pyattn touches no GPU, creates no
directory, starts no thread and imports nothing but this file: each public name is loaded on
first use (PEP 562), so a process pays only for the parts it calls.
"""

from ._version import __version__

# public name -> module that defines it (imported on first access)
_EXPORTS = {
    "attention": "ops.attention",
    "attention_varlen": "ops.varlen",
    "attention_backward": "ops.backward",
    "attention_varlen_backward": "ops.backward",
    "merge_states": "ops.merge",
    "sparse_attention": "ops.sparse",
    "block_sparse_attention": "ops.block_sparse",
    "decode": "ops.decode",
    "paged_decode": "ops.decode",
    "contiguous_decode": "ops.contiguous",
    "prefill": "ops.prefill",
    "verify_tree": "ops.prefill",
    "paged_prefill": "ops.paged_prefill",
    "sparq_decode": "ops.sparq",
    "PagedKVCache": "paged.cache",
    "OutOfPagesError": "paged.book",
    "DeviceArray": "array",
    "empty": "array",
    "asarray": "interop.convert",
    "pinned_empty": "runtime.pinned",
    "Device": "runtime.device",
    "get_device": "runtime.device",
    "device_count": "runtime.device",
    "Stream": "runtime.stream",
    "Event": "runtime.stream",
    "PyattnError": "runtime.errors",
    "CudaError": "runtime.errors",
    "NoDeviceError": "runtime.errors",
    "CaptureError": "runtime.errors",
    "NvrtcError": "runtime.errors",
    "CompileError": "runtime.errors",
}
_SUBMODULES = ("patterns", "quant", "reference")

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]


def __getattr__(name: str):
    import importlib

    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'pyattn' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(__all__)

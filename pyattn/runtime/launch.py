"""Kernel launch with one by-value parameter struct.

Every pyattn kernel takes a single ``const __grid_constant__ Params`` argument whose layout is
generated from :class:`pyattn.kernels.params.ParamStruct`, so Python packs it with
:mod:`struct` and the driver copies it at launch: one pointer to pass, no per-argument
marshalling, and no ctypes.

Thread safety: :func:`launch` may be called from several threads; each thread packs into its
own argument buffer (the driver has copied the struct by the time ``cuLaunchKernel`` returns,
so a thread can reuse its buffer for the next launch).
"""

from __future__ import annotations

import threading

import numpy as np

from .errors import check

__all__ = ["launch", "MAX_PARAM_BYTES"]

MAX_PARAM_BYTES = 4096  # the classic kernel-parameter limit; our structs are a few hundred bytes

_tls = threading.local()
_driver = None


class _ArgBuffer:
    """A struct buffer and the ``void*[1]`` array that points at it, for one thread, and its
    ``CUlaunchConfig`` for programmatic launches (made once a thread; its fields are set afresh each
    launch: ~0.3 us)."""

    def __init__(self):
        self.struct = np.zeros(MAX_PARAM_BYTES, dtype=np.uint8)
        self.view = memoryview(self.struct)
        self.argv = np.array([self.struct.__array_interface__["data"][0]], dtype=np.uint64)
        self.argv_ptr = self.argv.__array_interface__["data"][0]
        attr = _driver.CUlaunchAttribute()
        attr.id = _driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        self.config = _driver.CUlaunchConfig()
        self.config.attrs, self.config.numAttrs = [attr], 1


def launch(kernel, grid, block, shared_bytes: int, stream, params: bytes) -> None:
    """Launch ``kernel`` on ``stream`` with the packed parameter struct ``params``.

    Parameters
    ----------
    kernel : Kernel
    grid, block : tuple of 3 int
    shared_bytes : int
        Dynamic shared memory per block (the kernel must have opted in above 48 KiB).
    stream : Stream
        Always explicit: pyattn never launches on an implicit stream.
    params : bytes
        The packed parameter struct.

    A kernel whose ``dependent_launch`` is set (sm_90+: every pyattn kernel's entry point waits
    for the stream's previous kernel first, ``kernels_src/pdl.cuh``) launches with programmatic
    stream serialization: its blocks may start while that kernel finishes, so that the launch
    overlaps its tail (~2 us a launch between back-to-back kernels on an H200).
    """
    global _driver
    if _driver is None:
        from cuda.bindings import driver as _driver
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = _ArgBuffer()
    buf.view[: len(params)] = params
    pdl = kernel.dependent_launch
    if pdl:
        config = buf.config
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes, config.hStream = shared_bytes, stream.handle
        result = _driver.cuLaunchKernelEx(config, kernel.handle, buf.argv_ptr, 0)
    else:
        result = _driver.cuLaunchKernel(kernel.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                        shared_bytes, stream.handle, buf.argv_ptr, 0)
    if result[0]:
        check(result, f"{'cuLaunchKernelEx' if pdl else 'cuLaunchKernel'}({kernel.name}, grid={grid}, block={block}, "
                      f"smem={shared_bytes}{', pdl' if pdl else ''})")

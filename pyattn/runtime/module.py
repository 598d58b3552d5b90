"""Loaded modules and their kernels.

A :class:`Module` wraps a cubin (or, as a stated fallback, PTX) loaded into one device's primary
context; a :class:`Kernel` is one ``__global__`` entry point in it with its resource attributes.

Thread safety: loading is done under the caller's lock (see ``pyattn.kernels.registry``); a
loaded Kernel is immutable apart from :meth:`Kernel.set_max_dynamic_shared`, which is idempotent.
"""

from __future__ import annotations

import weakref

from .device import Device
from ._resource import Closeable, exiting, off_staging_threads, release_quietly, watch_exit
from .errors import check

__all__ = ["Module", "Kernel"]


def _drv():
    from cuda.bindings import driver

    return driver


class Module(Closeable):
    """A code image loaded into ``device``'s primary context.

    Parameters
    ----------
    device : Device
    image : bytes
        A cubin, or NUL-terminated PTX.
    """

    def __init__(self, device: Device, image: bytes):
        self.device = device
        device.activate()
        watch_exit()
        self.handle = check(_drv().cuModuleLoadData(image), "cuModuleLoadData")
        # Off the staging workers: unloading may wait for the device (see runtime._resource).
        self._finalizer = weakref.finalize(self, off_staging_threads, _unload, device, self.handle)

    def kernel(self, name: str) -> "Kernel":
        """Return the kernel with the (lowered) symbol ``name``."""
        fn = check(_drv().cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
        return Kernel(self, fn, name)

    def close(self) -> None:
        """Unload the module; kernels obtained from it become invalid."""
        self._finalizer()


def _unload(device: Device, handle) -> None:
    """``cuModuleUnload`` unloads "from the current context": the module's, made current for it
    (whichever context the thread that drops the module has current), then put back."""
    if exiting():
        return
    try:
        pushed = device.push()
    except Exception:  # (a finalizer has nobody to report to: see release_quietly)
        return
    release_quietly("cuModuleUnload", handle)
    if pushed:
        try:
            device.pop()
        except Exception:
            pass


class Kernel:
    """One entry point of a :class:`Module`.

    Attributes
    ----------
    name : str
    handle : CUfunction
    num_regs, max_threads_per_block, static_shared_bytes, local_bytes : int
        The compiler's resource usage, read from the loaded image.
    dependent_launch : bool
        Whether :func:`~pyattn.runtime.launch.launch` launches it as the stream's previous
        kernel's programmatic dependent; False until its loader says so (pyattn's registry sets
        it from ``KernelSpec.dependent_launch``: sm_90+, where every entry point waits first).
    """

    def __init__(self, module: Module, handle, name: str):
        A = _drv().CUfunction_attribute
        self.module, self.handle, self.name = module, handle, name
        self.num_regs = self._get(A.CU_FUNC_ATTRIBUTE_NUM_REGS)
        self.max_threads_per_block = self._get(A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        self.static_shared_bytes = self._get(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        self.local_bytes = self._get(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
        # Without the opt-in, static and dynamic shared memory together stay within 48 KiB.
        self._max_dynamic_shared = 48 * 1024 - self.static_shared_bytes
        self.dependent_launch = False

    def _get(self, attr) -> int:
        return int(check(_drv().cuFuncGetAttribute(attr, self.handle), "cuFuncGetAttribute"))

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory per block (needed above 48 KiB).

        Raises
        ------
        PyattnError
            When the device cannot give that much (checked against its opt-in limit).
        """
        from .errors import PyattnError

        if nbytes <= self._max_dynamic_shared:
            return
        limit = self.module.device.max_shared_per_block_optin - self.static_shared_bytes
        if nbytes > limit:
            raise PyattnError(f"kernel {self.name} needs {nbytes} bytes of dynamic shared memory; "
                              f"{self.module.device.name} allows {limit}")
        A = _drv().CUfunction_attribute
        check(_drv().cuFuncSetAttribute(self.handle, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
              "cuFuncSetAttribute")
        self._max_dynamic_shared = nbytes

    def max_active_blocks(self, threads: int, shared_bytes: int) -> int:
        """Blocks of ``threads`` threads and ``shared_bytes`` of dynamic shared memory that fit on one SM
        at once (the driver's occupancy calculator: registers, shared memory and warp limits)."""
        self.set_max_dynamic_shared(shared_bytes)
        return int(check(_drv().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.handle, threads, shared_bytes),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def __repr__(self) -> str:
        return (f"<pyattn.Kernel {self.name}: {self.num_regs} regs, {self.static_shared_bytes} B static smem, "
                f"{self.local_bytes} B local>")

"""Loaded kernels, by spec and device: the in-memory layer above the disk cache.

``get_kernel(spec, device)`` is the hot-path lookup of every op: a dict hit after the first call.
A miss builds the image (disk cache or NVRTC), loads it into the device's context, and opts the
kernel into the dynamic shared memory its spec needs.

Thread safety: lookups are lock-free dict reads; misses are serialised by one lock, so two threads
never load the same module twice.
"""

from __future__ import annotations

import threading

from ..runtime.module import Module

__all__ = ["get_kernel", "loaded_kernels", "forget_kernels", "generation"]

_kernels: dict = {}
_lock = threading.Lock()
_generation = [0]  # bumped by forget_kernels: anything holding kernels (launch plans) rebuilds


def get_kernel(spec, device):
    """Return the loaded :class:`~pyattn.runtime.module.Kernel` for ``spec`` on ``device``."""
    key = (device.ordinal, spec)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    from .. import jit

    with _lock:
        kernel = _kernels.get(key)
        if kernel is None:
            image, _, _ = jit.build(spec)  # (its metadata is not parsed: the spec names the entry)
            kernel = Module(device, image).kernel(spec.entry_name)
            kernel.set_max_dynamic_shared(spec.shared_bytes)
            kernel.dependent_launch = spec.dependent_launch
            _kernels[key] = kernel
    return kernel


def loaded_kernels() -> dict:
    """A snapshot of the loaded kernels, ``{(ordinal, spec): Kernel}``."""
    return dict(_kernels)


def forget_kernels() -> None:
    """Drop every loaded kernel, so the next lookup builds from the current tile tables.

    ``pyattn.kernels.families.override_tiles`` calls it: a spec keys its kernel here, but its
    tiles come from the table in force when it is built.
    """
    with _lock:
        _kernels.clear()
        _generation[0] += 1


def generation() -> int:
    """A number that changes whenever loaded kernels are forgotten (plans key on it)."""
    return _generation[0]

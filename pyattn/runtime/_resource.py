"""Lifetime helpers shared by every object that owns a driver resource."""

from __future__ import annotations

import threading

__all__ = ["Closeable", "release_quietly", "per_device"]

_registry_lock = threading.RLock()


class Closeable:
    """Context-manager support for objects with a ``close()`` method."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def release_quietly(destroy: str, handle) -> None:
    """Call ``cuda.bindings.driver.<destroy>(handle)`` from a finalizer, ignoring failures:
    at interpreter shutdown the driver (or the context) may already be gone, and a finalizer
    has nobody to report to."""
    try:
        from cuda.bindings import driver

        getattr(driver, destroy)(handle)
    except Exception:
        pass


def per_device(registry: dict, device, factory):
    """Return ``registry[device.ordinal]``, creating it with ``factory(device)`` exactly once
    even when several threads ask at the same time (process-wide pools and streams)."""
    obj = registry.get(device.ordinal)
    if obj is None:
        with _registry_lock:
            obj = registry.get(device.ordinal)
            if obj is None:
                obj = registry[device.ordinal] = factory(device)
    return obj

"""Lifetime helpers shared by every object that owns a driver resource."""

from __future__ import annotations

import atexit
import threading

__all__ = ["Closeable", "release_quietly", "per_device", "exiting", "watch_exit", "STAGING_THREADS",
           "register_staging_thread", "off_staging_threads", "run_deferred"]

_registry_lock = threading.RLock()
_exit = {"watched": False, "exiting": False}

# The threads that a stream may be waiting for: pyattn.pipeline's staging workers (transfer.executor)
# set the flags that its H2D copies wait on (cuStreamWaitValue32), so they make no driver call. The garbage
# collector runs finalizers on whichever thread it happens to run on, and some of pyattn's wait
# (freeing pinned memory synchronises the device; a mailbox waits for its events): on a staging
# worker such a call waits for a stream parked on a flag that the same worker has yet to set, and
# the process hangs. The others (stream-ordered frees, destroying events and streams) do not wait,
# but take the driver's locks, which a thread waiting in a synchronising call may hold. So every
# finalizer that calls the driver goes through off_staging_threads.
STAGING_THREADS = "pyattn-host"  # the workers' name prefix
_staging_idents: set = set()  # their thread idents (register_staging_thread, the pool's initializer)
_deferred: list = []  # (fn, args) queued by off_staging_threads on a staging worker
_deferred_lock = threading.Lock()


def register_staging_thread() -> None:
    """Mark the calling thread as a staging worker (the workers' pool calls this as each starts)."""
    _staging_idents.add(threading.get_ident())


def _on_staging_thread() -> bool:
    return threading.get_ident() in _staging_idents


def off_staging_threads(fn, *args) -> None:
    """Call ``fn(*args)`` now, or, on a staging worker, queue it for :func:`run_deferred` on another
    thread: every finalizer that calls the driver goes through this."""
    if _on_staging_thread():
        with _deferred_lock:
            _deferred.append((fn, args))
        return
    fn(*args)


def run_deferred() -> None:
    """Run the releases that staging workers queued (nothing on a staging worker itself). Called
    where a thread is about to stage uploads or take new pinned or device memory."""
    if not _deferred or _on_staging_thread():
        return
    with _deferred_lock:
        calls = _deferred[:]
        del _deferred[:]
    for fn, args in calls:
        fn(*args)


def _mark_exit() -> None:
    _exit["exiting"] = True


def watch_exit() -> None:
    """Have :func:`exiting` turn true when the interpreter starts to exit (an ``atexit`` hook,
    registered once, by the first owner of a driver resource).

    Why: at exit, objects are torn down in no useful order, so a block's stream-ordered free could
    name a stream whose finalizer already destroyed it, which crashed the driver (a segfault in
    about half of the runs of a script that kept a result in a global). The driver frees the
    context's memory, streams and events when the process ends anyway, so past this point pyattn
    releases nothing itself.
    """
    if not _exit["watched"]:
        with _registry_lock:
            if not _exit["watched"]:
                atexit.register(_mark_exit)
                _exit["watched"] = True


def exiting() -> bool:
    """Whether the interpreter is exiting (see :func:`watch_exit`)."""
    return _exit["exiting"]


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
    if _exit["exiting"]:
        return
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

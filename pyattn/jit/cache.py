"""On-disk cache of compiled kernel binaries (cubin bytes), safe across threads, processes and users.

One file ``<key>.pyattnk`` per kernel (format in :mod:`pyattn.jit._entry`). Guarantees:

- Trust: the directory and the entries must be owned by the current user and not
  group/world-writable (:mod:`pyattn.jit._trust`); an untrusted directory is refused entirely
  (one warning naming ``PYATTN_CACHE_DIR``; kernels are then compiled and not cached), an
  untrusted entry (symlink, FIFO, someone else's file, mode 0666...) is a miss and gets replaced.
- Atomic writes: a temp file in the same directory, fsync, then ``os.replace`` (as CuPy's
  ``_compiler_cache.py``; PyCUDA's in-place write can leave half a file), so readers see no file
  or a whole one. A file failing its checksum is a miss and is removed.
- Litter: temp files of writers that died are removed by the next write; lock files are removed
  by whoever releases them (:mod:`pyattn.jit._keylock`), those of killed holders by the next
  write or :meth:`KernelCache.clear`.

This module decides what to look up and builds under the per-key lock; the directory's files
(trusted opening, checked reads, atomic writes, the once-per-instance warnings) are handled by
:mod:`pyattn.jit._store`. The caller compiles: no CUDA here.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from . import _trust
from ._entry import (ENTRY_SUFFIX, LOCK_SUFFIX, MEMO_SUFFIX, CacheEntry, check_key, default_cache_dir, encode,
                     entry_key, is_memo_name, normalise_meta)
from ._log import LazyLogger
from ._store import EntryStore

# _keylock and _litter are imported where builds and clears need them: a warm start only reads.

__all__ = ["CacheEntry", "KernelCache", "default_cache_dir"]

logger = LazyLogger("pyattn.cache")


class KernelCache:
    """Atomic, checksummed on-disk cache of compiled kernels with a per-key build lock.

    Parameters
    ----------
    directory : str or os.PathLike, optional
        Cache directory; ``None`` means :func:`default_cache_dir`. Nothing is created until the
        first write; missing directories are then created with mode ``0o700``.
    lock_timeout : float, optional
        Seconds :meth:`get_or_build` waits for another builder of the same key before it builds
        without the lock (the atomic replace keeps the result consistent either way).
    poll_interval : float, optional
        Seconds between attempts to take a held file lock.

    Notes
    -----
    All methods are safe from any number of threads and processes: readers see no entry or a
    complete one, never a partial write. :meth:`get_or_build` runs ``build`` once per key across
    the threads of an instance (a ``threading.Lock`` per key) and across processes and instances
    (``fcntl.flock`` on ``<key>.lock``, removed again on release). The OS drops a flock when its
    holder dies, so a killed process never blocks anyone; if the lock does not come within
    ``lock_timeout`` or the directory is not writable, the build runs unlocked with a warning:
    duplicate work at worst, never a hang. :meth:`clear` racing a writer can lose that write,
    never corrupt it. A directory that is read-only, uncreatable or refused as untrusted never
    raises: reads miss or are served as allowed, writes are skipped, and one warning per instance
    is logged.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *,
                 lock_timeout: float = 120.0, poll_interval: float = 0.05) -> None:
        if not lock_timeout >= 0:
            raise ValueError(f"lock_timeout must be >= 0, got {lock_timeout!r}")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval!r}")
        self._dir = pathlib.Path(directory if directory is not None else default_cache_dir())
        self._lock_timeout = float(lock_timeout)
        self._poll_interval = float(poll_interval)
        self._thread_locks: dict[str, threading.Lock] = {}
        self._thread_locks_guard = threading.Lock()
        # The directory's files: trusted opening, atomic writes, checked reads, warnings once.
        self._store = EntryStore(self._dir)

    @property
    def directory(self) -> pathlib.Path:
        """pathlib.Path: The cache directory (may not exist yet)."""
        return self._dir

    def trust_problem(self) -> str | None:
        """Return why the directory is refused, or ``None`` if it is usable or does not exist yet.

        Returns
        -------
        str or None
            E.g. ``"/tmp/c is writable by group or others (mode 0777)"``.
        """
        try:
            fd = _trust.open_trusted_dir(self._dir, create=False)
        except _trust.UntrustedPath as exc:
            return str(exc)
        except OSError:
            return None
        if fd is not None:
            os.close(fd)
        return None

    def get(self, key: str) -> tuple[bytes, Mapping] | None:
        """Look up a cached kernel.

        Parameters
        ----------
        key : str
            16 to 128 lowercase hex digits (normally a BLAKE2b-256 hexdigest).

        Returns
        -------
        tuple of (bytes, Mapping) or None
            The payload and its metadata (an :class:`~pyattn.jit._entry.EntryMeta`, read-only,
            parsed when first looked at), or ``None`` on a miss. A truncated file, a bad
            magic/version, a checksum failure or a stored key other than ``key`` is a miss: a
            warning is logged and the file removed when possible. So is an entry that is not a
            regular file owned by us and private, or any entry of a refused directory.

        Raises
        ------
        ValueError
            If ``key`` is invalid.
        """
        key = check_key(key)
        with self._store.dir_fd(create=False) as dfd:
            return None if dfd is None else self._store.read(dfd, key)

    def put(self, key: str, payload: bytes, meta: dict) -> pathlib.Path | None:
        """Store a kernel atomically (and remove temp files that dead writers left).

        Parameters
        ----------
        key : str
            16 to 128 lowercase hex digits.
        payload : bytes
            The compiled binary (any bytes-like object).
        meta : dict
            JSON-serialisable metadata with str keys, returned by :meth:`get`.

        Returns
        -------
        pathlib.Path or None
            The entry file, or ``None`` if the directory could not be written or is refused (one
            warning per instance is logged; the run carries on uncached).

        Raises
        ------
        ValueError, TypeError
            If ``key`` is invalid, or ``meta`` is not a JSON-serialisable dict with str keys.
        """
        key = check_key(key)
        return self._store.write(key, ENTRY_SUFFIX, encode(key, bytes(payload), normalise_meta(meta)), quiet=False)

    def get_memo(self, key: str) -> bytes | None:
        """Look up a memo: a small value that is costly to compute, such as the kernel-source digest.

        Memos live beside the kernels, with the same format, checks and trust rules, but are no
        kernels: :meth:`entries` and counts leave them out; :meth:`clear` removes them too.

        Parameters
        ----------
        key : str
            16 to 128 lowercase hex digits, naming everything the value depends on.

        Returns
        -------
        bytes or None
            The value, or ``None`` on a miss (as :meth:`get`).
        """
        key = check_key(key)
        with self._store.dir_fd(create=False) as dfd:
            hit = None if dfd is None else self._store.read(dfd, key, MEMO_SUFFIX)
        return None if hit is None else hit[0]

    def put_memo(self, key: str, value: bytes) -> None:
        """Store a memo atomically and silently, in an existing directory only: a read-only cache
        (a shipped, pre-warmed one) is a normal setup, and a lost memo costs only its recomputation."""
        key = check_key(key)
        self._store.write(key, MEMO_SUFFIX, encode(key, bytes(value), {}), quiet=True)

    def get_or_build(self, key: str,
                     build: Callable[[], tuple[bytes, dict]]) -> tuple[bytes, Mapping, bool]:
        """Return the cached kernel for ``key``, building and storing it on a miss.

        Parameters
        ----------
        key : str
            16 to 128 lowercase hex digits.
        build : callable
            Called with no arguments on a miss; returns ``(payload, meta)`` as for :meth:`put`.
            Runs under the per-key lock, so concurrent callers wait for it instead of repeating
            it. Its exceptions propagate (the lock is released).

        Returns
        -------
        payload : bytes
        meta : Mapping
            JSON round-tripped, so a fresh build (a dict) and a later hit (an ``EntryMeta``)
            compare equal.
        built : bool
            Whether ``build`` ran in this call.
        """
        key = check_key(key)
        hit = self.get(key)
        if hit is not None:
            return hit[0], hit[1], False
        with self._key_lock(key):
            # Another thread or process may have stored it while we waited for the lock.
            hit = self.get(key)
            if hit is not None:
                return hit[0], hit[1], False
            result = build()
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError("build() must return a (payload, meta) tuple")
            payload, meta = bytes(result[0]), normalise_meta(result[1])
            self.put(key, payload, meta)
        return payload, meta, True

    def entries(self) -> list[CacheEntry]:
        """Return the entry files found by name (regular files; content not verified), by key.

        Empty when the directory is missing or refused.
        """
        found = []
        with self._store.dir_fd(create=False) as dfd:
            for name in self._store.listdir(dfd):
                if (key := entry_key(name)) is not None:
                    with contextlib.suppress(OSError):  # removed since listdir
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            found.append(CacheEntry(key, self._dir / name, st.st_size))
        return sorted(found, key=lambda e: e.key)

    def total_size(self) -> int:
        """Return the total size in bytes of the entry files (0 if the directory is missing)."""
        return sum(e.size for e in self.entries())

    def clear(self) -> int:
        """Delete every entry file and memo, plus lock files nobody holds and temp files of dead writers.

        Files whose names do not match the cache's patterns are left alone, and so is a refused
        (untrusted) directory.

        Returns
        -------
        int
            Number of entry files removed.
        """
        from ._litter import remove_litter

        removed, failed = 0, []
        with self._store.dir_fd(create=False) as dfd:
            for name in self._store.listdir(dfd):
                is_entry = entry_key(name) is not None
                if is_entry or is_memo_name(name):
                    try:
                        os.unlink(name, dir_fd=dfd)
                        removed += is_entry
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        failed.append(f"{name}: {exc}")
            if dfd is not None:
                remove_litter(dfd)
        if failed:
            logger.warning("could not remove from kernel cache %s: %s", self._dir, failed)
        return removed

    # -- build locks ---------------------------------------------------------------------------

    def _thread_lock(self, key: str) -> threading.Lock:
        # Kept for the instance's life: a process compiles a bounded set of kernels.
        with self._thread_locks_guard:
            return self._thread_locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Hold the per-key thread lock and file lock if they come within lock_timeout."""
        from . import _keylock

        deadline = time.monotonic() + self._lock_timeout
        tlock = self._thread_lock(key)
        have_tlock = tlock.acquire(timeout=self._lock_timeout)
        if not have_tlock:
            logger.warning("timed out after %.1fs waiting for another thread building kernel "
                           "%s; building without the lock", self._lock_timeout, key)
        held = None
        try:
            # Without the thread lock another thread of ours holds the file lock: don't wait twice.
            if have_tlock:
                held = self._acquire_file_lock(key, deadline)
            yield
        finally:
            if held is not None:
                dfd, fd = held
                try:
                    _keylock.release(dfd, key + LOCK_SUFFIX, fd)
                finally:
                    os.close(dfd)
            if have_tlock:
                tlock.release()

    def _acquire_file_lock(self, key: str, deadline: float) -> tuple[int, int] | None:
        """Return (directory fd, lock fd) holding <key>.lock, or None (warned) if not possible."""
        from . import _keylock

        dfd = self._store.open_dir(create=True)
        if dfd is None:
            return None
        name = key + LOCK_SUFFIX
        try:
            return dfd, _keylock.acquire(dfd, name, deadline, self._poll_interval)
        except _keylock.LockUnavailable as exc:
            os.close(dfd)
            logger.warning("%s (kernel %s in %s); building without the lock", exc, key, self._dir)
        except OSError as exc:
            os.close(dfd)
            self._store.warn_unwritable(exc)
        except BaseException:
            os.close(dfd)
            raise
        return None

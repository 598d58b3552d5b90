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

The caller compiles: no CUDA here.
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
from ._entry import (ENTRY_SUFFIX, LOCK_SUFFIX, MEMO_SUFFIX, CacheEntry, CorruptEntry, check_key, decode,
                     default_cache_dir, encode, entry_key, is_memo_name, normalise_meta, temp_name)
from ._log import LazyLogger

# _keylock and _litter are imported where writes need them: a warm start only reads.

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
        self._warned: set = set()  # what this instance has warned about: once is news, twice noise
        # Once refused, always refused: a directory must not be trusted by one call and not the
        # next (e.g. a component an attacker made fails, its child we then create passes).
        self._refused = False

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
        with self._dir_fd(create=False) as dfd:
            return None if dfd is None else self._read(dfd, key)

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
        return self._write(key, ENTRY_SUFFIX, encode(key, bytes(payload), normalise_meta(meta)), quiet=False)

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
        with self._dir_fd(create=False) as dfd:
            hit = None if dfd is None else self._read(dfd, key, MEMO_SUFFIX)
        return None if hit is None else hit[0]

    def put_memo(self, key: str, value: bytes) -> None:
        """Store a memo atomically and silently, in an existing directory only: a read-only cache
        (a shipped, pre-warmed one) is a normal setup, and a lost memo costs only its recomputation."""
        key = check_key(key)
        self._write(key, MEMO_SUFFIX, encode(key, bytes(value), {}), quiet=True)

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
        with self._dir_fd(create=False) as dfd:
            for name in self._listdir(dfd):
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
        with self._dir_fd(create=False) as dfd:
            for name in self._listdir(dfd):
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

    # -- directory, reading, litter ------------------------------------------------------------

    def _open_dir(self, create: bool) -> int | None:
        """A descriptor of the trusted directory, or None (missing, unusable or refused: warned)."""
        if self._refused:
            return None
        try:
            return _trust.open_trusted_dir(self._dir, create=create)
        except _trust.UntrustedPath as exc:
            self._refused = True
            self._warn_once("untrusted", "refusing kernel cache directory %s (%s); kernels will be "
                            "compiled but not cached. Set PYATTN_CACHE_DIR to a directory only you "
                            "can write (pyattn creates it with mode 0700)", self._dir, exc)
        except OSError as exc:
            if create:
                self._warn_unwritable(exc)
            else:  # unreadable: nothing to read, and writes will say why
                logger.debug("cannot open kernel cache directory %s: %s", self._dir, exc)
        return None

    @contextlib.contextmanager
    def _dir_fd(self, create: bool) -> Iterator[int | None]:
        fd = self._open_dir(create)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _write(self, key: str, suffix: str, data: bytes, quiet: bool) -> pathlib.Path | None:
        from ._litter import remove_litter

        with self._dir_fd(create=not quiet) as dfd:
            if dfd is None:
                return None
            remove_litter(dfd)
            name, tmp = key + suffix, temp_name(key)
            try:
                # O_EXCL + O_NOFOLLOW: never write through something already there. 0o600 can
                # only lose bits to the umask.
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=dfd)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                tmp = None
                return self._dir / name
            except OSError as exc:
                if quiet:
                    logger.debug("cannot write %s to kernel cache directory %s: %s", name, self._dir, exc)
                else:
                    self._warn_unwritable(exc)
                return None
            finally:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dfd)

    def _read(self, dfd: int, key: str, suffix: str = ENTRY_SUFFIX) -> tuple[bytes, dict] | None:
        name = key + suffix
        path = self._dir / name
        try:
            fd, st = _trust.open_trusted_file(dfd, name, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except _trust.UntrustedPath as exc:
            self._warn_once(("entry", key), "ignoring kernel cache entry %s: %s; it will be rebuilt",
                            path, exc)
            return None
        except OSError as exc:
            logger.warning("cannot read kernel cache entry %s (%s); treating as a miss", path, exc)
            return None
        try:
            return decode(key, data)
        except CorruptEntry as exc:
            logger.warning("discarding corrupt kernel cache entry %s: %s", path, exc)
            # Only remove the file we read: a writer may have replaced it with a good one since.
            if _trust.names_inode(dfd, name, st):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
            return None

    def _listdir(self, dfd: int | None) -> list[str]:
        if dfd is None:
            return []
        try:
            return os.listdir(dfd)
        except OSError:  # unreadable: nothing to list
            return []

    def _warn_once(self, what, message: str, *args) -> None:
        # A refused or read-only cache is a fact of the setup, not news per kernel.
        if what in self._warned:
            logger.debug(message, *args)
            return
        self._warned.add(what)
        logger.warning(message, *args)

    def _warn_unwritable(self, exc: OSError) -> None:
        self._warn_once("unwritable", "cannot write to kernel cache directory %s (%s); "
                        "kernels will be built but not cached", self._dir, exc)

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

        dfd = self._open_dir(create=True)
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
            self._warn_unwritable(exc)
        except BaseException:
            os.close(dfd)
            raise
        return None

"""On-disk cache of compiled kernel binaries (cubin bytes), safe across threads and processes.

Each entry is one file ``<key>.pyattnk`` in the cache directory::

    b"PYATTNK1"                      magic; the trailing digit is the format version
    uint32 little-endian n           length of the JSON header
    n bytes of UTF-8 JSON            {"key": <key>, "meta": <caller's dict>}
    payload                          the compiled binary
    32 bytes                         sha256 of everything above

Writes go to a temp file in the same directory, fsync, then ``os.replace`` (as CuPy's
``_compiler_cache.py``; PyCUDA's in-place write can leave half a file), so readers see no file or
a whole one; a file failing validation is a miss and is removed. The caller compiles: no CUDA here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["CacheEntry", "KernelCache", "default_cache_dir"]

logger = logging.getLogger("pyattn.cache")

_MAGIC = b"PYATTNK1"
_HEADER_LEN = struct.Struct("<I")
_DIGEST_SIZE = hashlib.sha256().digest_size
_MIN_SIZE = len(_MAGIC) + _HEADER_LEN.size + _DIGEST_SIZE

_ENTRY_SUFFIX = ".pyattnk"
_LOCK_SUFFIX = ".lock"
_TMP_SUFFIX = ".tmp"
_KEY_RE = re.compile(r"[0-9a-f]{16,128}")
_ENTRY_RE = re.compile(r"([0-9a-f]{16,128})" + re.escape(_ENTRY_SUFFIX))
_LOCK_RE = re.compile(r"[0-9a-f]{16,128}" + re.escape(_LOCK_SUFFIX))
_TMP_RE = re.compile(r"\.[0-9a-f]{16,128}\.[A-Za-z0-9_]+" + re.escape(_TMP_SUFFIX))

# A put() takes milliseconds; a temp file this old belongs to a writer that died.
_STALE_TMP_SECONDS = 60.0


def default_cache_dir() -> pathlib.Path:
    """Return the default kernel cache directory, without creating it.

    Returns
    -------
    pathlib.Path
        ``$PYATTN_CACHE_DIR`` if set and non-empty (``~`` expanded), else
        ``$XDG_CACHE_HOME/pyattn`` if set and non-empty, else ``~/.cache/pyattn``.
    """
    explicit = os.environ.get("PYATTN_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "pyattn"
    return pathlib.Path.home() / ".cache" / "pyattn"


@dataclass(frozen=True)
class CacheEntry:
    """One entry file found in the cache directory.

    Attributes
    ----------
    key : str
        The hex key the entry was stored under.
    path : pathlib.Path
        Location of the entry file.
    size : int
        Size of the file on disk in bytes (header and checksum included).
    """

    key: str
    path: pathlib.Path
    size: int


class _CorruptEntry(Exception):
    """An entry file that must be treated as a miss; the message says why."""


def _check_key(key: object) -> str:
    # The key becomes a file name: restricting it to hex means it can never leave the directory.
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"key must be 16 to 128 lowercase hex digits, got {key!r}")
    return key


def _normalise_meta(meta: object) -> dict:
    # Round-trip through JSON so a freshly built entry and a cache hit return equal dicts.
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise TypeError("meta must be a dict with str keys")
    return json.loads(json.dumps(meta, allow_nan=False))


def _encode(key: str, payload: bytes, meta: dict) -> bytes:
    header = json.dumps({"key": key, "meta": meta}, allow_nan=False, sort_keys=True).encode()
    body = b"".join([_MAGIC, _HEADER_LEN.pack(len(header)), header, payload])
    return body + hashlib.sha256(body).digest()


def _decode(key: str, data: bytes) -> tuple[bytes, dict]:
    if len(data) < _MIN_SIZE:
        raise _CorruptEntry(f"file too short ({len(data)} bytes)")
    if data[: len(_MAGIC)] != _MAGIC:
        raise _CorruptEntry(f"bad magic/version {data[:len(_MAGIC)]!r}")
    body, digest = data[:-_DIGEST_SIZE], data[-_DIGEST_SIZE:]
    if hashlib.sha256(body).digest() != digest:
        raise _CorruptEntry("checksum mismatch")
    (header_len,) = _HEADER_LEN.unpack_from(body, len(_MAGIC))
    start = len(_MAGIC) + _HEADER_LEN.size
    if start + header_len > len(body):
        raise _CorruptEntry("header length exceeds file size")
    try:
        header = json.loads(body[start : start + header_len].decode())
        stored_key, meta = header["key"], header["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise _CorruptEntry(f"unreadable header ({exc})") from None
    if stored_key != key:
        raise _CorruptEntry(f"stored key {stored_key!r} differs from requested key")
    if not isinstance(meta, dict):
        raise _CorruptEntry("meta is not a JSON object")
    return body[start + header_len :], meta


def _same_file(path: pathlib.Path, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


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
    (``fcntl.flock`` on ``<key>.lock``, opened afresh per call). The OS drops a flock when its
    holder dies, so a killed process never blocks anyone; if the lock does not come within
    ``lock_timeout`` or the directory is not writable, the build runs unlocked with a warning:
    duplicate work at worst, never a hang. :meth:`clear` racing a writer can lose that write,
    never corrupt it. A read-only or uncreatable directory never raises: writes are skipped and
    one warning per instance is logged.
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
        self._warned_unwritable = False

    @property
    def directory(self) -> pathlib.Path:
        """pathlib.Path: The cache directory (may not exist yet)."""
        return self._dir

    def get(self, key: str) -> tuple[bytes, dict] | None:
        """Look up a cached kernel.

        Parameters
        ----------
        key : str
            16 to 128 lowercase hex digits (normally a sha256 hexdigest).

        Returns
        -------
        tuple of (bytes, dict) or None
            The payload and its metadata, or ``None`` on a miss. A truncated file, a bad
            magic/version, a checksum failure or a stored key other than ``key`` is a miss: a
            warning is logged and the file removed when possible.

        Raises
        ------
        ValueError
            If ``key`` is invalid.
        """
        key = _check_key(key)
        path = self._entry_path(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            logger.warning("cannot read kernel cache entry %s (%s); treating as a miss", path, exc)
            return None
        try:
            return _decode(key, data)
        except _CorruptEntry as exc:
            logger.warning("discarding corrupt kernel cache entry %s: %s", path, exc)
            # Only remove the file we read: a writer may have replaced it with a good one since.
            if _same_file(path, st):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return None

    def put(self, key: str, payload: bytes, meta: dict) -> pathlib.Path | None:
        """Store a kernel atomically.

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
            The entry file, or ``None`` if the directory could not be written (one warning per
            instance is logged; the run carries on uncached).

        Raises
        ------
        ValueError, TypeError
            If ``key`` is invalid, or ``meta`` is not a JSON-serialisable dict with str keys.
        """
        key = _check_key(key)
        data = _encode(key, bytes(payload), _normalise_meta(meta))
        if not self._ensure_dir():
            return None
        final = self._entry_path(key)
        tmp_name = None
        try:
            # mkstemp makes the file 0o600 whatever the umask; same dir keeps replace atomic.
            import tempfile  # here, not at import: warm starts only read the cache
            fd, tmp_name = tempfile.mkstemp(prefix=f".{key}.", suffix=_TMP_SUFFIX, dir=self._dir)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, final)
            tmp_name = None
            return final
        except OSError as exc:
            self._warn_unwritable(exc)
            return None
        finally:
            if tmp_name is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name)

    def get_or_build(self, key: str,
                     build: Callable[[], tuple[bytes, dict]]) -> tuple[bytes, dict, bool]:
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
        meta : dict
            JSON round-tripped, so a fresh build and a later hit compare equal.
        built : bool
            Whether ``build`` ran in this call.
        """
        key = _check_key(key)
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
            payload, meta = bytes(result[0]), _normalise_meta(result[1])
            self.put(key, payload, meta)
        return payload, meta, True

    def entries(self) -> list[CacheEntry]:
        """Return the entry files found by name (not verified), sorted by key."""
        found = []
        for name in self._listdir():
            if (match := _ENTRY_RE.fullmatch(name)) is not None:
                with contextlib.suppress(FileNotFoundError):  # removed since listdir
                    size = (self._dir / name).stat().st_size
                    found.append(CacheEntry(match.group(1), self._dir / name, size))
        return sorted(found, key=lambda e: e.key)

    def total_size(self) -> int:
        """Return the total size in bytes of the entry files (0 if the directory is missing)."""
        return sum(e.size for e in self.entries())

    def clear(self) -> int:
        """Delete every entry file, plus lock files nobody holds and stale temporary files.

        Files whose names do not match the cache's patterns are left alone.

        Returns
        -------
        int
            Number of entry files removed.
        """
        removed, failed, now = 0, [], time.time()
        for name in self._listdir():
            path = self._dir / name
            try:
                if _ENTRY_RE.fullmatch(name):
                    os.unlink(path)
                    removed += 1
                elif _LOCK_RE.fullmatch(name):
                    self._remove_free_lock(path)
                elif _TMP_RE.fullmatch(name) and now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append(f"{name}: {exc}")
        if failed:
            logger.warning("could not remove from kernel cache %s: %s", self._dir, failed)
        return removed

    def _entry_path(self, key: str) -> pathlib.Path:
        return self._dir / (key + _ENTRY_SUFFIX)

    def _listdir(self) -> list[str]:
        try:
            return os.listdir(self._dir)
        except OSError:  # missing, not a directory, unreadable: nothing to list
            return []

    def _warn_unwritable(self, exc: OSError) -> None:
        # One warning per instance: a read-only cache is a fact of the setup, not news per kernel.
        if self._warned_unwritable:
            logger.debug("kernel cache %s not writable: %s", self._dir, exc)
            return
        self._warned_unwritable = True
        logger.warning("cannot write to kernel cache directory %s (%s); "
                       "kernels will be built but not cached", self._dir, exc)

    def _ensure_dir(self) -> bool:
        """Create the directory (and missing parents) with mode 0o700; False if impossible."""
        try:
            # Not os.makedirs: it would create the parents with the umask's mode, maybe 0o777.
            for path in reversed([p for p in (self._dir, *self._dir.parents) if not p.exists()]):
                try:
                    # mode is masked by the umask, which can only remove bits: never g/o-writable.
                    os.mkdir(path, 0o700)
                except FileExistsError:  # another process won the race
                    if not path.is_dir():
                        raise
        except OSError as exc:
            self._warn_unwritable(exc)
            return False
        return True

    def _thread_lock(self, key: str) -> threading.Lock:
        # Kept for the instance's life: a process compiles a bounded set of kernels.
        with self._thread_locks_guard:
            return self._thread_locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Hold the per-key thread lock and file lock if they come within lock_timeout."""
        deadline = time.monotonic() + self._lock_timeout
        tlock = self._thread_lock(key)
        have_tlock = tlock.acquire(timeout=self._lock_timeout)
        if not have_tlock:
            logger.warning("timed out after %.1fs waiting for another thread building kernel "
                           "%s; building without the lock", self._lock_timeout, key)
        fd = None
        try:
            # Without the thread lock another thread of ours holds the file lock: don't wait twice.
            if have_tlock:
                fd = self._acquire_file_lock(key, deadline)
            yield
        finally:
            if fd is not None:
                os.close(fd)  # closing the descriptor releases the flock
            if have_tlock:
                tlock.release()

    def _acquire_file_lock(self, key: str, deadline: float) -> int | None:
        """Return a descriptor holding flock on <key>.lock, or None (warned) if not possible."""
        if not self._ensure_dir():
            return None
        path = self._dir / (key + _LOCK_SUFFIX)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                self._warn_unwritable(exc)
                return None
            try:
                locked = self._poll_flock(fd, deadline)
            except BaseException as exc:
                os.close(fd)
                if not isinstance(exc, OSError):
                    raise
                # e.g. ENOLCK on a filesystem without flock support
                logger.warning("cannot lock %s (%s); building without the lock", path, exc)
                return None
            if not locked:
                os.close(fd)
                logger.warning("timed out after %.1fs waiting for the lock on kernel %s (%s); "
                               "building without it", self._lock_timeout, key, path)
                return None
            # clear() may have unlinked the file while we waited: a lock on an orphaned inode
            # excludes nobody who opens the path afresh, so start over.
            if _same_file(path, os.fstat(fd)):
                return fd
            os.close(fd)

    def _poll_flock(self, fd: int, deadline: float) -> bool:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                time.sleep(min(self._poll_interval, remaining))

    def _remove_free_lock(self, path: pathlib.Path) -> None:
        # A lock file someone holds is live: removing it would let a second builder in.
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)

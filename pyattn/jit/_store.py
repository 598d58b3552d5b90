"""The cache directory's files: opened through the trust checks, read and written atomically.

:class:`EntryStore` is the file half of :class:`~pyattn.jit.cache.KernelCache`: it opens the
directory (refused for good once it fails :mod:`pyattn.jit._trust`), reads an entry or memo (a
corrupt one is a miss and is removed), writes one through a temp file and ``os.replace``, and
warns once per instance about a directory it cannot use. What to look up, and building under the
per-key lock, stay with the cache; the file format is :mod:`pyattn.jit._entry`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

from . import _trust
from ._entry import ENTRY_SUFFIX, CorruptEntry, decode, temp_name
from ._log import LazyLogger

# _litter is imported where writes need it: a warm start only reads.

__all__ = ["EntryStore"]

# The cache's logger: these warnings are the cache's, whichever module words them.
logger = LazyLogger("pyattn.cache")


class EntryStore:
    """The entry and memo files of one cache directory, reached through its trusted descriptor.

    Parameters
    ----------
    directory : pathlib.Path
        The cache directory. Nothing is created until the first write; missing directories are
        then created with mode ``0o700``.

    Notes
    -----
    Never raises for an unusable directory: a read-only, uncreatable or refused one gives ``None``
    descriptors (reads miss, writes are skipped) and one warning per instance.
    """

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self._warned: set = set()  # what this instance has warned about: once is news, twice noise
        # Once refused, always refused: a directory must not be trusted by one call and not the
        # next (e.g. a component an attacker made fails, its child we then create passes).
        self._refused = False

    def open_dir(self, create: bool) -> int | None:
        """A descriptor of the trusted directory, or None (missing, unusable or refused: warned)."""
        if self._refused:
            return None
        try:
            return _trust.open_trusted_dir(self.directory, create=create)
        except _trust.UntrustedPath as exc:
            self._refused = True
            self.warn_once("untrusted", "refusing kernel cache directory %s (%s); kernels will be "
                           "compiled but not cached. Set PYATTN_CACHE_DIR to a directory only you "
                           "can write (pyattn creates it with mode 0700)", self.directory, exc)
        except OSError as exc:
            if create:
                self.warn_unwritable(exc)
            else:  # unreadable: nothing to read, and writes will say why
                logger.debug("cannot open kernel cache directory %s: %s", self.directory, exc)
        return None

    @contextlib.contextmanager
    def dir_fd(self, create: bool) -> Iterator[int | None]:
        """:meth:`open_dir` for a ``with`` block, closing the descriptor after it."""
        fd = self.open_dir(create)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def write(self, key: str, suffix: str, data: bytes, quiet: bool) -> pathlib.Path | None:
        """Store ``data`` as ``<key><suffix>`` atomically (removing dead writers' litter first).

        ``quiet``: a memo's write, which creates no directory and logs a failure at debug level
        only. Returns the file, or ``None`` if it could not be written.
        """
        from ._litter import remove_litter

        with self.dir_fd(create=not quiet) as dfd:
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
                return self.directory / name
            except OSError as exc:
                if quiet:
                    logger.debug("cannot write %s to kernel cache directory %s: %s", name, self.directory, exc)
                else:
                    self.warn_unwritable(exc)
                return None
            finally:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dfd)

    def read(self, dfd: int, key: str, suffix: str = ENTRY_SUFFIX) -> tuple[bytes, dict] | None:
        """The payload and metadata of ``<key><suffix>`` in ``dfd``, or None on a miss (a missing,
        untrusted, unreadable or corrupt file; a corrupt one is removed)."""
        name = key + suffix
        path = self.directory / name
        try:
            fd, st = _trust.open_trusted_file(dfd, name, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except _trust.UntrustedPath as exc:
            self.warn_once(("entry", key), "ignoring kernel cache entry %s: %s; it will be rebuilt",
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

    def listdir(self, dfd: int | None) -> list[str]:
        """The names in the directory ``dfd``; empty without one or when it cannot be listed."""
        if dfd is None:
            return []
        try:
            return os.listdir(dfd)
        except OSError:  # unreadable: nothing to list
            return []

    def warn_once(self, what, message: str, *args) -> None:
        """Log ``message`` as a warning the first time ``what`` happens, at debug level after."""
        # A refused or read-only cache is a fact of the setup, not news per kernel.
        if what in self._warned:
            logger.debug(message, *args)
            return
        self._warned.add(what)
        logger.warning(message, *args)

    def warn_unwritable(self, exc: OSError) -> None:
        """Warn (once) that the directory cannot be written, so kernels go uncached."""
        self.warn_once("unwritable", "cannot write to kernel cache directory %s (%s); "
                       "kernels will be built but not cached", self.directory, exc)

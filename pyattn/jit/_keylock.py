"""Per-key build locks across processes: ``flock`` on ``<key>.lock``, removed after use.

Why per key and not one lock for the directory: ``pyattn warmup`` compiles on many threads, and
other processes may compile other kernels meanwhile; one directory lock would serialise them all.
Why ``flock``: the OS drops it when its holder dies, so a killed process never hangs anyone.

Why the lock file can be removed safely. A lock file left per entry forever is litter, but
unlinking a lock file naively lets two builders in: B opens the file, A (holder) unlinks it and
releases, B now locks an inode nobody else will ever open, while C creates a fresh file at the
path and locks that one too. The protocol that prevents it:

1. acquire: open (create) the path, ``flock`` it, then check that the path *still names the
   inode we locked* (``fstat`` of our descriptor against ``lstat`` of the path). If not, the
   lock is on an orphan: close and start over on the current file.
2. release: unlink the path *while still holding the lock*, then close (which unlocks).

Invariant: the path is only ever unlinked by someone holding the lock on the inode it names
(holders in step 2, and :func:`remove_if_free`, which takes the lock first). So once step 1's
check passes, nobody can remove or replace the path until we release: whoever else holds a lock
at the same time holds it on an orphan and fails its own check. A holder that dies leaves its
file behind; the next builder of that key, or :func:`remove_if_free`, removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

from ._trust import UntrustedPath, names_inode, open_trusted_file

__all__ = ["acquire", "release", "remove_if_free", "LockUnavailable"]


class LockUnavailable(Exception):
    """The lock could not be taken (timeout, unlockable file system, odd lock file); says why."""


def _poll_flock(fd: int, deadline: float, poll_interval: float) -> bool:
    # Polling with LOCK_NB rather than a blocking flock: a blocking call cannot time out.
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(poll_interval, remaining))


def acquire(dir_fd: int, name: str, deadline: float, poll_interval: float) -> int:
    """Take the lock ``name`` in ``dir_fd`` (step 1 above); return the descriptor holding it.

    Parameters
    ----------
    dir_fd : int
        Trusted cache directory.
    name : str
        Lock file name.
    deadline : float
        ``time.monotonic()`` value after which to give up.
    poll_interval : float
        Seconds between attempts while another process holds the lock.

    Raises
    ------
    LockUnavailable
        On timeout, a lock file that is a symlink or not a regular file, or a file system
        without ``flock`` (``ENOLCK``).
    OSError
        If the lock file cannot be created (e.g. a read-only directory).
    """
    while True:
        try:
            fd, st = open_trusted_file(dir_fd, name, os.O_RDWR | os.O_CREAT, check_owner=False)
        except UntrustedPath as exc:
            raise LockUnavailable(str(exc)) from None
        try:
            locked = _poll_flock(fd, deadline, poll_interval)
        except OSError as exc:  # e.g. ENOLCK on a file system without flock support
            os.close(fd)
            raise LockUnavailable(f"cannot lock {name} ({exc})") from None
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            os.close(fd)
            raise LockUnavailable(f"timed out waiting for the lock {name}")
        if names_inode(dir_fd, name, st):
            return fd
        os.close(fd)  # an orphan: its holder unlinked it while we waited; take the current one


def release(dir_fd: int, name: str, fd: int) -> None:
    """Unlink the lock file while holding it, then close (step 2 above)."""
    try:
        # By the invariant the path names our inode; checking costs one stat and guards against
        # anyone outside the protocol (a person tidying the directory by hand).
        if names_inode(dir_fd, name, os.fstat(fd)):
            with contextlib.suppress(OSError):  # a directory made read-only meanwhile
                os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(fd)


def remove_if_free(dir_fd: int, name: str) -> bool:
    """Remove the lock file ``name`` if nobody holds it (left by a killed holder); True if removed.

    Follows the protocol: the file is removed only while we hold its lock, so a holder is never
    robbed and a waiter on it will notice and start over.
    """
    try:
        fd, st = open_trusted_file(dir_fd, name, os.O_RDWR, check_owner=False)
    except UntrustedPath:
        # A symlink or FIFO named like a lock: nobody can be holding it through the protocol.
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
            return True
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or flock unsupported: leave it
        os.close(fd)
        return False
    removed = False
    if names_inode(dir_fd, name, st):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
            removed = True
    os.close(fd)
    return removed

"""Removing what crashed writers leave in the kernel cache: temp files and lock files.

Called by every write (so litter never accumulates) and by ``pyattn cache clear``.
"""

from __future__ import annotations

import contextlib
import os
import time

from . import _keylock
from ._entry import is_lock_name, temp_writer_pid

__all__ = ["remove_litter"]

# A put() takes milliseconds: a temp file this old belongs to a writer that died or hangs, whatever
# its pid says (pids are reused).
_STALE_TMP_SECONDS = 60.0
# A temp file whose writer's pid is gone is removed once it is this old. Not at once: a writer in
# another pid namespace (a container sharing the cache) looks dead from here; the grace means it
# would have to stall mid-write to lose its write, and even then only that write is lost (its
# os.replace fails and it runs uncached), never an entry corrupted.
_DEAD_WRITER_GRACE_SECONDS = 2.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # alive but not ours / not a real pid
        return True
    return True


def _is_orphan_temp(dir_fd: int, name: str, pid: int, now: float) -> bool:
    try:
        age = now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime
    except OSError:
        return False
    if age > _STALE_TMP_SECONDS:
        return True
    # pid 0: a name without a pid (older pyattn), judged by age alone. Our own pid: another thread
    # of ours may be writing it right now. (pid <= 0 must never reach os.kill: 0 and -1 address
    # process groups.)
    if pid <= 0 or pid == os.getpid() or age < _DEAD_WRITER_GRACE_SECONDS:
        return False
    return not _pid_alive(pid)


def remove_litter(dir_fd: int) -> None:
    """Remove temp files of dead writers and lock files nobody holds from the directory ``dir_fd``.

    Parameters
    ----------
    dir_fd : int
        Descriptor of the trusted cache directory.
    """
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    now = time.time()
    for name in names:
        pid = temp_writer_pid(name)
        if pid is not None:
            if _is_orphan_temp(dir_fd, name, pid, now):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
        elif is_lock_name(name):
            _keylock.remove_if_free(dir_fd, name)  # a held lock (one of ours included) stays

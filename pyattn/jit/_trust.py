"""Who the kernel cache trusts: only files and directories the user owns and nobody else can write.

A cached kernel is machine code the process will run, so a cache another user can write is a way
into the process: the checksum in each entry detects accidents, not forgeries (a forger recomputes
it). The rules, applied at every use rather than once (a path can be swapped between two runs):

- the cache directory (after following a symlink: the target is what gets written) and every
  directory the cache creates on the way to it must be owned by :func:`current_uid` and not
  group- or world-writable; otherwise the cache refuses the directory entirely;
- an entry or lock file is opened with ``O_NOFOLLOW`` (a symlink is refused, never followed) and
  ``O_NONBLOCK`` (a FIFO named like an entry cannot block ``open``), then used only if ``fstat``
  on the open descriptor says: regular file, owned by us, not group/world-writable. Checking the
  descriptor, not the path, leaves no window between the check and the read.

Operations then go through the directory's descriptor (``dir_fd``), so a directory renamed or
replaced after the check is not the one written to.
"""

from __future__ import annotations

import errno
import os
import pathlib
import stat

__all__ = ["UntrustedPath", "current_uid", "untrusted_reason", "open_trusted_dir", "open_trusted_file",
           "names_inode"]

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UntrustedPath(Exception):
    """A cache directory or file that fails the ownership/permission rules; the message says why."""


def current_uid() -> int:
    """Return the uid that must own the cache directory and its files (the effective uid).

    A module-level function so tests can inject another owner: CI runs as root, where files
    owned by someone else are otherwise only reachable through ``chown``.
    """
    return os.geteuid()


def untrusted_reason(st: os.stat_result, what: str) -> str | None:
    """Return why ``st`` may not be trusted, or ``None`` when it may.

    Parameters
    ----------
    st : os.stat_result
        Result of ``fstat``/``lstat`` on the object.
    what : str
        How to name the object in the message (e.g. its path).

    Returns
    -------
    str or None
        ``None`` if ``st`` is owned by :func:`current_uid` and not writable by group or others.
    """
    uid = current_uid()
    if st.st_uid != uid:
        return f"{what} is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & _WRITABLE_BY_OTHERS:
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _make_dirs(directory: pathlib.Path) -> None:
    """Create the missing components of ``directory`` with mode 0o700, verifying each one.

    Not ``os.makedirs``: it would create parents with the umask's mode, maybe 0o777. Existing
    parents are not judged (``/tmp`` is world-writable and fine to live under); a component we
    set out to create but find already made (a race, or an attacker's mkdir in a shared parent)
    must pass the same rules as the cache directory, and must not be a symlink.
    """
    missing = [p for p in (directory, *directory.parents) if not os.path.lexists(p)]
    for path in reversed(missing):
        try:
            # The umask can only remove bits from 0o700: never group/world-writable.
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise UntrustedPath(f"{path} appeared as something other than a directory while "
                                "the cache was creating it")
        reason = untrusted_reason(st, str(path))
        if reason is not None:
            raise UntrustedPath(reason)


def open_trusted_dir(directory: pathlib.Path, *, create: bool) -> int | None:
    """Open the cache directory for ``dir_fd`` use, after checking it may be trusted.

    Parameters
    ----------
    directory : pathlib.Path
        The cache directory; a symlink is followed and its target judged.
    create : bool
        Create missing components (mode 0o700) first. Without it a missing directory gives
        ``None``.

    Returns
    -------
    int or None
        A descriptor (close it), or ``None`` when ``create`` is false and the directory is missing.

    Raises
    ------
    UntrustedPath
        If the directory, or a component created on the way, is not owned by us or is
        group/world-writable.
    OSError
        If the directory cannot be created or opened.
    """
    if create:
        _make_dirs(directory)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        if create:
            raise
        return None
    try:
        reason = untrusted_reason(os.fstat(fd), str(directory))
    except BaseException:
        os.close(fd)
        raise
    if reason is not None:
        os.close(fd)
        raise UntrustedPath(reason)
    return fd


def open_trusted_file(dir_fd: int, name: str, flags: int, *, check_owner: bool = True,
                      mode: int = 0o600) -> tuple[int, os.stat_result]:
    """Open ``name`` in the directory ``dir_fd`` without following symlinks or blocking.

    Parameters
    ----------
    dir_fd : int
        Descriptor of a trusted directory (:func:`open_trusted_dir`).
    name : str
        File name inside it.
    flags : int
        ``os.O_RDONLY``, ``os.O_RDWR | os.O_CREAT``...; ``O_NOFOLLOW``, ``O_NONBLOCK`` and
        ``O_CLOEXEC`` are added.
    check_owner : bool, optional
        Also require ownership by :func:`current_uid` and no group/world write bit (entries).
        Lock files only need to be regular files: their content is never read.
    mode : int, optional
        Permission bits if the file is created.

    Returns
    -------
    fd : int
        The open descriptor (close it).
    st : os.stat_result
        ``fstat`` of that descriptor.

    Raises
    ------
    FileNotFoundError
        If there is no such file (and ``O_CREAT`` was not given).
    UntrustedPath
        If it is a symlink, not a regular file (a FIFO, a device...), or fails the owner check.
    OSError
        For other failures to open it.
    """
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a symlink
            raise UntrustedPath(f"{name} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPath(f"{name} is not a regular file (mode {st.st_mode:o})")
        reason = untrusted_reason(st, name) if check_owner else None
        if reason is not None:
            raise UntrustedPath(reason)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def names_inode(dir_fd: int, name: str, st: os.stat_result) -> bool:
    """Whether ``name`` in ``dir_fd`` (not following a symlink) is still the file ``st`` describes."""
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

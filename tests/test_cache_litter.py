"""What writers leave behind: temp files of dead writers and lock files are removed, safely.

The lock files are removed by whoever releases them (``pyattn.jit._keylock``); these tests check
that this never lets two builders in, and that litter from killed processes goes away.
"""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from pyattn.jit import _litter
from pyattn.jit.cache import KernelCache

KEY = hashlib.sha256(b"kernel-a").hexdigest()
KEY2 = hashlib.sha256(b"kernel-b").hexdigest()
PAYLOAD = b"cubin" * 100
META = {"arch": "sm_80"}

FORK = multiprocessing.get_context("fork")  # fast, and the child needs nothing but this module


def _names(directory: pathlib.Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def _age(path: pathlib.Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _killed_in_put(directory: str) -> None:
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)  # after the temp file is written, before the rename

    os.replace = die
    KernelCache(directory).put(KEY, PAYLOAD, META)


def test_temp_file_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    proc = FORK.Process(target=_killed_in_put, args=(str(tmp_path),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    (orphan,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert f".{proc.pid}." in orphan.name, "the temp name carries the writer's pid"
    _age(orphan, _litter._DEAD_WRITER_GRACE_SECONDS + 1)
    assert KernelCache(tmp_path).put(KEY2, PAYLOAD, META) is not None
    assert _names(tmp_path) == {f"{KEY2}.pyattnk"}


def test_which_temp_files_a_write_removes(tmp_path):
    dead, alive, ours = _dead_pid(), os.getppid(), os.getpid()
    grace, stale = _litter._DEAD_WRITER_GRACE_SECONDS, _litter._STALE_TMP_SECONDS
    files = {  # name -> (age in seconds, removed?)
        f".{KEY}.{dead}.aa11.tmp": (grace + 1, True),     # writer gone
        f".{KEY}.{dead}.bb22.tmp": (0, False),            # writer gone, but maybe another pid namespace
        f".{KEY}.{alive}.cc33.tmp": (stale / 2, False),   # writer alive, may be writing
        f".{KEY}.{alive}.dd44.tmp": (stale + 5, True),    # alive pid, yet far too old: pid reused or hung
        f".{KEY}.{ours}.ee55.tmp": (stale / 2, False),    # another thread of ours may be writing it
        f".{KEY}.x7_kq2m9.tmp": (stale / 2, False),       # pyattn <= 0.4 name (no pid): by age only
        f".{KEY}.x7_kq2m8.tmp": (stale + 5, True),
        f".{KEY}.0.ff66.tmp": (stale / 2, False),         # pid 0 must never reach os.kill
        ".notes.tmp": (3600, False),                      # not ours: never touched
    }
    for name, (age, _) in files.items():
        (tmp_path / name).write_bytes(b"partial")
        _age(tmp_path / name, age)
    KernelCache(tmp_path).put(KEY2, PAYLOAD, META)
    expected = {n for n, (_, removed) in files.items() if not removed} | {f"{KEY2}.pyattnk"}
    assert _names(tmp_path) == expected


def _hold_lock(path: str, locked, release) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    release.wait(30)


def test_writes_remove_free_lock_files_but_never_a_held_one(tmp_path):
    stale, held = tmp_path / f"{KEY}.lock", tmp_path / f"{'c' * 64}.lock"
    stale.touch(mode=0o600)  # as a builder killed while holding it leaves it
    locked, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold_lock, args=(str(held), locked, release))
    holder.start()
    try:
        assert locked.wait(20)
        assert KernelCache(tmp_path).put(KEY2, PAYLOAD, META) is not None
        assert _names(tmp_path) == {held.name, f"{KEY2}.pyattnk"}
    finally:
        release.set()
        holder.join(10)
    KernelCache(tmp_path).clear()
    assert _names(tmp_path) == set(), "once free, clear() removes it"


def test_lock_protocol_excludes_while_lock_files_come_and_go(tmp_path):
    """Builders on separate instances (separate descriptors: as separate processes) take the
    same key's lock over and over, each release unlinking the file, while another thread keeps
    removing free lock files as clear() does. At most one may ever be inside."""
    inside, most, entries = 0, 0, 0
    guard, stop = threading.Lock(), threading.Event()
    errors = []

    def builder():
        nonlocal inside, most, entries
        cache = KernelCache(tmp_path, lock_timeout=30, poll_interval=0.0005)
        try:
            for _ in range(40):
                with cache._key_lock(KEY):
                    with guard:
                        inside += 1
                        most = max(most, inside)
                        entries += 1
                    time.sleep(0.0003)
                    with guard:
                        inside -= 1
        except BaseException as exc:  # surfaced below: a thread's exception is otherwise lost
            errors.append(exc)

    def sweeper():
        cache = KernelCache(tmp_path)
        while not stop.is_set():
            cache.clear()

    threads = [threading.Thread(target=builder) for _ in range(6)]
    sweep = threading.Thread(target=sweeper)
    sweep.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    sweep.join(10)
    assert errors == []
    assert entries == 6 * 40
    assert most == 1, f"{most} builders held the lock at once"
    assert _names(tmp_path) == set(), "no lock file is left behind"


@pytest.mark.parametrize("built", [True, False])
def test_get_or_build_leaves_only_the_entry(tmp_path, built):
    cache = KernelCache(tmp_path)
    if not built:
        cache.put(KEY, PAYLOAD, META)
    assert cache.get_or_build(KEY, lambda: (PAYLOAD, META)) == (PAYLOAD, META, built)
    assert _names(tmp_path) == {f"{KEY}.pyattnk"}

"""Tests of pyattn.jit.cache's locking: concurrent builders (threads and spawned processes) build
once, a killed lock holder does not block, a lock timeout builds without the lock, and a lock file
replaced while waiting is reacquired. The cache's other behaviour is in test_cache.py."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import pathlib
import signal
import sys
import threading
import time

import pytest

# Spawned children import this module (and _cache_helpers) by name and need the package; make the repo
# root importable.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from _cache_helpers import KEY, META, PAYLOAD, _Builder, _cache_warnings  # noqa: E402
from pyattn.jit.cache import KernelCache  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")


# -- helpers run in spawned child processes (top level so spawn can pickle them by reference) --


def _child_build(directory: str, key: str, counter: str, barrier, results) -> None:
    def build():
        time.sleep(0.3)
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        return b"payload-" + key.encode(), {"pid": "any"}

    barrier.wait()
    payload, meta, built = KernelCache(directory, lock_timeout=30).get_or_build(key, build)
    results.put((payload, meta, built))


def _child_hold_lock(lock_path: str, locked, seconds: float) -> None:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    time.sleep(seconds)


def _start_lock_holder(lock_path: pathlib.Path, seconds: float):
    locked = SPAWN.Event()
    proc = SPAWN.Process(target=_child_hold_lock, args=(str(lock_path), locked, seconds))
    proc.start()
    assert locked.wait(20), "child never took the lock"
    # The lock really is held: a non-blocking attempt from here must fail.
    fd = os.open(lock_path, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    return proc


# -- concurrency -------------------------------------------------------------------------------


def test_two_processes_build_once(tmp_path):
    n = 3
    counter = tmp_path / "builds.txt"
    barrier, results = SPAWN.Barrier(n), SPAWN.Queue()
    procs = [SPAWN.Process(target=_child_build,
                           args=(str(tmp_path / "c"), KEY, str(counter), barrier, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=30) for _ in range(n)]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert len(counter.read_text().splitlines()) == 1, "exactly one process may build"
    assert sum(built for _, _, built in got) == 1
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [f"{KEY}.pyattnk"], \
        "no lock or temp file is left behind"
    assert {(payload, tuple(meta.items())) for payload, meta, _ in got} == {
        (b"payload-" + KEY.encode(), (("pid", "any"),))}


def test_lock_of_killed_process_does_not_block(tmp_path):
    tmp_path.joinpath("c").mkdir()
    proc = _start_lock_holder(tmp_path / "c" / f"{KEY}.lock", seconds=600)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    assert (tmp_path / "c" / f"{KEY}.lock").exists(), "the stale lock file is left behind"
    start = time.monotonic()
    result = KernelCache(tmp_path / "c", lock_timeout=30).get_or_build(KEY, _Builder())
    assert result == (PAYLOAD, META, True)
    assert time.monotonic() - start < 2.0
    assert not (tmp_path / "c" / f"{KEY}.lock").exists(), "the next builder removes it"


def test_lock_timeout_builds_without_lock(tmp_path, caplog):
    tmp_path.joinpath("c").mkdir()
    proc = _start_lock_holder(tmp_path / "c" / f"{KEY}.lock", seconds=60)
    try:
        cache = KernelCache(tmp_path / "c", lock_timeout=0.3, poll_interval=0.02)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
            result = cache.get_or_build(KEY, _Builder(delay=0.1))
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.join(10)
    assert result == (PAYLOAD, META, True)
    assert 0.3 <= elapsed < 1.5, elapsed
    assert any("lock" in r.getMessage() for r in _cache_warnings(caplog))
    assert cache.get(KEY) == (PAYLOAD, META), "the unlocked build is still stored"


def test_lock_file_replaced_while_waiting_is_reacquired(tmp_path, caplog):
    # A waiter whose lock file is unlinked and recreated (as clear() may do between two holders)
    # must not treat its lock on the orphaned inode as exclusive.
    lock = tmp_path / f"{KEY}.lock"
    old_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(old_fd, fcntl.LOCK_EX)
    built_at = []
    builder = _Builder()
    cache = KernelCache(tmp_path, lock_timeout=0.8, poll_interval=0.01)
    start = time.monotonic()

    def build():
        built_at.append(time.monotonic() - start)
        return builder()

    waiter = threading.Thread(target=cache.get_or_build, args=(KEY, build))
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        waiter.start()
        deadline = time.monotonic() + 5
        while _open_fds_on(lock) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)  # until the waiter has the old file open
        lock.unlink()
        new_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(new_fd, fcntl.LOCK_EX)
        os.close(old_fd)  # the waiter now gets the orphaned inode
        waiter.join(10)
        os.close(new_fd)
    assert built_at and built_at[0] >= 0.75, "built while the new lock file was held"
    assert any("timed out" in r.getMessage() for r in _cache_warnings(caplog))


def _open_fds_on(path: pathlib.Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return count


@pytest.mark.parametrize("shared_instance", [True, False])
def test_threads_build_once(tmp_path, shared_instance):
    n = 8
    shared = KernelCache(tmp_path)
    builder = _Builder(delay=0.2)
    barrier = threading.Barrier(n)
    results = []

    def work():
        cache = shared if shared_instance else KernelCache(tmp_path)
        barrier.wait()
        results.append(cache.get_or_build(KEY, builder))

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert builder.calls == 1
    assert len(results) == n and all(r[:2] == (PAYLOAD, META) for r in results)
    assert sum(r[2] for r in results) == 1

"""Tests for pyattn.jit.cache: format validation, atomicity, permissions and locking."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import multiprocessing
import os
import pathlib
import signal
import stat
import sys
import threading
import time

import pytest

# Spawned children import this module by name and need the package; make the repo root importable.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from pyattn.jit.cache import CacheEntry, KernelCache, default_cache_dir  # noqa: E402

KEY = hashlib.sha256(b"kernel-a").hexdigest()
KEY2 = hashlib.sha256(b"kernel-b").hexdigest()
KEY3 = hashlib.sha256(b"kernel-c").hexdigest()
PAYLOAD = bytes(range(256)) * 8
META = {"arch": "sm_90a", "names": ["k0", "k1"], "n": 3}

SPAWN = multiprocessing.get_context("spawn")


def _entry(directory: pathlib.Path, key: str = KEY) -> pathlib.Path:
    return directory / f"{key}.pyattnk"


def _cache_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pyattn.cache" and r.levelno >= logging.WARNING]


class _Builder:
    """Counts calls; thread-safe."""

    def __init__(self, payload: bytes = PAYLOAD, meta: dict = META, delay: float = 0.0):
        self.payload, self.meta, self.delay = payload, meta, delay
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        return self.payload, self.meta


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


# -- basics ------------------------------------------------------------------------------------


def test_round_trip_and_miss(tmp_path):
    cache = KernelCache(tmp_path / "c")
    assert cache.get(KEY) is None
    assert not (tmp_path / "c").exists(), "a read must not create the directory"
    path = cache.put(KEY, PAYLOAD, META)
    assert path == _entry(tmp_path / "c")
    assert cache.get(KEY) == (PAYLOAD, META)
    assert cache.get(KEY2) is None
    # A fresh instance reads the same file.
    assert KernelCache(tmp_path / "c").get(KEY) == (PAYLOAD, META)


def test_get_or_build_builds_once_then_hits(tmp_path):
    cache = KernelCache(tmp_path)
    builder = _Builder()
    assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
    assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, False)
    assert KernelCache(tmp_path).get_or_build(KEY, builder) == (PAYLOAD, META, False)
    assert builder.calls == 1


def test_build_exception_propagates_and_releases_lock(tmp_path):
    cache = KernelCache(tmp_path, lock_timeout=5)

    def boom():
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        cache.get_or_build(KEY, boom)
    assert not (tmp_path / f"{KEY}.lock").exists(), "the lock is released and its file removed"
    start = time.monotonic()
    assert cache.get_or_build(KEY, _Builder())[2] is True
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("key", ["../x", "", "ABC" * 8, "a" * 15, "a" * 129, "ab/" + "c" * 20,
                                 KEY + "\n", "g" * 64])
def test_invalid_keys_raise(tmp_path, key):
    cache = KernelCache(tmp_path)
    for call in (lambda: cache.get(key), lambda: cache.put(key, b"x", {}),
                 lambda: cache.get_or_build(key, _Builder())):
        with pytest.raises(ValueError, match="key"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_bad_meta_rejected_before_writing(tmp_path):
    cache = KernelCache(tmp_path / "c")
    with pytest.raises(TypeError):
        cache.put(KEY, b"x", {1: "int key"})
    with pytest.raises(TypeError):
        cache.put(KEY, b"x", {"obj": object()})
    assert not (tmp_path / "c").exists()


# -- corruption --------------------------------------------------------------------------------


def _flip_payload_byte(data: bytes) -> bytes:
    i = len(data) - 33  # last payload byte, just before the checksum
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


CORRUPTIONS = {
    "flip_payload": _flip_payload_byte,
    "flip_header": lambda d: d[:20] + bytes([d[20] ^ 0x20]) + d[21:],
    "truncate_half": lambda d: d[: len(d) // 2],
    "truncate_digest": lambda d: d[:-1],
    "truncate_tiny": lambda d: d[:5],
    "empty": lambda d: b"",
    "bad_magic": lambda d: b"XXXXXXXX" + d[8:],
    "bad_version": lambda d: b"PYATTNK9" + d[8:],
    "old_version": lambda d: b"PYATTNK1" + d[8:],  # format 1 (sha256 checksums): never read as format 2
    "garbage": lambda d: os.urandom(len(d)),
}


@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
def test_corrupt_entry_is_a_miss_and_rebuilt(tmp_path, caplog, corrupt):
    cache = KernelCache(tmp_path)
    path = cache.put(KEY, PAYLOAD, META)
    path.write_bytes(CORRUPTIONS[corrupt](path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        assert cache.get(KEY) is None
    assert len(_cache_warnings(caplog)) == 1
    assert not path.exists(), "the bad file must be removed"
    path.write_bytes(CORRUPTIONS[corrupt](_entry_bytes(tmp_path)))
    builder = _Builder()
    assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
    assert builder.calls == 1
    assert KernelCache(tmp_path).get(KEY) == (PAYLOAD, META), "a valid file is rewritten"


def _entry_bytes(tmp_path: pathlib.Path) -> bytes:
    other = KernelCache(tmp_path / "scratch")
    return other.put(KEY, PAYLOAD, META).read_bytes()


def test_stored_key_differs_from_name_is_a_miss(tmp_path, caplog):
    cache = KernelCache(tmp_path)
    cache.put(KEY, PAYLOAD, META).rename(_entry(tmp_path, KEY2))
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        assert cache.get(KEY2) is None
    assert any("differs" in r.getMessage() for r in _cache_warnings(caplog))
    assert not _entry(tmp_path, KEY2).exists()


# -- permissions and unwritable directories ----------------------------------------------------


def test_modes_private_even_with_umask_zero(tmp_path):
    directory = tmp_path / "a" / "b" / "cache"
    lock_modes = []

    def build():  # runs while the lock file exists: look at it then
        lock_modes.append(stat.S_IMODE((directory / f"{KEY2}.lock").stat().st_mode))
        return PAYLOAD, META

    old = os.umask(0)
    try:
        cache = KernelCache(directory)
        path = cache.put(KEY, PAYLOAD, META)
        cache.get_or_build(KEY2, build)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", directory):
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, oct(d.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(_entry(directory, KEY2).stat().st_mode) == 0o600
    assert len(lock_modes) == 1 and lock_modes[0] & 0o077 == 0, lock_modes


def test_directory_under_a_regular_file(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    builder = _Builder()
    cache = KernelCache(blocker / "cache")
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
        assert cache.put(KEY2, PAYLOAD, META) is None
    assert builder.calls == 2
    assert len(_cache_warnings(caplog)) == 1, [r.getMessage() for r in caplog.records]
    assert cache.entries() == [] and cache.clear() == 0
    assert blocker.read_text() == "not a directory"


# -- atomicity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [OSError("disk gone"), RuntimeError("interrupted")])
def test_failed_replace_leaves_nothing_behind(tmp_path, monkeypatch, exc):
    cache = KernelCache(tmp_path)

    written = []

    def failing_replace(src, dst, **kwargs):
        written.append(os.stat(src, dir_fd=kwargs.get("src_dir_fd")).st_size)  # temp fully written
        raise exc

    monkeypatch.setattr(os, "replace", failing_replace)
    if isinstance(exc, OSError):
        assert cache.put(KEY, PAYLOAD, META) is None
    else:
        with pytest.raises(RuntimeError):
            cache.put(KEY, PAYLOAD, META)
    assert len(written) == 1 and written[0] > len(PAYLOAD) + 32
    assert list(tmp_path.iterdir()) == [], "no entry and no temp file may remain"


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


# -- inspection and maintenance ----------------------------------------------------------------


def test_entries_total_size_clear(tmp_path):
    cache = KernelCache(tmp_path)
    assert cache.entries() == [] and cache.total_size() == 0
    written = {KEY: cache.put(KEY, b"a" * 10, {}), KEY2: cache.put(KEY2, b"b" * 1000, {"x": 1})}
    cache.get_or_build(KEY3, _Builder())
    written[KEY3] = _entry(tmp_path, KEY3)
    (tmp_path / "README").write_text("keep me")
    (tmp_path / "notakey.pyattnk").write_text("keep me too")
    stale_tmp = tmp_path / f".{KEY}.abc123.tmp"
    stale_tmp.write_bytes(b"partial")
    os.utime(stale_tmp, (time.time() - 3600,) * 2)

    expected = [CacheEntry(k, written[k], written[k].stat().st_size) for k in sorted(written)]
    assert cache.entries() == expected
    assert cache.total_size() == sum(e.size for e in expected)
    stale_lock = tmp_path / f"{KEY3}.lock"  # as a killed builder leaves it
    stale_lock.touch()

    assert cache.clear() == 3
    assert cache.entries() == [] and cache.total_size() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README", "notakey.pyattnk"]


def test_clear_keeps_a_held_lock(tmp_path):
    cache = KernelCache(tmp_path)
    lock = tmp_path / f"{KEY}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert cache.clear() == 0
        assert lock.exists()
    finally:
        os.close(fd)
    cache.clear()
    assert not lock.exists()


# -- default directory -------------------------------------------------------------------------


def test_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PYATTN_CACHE_DIR", "~/explicit")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "home" / "explicit"
    monkeypatch.delenv("PYATTN_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "pyattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "pyattn"
    cache = KernelCache()
    assert cache.directory == tmp_path / "home" / ".cache" / "pyattn"
    assert cache.get(KEY) is None and cache.entries() == []
    assert list(tmp_path.iterdir()) == [], "nothing may be created before the first write"

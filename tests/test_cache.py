"""Tests for pyattn.jit.cache: round trips, format validation (corrupt entries), permissions,
atomicity, inspection and clearing, and the default directory. Locking and concurrent builders
(threads, spawned processes, killed lock holders) are in test_cache_locking.py."""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import stat
import time

import pytest

from _cache_helpers import KEY, KEY2, KEY3, META, PAYLOAD, _Builder, _cache_warnings, _entry
from pyattn.jit.cache import CacheEntry, KernelCache, default_cache_dir


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

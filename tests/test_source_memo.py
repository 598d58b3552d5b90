"""The kernel-source digest is memoised in the kernel cache under the templates' file stats
(issue 16: hashing ~340 KB of templates was ~1.3 ms of a GPU host's warm first call). The memo must
give exactly the real digest, follow every edit, stay out of the kernel listings, and never warn."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from pyattn import jit
from pyattn.jit import source
from pyattn.jit.cache import KernelCache


def _clear_source_caches():
    for fn in (source.kernel_source_dir, source._header_files, source.kernel_headers, source.sources_digest,
               jit.toolchain_fingerprint):
        fn.cache_clear()


@pytest.fixture
def templates(tmp_path, monkeypatch):
    """A private copy of the templates, used by this test's digests and fingerprints."""
    d = tmp_path / "kernels_src"
    shutil.copytree(source.kernel_source_dir(), d)
    monkeypatch.setattr(source, "kernel_source_dir", lambda: d)
    monkeypatch.setenv("PYATTN_CACHE_DIR", str(tmp_path / "cache"))
    for fn in (source._header_files, source.kernel_headers, source.sources_digest, jit.toolchain_fingerprint):
        fn.cache_clear()
    yield d
    monkeypatch.undo()
    _clear_source_caches()


def _src(fingerprint: str) -> str:
    return fingerprint.split(";src=")[1].split(";")[0]


def _memos(cache_dir):
    return sorted(p.name for p in cache_dir.iterdir() if p.name.endswith(".pyattnm")) if cache_dir.exists() else []


def _fresh_fingerprint() -> str:
    for fn in (source._header_files, source.kernel_headers, source.sources_digest, jit.toolchain_fingerprint):
        fn.cache_clear()
    return jit.toolchain_fingerprint()


def test_the_memo_gives_the_real_digest_and_is_no_kernel(templates, tmp_path, monkeypatch, caplog):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)  # a memo never creates the directory (the first compile does)
    with caplog.at_level(logging.WARNING, logger="pyattn"):
        first = _fresh_fingerprint()
    assert _src(first) == source.sources_digest()
    assert len(_memos(cache_dir)) == 1
    assert KernelCache(cache_dir).entries() == []  # not counted as a kernel

    def no_hashing():
        raise AssertionError("the digest was recomputed although the memo matches")

    monkeypatch.setattr(source, "sources_digest", no_hashing)
    for fn in (source._header_files, jit.toolchain_fingerprint):
        fn.cache_clear()
    assert jit.toolchain_fingerprint() == first  # served from the memo
    assert not caplog.records
    assert KernelCache(cache_dir).clear() == 0 and _memos(cache_dir) == []  # clear removes memos, counts kernels


def test_an_edited_template_misses_the_memo(templates, tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    before = _src(_fresh_fingerprint())
    path = templates / "common.cuh"
    path.write_bytes(path.read_bytes() + b"\n// edited\n")
    after = _src(_fresh_fingerprint())
    assert after != before and after == source.sources_digest()
    # an edit that keeps the size and the mtime still changes the ctime, so the memo key
    st = path.stat()
    data = path.read_bytes()
    path.write_bytes(data[:-2] + b"X\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = _src(_fresh_fingerprint())
    assert again == source.sources_digest() and again != after
    assert len(_memos(tmp_path / "cache")) == 3


def test_a_corrupt_memo_is_recomputed(templates, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    real = _src(_fresh_fingerprint())
    (name,) = _memos(cache_dir)
    (cache_dir / name).write_bytes(b"PYATTNK2 not a memo")
    assert _src(_fresh_fingerprint()) == real
    assert (cache_dir / name).read_bytes() != b"PYATTNK2 not a memo"  # rewritten


def test_memo_writes_are_silent_and_create_no_directory(templates, tmp_path, monkeypatch, caplog):
    cache_dir = tmp_path / "cache"
    with caplog.at_level(logging.DEBUG, logger="pyattn"):
        assert _src(_fresh_fingerprint()) == source.sources_digest()
    assert not cache_dir.exists()
    cache_dir.mkdir(mode=0o700)

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)  # a write that fails once the directory exists
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="pyattn"):
        assert _src(_fresh_fingerprint()) == source.sources_digest()
    assert _memos(cache_dir) == []
    assert [r.levelno for r in caplog.records if "cannot write" in r.getMessage()] == [logging.DEBUG]


def test_a_process_that_read_the_old_templates_does_not_poison_the_memo(templates, tmp_path):
    """A long-lived process (a test run, a notebook) read the templates, then they were edited: its
    next fingerprint may still carry the digest of the bytes it holds, but the memo it writes must
    not file that old digest under the edited files' identity, where later processes would find it."""
    (tmp_path / "cache").mkdir(mode=0o700)
    old = _src(_fresh_fingerprint())  # this "process" has read and hashed the templates
    path = templates / "common.cuh"
    path.write_bytes(path.read_bytes() + b"\n// edited while the process ran\n")
    jit.toolchain_fingerprint.cache_clear()  # the process's next fingerprint; its read headers stay
    assert _src(jit.toolchain_fingerprint()) == old  # what it compiles is the text it read
    fresh = _src(_fresh_fingerprint())  # a later process
    assert fresh != old
    for fn in (source._header_files, source.kernel_headers, source.sources_digest):
        fn.cache_clear()
    assert fresh == source.sources_digest()

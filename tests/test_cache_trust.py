"""The kernel cache trusts only what the user owns: directories, entries, and what stands in their place.

Runs as root (CI does) and as a normal user. Ownership by someone else is made real with
``chown`` when root, and otherwise simulated by injecting the expected owner
(``pyattn.jit._trust.current_uid``). Permission checks that root bypasses (a read-only
directory) run in a forked child that has dropped to ``nobody``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import pwd
import shutil
import signal
import stat
import tempfile
import threading
import time
import traceback

import pytest

from pyattn.jit import _trust
from pyattn.jit.cache import KernelCache

KEY = hashlib.sha256(b"kernel-a").hexdigest()
KEY2 = hashlib.sha256(b"kernel-b").hexdigest()
PAYLOAD = b"\x7fELF genuine cubin" * 64
FORGED = b"\x7fELF forged cubin!" * 64
META = {"arch": "sm_90a"}

IS_ROOT = os.geteuid() == 0
NOBODY = pwd.getpwnam("nobody")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")


class _Builder:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return PAYLOAD, META


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pyattn.cache" and r.levelno >= logging.WARNING]


def _forged_entry(directory: pathlib.Path, key: str = KEY) -> pathlib.Path:
    """A well-formed entry with foreign content: the checksum is recomputed, as a forger would."""
    return KernelCache(directory).put(key, FORGED, META)


def _assert_refused(cache: KernelCache, caplog, reason: str) -> None:
    """Nothing is read or written there, the build still runs, exactly one warning says why."""
    before = sorted(p.name for p in cache.directory.iterdir())
    builder = _Builder()
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        assert cache.get(KEY) is None, "a forged but valid entry was served"
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
        assert cache.put(KEY2, PAYLOAD, META) is None
        assert cache.entries() == [] and cache.clear() == 0
    assert builder.calls == 2
    messages = _warnings(caplog)
    assert len(messages) == 1, messages
    assert "PYATTN_CACHE_DIR" in messages[0] and reason in messages[0], messages[0]
    assert reason in cache.trust_problem()
    assert sorted(p.name for p in cache.directory.iterdir()) == before, "nothing written or removed"


# -- the directory -----------------------------------------------------------------------------


def test_directory_owned_by_someone_else_injected(tmp_path, caplog, monkeypatch):
    _forged_entry(tmp_path / "c")
    monkeypatch.setattr(_trust, "current_uid", lambda: os.geteuid() + 4242)
    _assert_refused(KernelCache(tmp_path / "c"), caplog, f"owned by uid {os.geteuid()}")


@needs_root
def test_directory_owned_by_someone_else_chown(tmp_path, caplog):
    _forged_entry(tmp_path / "c")
    os.chown(tmp_path / "c", NOBODY.pw_uid, NOBODY.pw_gid)
    _assert_refused(KernelCache(tmp_path / "c"), caplog, f"owned by uid {NOBODY.pw_uid}")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o720], ids=oct)
def test_directory_writable_by_others(tmp_path, caplog, mode):
    _forged_entry(tmp_path / "c")
    (tmp_path / "c").chmod(mode)
    _assert_refused(KernelCache(tmp_path / "c"), caplog, f"mode {mode:04o}")


@pytest.mark.parametrize("target_kind", ["world_writable", pytest.param("other_owner", marks=needs_root)])
def test_symlink_to_a_foreign_directory_is_refused(tmp_path, caplog, target_kind):
    """The reported attack: the cache path is a symlink to a directory someone else controls."""
    shared = tmp_path / "shared"
    _forged_entry(shared)
    if target_kind == "world_writable":
        shared.chmod(0o777)
        reason = "mode 0777"
    else:
        os.chown(shared, NOBODY.pw_uid, NOBODY.pw_gid)
        reason = f"owned by uid {NOBODY.pw_uid}"
    (tmp_path / "link").symlink_to(shared)
    _assert_refused(KernelCache(tmp_path / "link"), caplog, reason)


def test_symlink_to_our_own_private_directory_is_used(tmp_path, caplog):
    mine = tmp_path / "mine"
    KernelCache(mine).put(KEY, PAYLOAD, META)
    (tmp_path / "link").symlink_to(mine)
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        assert KernelCache(tmp_path / "link").get_or_build(KEY, _Builder()) == (PAYLOAD, META, False)
    assert _warnings(caplog) == []
    assert KernelCache(tmp_path / "link").trust_problem() is None


def test_component_created_concurrently_by_someone_else(tmp_path, caplog, monkeypatch):
    """A directory we set out to create, made first (world-writable) by another user, is refused."""
    real_mkdir = os.mkdir

    def racing_mkdir(path, mode=0o777, **kwargs):
        if pathlib.Path(path).name != "shared":
            return real_mkdir(path, mode, **kwargs)
        real_mkdir(path, 0o777)  # the other user wins the race...
        os.chmod(path, 0o777)
        raise FileExistsError(path)  # ...and our mkdir finds it there

    cache = KernelCache(tmp_path / "shared" / "cache")
    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    builder = _Builder()
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)  # refused for good
    monkeypatch.undo()
    assert builder.calls == 2
    messages = _warnings(caplog)
    assert len(messages) == 1 and "PYATTN_CACHE_DIR" in messages[0], messages
    assert "shared is writable by group or others" in messages[0]
    assert not (tmp_path / "shared" / "cache").exists(), "nothing created below the refused component"


# -- entries -----------------------------------------------------------------------------------


def _make_symlink(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    path.symlink_to(_forged_entry(tmp_path / "elsewhere"))


def _make_world_writable(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    path.write_bytes(_forged_entry(tmp_path / "elsewhere").read_bytes())
    path.chmod(0o666)


def _make_other_owner(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    path.write_bytes(_forged_entry(tmp_path / "elsewhere").read_bytes())
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)


def _make_fifo(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    os.mkfifo(path, 0o600)


UNTRUSTED_ENTRIES = {
    "symlink": (_make_symlink, "symbolic link"),
    "world_writable": (_make_world_writable, "mode 0666"),
    "other_owner": (_make_other_owner, f"owned by uid {NOBODY.pw_uid}"),
    "fifo": (_make_fifo, "not a regular file"),
}


def _in_thread(fn, timeout: float):
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it blocks."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"blocked for more than {timeout} s"
    return result[0]


@pytest.mark.parametrize("kind", [k if k != "other_owner" else pytest.param(k, marks=needs_root)
                                  for k in UNTRUSTED_ENTRIES])
def test_untrusted_entry_is_a_miss_and_replaced(tmp_path, caplog, kind):
    make, reason = UNTRUSTED_ENTRIES[kind]
    directory = tmp_path / "c"
    directory.mkdir(mode=0o700)
    path = directory / f"{KEY}.pyattnk"
    make(path, tmp_path)
    cache = KernelCache(directory)
    builder = _Builder()
    try:
        with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
            assert _in_thread(lambda: cache.get(KEY), timeout=10) is None
            assert _in_thread(lambda: cache.get_or_build(KEY, builder), 10) == (PAYLOAD, META, True)
    finally:
        if kind == "fifo" and stat.S_ISFIFO(os.lstat(path).st_mode):
            # Unblock a reader stuck in open() (if the test failed), so the process can exit.
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert builder.calls == 1
    messages = _warnings(caplog)
    assert len(messages) == 1 and reason in messages[0], messages  # warned once per entry
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert KernelCache(directory).get(KEY) == (PAYLOAD, META), "our build replaced it"
    if kind == "symlink":
        assert KernelCache(tmp_path / "elsewhere").get(KEY) == (FORGED, META), "target untouched"


def test_entry_owned_by_someone_else_injected(tmp_path, caplog, monkeypatch):
    """Without root, a foreign entry in a trusted directory, by injecting the expected owner."""
    directory = tmp_path / "c"
    _forged_entry(directory)
    uid = os.geteuid()
    # The directory is ours (checked first), the entry file is not.
    monkeypatch.setattr(_trust, "untrusted_reason", lambda st, what: None if stat.S_ISDIR(st.st_mode)
                        else f"{what} is owned by uid {st.st_uid}, not by you (uid {uid + 1})")
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        assert KernelCache(directory).get(KEY) is None
    assert any("owned by uid" in m for m in _warnings(caplog))


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_odd_lock_file_builds_unlocked_without_touching_it(tmp_path, caplog, kind):
    directory = tmp_path / "c"
    directory.mkdir(mode=0o700)
    lock = directory / f"{KEY}.lock"
    target = tmp_path / "victim"
    if kind == "symlink":
        lock.symlink_to(target)  # root must never create or truncate a file through it
    else:
        os.mkfifo(lock, 0o600)
    builder = _Builder()
    with caplog.at_level(logging.WARNING, logger="pyattn.cache"):
        got = _in_thread(lambda: KernelCache(directory).get_or_build(KEY, builder), timeout=10)
    assert got == (PAYLOAD, META, True) and builder.calls == 1
    assert any("building without the lock" in m for m in _warnings(caplog)), _warnings(caplog)
    assert not target.exists()
    assert KernelCache(directory).get(KEY) == (PAYLOAD, META)


# -- a read-only directory, for real: as root in a child that dropped to nobody ---------------


@pytest.fixture
def unprivileged_tmp():
    """A directory the unprivileged runner owns, reachable by it (pytest's tmp_path is 0700 root)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="pyattn-test-"))
    if IS_ROOT:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    try:
        yield path
    finally:
        for p in path.rglob("*"):  # a non-root runner needs write permission back to remove
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o700)
        shutil.rmtree(path)


def run_unprivileged(fn, *args, timeout: float = 60.0) -> None:
    """Run ``fn(*args)`` without root: in a forked child as ``nobody`` when root, else here."""
    if not IS_ROOT:
        fn(*args)
        return
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            fn(*args)
            status = 0
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
        finally:
            os._exit(status)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"unprivileged child still running after {timeout} s")
        time.sleep(0.01)
    with os.fdopen(read_end, "rb") as f:
        report = f.read().decode()
    assert os.waitstatus_to_exitcode(done[1]) == 0, f"unprivileged child failed:\n{report}"


class _Records(logging.Handler):
    """caplog does not reach a forked child's assertions; this does."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _check_read_only(base: pathlib.Path) -> None:
    directory = base / "ro"
    directory.mkdir(mode=0o700)
    KernelCache(directory).put(KEY2, PAYLOAD, META)
    directory.chmod(0o500)
    with pytest.raises(PermissionError):  # the premise: this process really cannot write there
        (directory / "probe").touch()
    records = _Records()
    logging.getLogger("pyattn.cache").addHandler(records)
    try:
        cache, builder = KernelCache(directory), _Builder()
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
        assert cache.get_or_build(KEY, builder) == (PAYLOAD, META, True)
        assert cache.put(KEY, PAYLOAD, META) is None
        assert builder.calls == 2
        # The existing entry is still served, and reading needed no lock file.
        assert cache.get_or_build(KEY2, builder) == (PAYLOAD, META, False)
    finally:
        logging.getLogger("pyattn.cache").removeHandler(records)
    assert len(records.messages) == 1 and "cannot write" in records.messages[0], records.messages
    assert sorted(p.name for p in directory.iterdir()) == [f"{KEY2}.pyattnk"]


def test_read_only_directory(unprivileged_tmp):
    run_unprivileged(_check_read_only, unprivileged_tmp)


def _check_refuses_root_owned(base: pathlib.Path, root_owned: pathlib.Path) -> None:
    # As nobody: a directory owned by root (0755) is not ours, however trustworthy root is.
    assert KernelCache(root_owned).get(KEY) is None
    assert "owned by uid 0" in KernelCache(root_owned).trust_problem()


@needs_root
def test_unprivileged_user_refuses_a_directory_it_does_not_own(unprivileged_tmp):
    root_owned = unprivileged_tmp / "root-owned"
    _forged_entry(root_owned)
    root_owned.chmod(0o755)
    (root_owned / f"{KEY}.pyattnk").chmod(0o644)
    run_unprivileged(_check_refuses_root_owned, unprivileged_tmp, root_owned)

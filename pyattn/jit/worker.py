"""NVRTC in child processes: the user's process never runs ``nvrtcCompileProgram``.

Why: measured on an H200 machine (driver 580.159, NVRTC 13.0 from the wheel, torch 2.11), one
``nvrtcCompileProgram`` in a process makes a later ``import torch`` there fail in torch's schema
parser (``expected ident but found ')' here: annotate(strtag) -> ()``), also when the compile ran
on another thread. Loading libnvrtc and creating a program do not; the same compile in a child
process does not. It is not the locale: the global and thread locales, the environment, and C
and C++ character classification are unchanged after the compile, and NVRTC's own locale calls
(``newlocale``/``uselocale``/``freelocale`` on glibc's static "C" locale) are balanced
(``dev/probe_nvrtc_torch.py`` records all of it). What else the compile changes for good could not
be seen from outside; keeping it out of the process is the fix that holds for any such state,
and a compiler crash can no longer take the user's process down.

A small pool of persistent workers (``_nvrtc_worker.py`` run by path: the standard library and
``cuda.bindings`` only) serves the compiles, up to one per CPU for ``pyattn warmup``; a worker
costs ~0.1-0.2 s to start once, against 0.3-1.6 s per compile. Workers exit with the process
(their request pipe closes) and are reaped after idling. A fork of the process starts its own pool.
``PYATTN_NVRTC_IN_PROCESS=1`` compiles in-process instead, for places that forbid child
processes; a later ``import torch`` in such a process may then fail as above.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time

from . import _nvrtc_worker as protocol

__all__ = ["compile_in_worker", "shutdown"]

_IDLE_SECONDS = 60.0  # a worker idle this long is stopped (one is kept)


class _Worker:
    def __init__(self):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        boot = (f"import sys, runpy; sys.path[:] = {sys.path!r}; "
                f"runpy.run_path({protocol.__file__!r}, run_name='__main__')")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", boot, str(req_r), str(rep_w)],
                                         pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(req_r)
            os.close(rep_w)
        self.req, self.rep = req_w, rep_r
        self.idle_since = time.monotonic()

    def ask(self, request):
        protocol.send(self.req, request)
        return protocol.receive(self.rep)

    def stop(self, kill: bool = False) -> None:
        for fd in (self.req, self.rep):
            try:
                os.close(fd)
            except OSError:
                pass
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _Pool:
    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.idle: list = []

    def take(self) -> _Worker:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return _Worker()

    def give_back(self, w: _Worker) -> None:
        now = time.monotonic()
        w.idle_since = now
        with self.lock:
            self.idle.append(w)
            stale = [x for x in self.idle[:-1] if now - x.idle_since > _IDLE_SECONDS]
            self.idle = [x for x in self.idle if x not in stale]
        for x in stale:
            x.stop()

    def shutdown(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for w in idle:
            w.stop()


_pool = None
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():  # a forked child must not share its parent's pipes
        with _pool_lock:
            if _pool is None or _pool.pid != os.getpid():
                _pool = _Pool()
                atexit.register(_pool.shutdown)
    return _pool


def compile_in_worker(source: str, headers, options, name: str, ptx: bool):
    """Compile in a worker process; returns the worker's reply (see ``_nvrtc_worker``).

    Raises
    ------
    RuntimeError
        The worker could not be started or died; the message says how (the caller turns it into a
        pyattn ``CompileError``).
    """
    pool = _get_pool()
    try:
        w = pool.take()
    except OSError as exc:
        raise RuntimeError(f"could not start an NVRTC worker process ({exc}); set PYATTN_NVRTC_IN_PROCESS=1 to "
                           f"compile in this process instead") from exc
    try:
        reply = w.ask((source, tuple(headers), tuple(options), name, bool(ptx)))
    except BaseException as exc:
        # A worker interrupted mid-request (Ctrl-C) or dead can answer nothing reliable again.
        w.stop(kill=True)
        if isinstance(exc, (EOFError, OSError)):
            code = w.proc.returncode
            raise RuntimeError(f"the NVRTC worker process died (exit status {code}) while compiling {name}") from None
        raise
    pool.give_back(w)
    return reply


def shutdown() -> None:
    """Stop the idle workers of this process (they also stop by themselves when it exits)."""
    if _pool is not None and _pool.pid == os.getpid():
        _pool.shutdown()

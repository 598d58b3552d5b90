"""The NVRTC call sequence, and the compile-worker program that runs it in a child process.

This file imports only the standard library and ``cuda.bindings``: ``pyattn.jit.worker`` starts
it by path in a child process (no ``pyattn`` import there), and ``pyattn.jit.nvrtc`` imports it
as a module for the in-process path (``PYATTN_NVRTC_IN_PROCESS=1``).

Protocol on two pipes (file descriptors given on the command line): each message is an 8-byte
little-endian length and a pickle. Request: ``(source, headers, options, name, ptx)``. Reply:
``("ok", image, log)``, ``("compile", status_name, log)`` or ``("nvrtc", code, name, description,
call)``. The worker exits when its request pipe reaches end of file (its parent is gone).
"""

import os
import pickle
import struct
import sys

_LEN = struct.Struct("<Q")


class NvrtcCallFailed(Exception):
    """An NVRTC API call (not the compile itself) failed: ``(code, name, description, call)``."""


class CompileFailed(Exception):
    """``nvrtcCompileProgram`` rejected the unit: ``(status_name, log)``."""


def _check(nvrtc, result, call: str):
    code, values = result[0], result[1:]
    if int(code) != 0:
        _, desc = nvrtc.nvrtcGetErrorString(code)
        raise NvrtcCallFailed(int(code), getattr(code, "name", f"nvrtcResult {int(code)}"),
                              desc.decode() if desc else "unknown error", call)
    return None if not values else (values[0] if len(values) == 1 else values)


def nvrtc_compile(source: str, headers, options, name: str, ptx: bool):
    """Compile with NVRTC in this process; returns ``(image, log)``.

    Raises :class:`CompileFailed` (the unit is rejected, or a cubin was asked for and none came)
    or :class:`NvrtcCallFailed`.
    """
    from cuda.bindings import nvrtc

    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), len(headers),
                                                  [t.encode() for _, t in headers],
                                                  [n.encode() for n, _ in headers]), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (code,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0").decode(errors="replace")
        if int(code) != 0:
            raise CompileFailed(getattr(code, "name", str(int(code))), log)
        kind = "PTX" if ptx else "CUBIN"
        size = _check(nvrtc, getattr(nvrtc, f"nvrtcGet{kind}Size")(prog), f"nvrtcGet{kind}Size")
        if size == 0:  # NVRTC gives no cubin for a virtual arch: refuse rather than load nothing
            raise CompileFailed("NO_CUBIN", f"no cubin produced for options {list(options)}")
        image = b" " * size
        _check(nvrtc, getattr(nvrtc, f"nvrtcGet{kind}")(prog, image), f"nvrtcGet{kind}")
        return image, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def send(fd: int, obj) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    _write_all(fd, _LEN.pack(len(payload)) + payload)


def receive(fd: int):
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    return pickle.loads(_read_exact(fd, n))


def serve(rfd: int, wfd: int) -> None:
    """Answer compile requests until the parent closes the request pipe."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    while True:
        try:
            source, headers, options, name, ptx = receive(rfd)
        except EOFError:
            return
        try:
            image, log = nvrtc_compile(source, headers, options, name, ptx)
            reply = ("ok", image, log)
        except CompileFailed as exc:
            reply = ("compile", *exc.args)
        except NvrtcCallFailed as exc:
            reply = ("nvrtc", *exc.args)
        send(wfd, reply)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))

"""Compile a translation unit with NVRTC to a cubin for the exact arch (PTX only on request).

Why cubin: SASS built for the device's arch loads on any driver of the same major version,
while PTX from an NVRTC newer than the driver is refused at load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)
and is JIT-compiled by the driver at every first load otherwise. PTX is produced only when the spec
asks for it (``PYATTN_PTX=1``), and that choice is logged as a warning.

The compile itself runs in a worker process (``pyattn.jit.worker`` says why), unless
``PYATTN_NVRTC_IN_PROCESS=1``.
"""

from __future__ import annotations

import logging
import os

from ..runtime.errors import CompileError, NvrtcError
from . import _nvrtc_worker as _calls

__all__ = ["compile_source", "in_process"]

log = logging.getLogger("pyattn.jit")


def in_process() -> bool:
    """``PYATTN_NVRTC_IN_PROCESS=1``: compile in this process (no worker process)."""
    return os.environ.get("PYATTN_NVRTC_IN_PROCESS", "") == "1"


def compile_source(source: str, headers, options, *, name: str, ptx: bool = False) -> tuple[bytes, str]:
    """Compile ``source`` and return ``(image, log)``.

    Parameters
    ----------
    source : str
        The translation unit.
    headers : sequence of (str, str)
        In-memory headers ``(include name, text)``.
    options : sequence of str
        NVRTC options (from ``KernelSpec.compile_options``).
    name : str
        Kernel spec description, for error messages and the virtual file name.
    ptx : bool
        Return NUL-terminated PTX instead of a cubin.

    Raises
    ------
    CompileError
        Carrying the NVRTC status name, the log, the source and the options (also when the worker
        process could not run: status ``NVRTC_WORKER``).
    NvrtcError
        An NVRTC API call other than the compile failed.
    """
    if ptx:
        log.warning("pyattn: emitting PTX for %s (PYATTN_PTX=1); the driver JIT-compiles it at load", name)
    if in_process():
        try:
            return _calls.nvrtc_compile(source, tuple(headers), tuple(options), name, ptx)
        except _calls.CompileFailed as exc:
            raise CompileError(exc.args[0], exc.args[1], source, options, name) from None
        except _calls.NvrtcCallFailed as exc:
            raise NvrtcError(*exc.args) from None
    from .worker import compile_in_worker

    try:
        reply = compile_in_worker(source, headers, options, name, ptx)
    except RuntimeError as exc:
        raise CompileError("NVRTC_WORKER", str(exc), source, options, name) from None
    if reply[0] == "ok":
        return reply[1], reply[2]
    if reply[0] == "compile":
        raise CompileError(reply[1], reply[2], source, options, name)
    raise NvrtcError(*reply[1:])

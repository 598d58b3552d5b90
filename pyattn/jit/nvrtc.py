"""Compile a translation unit with NVRTC to a cubin for the exact arch (PTX only on request).

Why cubin: SASS built for the device's arch loads on any driver of the same major version,
while PTX from an NVRTC newer than the driver is refused at load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)
and is JIT-compiled by the driver at every first load otherwise. PTX is produced only when the spec
asks for it (``PYATTN_PTX=1``), and that choice is logged as a warning.
"""

from __future__ import annotations

from ..runtime.errors import CompileError, check_nvrtc
from ._log import LazyLogger

__all__ = ["compile_source"]

log = LazyLogger("pyattn.jit")


def _buffer(size: int) -> bytearray:
    """A fresh writable buffer for NVRTC to fill. Not ``b" " * size``: for size 1 (an empty log) that
    is the interpreter's shared ``b" "``, and NVRTC writing its NUL there made every later ``b" "``
    in the process a ``b"\\0"`` (print's separator came out as NUL once encoded)."""
    return bytearray(size)


def _program_log(nvrtc, prog) -> str:
    size = check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = _buffer(size)
    check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


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
        Carrying the NVRTC status name, the log, the source and the options.
    """
    from cuda.bindings import nvrtc

    hdr_names = [n.encode() for n, _ in headers]
    hdr_texts = [t.encode() for _, t in headers]
    prog = check_nvrtc(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), len(headers),
                                                hdr_texts, hdr_names), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (code,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        text = _program_log(nvrtc, prog)
        if int(code) != 0:
            raise CompileError(getattr(code, "name", str(int(code))), text, source, options, name)
        if ptx:
            log.warning("pyattn: emitting PTX for %s (PYATTN_PTX=1); the driver JIT-compiles it at load", name)
            size = check_nvrtc(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            image = _buffer(size)
            check_nvrtc(nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
        else:
            size = check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            if size == 0:  # NVRTC gives no cubin for a virtual arch: refuse rather than load nothing
                raise CompileError("NO_CUBIN", f"no cubin produced for options {options}", source, options, name)
            image = _buffer(size)
            check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        return bytes(image), text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)

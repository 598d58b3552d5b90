"""The one place where CUDA driver and NVRTC status codes become Python exceptions.

Every call into ``cuda.bindings.driver`` or ``cuda.bindings.nvrtc`` goes through
:func:`check` (driver) or :func:`check_nvrtc` (NVRTC), so that a failure always
carries the error's symbolic name, NVIDIA's description string and, for
compilation, the compiler log and the numbered source.
"""

from __future__ import annotations

__all__ = [
    "PyattnError",
    "CudaError",
    "NvrtcError",
    "CompileError",
    "NoDeviceError",
    "CaptureError",
    "no_device_error",
    "check",
    "check_nvrtc",
]


class PyattnError(RuntimeError):
    """Base class of every error pyattn raises for a failure outside the user's input."""


class CudaError(PyattnError):
    """A CUDA driver call failed.

    Attributes
    ----------
    code : int
        The numeric ``CUresult``.
    name : str
        Its symbolic name, e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``.
    description : str
        The driver's description of the error.
    call : str
        What pyattn was doing when the call failed.
    """

    def __init__(self, code: int, name: str, description: str, call: str = ""):
        self.code, self.name, self.description, self.call = int(code), name, description, call
        where = f" in {call}" if call else ""
        super().__init__(f"{name} ({int(code)}){where}: {description}")


class NoDeviceError(CudaError):
    """No usable CUDA driver or GPU; :attr:`reason` says which, for a message that helps.

    Attributes
    ----------
    reason : str
        ``"no_driver"``: the driver library (``libcuda.so.1``) cannot be loaded, or is a stub;
        ``"driver_too_old"``: the driver predates CUDA 13.0 (R580), which cuda-bindings 13 needs;
        ``"no_device"``: the driver works but sees no GPU (``CUDA_ERROR_NO_DEVICE``);
        ``"driver_error"``: initialisation failed otherwise (e.g. ``CUDA_ERROR_UNKNOWN``, often
        missing ``/dev/nvidia*`` nodes in a container started without GPU access).
    code, name : int, str
        The ``CUresult`` when the driver returned one; ``-1`` and a descriptive name when no
        driver call could be made (``"DRIVER_LIBRARY_NOT_FOUND"``, ``"DRIVER_TOO_OLD"``).
    """

    #: The message's headline for each reason.
    REASONS = {
        "no_driver": "no NVIDIA driver: libcuda.so.1 cannot be loaded (install the NVIDIA driver, "
                     "R580 or newer, for CUDA 13)",
        "driver_too_old": "NVIDIA driver too old: pyattn (cuda-bindings 13) needs a driver for "
                          "CUDA 13.0 or newer (R580+)",
        "no_device": "no GPU: the NVIDIA driver is loaded but reports no CUDA device",
        "driver_error": "the NVIDIA driver failed to initialise",
    }
    # Driver results at initialisation -> reason; any other failure there is "driver_error".
    # 35 is the runtime API's cudaErrorInsufficientDriver, kept in case a driver returns it.
    _REASON_BY_CODE = {34: "no_driver", 35: "driver_too_old", 36: "driver_too_old", 100: "no_device"}

    def __init__(self, code: int, name: str, description: str, call: str = "",
                 reason: str | None = None):
        reason = reason or self._REASON_BY_CODE.get(int(code), "driver_error")
        if reason not in self.REASONS:
            raise ValueError(f"reason must be one of {sorted(self.REASONS)}, got {reason!r}")
        self.reason = reason
        self.code, self.name, self.description, self.call = int(code), name, description, call
        detail = f"{name} ({int(code)}) in {call}: {description}" if int(code) >= 0 else description
        PyattnError.__init__(self, f"{self.REASONS[reason]} [{detail}]")


class CaptureError(PyattnError):
    """A call that a CUDA graph capture cannot hold, refused before it queued anything on the
    capturing stream (which the driver's own refusal would have left invalidated).

    Attributes
    ----------
    stream : int
        The capturing ``CUstream`` handle.
    """

    def __init__(self, stream: int, what: str):
        self.stream = int(stream)
        super().__init__(f"stream 0x{self.stream:x} is capturing a CUDA graph, and {what}")


class NvrtcError(PyattnError):
    """An NVRTC call other than compilation itself failed (program creation, queries)."""

    def __init__(self, code: int, name: str, description: str, call: str = ""):
        self.code, self.name, self.description, self.call = int(code), name, description, call
        where = f" in {call}" if call else ""
        super().__init__(f"{name} ({int(code)}){where}: {description}")


class CompileError(PyattnError):
    """NVRTC rejected a kernel translation unit.

    Attributes
    ----------
    name : str
        The NVRTC status name (normally ``"NVRTC_ERROR_COMPILATION"``).
    log : str
        The full compiler log.
    source : str
        The translation unit that was compiled.
    options : tuple of str
        The compiler options used.
    kernel : str
        The kernel spec's identifier, to reproduce the failure.
    """

    def __init__(self, name: str, log: str, source: str, options=(), kernel: str = ""):
        self.name, self.log, self.source = name, log, source
        self.options, self.kernel = tuple(options), kernel
        head = f"{name} while compiling {kernel or 'a kernel'}"
        super().__init__(f"{head}\n--- NVRTC log ---\n{log.strip()}\n(see .dump() for the numbered source)")

    def numbered_source(self) -> str:
        """Return the translation unit with line numbers, to match the log's ``(line)`` references."""
        lines = self.source.splitlines()
        width = len(str(len(lines)))
        return "\n".join(f"{i:>{width}} | {line}" for i, line in enumerate(lines, 1))

    def dump(self, file=None) -> None:
        """Print options, log and numbered source to ``file`` (default ``sys.stderr``)."""
        import sys

        out = file if file is not None else sys.stderr
        print(f"options: {' '.join(self.options)}", file=out)
        print(self.log, file=out)
        print(self.numbered_source(), file=out)


def _driver_error_text(code) -> tuple[str, str]:
    from cuda.bindings import driver

    try:
        err, name = driver.cuGetErrorName(code)
        name = name.decode() if err == driver.CUresult.CUDA_SUCCESS and name else ""
        err, desc = driver.cuGetErrorString(code)
        desc = desc.decode() if err == driver.CUresult.CUDA_SUCCESS and desc else ""
    except Exception:  # the driver library itself is unusable: the enum still knows the name
        name = desc = ""
    if not name:
        try:
            name = driver.CUresult(int(code)).name
        except ValueError:
            name = f"CUresult {int(code)}"
    return name, desc or "unknown error"


def no_device_error(code, call: str) -> NoDeviceError:
    """The :class:`NoDeviceError` for a failed driver initialisation call (``cuInit``...)."""
    name, desc = _driver_error_text(code)
    return NoDeviceError(int(code), name, desc, call)


def check(result, call: str = ""):
    """Unwrap a ``cuda.bindings.driver`` return tuple, raising :class:`CudaError` on failure.

    Parameters
    ----------
    result : tuple or CUresult
        What the binding returned: ``(CUresult, value...)`` or a bare ``CUresult``.
    call : str, optional
        A short description of the call for the message (e.g. ``"cuModuleLoadData"``).

    Returns
    -------
    object
        ``None``, the single value, or a tuple of the values after the status.
    """
    if isinstance(result, tuple):
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    if int(code) != 0:
        if call.startswith("cuInit"):  # whatever the code, without cuInit there is no device
            raise no_device_error(code, call)
        name, desc = _driver_error_text(code)
        raise CudaError(int(code), name, desc, call)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def check_nvrtc(result, call: str = ""):
    """Unwrap a ``cuda.bindings.nvrtc`` return tuple, raising :class:`NvrtcError` on failure.

    Compilation failures are turned into :class:`CompileError` by the compiler module, which
    has the log and source; this function handles every other NVRTC call.
    """
    from cuda.bindings import nvrtc

    code, values = result[0], result[1:]
    if int(code) != 0:
        err, desc = nvrtc.nvrtcGetErrorString(code)
        desc = desc.decode() if desc else "unknown error"
        raise NvrtcError(int(code), getattr(code, "name", f"nvrtcResult {int(code)}"), desc, call)
    if not values:
        return None
    return values[0] if len(values) == 1 else values

"""Find the CUDA headers NVRTC compiles against, and check they match the NVRTC in use.

The kernels include ``cuda_fp16.h`` and ``cuda_bf16.h``, which NVRTC does not carry built in.
They are looked up the way ``cuda.pathfinder`` does (pip wheels first, then conda, then
``CUDA_HOME``/``CUDA_PATH``), unless ``PYATTN_CUDA_INCLUDE`` names a directory. Headers newer
than the compiler, or of another major version, break compiles in confusing ways, so that is a
clear error instead.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

from ..runtime.errors import PyattnError, check_nvrtc

__all__ = ["nvrtc_version", "cuda_include_dir", "check_headers_match_nvrtc", "header_version"]


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    """Return the loaded NVRTC's ``(major, minor)``."""
    from cuda.bindings import nvrtc

    major, minor = check_nvrtc(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def _in_cu13_wheel(*parts: str):
    """First ``site-packages/nvidia/cu13/<parts>`` on ``sys.path`` (where the CUDA 13 wheels put
    the headers, and where ``cuda.pathfinder`` looks first), or None."""
    for entry in sys.path:
        path = Path(entry or ".", "nvidia", "cu13", *parts)
        if path.exists():
            return path
    return None


_CUDART_VERSION = re.compile(rb"#define\s+CUDART_VERSION\s+(\d+)")


def header_version(include_dir: Path) -> tuple[int, int]:
    """Read ``CUDART_VERSION`` from ``cuda_runtime_api.h`` in ``include_dir`` as ``(major, minor)``."""
    # The define is near the top (line ~140) of a ~660 KB header; reading all of it cost ~1.5 ms
    # of a warm process's first call (the cache key needs the header version).
    with open(Path(include_dir) / "cuda_runtime_api.h", "rb") as f:
        head = f.read(1 << 16)
        m = _CUDART_VERSION.search(head) or _CUDART_VERSION.search(head + f.read())
    if not m:
        raise PyattnError(f"cannot read CUDART_VERSION from {include_dir}/cuda_runtime_api.h")
    v = int(m.group(1))
    return v // 1000, (v % 1000) // 10


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> tuple[Path, tuple[int, int]]:
    """Return the CUDA include directory and its version (see :func:`check_headers_match_nvrtc`).

    Raises
    ------
    PyattnError
        When no headers are found.
    """
    override = os.environ.get("PYATTN_CUDA_INCLUDE")
    wheel = None if override else _in_cu13_wheel("include", "cuda_fp16.h")
    if override:
        path = Path(override)
    elif wheel is not None:  # the common case, without importing cuda.pathfinder (~40 ms)
        path = wheel.parent
    else:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found is None:
            raise PyattnError("CUDA runtime headers (cuda_fp16.h) not found: "
                              "pip install 'nvidia-cuda-runtime>=13,<14' or set PYATTN_CUDA_INCLUDE")
        path = Path(found)
    if not (path / "cuda_fp16.h").is_file():
        raise PyattnError(f"{path} has no cuda_fp16.h (set PYATTN_CUDA_INCLUDE to a CUDA include directory)")
    return path, header_version(path)


def check_headers_match_nvrtc() -> Path:
    """Return the include directory after checking it fits the NVRTC in use (done before compiling).

    Raises
    ------
    PyattnError
        When the headers are of another major version or newer than NVRTC, with the fix.
    """
    path, hv = cuda_include_dir()
    nv = nvrtc_version()
    if hv[0] != nv[0] or hv > nv:
        raise PyattnError(
            f"CUDA headers {hv[0]}.{hv[1]} in {path} do not fit NVRTC {nv[0]}.{nv[1]}: headers must be "
            f"the same major version and not newer. Fix: pip install 'nvidia-cuda-runtime=={nv[0]}.{nv[1]}.*' "
            f"(or upgrade nvidia-cuda-nvrtc), or set PYATTN_CUDA_INCLUDE")
    return path

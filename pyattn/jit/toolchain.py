"""What the compiled bytes depend on besides the spec, found without loading NVRTC when possible.

A cache key must change whenever the compiler, the CUDA headers or the kernel templates change,
or a process would load a kernel made by the old ones. Asking NVRTC its version would do, but
loading libnvrtc costs 10-50 ms (a ~140 MB library), more than a warm start's whole budget, and a
version (13.0) does not even tell two builds of one version apart. So the toolchain is identified
by its files:

- NVRTC: the library file cuda.bindings uses, by size and mtime (nanoseconds). Not by device and
  inode, nor path: a cache warmed while an image was built (``pyattn warmup --arch``) must still hit
  in the container run from it, where the same files sit on another device and inode, and two
  spellings of one path must give one key. Which file that is follows ``cuda.pathfinder.load_nvidia_dynamic_lib("nvrtc")``,
  which cuda.bindings calls on its first NVRTC call: a libnvrtc already loaded in the process wins; else the first found in pip
  wheels (``nvidia/cu13/lib``, then ``nvidia/cuda_nvrtc/lib``, in site-packages order), then under
  ``$CONDA_PREFIX``. Those steps only look at files and are mirrored here; past them only the
  dynamic loader can tell (``LD_LIBRARY_PATH``, ``ldconfig``, ``CUDA_HOME``), so NVRTC is loaded
  and asked where it is, as the compile would. A reinstall writes new files (pip does not keep the
  archive's times), so their mtimes change even when the version does not.
- Headers: the include directory and its ``CUDART_VERSION`` (:mod:`.headers`), plus size and mtime
  of the headers the kernels include (and ``cuda_runtime_api.h``), so headers replaced in place
  by another build of the same version change the key too. The headers those include in turn
  (``vector_types.h``...) are covered as part of a release (a reinstall rewrites these files too),
  not one by one: a hand edit of only such a header would not be seen.
- Templates: BLAKE2b-256 over every ``kernels_src`` file (:func:`.source.sources_digest`); compiles read
  the same bytes the digest covers.

The mirror of pathfinder's search could drift from a future cuda-pathfinder. That must never store
a kernel under the wrong toolchain, so every compile first checks (:func:`check_unchanged`), with
NVRTC loaded by then anyway, that the fingerprint made from the library cuda.bindings actually
loaded, the headers and the sources as they are now equals the one the key was made from; if not,
the kernel is compiled and used but not stored (``pyattn.jit.build``).
"""

from __future__ import annotations

import os
import site
import sys

from .._version import __version__
from .headers import cuda_include_dir
from .source import sources_digest

__all__ = ["nvrtc_path", "loaded_nvrtc_path", "nvrtc_identity", "headers_identity", "fingerprint",
           "check_unchanged", "ToolchainChanged", "file_identity"]

# From cuda.pathfinder's descriptor of "nvrtc" (descriptor_catalog.py), in its order.
_NVRTC_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12")
_NVRTC_WHEEL_DIRS = (("nvidia", "cu13", "lib"), ("nvidia", "cuda_nvrtc", "lib"))
_CONDA_LIB_DIRS = ("lib64", "lib")
# The CUDA headers the kernel templates include (kernels_src/common.cuh), their .hpp halves, and
# the one the version is read from.
_KERNEL_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp8.h", "cuda_fp8.hpp",
                   "cuda_runtime_api.h")


class ToolchainChanged(Exception):
    """The toolchain a compile would use is not the one its cache key names; the message says how."""


def file_identity(path) -> str:
    """``size:mtime_ns`` of the file at ``path`` (symlinks followed), ``-`` if missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def _site_packages() -> list:
    """The directories pathfinder searches for wheels, in its order: site-packages, with the user
    site after a virtual environment's own and before the system's (cuda.pathfinder
    ``find_sub_dirs_all_sitepackages``)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        user = site.getusersitepackages()
        if user:
            dirs.insert(1 if sys.prefix != sys.base_prefix else 0, user)
    return dirs


def _nvrtc_on_disk() -> str | None:
    """The libnvrtc pathfinder finds before asking the dynamic loader (wheels, then conda), or None."""
    for rel in _NVRTC_WHEEL_DIRS:
        for parent in _site_packages():
            lib_dir = os.path.join(parent, *rel)
            if os.path.isdir(lib_dir):
                for soname in _NVRTC_SONAMES:
                    if os.path.isfile(os.path.join(lib_dir, soname)):
                        return os.path.join(lib_dir, soname)
    conda = os.environ.get("CONDA_PREFIX")
    if conda:
        for rel in _CONDA_LIB_DIRS:
            lib_dir = os.path.join(conda, rel)
            if os.path.isdir(lib_dir):
                for soname in _NVRTC_SONAMES:
                    if os.path.isfile(os.path.join(lib_dir, soname)):
                        return os.path.join(lib_dir, soname)
    return None


def _nvrtc_already_loaded() -> bool:
    """Whether some libnvrtc is in the process already (pathfinder then uses that one)."""
    import ctypes  # already imported by numpy and cuda.pathfinder

    for soname in _NVRTC_SONAMES:
        try:
            ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)  # only finds a loaded library, loads nothing
            return True
        except OSError:
            pass
    return False


def loaded_nvrtc_path() -> str:
    """The libnvrtc cuda.bindings uses, loading it if it is not loaded yet (the slow path)."""
    from cuda.pathfinder import load_nvidia_dynamic_lib  # cached: cuda.bindings gets the same answer

    return load_nvidia_dynamic_lib("nvrtc").abs_path


def nvrtc_path() -> str:
    """The libnvrtc this process compiles with, without loading it where its files tell."""
    if _nvrtc_already_loaded():
        return loaded_nvrtc_path()  # cheap: pathfinder only looks it up
    found = _nvrtc_on_disk()
    return found if found is not None else loaded_nvrtc_path()


def nvrtc_identity(path: str | None = None) -> str:
    """:func:`file_identity` of the libnvrtc at ``path`` (default :func:`nvrtc_path`)."""
    return file_identity(nvrtc_path() if path is None else path)


def headers_identity() -> str:
    """``<major>.<minor>@<include dir>|<identity of each kernel header>``."""
    inc, hv = cuda_include_dir()
    files = ",".join(file_identity(inc / name) for name in _KERNEL_HEADERS)
    return f"{hv[0]}.{hv[1]}@{inc}|{files}"


def fingerprint(nvrtc: str | None = None, src: str | None = None) -> str:
    """The toolchain fingerprint (see ``pyattn.jit.toolchain_fingerprint``) with the libnvrtc at
    ``nvrtc`` (default :func:`nvrtc_path`) and the kernel-source digest ``src`` (default
    :func:`~.source.sources_digest`, hashed now), computed now."""
    return (f"nvrtc={nvrtc_identity(nvrtc)};headers={headers_identity()};src={src or sources_digest()};"
            f"pyattn={__version__}")


def check_unchanged(named: str) -> None:
    """Before a compile: raise :class:`ToolchainChanged` unless the toolchain the compile will use
    (NVRTC as cuda.bindings loads it, now: the compile needs it anyway; the headers as they are;
    the digest of the very template bytes compiled, never a memo) gives the fingerprint ``named``,
    the one the cache key was made from."""
    path = loaded_nvrtc_path()
    now = fingerprint(path)
    if now != named:
        raise ToolchainChanged(f"the toolchain differs from the one the cache key names (NVRTC loaded from "
                               f"{path}): key {named!r}, compile {now!r}")

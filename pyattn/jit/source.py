"""Render a kernel spec into one NVRTC translation unit.

The templates in ``kernels_src/`` are handed to NVRTC as in-memory headers, so what is compiled
is exactly what the digest covers. In a wheel they are package data (``pyattn/kernels_src``);
in a source checkout they sit at the repository root.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from . import digest

__all__ = ["kernel_source_dir", "kernel_headers", "sources_digest", "sources_identity", "read_identity",
           "render"]


@functools.lru_cache(maxsize=None)
def kernel_source_dir() -> Path:
    """Locate the ``*.cuh`` templates: package data first, then the checkout's ``kernels_src/``."""
    here = Path(__file__).resolve().parent.parent  # the pyattn package
    for candidate in (here / "kernels_src", here.parent / "kernels_src"):
        if (candidate / "attention_fwd.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"pyattn kernel sources not found next to {here}")


@functools.lru_cache(maxsize=None)
def _header_files() -> tuple:
    """``(identity, ((name, bytes), ...))``: every template header, sorted by name, read once a
    process, and :func:`sources_identity` as it was just before the read. The digest and the
    compiles use these very bytes, so an edit while a process runs can never give a kernel compiled
    from one text a key made from another; and the memoised digest is stored under the identity of
    the bytes it hashed (:func:`read_identity` says why)."""
    identity = sources_identity()
    d = kernel_source_dir()
    files = []
    for name in sorted(n for n in os.listdir(d) if n.endswith(".cuh")):  # not Path.glob: ~0.1 ms slower
        with open(os.path.join(d, name), "rb") as f:
            files.append((name, f.read()))
    return identity, tuple(files)


def read_identity() -> str:
    """The :func:`sources_identity` under which this process's :func:`sources_digest` may be memoised.

    Taken before the read, not when the memo is written: a process that read the templates, then
    saw them edited, would otherwise store its old digest under the new files' identity, and every
    later process would key its kernels by a digest of text it does not compile (seen: a test run
    left across a template edit poisoned the memo of the default cache). An edit between the stat
    and the read only files the new digest under the old identity, which no later stat matches.
    """
    return _header_files()[0]


@functools.lru_cache(maxsize=None)
def kernel_headers() -> tuple:
    """All template headers as ``((name, text), ...)``, sorted by name (UTF-8, as read)."""
    return tuple((name, data.decode("utf-8")) for name, data in _header_files()[1])


@functools.lru_cache(maxsize=None)
def sources_digest() -> str:
    """BLAKE2b-256 (:mod:`.digest`) over every template header: any edit to a kernel source changes every cache key.

    Over the bytes, not decoded text: a warm start needs only the digest, and decoding them (what
    ``Path.read_text`` did) cost more than reading and hashing together (0.77 ms against 0.26 ms
    for the 16 templates).
    """
    h = digest.new()
    for name, data in _header_files()[1]:
        h.update(name.encode() + b"\0")
        h.update(data)
        h.update(b"\0")
    return h.hexdigest()


def sources_identity() -> str:
    """The template directory and each ``*.cuh`` file's name, size, mtime, ctime and inode (no reads).

    The key of the memoised :func:`sources_digest` (``pyattn.jit.toolchain_fingerprint``): hashing
    the ~340 KB of templates cost 0.7 ms locally and ~1.3 ms on a GPU host, of a warm first call's
    15 ms; these stats cost ~0.1 ms. An edit changes the ctime (which no user can set back) unless
    it lands in the same filesystem clock tick as the memo's making with the size unchanged; and
    every compile hashes the bytes it compiles anyway (``toolchain.check_unchanged``), so even
    then no kernel is stored under the wrong source.
    """
    d = kernel_source_dir()
    parts = [str(d)]
    for name in sorted(n for n in os.listdir(d) if n.endswith(".cuh")):
        st = os.stat(os.path.join(d, name))
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_dev}:{st.st_ino}")
    return "|".join(parts)


def render(spec) -> str:
    """Return the translation unit for ``spec``: the generated params struct, the template
    header, and one ``extern "C"`` entry point instantiating ``spec.template_id``.

    For a family with dynamic shared memory the unit also ``static_assert``s that the C++ traits'
    ``kSmemBytes`` (the layout the kernel carves) equals ``spec.shared_bytes`` (the Python formula
    the launch asks for), so the two cannot drift apart. Families without (``spec.traits`` None)
    launch with 0 bytes and assert nothing.

    The entry point's first statement waits for the stream's previous kernel
    (``kernels_src/pdl.cuh``), so every kernel may launch as that kernel's programmatic dependent
    on sm_90+ (:attr:`~pyattn.kernels.kernel_spec.KernelSpec.dependent_launch`): it is here, not
    in each kernel, so that no kernel can read or write global memory before it.
    """
    smem_check = "" if spec.traits is None else (
        f"static_assert({spec.traits}::kSmemBytes == {spec.shared_bytes}, "
        f'"pyattn: the traits\' shared memory differs from the family\'s formula (pyattn/kernels/families)");\n')
    return (
        f"// pyattn kernel {spec.describe()} (generated; edit kernels_src/{spec.header} instead)\n"
        f'#include "common.cuh"\n'
        f'#include "mma.cuh"\n'
        f'#include "pdl.cuh"\n'
        f"namespace pyattn {{\n{spec.params.c_declaration()}}}  // namespace pyattn\n"
        f'#include "{spec.header}"\n\n'
        f"{smem_check}"
        f'extern "C" __global__ void __launch_bounds__({spec.threads}, {spec.tiles.min_blocks})\n'
        f"{spec.entry_name}(const __grid_constant__ pyattn::{spec.params.name} params) {{\n"
        f"  pyattn::pdl::wait();\n"
        f"  {spec.template_id}(params);\n"
        f"}}\n"
    )

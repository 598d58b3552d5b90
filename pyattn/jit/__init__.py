"""Run-time compilation: render -> NVRTC -> disk cache.

:func:`build` turns a :class:`~pyattn.kernels.specs.KernelSpec` into a code image, through the
disk cache; :func:`build_many` does it for a list (``pyattn warmup``, CI), in parallel threads.

A warm start (every kernel on disk) computes keys and reads entries only: it neither loads NVRTC
nor imports the compiling modules (:mod:`.toolchain` says how the key identifies the toolchain
without NVRTC, and how a compile checks that identification).
"""

from __future__ import annotations

import functools
import os
import time

from .._version import __version__
from ._log import LazyLogger
from .cache import KernelCache
from . import toolchain
from .toolchain import ToolchainChanged, check_unchanged

__all__ = ["toolchain_fingerprint", "get_cache", "build", "build_many", "compile_spec"]

log = LazyLogger("pyattn.jit")


@functools.lru_cache(maxsize=None)
def toolchain_fingerprint() -> str:
    """Everything besides the spec that changes the compiled bytes, computed once a process: the
    NVRTC library file, the header directory, version and files, the kernel-source digest and the
    pyattn version (see :mod:`pyattn.jit.toolchain`).

    Returns
    -------
    str
        ``nvrtc=<file id>;headers=<version>@<dir>|<file ids>;src=<blake2b-256>;pyattn=<version>``.
    """
    return toolchain.fingerprint(src=_memoised_sources_digest())


def _memoised_sources_digest() -> str:
    """:func:`~.source.sources_digest`, memoised in the cache under the templates' file stats
    (:func:`~.source.sources_identity` says why that is safe and what it saves)."""
    from .digest import hexdigest
    from .source import read_identity, sources_digest, sources_identity

    def memo_key(identity: str) -> str:
        return hexdigest(b"pyattn kernel-source digest|" + identity.encode())

    cache = get_cache()
    hit = cache.get_memo(memo_key(sources_identity()))
    if hit is not None and len(hit) == 64:
        return hit.decode("ascii")
    value = sources_digest()
    cache.put_memo(memo_key(read_identity()), value.encode("ascii"))  # the identity of the bytes hashed
    return value


_caches: dict = {}


def get_cache() -> KernelCache:
    """The disk cache for the current ``PYATTN_CACHE_DIR`` (looked up at each call, so tests and
    users can redirect it at run time; instances are reused per directory)."""
    from .cache import default_cache_dir

    d = default_cache_dir()
    cache = _caches.get(d)
    if cache is None:
        cache = _caches.setdefault(d, KernelCache(d))
    return cache


def compile_spec(spec) -> tuple[bytes, dict]:
    """Compile ``spec`` now, bypassing the cache; returns ``(image, meta)``."""
    # Imported here: a warm start never compiles (these load NVRTC's bindings and the renderer).
    from .headers import check_headers_match_nvrtc
    from .nvrtc import compile_source
    from .source import kernel_headers, render

    inc = check_headers_match_nvrtc()
    options = spec.compile_options((str(inc),))
    t0 = time.perf_counter()
    image, compile_log = compile_source(render(spec), kernel_headers(), options, name=spec.describe(), ptx=spec.ptx)
    meta = {"entry": spec.entry_name, "spec": spec.describe(), "format": "ptx" if spec.ptx else "cubin",
            "compile_seconds": round(time.perf_counter() - t0, 4), "log": compile_log}
    return image, meta


_toolchain_warned = []  # the first ToolchainChanged of the process was logged as a warning


def build(spec) -> tuple[bytes, dict, bool]:
    """Return ``(image, meta, compiled_now)`` for ``spec``, compiling on a cache miss.

    A miss first checks that the toolchain the compile will use is the one the key names
    (``toolchain.check_unchanged``); if not, the kernel is compiled and returned but not stored,
    so no entry is ever filed under a toolchain that did not make it.
    """
    fingerprint = toolchain_fingerprint()
    key = spec.cache_key(fingerprint)

    def _compile():
        check_unchanged(fingerprint)
        log.info("pyattn: compiling 1 kernel (%s)", spec.describe())
        return compile_spec(spec)

    try:
        return get_cache().get_or_build(key, _compile)
    except ToolchainChanged as exc:
        (log.debug if _toolchain_warned else log.warning)(
            "pyattn: compiling %s without caching it: %s", spec.describe(), exc)
        _toolchain_warned.append(True)
        image, meta = compile_spec(spec)
        return image, meta, True


def build_many(specs, *, workers: int | None = None, progress=None) -> list:
    """Build every spec (cache hits are cheap), compiling misses on ``workers`` threads.

    NVRTC releases the GIL while compiling, so threads give real parallelism.

    Parameters
    ----------
    specs : sequence of KernelSpec
    workers : int, optional
        Default: the CPU count.
    progress : callable, optional
        Called as ``progress(done, total, spec, compiled_now)`` after each spec.

    Returns
    -------
    list of (spec, meta, compiled_now)
    """
    from concurrent.futures import ThreadPoolExecutor  # not at import: warm starts never need it

    specs = list(specs)
    cache, fp = get_cache(), toolchain_fingerprint()
    # Only for the log line: a directory listing, not a read and checksum of every entry
    # (build() verifies each entry once anyway).
    cached = {e.key for e in cache.entries()}
    missing = [s for s in specs if s.cache_key(fp) not in cached]
    if missing:
        log.info("pyattn: compiling %d kernels", len(missing))
    results, done = [], 0
    pool = ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1)
    try:
        for spec, (image, meta, built) in zip(specs, pool.map(build, specs)):
            done += 1
            results.append((spec, meta, built))
            if progress is not None:
                progress(done, len(specs), spec, built)
    except BaseException:
        # Ctrl-C or a failed compile: drop the queued compiles rather than finish them all before
        # the exception gets out (only the ones already running complete).
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results

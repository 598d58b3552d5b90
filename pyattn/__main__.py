"""Command line: ``python -m pyattn {demo,info,warmup,cache}``.

Exit status: 0 success; 1 failure (a demo result off the reference, a compile error, the output
pipe closed); 2 usage error, or no GPU where one is needed; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from .runtime.device import ARCH_GPUS, SUPPORTED_ARCHS

_DEMO_HEAD_DIM = 128


def _python() -> str:
    """How to call this interpreter in a hint: ``.venv/bin/python`` when it lives under the cwd."""
    exe = sys.executable or "python"
    try:
        rel = os.path.relpath(exe)
    except ValueError:  # another drive (Windows)
        return exe
    return rel if not rel.startswith("..") else exe


def _gpu_or_none():
    """The current device, or None with the reason when there is no usable GPU."""
    from .runtime.device import get_device
    from .runtime.errors import PyattnError

    try:
        dev = get_device()
        dev.arch  # raises for an unsupported compute capability
        return dev, None
    except PyattnError as exc:
        return None, str(exc)


class Progress:
    """Compile progress for :func:`pyattn.jit.build_many`.

    On a terminal, one bar redrawn in place; anywhere else (a log file, a pipe, CI) a plain line
    at every tenth of the work or every ``interval`` seconds, whichever comes first: ``\\r``
    frames would make one endless line of a log.

    Parameters
    ----------
    stream : file, optional
        Where to write (default ``sys.stdout``); its ``isatty()`` picks the style.
    interval : float, optional
        Longest silence between plain lines, in seconds.
    clock : callable, optional
        Monotonic seconds (injectable for tests).
    """

    def __init__(self, stream=None, *, interval: float = 5.0, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.interval, self.clock = interval, clock
        self.compiled, self._last_tenth, self._last_time = 0, 0, clock()

    def __call__(self, done: int, total: int, spec, built: bool) -> None:
        self.compiled += bool(built)
        if self.tty:
            width = 30
            filled = width * done // total
            bar = "#" * filled + "-" * (width - filled)
            line = f"  [{bar}] {done}/{total} {'compiled' if built else 'cached  '} {spec.describe()}"
            columns = shutil.get_terminal_size().columns - 1  # never wrap: \r redraws one line
            end = "\n" if done == total else ""
            print(f"\r{line[:columns]:<{columns}}", end=end, file=self.stream, flush=True)
            return
        tenth, now = 10 * done // total, self.clock()
        if done == total or tenth > self._last_tenth or now - self._last_time >= self.interval:
            self._last_tenth, self._last_time = tenth, now
            print(f"  {done}/{total} kernels ({100 * done // total}%), {self.compiled} compiled",
                  file=self.stream, flush=True)


def cmd_warmup(args) -> int:
    """Precompile the standard variants for the given archs (or the GPU's)."""
    from . import jit
    from .kernels.specs import warmup_specs
    from .runtime.errors import PyattnError

    archs = args.arch
    if not archs:
        dev, why = _gpu_or_none()
        if dev is None:
            print(f"no usable GPU ({why}); name archs with --arch", file=sys.stderr)
            return 2
        archs = [dev.arch]
    specs = [s for a in archs for s in warmup_specs(a)]
    print(f"pyattn warmup: {len(specs)} kernels for {', '.join(archs)} into {jit.get_cache().directory}",
          flush=True)
    t0 = time.perf_counter()
    try:
        results = jit.build_many(specs, progress=None if args.quiet else Progress())
    except PyattnError as exc:
        print(f"\nwarmup failed: {exc}", file=sys.stderr)
        return 1
    compiled = [m for _, m, built in results if built]
    slowest = max((m["compile_seconds"] for m in compiled), default=0.0)
    print(f"done in {time.perf_counter() - t0:.1f} s: {len(compiled)} compiled "
          f"(slowest {slowest:.2f} s), {len(results) - len(compiled)} already cached")
    return 0


def cmd_info(args) -> int:
    """Print GPU, driver, NVRTC, headers and cache facts."""
    import numpy as np

    from . import __version__, jit
    from .jit.headers import check_headers_match_nvrtc, cuda_include_dir, nvrtc_version
    from .runtime.device import driver_version

    print(f"pyattn {__version__}, numpy {np.__version__}, python {sys.version.split()[0]}")
    dev, why = _gpu_or_none()
    if dev is None:
        print(f"GPU: none ({why})")
    else:
        dv = driver_version()
        print(f"GPU: {dev.name}, compute {dev.capability[0]}.{dev.capability[1]} -> {dev.arch}, "
              f"{dev.sm_count} SMs, {dev.l2_bytes >> 20} MiB L2, "
              f"{dev.max_shared_per_block_optin >> 10} KiB smem/block (opt-in)")
        print(f"driver: CUDA {dv[0]}.{dv[1]}")
    nv = nvrtc_version()
    print(f"NVRTC: {nv[0]}.{nv[1]}")
    try:
        inc, hv = cuda_include_dir()
        check_headers_match_nvrtc()
        print(f"CUDA headers: {hv[0]}.{hv[1]} at {inc}")
    except Exception as exc:  # still print the rest: info is the tool to diagnose this
        print(f"CUDA headers: PROBLEM: {exc}")
    cache = jit.get_cache()
    problem = cache.trust_problem()
    if problem is not None:
        print(f"cache: {cache.directory} REFUSED ({problem}); kernels are compiled every run: "
              "set PYATTN_CACHE_DIR to a directory only you can write")
    else:
        entries = cache.entries()
        print(f"cache: {cache.directory} ({len(entries)} kernels, "
              f"{sum(e.size for e in entries) / 2**20:.1f} MiB)")
    return 0


def cmd_cache(args) -> int:
    """``cache clear``: delete every cached kernel."""
    from . import jit

    cache = jit.get_cache()
    n = cache.clear()
    print(f"removed {n} cached kernels from {cache.directory}")
    return 0


def _demo_without_gpu(dtype_name: str, why: str, quiet: bool) -> int:
    """Show what works without a GPU, quickly: the demo's kernel compiled for every arch."""
    from . import jit
    from .kernels.specs import select_attention_spec, warmup_specs

    print(f"GPU: none ({why})")
    specs = [select_attention_spec(dtype_name, _DEMO_HEAD_DIM, arch) for arch in SUPPORTED_ARCHS]
    print(f"compiling the demo's kernel for each supported arch instead (NVRTC needs no GPU), "
          f"into {jit.get_cache().directory}:", flush=True)
    t0 = time.perf_counter()
    # The table below is the report; a bar is only worth it where it redraws in place.
    results = jit.build_many(specs, progress=None if quiet or not sys.stdout.isatty() else Progress())
    for spec, meta, built in results:
        how = f"compiled in {meta['compile_seconds']:.2f} s" if built else "cached"
        print(f"  {spec.arch:<8} {spec.describe():<44} {how}")
    print(f"done in {time.perf_counter() - t0:.1f} s: {len(results)} kernels")
    print("to precompile every standard kernel for your GPU's arch "
          f"({', '.join(f'{a}: {len(warmup_specs(a))}' for a in SUPPORTED_ARCHS)} kernels):")
    print(f"  {_python()} -m pyattn warmup --arch ARCH [ARCH ...]")
    return 0


def cmd_demo(args) -> int:
    """Run attention on the GPU against the fp64 reference; without a GPU, compile and run the reference."""
    import ml_dtypes
    import numpy as np

    from . import attention
    from .reference import attention_ref, error_bound

    rng = np.random.default_rng(0)
    B, S, H, Hkv, D = 2, 1000, 8, 2, _DEMO_HEAD_DIM
    dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bf16" else np.dtype(args.dtype)
    q = rng.standard_normal((B, S, H, D)).astype(dtype)
    k = rng.standard_normal((B, S, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, S, Hkv, D)).astype(dtype)
    print(f"pyattn demo: q {q.shape}, k/v {k.shape} ({dtype}), causal, GQA {H}:{Hkv}", flush=True)
    t0 = time.perf_counter()
    ref = attention_ref(q, k, v, causal=True)
    print(f"fp64 NumPy reference: {time.perf_counter() - t0:.2f} s", flush=True)

    dev, why = _gpu_or_none()
    if dev is None:
        return _demo_without_gpu(dtype.name, why, args.quiet)

    print(f"GPU: {dev.name} ({dev.arch})")
    t0 = time.perf_counter()
    out = attention(q, k, v, causal=True)
    first = time.perf_counter() - t0
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = attention(q, k, v, causal=True)
        times.append(time.perf_counter() - t0)
    err = float(np.max(np.abs(out.astype(np.float64) - ref)))
    bound = error_bound(q, k, v, causal=True)
    print(f"out {out.shape} {out.dtype}; max |out - ref| = {err:.2e} (bound {bound:.2e}) "
          f"-> {'OK' if err <= bound else 'FAIL'}")
    print(f"time: first call {first * 1e3:.1f} ms (incl. compile/load), then median "
          f"{sorted(times)[len(times) // 2] * 1e3:.2f} ms NumPy->GPU->NumPy")
    return 0 if err <= bound else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m pyattn`` (every subcommand and option has help)."""
    archs = "; ".join(f"{a}: {gpus}" for a, gpus in ARCH_GPUS.items())
    parser = argparse.ArgumentParser(
        prog="python -m pyattn", description="pyattn: GPU attention compiled at run time with NVRTC.",
        epilog="exit status: 0 ok, 1 failure, 2 usage error or no GPU where one is needed, "
               "130 interrupted. Kernel cache: $PYATTN_CACHE_DIR, else $XDG_CACHE_HOME/pyattn, "
               "else ~/.cache/pyattn.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="attention on the GPU checked against the float64 reference "
                       "(without a GPU: the reference, plus the demo's kernel compiled for every arch)",
                       description="Run causal GQA attention on the GPU and check it against the "
                       "float64 NumPy reference. Without a GPU, run the reference and compile the "
                       "demo's kernel for every supported arch.")
    p.add_argument("--dtype", default="float16", choices=["float16", "bf16", "float32"],
                   help="input dtype (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress output while compiling")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("info", help="GPU, driver, NVRTC, CUDA headers and kernel cache",
                       description="Print what pyattn finds: GPU and arch, driver, NVRTC, CUDA "
                       "headers, and the kernel cache (location, size, or why it is refused).")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("warmup", help="precompile the standard kernel variants into the cache",
                       description="Compile the standard kernels (attention variants without score "
                       "modifiers, decode, KV append) for the given archs, or this GPU's, into the "
                       "kernel cache. Needs no GPU with --arch.")
    p.add_argument("--arch", nargs="+", choices=SUPPORTED_ARCHS, metavar="ARCH",
                   help=f"archs to compile for, one or more of: {archs} (default: this GPU's). "
                        "Other archs (sm_75, sm_120...) are not supported")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("cache", help="manage the kernel cache",
                       description="Manage the kernel cache ($PYATTN_CACHE_DIR).")
    p.add_argument("action", choices=["clear"],
                   help="clear: delete every cached kernel, free lock files and dead writers' temp files")
    p.set_defaults(func=cmd_cache)
    return parser


def main(argv=None) -> int:
    """Entry point of ``python -m pyattn`` and the ``pyattn`` script; returns the exit status."""
    from .runtime.errors import PyattnError

    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe must show up here, inside the handler below
        return status
    except PyattnError as exc:  # a diagnosed failure (driver, headers, compile): its message, no traceback
        sys.stdout.flush()
        print(f"pyattn: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`pyattn info | head -2`). As the Python docs advise: point stdout
        # at devnull so the flush at exit does not raise again, and exit 1 as Python does on EPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m pyattn {demo,info,warmup,cache}``."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


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


def _progress(done: int, total: int, spec, built: bool) -> None:
    width = 30
    filled = width * done // total
    bar = "#" * filled + "-" * (width - filled)
    end = "\n" if done == total else ""
    print(f"\r  [{bar}] {done}/{total} {'compiled' if built else 'cached  '} {spec.describe():<40}", end=end, flush=True)


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
    print(f"pyattn warmup: {len(specs)} kernels for {', '.join(archs)} into {jit.get_cache().directory}")
    t0 = time.perf_counter()
    try:
        results = jit.build_many(specs, progress=None if args.quiet else _progress)
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
    entries = cache.entries()
    print(f"cache: {cache.directory} ({len(entries)} kernels, {sum(e.size for e in entries) / 2**20:.1f} MiB)")
    return 0


def cmd_cache(args) -> int:
    """``cache clear``: delete every cached kernel."""
    from . import jit

    cache = jit.get_cache()
    n = cache.clear()
    print(f"removed {n} cached kernels from {cache.directory}")
    return 0


def cmd_demo(args) -> int:
    """Run attention on the GPU against the fp64 reference; without a GPU, compile and run the reference."""
    from . import attention
    from .reference import attention_ref, error_bound
    from .runtime.device import SUPPORTED_ARCHS

    import ml_dtypes

    rng = np.random.default_rng(0)
    B, S, H, Hkv, D = 2, 1000, 8, 2, 128
    dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bf16" else np.dtype(args.dtype)
    q = rng.standard_normal((B, S, H, D)).astype(dtype)
    k = rng.standard_normal((B, S, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, S, Hkv, D)).astype(dtype)
    print(f"pyattn demo: q {q.shape}, k/v {k.shape} ({dtype}), causal, GQA {H}:{Hkv}")
    t0 = time.perf_counter()
    ref = attention_ref(q, k, v, causal=True)
    print(f"fp64 NumPy reference: {time.perf_counter() - t0:.2f} s")

    dev, why = _gpu_or_none()
    if dev is None:
        print(f"no GPU: {why}")
        print("compiling every kernel variant for every supported arch instead (NVRTC needs no GPU):")
        ns = argparse.Namespace(arch=list(SUPPORTED_ARCHS), quiet=args.quiet)
        return cmd_warmup(ns)

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


def main(argv=None) -> int:
    """Entry point of ``python -m pyattn``."""
    parser = argparse.ArgumentParser(prog="python -m pyattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="attention on the GPU vs the fp64 reference (compiles all archs without a GPU)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bf16", "float32"])
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_demo)
    sub.add_parser("info", help="GPU, driver, NVRTC, headers, cache").set_defaults(func=cmd_info)
    p = sub.add_parser("warmup", help="precompile the standard kernel variants")
    p.add_argument("--arch", nargs="+", help="archs to build for (default: this GPU's); works without a GPU")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_warmup)
    p = sub.add_parser("cache", help="manage the kernel cache")
    p.add_argument("action", choices=["clear"])
    p.set_defaults(func=cmd_cache)
    args = parser.parse_args(argv)
    if getattr(args, "arch", None):
        from .runtime.device import SUPPORTED_ARCHS

        bad = [a for a in args.arch if a not in SUPPORTED_ARCHS]
        if bad:
            parser.error(f"--arch: unsupported {bad}; choose from {list(SUPPORTED_ARCHS)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""Prefill benchmark: pyattn against torch SDPA's FlashAttention-2 and cuDNN backends, one GPU, one run.

Usage: PYTHONPATH=. python scripts/bench_prefill.py [--json out.json] [--png out.png] [--quick]

- Shapes as in FlashAttention's own benchmark: batch = 16384 // seqlen, hidden 2048, so
  heads = 2048 // head_dim; bshd; fp16 and bf16, head_dim 64 and 128, seqlen 1k/4k/16k,
  causal and not. torch's ``is_causal`` is top-left; with seqlen_q == seqlen_k that equals
  pyattn's (bottom-right) ``causal=True``.
- The torch tensors go to pyattn as they are (zero-copy: CAI, DLPack for bf16) with
  ``stream=`` torch's current stream, so both run on one stream and torch CUDA events time both
  (pyattn events when torch is missing). Time per call: warmup, then the median of several
  repeats, each timing a loop of calls (the loop long enough to hide launch gaps), as in
  ``bench_foundation.py``.
- Ceilings measured in the same run: dense matmul TFLOP/s (torch, 8192^3, fp16 and bf16) and
  device-to-device copy GB/s (bytes read + written). Each pyattn figure is also given as a % of
  the matmul ceiling of its dtype.
- NumPy end to end for (B=1, S=4096, H=16, D=128, fp16, non-causal): ``pyattn.attention`` on
  NumPy arrays (wall time until the result is on the host) against the pinned-copy floor for its
  bytes (pinned H2D of q, k, v + pinned D2H of the output) and against NumPy -> torch -> SDPA ->
  NumPy; plus a sweep of the host pipeline's chunk size.
- Every pyattn result is checked once per config against torch's output (max abs diff; a loud
  warning above 2e-2). A failing config prints its error and the run goes on; the exit code is 1
  when any pyattn config failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import pyattn  # noqa: E402

TOL = 2e-2  # max abs diff against torch above which a result is called suspect


def _timer(torch, stream):
    """(mark, elapsed_ms): CUDA events on ``stream`` (torch's when torch is there, else pyattn's)."""
    if torch is not None:
        def mark():
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            return e

        def elapsed(a, b):
            b.synchronize()
            return a.elapsed_time(b)
        return mark, elapsed
    return (lambda: stream.record(timing=True)), (lambda a, b: a.elapsed_ms(b))


def time_gpu(fn, clock, *, reps=5, target_ms=20.0, warmup=3, max_loop=200) -> float:
    """Median milliseconds per call of ``fn``: warmup calls, then ``reps`` repeats, each timing a
    loop of calls sized to take about ``target_ms``."""
    mark, elapsed = clock
    for _ in range(warmup):
        fn()
    a = mark()
    fn()
    one = elapsed(a, mark())
    loop = max(1, min(max_loop, math.ceil(target_ms / max(one, 1e-3))))
    times = []
    for _ in range(reps):
        a = mark()
        for _ in range(loop):
            fn()
        times.append(elapsed(a, mark()) / loop)
    return float(np.median(times))


def time_wall(fn, *, reps=7, warmup=2) -> float:
    """Median wall milliseconds of ``fn`` (which must return only when its work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


# -- environment and ceilings -------------------------------------------------------------------------


def environment(torch) -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    dev = pyattn.get_device()
    from pyattn.runtime.device import driver_version

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        driver = smi[dev.ordinal] if len(smi) > dev.ordinal else None
    except Exception:
        driver = None
    return {"gpu": dev.name, "arch": dev.arch, "sm_count": dev.sm_count, "driver": driver,
            "cuda_driver_api": "%d.%d" % driver_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "versions": {"python": sys.version.split()[0], "pyattn": pyattn.__version__, "numpy": np.__version__,
                         "torch": getattr(torch, "__version__", None), "cuda-bindings": version("cuda-bindings"),
                         "cuda-core": version("cuda-core"), "ml_dtypes": version("ml_dtypes")}}


def ceilings(torch, clock, quick: bool, pstream=None) -> dict:
    """Dense matmul TFLOP/s (torch only) and device-to-device copy GB/s, timed on ``clock``'s stream
    (``pstream``, the pyattn stream, when there is no torch)."""
    res = {}
    reps = 3 if quick else 5
    if torch is not None:
        n = 8192
        for name, dt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            try:
                a, b = (torch.randn(n, n, device="cuda", dtype=dt) for _ in range(2))
                c = torch.empty(n, n, device="cuda", dtype=dt)
                ms = time_gpu(lambda: torch.matmul(a, b, out=c), clock, reps=reps)
                res[f"matmul_{name}_tflops"] = 2 * n ** 3 / ms / 1e9
                del a, b, c
            except Exception as exc:  # noqa: BLE001 - a ceiling we cannot measure is reported, not fatal
                res[f"matmul_{name}_tflops"] = None
                print(f"matmul ceiling ({name}) failed: {exc}")
    nbytes = 1 << 30
    try:
        if torch is not None:
            src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
            dst = torch.empty_like(src)
            ms = time_gpu(lambda: dst.copy_(src), clock, reps=reps)
            del src, dst
        else:
            from cuda.bindings import driver

            src, dst = (pyattn.empty((nbytes,), np.uint8, stream=pstream) for _ in range(2))
            ms = time_gpu(lambda: driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, pstream.handle), clock, reps=reps)
        res["d2d_copy_gbs"] = 2 * nbytes / ms / 1e6  # bytes read + written
    except Exception as exc:  # noqa: BLE001
        res["d2d_copy_gbs"] = None
        print(f"copy ceiling failed: {exc}")
    return res


# -- kernels --------------------------------------------------------------------------------------------


def configs(quick: bool):
    dtypes = ("float16",) if quick else ("float16", "bfloat16")
    dims = (128,) if quick else (64, 128)
    seqs = (1024, 4096) if quick else (1024, 4096, 16384)
    for dtype in dtypes:
        for d in dims:
            for s in seqs:
                for causal in (False, True):
                    yield dtype, d, s, causal


def bench_config(torch, clock, stream_arg, dtype, D, S, causal, quick) -> dict:
    B, H = 16384 // S, 2048 // D
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    row = {"dtype": dtype, "head_dim": D, "seqlen": S, "causal": causal, "batch": B, "heads": H,
           "flops": flops}
    reps = 3 if quick else 5
    if torch is not None:
        tdt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=tdt, generator=g) for _ in range(3))
    else:
        import ml_dtypes

        npdt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
        rng = np.random.default_rng(0)
        q, k, v = (pyattn.asarray(rng.standard_normal((B, S, H, D), np.float32).astype(npdt), stream=stream_arg)
                   for _ in range(3))

    def run_pyattn():
        return pyattn.attention(q, k, v, causal=causal, stream=stream_arg)

    try:
        ms = time_gpu(run_pyattn, clock, reps=reps)
        row.update(pyattn_ms=ms, pyattn_tflops=flops / ms / 1e9)
    except Exception as exc:  # noqa: BLE001 - report and go on to the next config
        row["pyattn_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if torch is None:
        return row

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D) views: torch SDPA's order
    ref = None
    for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                def run_torch():
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                ms = time_gpu(run_torch, clock, reps=reps)
                if ref is None:
                    ref = run_torch()
            row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001 - a backend torch cannot run here is "n/a"
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if "pyattn_ms" in row and ref is not None:
        try:
            out = run_pyattn()
            t_out = torch.from_dlpack(out.view(np.uint16)).view(getattr(torch, dtype))  # bf16 cannot go through DLPack
            diff = (t_out.float() - ref.transpose(1, 2).float()).abs().max().item()
            row["max_abs_diff_vs_torch"] = diff
            if not diff <= TOL:  # also catches NaN
                print(f"!!!!! WARNING: pyattn differs from torch by {diff:.3e} (> {TOL}) for {dtype} d={D} "
                      f"S={S} causal={causal} !!!!!")
        except Exception as exc:  # noqa: BLE001
            row["check_error"] = f"{type(exc).__name__}: {exc}"
            print(f"!!!!! WARNING: could not check pyattn against torch: {row['check_error']}")
    return row


# -- NumPy end to end -----------------------------------------------------------------------------------


def bench_skipping(torch, clock, stream_arg) -> dict:
    """Tile skipping, (B=1, S=16384, H=16, D=128, bf16): dense, causal and sliding windows, each
    against the fraction of (query, key) pairs it keeps; and what the score-modifier path costs
    (a bool mask of all True and a soft-cap, which run on the mma.sync kernel)."""
    S, H, D = 16384, 16, 128
    if torch is not None:
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        ones = torch.ones(S, S, device="cuda", dtype=torch.bool)
    else:
        import ml_dtypes

        q = pyattn.asarray(np.random.default_rng(1).standard_normal((1, S, H, D)).astype(ml_dtypes.bfloat16))
        ones = pyattn.asarray(np.ones((S, S), bool))
    cases = [("dense", {}, 1.0), ("causal", {"causal": True}, 0.5)]
    for w in (4096, 1024, 256):
        cases.append((f"window ({w}, 0)", {"window": (w, 0)}, (w + 1) / S))
    cases += [("bool mask (all True)", {"mask": ones}, 1.0), ("softcap 30", {"softcap": 30.0}, 1.0)]
    rows = []
    for name, opts, kept in cases:
        ms = time_gpu(lambda: pyattn.attention(q, q, q, stream=stream_arg, **opts), clock, reps=3)
        rows.append({"case": name, "ms": ms, "kept": kept})
    dense = rows[0]["ms"]
    for r in rows:
        r["x_dense"] = r["ms"] / dense
    return {"shape": [1, S, H, D], "dtype": "bfloat16", "rows": rows}


def bench_numpy(torch, quick: bool) -> dict:
    """pyattn on NumPy arrays (B=1, S=4096, H=16, D=128, fp16) against the pinned-copy floor and torch."""
    from cuda.bindings import driver

    from pyattn.runtime.errors import check
    from pyattn.runtime.memory import PinnedBuffer

    B, S, H, D = 1, 4096, 16, 128
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, S, H, D), np.float32).astype(np.float16) for _ in range(3))
    n_in, n_out = 3 * q.nbytes, q.nbytes
    res = {"shape": [B, S, H, D], "dtype": "float16", "bytes_h2d": n_in, "bytes_d2h": n_out}
    reps = 5 if quick else 9

    # The floor: pinned H2D of q, k, v and pinned D2H of the output, one stream, CUDA events.
    s = pyattn.Stream()
    h_in, h_out = PinnedBuffer(n_in), PinnedBuffer(n_out)
    h_in.array(np.uint8, (n_in,))[:] = 1  # touch the pages
    d_in, d_out = pyattn.empty((n_in,), np.uint8, stream=s), pyattn.empty((n_out,), np.uint8, stream=s)
    clock = _timer(None, s)
    h2d = time_gpu(lambda: check(driver.cuMemcpyHtoDAsync(d_in.ptr, h_in.ptr, n_in, s.handle)), clock,
                   reps=reps, target_ms=10)
    d2h = time_gpu(lambda: check(driver.cuMemcpyDtoHAsync(h_out.ptr, d_out.ptr, n_out, s.handle)), clock,
                   reps=reps, target_ms=10)
    res.update(floor_h2d_ms=h2d, floor_d2h_ms=d2h, floor_ms=h2d + d2h, h2d_gbs=n_in / h2d / 1e6,
               d2h_gbs=n_out / d2h / 1e6)
    s.synchronize()
    h_in.close()
    h_out.close()

    out = pyattn.attention(q, k, v)
    res["pyattn_ms"] = time_wall(lambda: pyattn.attention(q, k, v), reps=reps)
    if torch is not None:
        def torch_path():
            tq, tk, tv = (torch.from_numpy(x).cuda().transpose(1, 2) for x in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
            return o.transpose(1, 2).contiguous().cpu().numpy()
        t_out = torch_path()
        res["torch_ms"] = time_wall(torch_path, reps=reps)
        res["max_abs_diff_vs_torch"] = float(np.abs(out.astype(np.float32) - t_out.astype(np.float32)).max())
        if not res["max_abs_diff_vs_torch"] <= TOL:
            print(f"!!!!! WARNING: NumPy pyattn differs from torch by {res['max_abs_diff_vs_torch']:.3e} !!!!!")

    # The host pipeline's chunk size, swept (called directly, whether or not attention() uses it yet).
    try:
        from pyattn.ops import _host
    except ImportError:
        return res
    sweep = []
    saved = (_host._CHUNK_BYTES, _host._MIN_PIPELINE_BYTES)
    nbytes = 4 * q.nbytes + B * H * S * 4
    try:
        for mib in ((4, 8, None) if quick else (2, 4, 8, 16, 32, None)):
            _host._CHUNK_BYTES = (mib or 8) << 20
            _host._MIN_PIPELINE_BYTES = saved[1] if mib else 1 << 62  # None: one chunk
            n_chunks = len(_host.plan_chunks(B, H, nbytes))
            ms = time_wall(lambda: _host.attention_numpy(q, k, v, layout="bshd", return_lse=False, stream=None,
                                                          options={}), reps=reps)
            sweep.append({"chunk_mib": mib, "chunks": n_chunks, "ms": ms})
    except Exception as exc:  # noqa: BLE001
        res["sweep_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        _host._CHUNK_BYTES, _host._MIN_PIPELINE_BYTES = saved
    res["chunk_sweep"] = sweep
    return res


# -- report ---------------------------------------------------------------------------------------------


def _f(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) and x == x else "n/a"


def print_report(result: dict) -> None:
    env, ceil = result["environment"], result["ceilings"]
    print(f"\n== pyattn prefill benchmark on {env['gpu']} ({env['arch']}), driver {env['driver']}, "
          f"torch {env['versions']['torch']}")
    print(f"ceilings: matmul fp16 {_f(ceil.get('matmul_float16_tflops'), '.0f')} TFLOP/s, bf16 "
          f"{_f(ceil.get('matmul_bfloat16_tflops'), '.0f')} TFLOP/s (8192^3); d2d copy "
          f"{_f(ceil.get('d2d_copy_gbs'), '.0f')} GB/s (read + write)")
    head = (f"{'dtype':8} {'d':>3} {'seqlen':>6} {'causal':6} {'B':>3} {'H':>3} | {'pyattn ms':>9} {'TFLOP/s':>7} "
            f"{'%mm':>4} | {'FA2 ms':>7} {'TFLOP/s':>7} | {'cuDNN ms':>8} {'TFLOP/s':>7} | {'x FA2':>5} "
            f"{'x cuDNN':>7} | {'maxdiff':>7}")
    print(head)
    print("-" * len(head))
    for r in result["configs"]:
        mm = ceil.get(f"matmul_{r['dtype']}_tflops")
        pct = r["pyattn_tflops"] / mm * 100 if mm and "pyattn_tflops" in r else None
        x_fa2 = r["fa2_ms"] / r["pyattn_ms"] if "fa2_ms" in r and "pyattn_ms" in r else None
        x_cud = r["cudnn_ms"] / r["pyattn_ms"] if "cudnn_ms" in r and "pyattn_ms" in r else None
        line = (f"{r['dtype']:8} {r['head_dim']:>3} {r['seqlen']:>6} {str(r['causal']):6} {r['batch']:>3} "
                f"{r['heads']:>3} | {_f(r.get('pyattn_ms'), '9.3f'):>9} {_f(r.get('pyattn_tflops'), '7.1f'):>7} "
                f"{_f(pct, '4.0f'):>4} | {_f(r.get('fa2_ms'), '7.3f'):>7} {_f(r.get('fa2_tflops'), '7.1f'):>7} | "
                f"{_f(r.get('cudnn_ms'), '8.3f'):>8} {_f(r.get('cudnn_tflops'), '7.1f'):>7} | "
                f"{_f(x_fa2, '5.2f'):>5} {_f(x_cud, '7.2f'):>7} | {_f(r.get('max_abs_diff_vs_torch'), '7.1e'):>7}")
        if "pyattn_error" in r:
            line += f"  PYATTN FAILED: {r['pyattn_error'][:100]}"
        print(line)
    print("(x FA2 / x cuDNN = torch time / pyattn time: above 1 means pyattn is faster; %mm = pyattn TFLOP/s "
          "as a % of the matmul ceiling of its dtype)")
    sk = result.get("skipping")
    if sk and "rows" in sk:
        print(f"tile skipping, {tuple(sk['shape'])} {sk['dtype']}: case, ms, time / dense, pairs kept")
        for r in sk["rows"]:
            print(f"  {r['case']:<22} {r['ms']:8.3f} ms  {r['x_dense']:5.2f}x  {r['kept']:.3f}")
    e = result.get("numpy_e2e")
    if e and "error" in e:
        print(f"NumPy end to end FAILED: {e['error']}")
    elif e:
        fl = e.get("floor_ms")
        print(f"NumPy end to end (B=1, S=4096, H=16, D=128, fp16): floor {_f(fl, '.3f')} ms = pinned H2D "
              f"{_f(e.get('floor_h2d_ms'), '.3f')} ms ({_f(e.get('h2d_gbs'), '.1f')} GB/s) + D2H "
              f"{_f(e.get('floor_d2h_ms'), '.3f')} ms ({_f(e.get('d2h_gbs'), '.1f')} GB/s)")
        for key, label in (("pyattn_ms", "pyattn.attention(numpy)"), ("torch_ms", "numpy->torch->SDPA->numpy")):
            if key in e:
                print(f"  {label:27} {e[key]:8.3f} ms = {e[key] / fl:5.2f}x the floor")
        if e.get("chunk_sweep"):
            print("  host pipeline chunk sweep: " + ", ".join(
                f"{'one chunk' if s['chunk_mib'] is None else str(s['chunk_mib']) + ' MiB'} ({s['chunks']}): "
                f"{s['ms']:.2f} ms = {s['ms'] / fl:.2f}x" for s in e["chunk_sweep"]))


def write_png(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no matplotlib: no plot, silently
        return
    rows = result["configs"]
    labels = [f"{'fp16' if r['dtype'] == 'float16' else 'bf16'} d{r['head_dim']} {r['seqlen'] // 1024}k{' c' if r['causal'] else ''}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.55), 4.5))
    for i, (key, name) in enumerate((("pyattn_tflops", "pyattn"), ("fa2_tflops", "torch FA2"),
                                     ("cudnn_tflops", "torch cuDNN"))):
        ax.bar(x + (i - 1) * 0.27, [r.get(key) or 0 for r in rows], 0.27, label=name)
    mm = result["ceilings"].get("matmul_float16_tflops")
    if mm:
        ax.axhline(mm, color="k", lw=0.8, ls="--", label="fp16 matmul ceiling")
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"prefill forward, {result['environment']['gpu']} (B = 16384 / seqlen, hidden 2048)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every figure to this JSON file")
    parser.add_argument("--png", help="write a plot here (when matplotlib is installed)")
    parser.add_argument("--quick", action="store_true", help="a small subset: fp16, d=128, seqlen 1k and 4k")
    args = parser.parse_args()
    t0 = time.perf_counter()
    try:
        import torch

        if not torch.cuda.is_available():
            print("torch cannot see the GPU: pyattn alone")
            torch = None
    except ImportError:
        print("torch is not installed: pyattn alone")
        torch = None

    try:
        result = {"environment": environment(torch), "quick": args.quick}
    except pyattn.NoDeviceError as exc:
        print(f"no GPU: {exc}")
        return 1
    pstream = None
    if torch is not None:
        ts = torch.cuda.Stream()
        torch.cuda.synchronize()
        stream_ctx, clock = torch.cuda.stream(ts), _timer(torch, ts)
        stream_arg = ts.cuda_stream  # == torch.cuda.current_stream().cuda_stream inside the context
    else:
        import contextlib

        pstream = pyattn.Stream()
        stream_ctx, clock, stream_arg = contextlib.nullcontext(), _timer(None, pstream), pstream
    failures = 0
    with stream_ctx:
        result["ceilings"] = ceilings(torch, clock, args.quick, pstream)
        rows = []
        for dtype, d, s, causal in configs(args.quick):
            try:
                row = bench_config(torch, clock, stream_arg, dtype, d, s, causal, args.quick)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory creating the inputs
                traceback.print_exc()
                row = {"dtype": dtype, "head_dim": d, "seqlen": s, "causal": causal, "batch": 16384 // s,
                       "heads": 2048 // d, "pyattn_error": f"{type(exc).__name__}: {exc}"}
            failures += "pyattn_error" in row
            rows.append(row)
            print(f"  {dtype} d={d} S={s} causal={causal}: pyattn {_f(row.get('pyattn_ms'), '.3f')} ms, "
                  f"FA2 {_f(row.get('fa2_ms'), '.3f')} ms, cuDNN {_f(row.get('cudnn_ms'), '.3f')} ms", flush=True)
            if torch is not None:
                torch.cuda.synchronize()
        result["configs"] = rows
        if not args.quick:
            try:
                result["skipping"] = bench_skipping(torch, clock, stream_arg)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                result["skipping"] = {"error": f"{type(exc).__name__}: {exc}"}
                failures += 1
    try:
        result["numpy_e2e"] = bench_numpy(torch, args.quick)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        result["numpy_e2e"] = {"error": f"{type(exc).__name__}: {exc}"}
        failures += 1
    result["pyattn_failures"] = failures
    result["seconds"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        try:
            write_png(result, args.png)
        except Exception as exc:  # noqa: BLE001 - a plot is never worth failing the run
            print(f"plot failed: {exc}")
    print_report(result)
    print(f"({result['seconds']:.0f} s; {failures} pyattn failure(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Foundation benchmarks: compile time, warm cache load, host overhead, one kernel vs torch SDPA.

Usage: PYTHONPATH=. python scripts/bench_foundation.py [--json out.json]

Each figure is measured in a way that matches its target in the foundation issue:
- cold NVRTC compile per variant, in a fresh process with an empty cache (first program of a
  process pays NVRTC's one-time start-up; reported separately);
- warm load from the disk cache in a new process: cache read + cuModuleLoadData + attribute setup;
- host overhead of a tiny device-resident ``attention`` call: wall time per call over a loop of
  calls whose kernels are shorter than the host work, so the host is the bottleneck;
- kernel time for a mid-size shape by CUDA events, next to torch SDPA on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CHILD_COMPILE = r"""
import time, json
import pyattn
from pyattn import jit
from pyattn.kernels.specs import KernelSpec
arch = pyattn.get_device().arch
times = []
for dtype, d in [("f16", 64), ("f16", 128), ("bf16", 128), ("f32", 256)]:
    t = time.perf_counter(); jit.compile_spec(KernelSpec("attn_fwd_simt", dtype, d, arch)); times.append(time.perf_counter() - t)
print(json.dumps(times))
"""

_CHILD_LOAD = r"""
import time, json
import pyattn
from pyattn.kernels.registry import get_kernel
from pyattn.kernels.specs import select_attention_spec
t0 = time.perf_counter(); dev = pyattn.get_device(); dev.activate(); t1 = time.perf_counter()
spec = select_attention_spec("float16", 128, dev.arch)
t2 = time.perf_counter(); get_kernel(spec, dev); t3 = time.perf_counter()
print(json.dumps({"driver_init_s": t1 - t0, "load_s": t3 - t2}))
"""


def _child(code: str, cache_dir: str) -> str:
    env = dict(os.environ, PYATTN_CACHE_DIR=cache_dir, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout


def bench_compile(cache_dir: str) -> dict:
    times = json.loads(_child(_CHILD_COMPILE, cache_dir))
    return {"first_compile_s": times[0], "compile_s_median_after_first": float(np.median(times[1:])),
            "compile_s_max": max(times)}


def bench_warm_load(cache_dir: str) -> dict:
    _child(_CHILD_LOAD, cache_dir)  # fills the cache
    runs = [json.loads(_child(_CHILD_LOAD, cache_dir)) for _ in range(3)]
    return {"warm_load_s_median": float(np.median([r["load_s"] for r in runs])),
            "driver_init_s": float(np.median([r["driver_init_s"] for r in runs]))}


def _events_ms(fn, stream, reps=20) -> float:
    import pyattn

    fn()
    times = []
    for _ in range(reps):
        a, b = pyattn.Event(timing=True), pyattn.Event(timing=True)
        stream.record(a)
        fn()
        stream.record(b)
        times.append(a.elapsed_ms(b))
    return float(np.median(times))


def bench_host_overhead() -> dict:
    import pyattn

    rng = np.random.default_rng(0)
    q = pyattn.asarray(rng.standard_normal((1, 4, 1, 64)).astype(np.float16))
    s = pyattn.Stream()
    for _ in range(50):
        pyattn.attention(q, q, q, stream=s)
    s.synchronize()
    res = {}
    for n in (2000,):
        t0 = time.perf_counter()
        for _ in range(n):
            pyattn.attention(q, q, q, stream=s)
        t1 = time.perf_counter()
        s.synchronize()
        res["host_us_per_call"] = (t1 - t0) / n * 1e6
    res["tiny_kernel_us"] = _events_ms(lambda: pyattn.attention(q, q, q, stream=s), s, 50) * 1e3
    try:
        import torch

        tq = torch.randn(1, 1, 4, 64, device="cuda", dtype=torch.float16)
        for _ in range(50):
            torch.nn.functional.scaled_dot_product_attention(tq, tq, tq)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            torch.nn.functional.scaled_dot_product_attention(tq, tq, tq)
        res["torch_sdpa_host_us_per_call"] = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
    except ImportError:
        pass
    return res


def bench_kernel(B=4, H=16, S=2048, D=128) -> list:
    import ml_dtypes  # noqa: F401

    import pyattn

    rows = []
    rng = np.random.default_rng(0)
    s = pyattn.Stream()
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    for dtype in ("float16", "bfloat16"):
        npdt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
        q, k, v = (pyattn.asarray(rng.standard_normal((B, S, H, D)).astype(npdt), stream=s) for _ in range(3))
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            ms = _events_ms(lambda: pyattn.attention(q, k, v, causal=causal, stream=s), s)
            row = {"dtype": dtype, "causal": causal, "shape": [B, S, H, D], "pyattn_ms": ms,
                   "pyattn_tflops": flops / ms / 1e9}
            if torch is not None:
                tdt = torch.float16 if dtype == "float16" else torch.bfloat16
                tq, tk, tv = (torch.from_dlpack(x.view(np.uint16)).view(tdt).transpose(1, 2) for x in (q, k, v))
                ts = torch.cuda.Stream()
                for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend), torch.cuda.stream(ts):
                            fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                                tq, tk, tv, is_causal=causal)
                            ps = pyattn.Stream(handle=ts.cuda_stream)
                            tms = _events_ms(fn, ps)
                        row[f"torch_{name}_ms"] = tms
                        row[f"ratio_vs_{name}"] = tms / ms
                    except RuntimeError as exc:
                        row[f"torch_{name}_ms"] = f"unavailable: {str(exc)[:60]}"
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    import pyattn

    dev = pyattn.get_device()
    result = {"gpu": dev.name, "arch": dev.arch, "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as d:
        result.update(bench_compile(d))
        result.update(bench_warm_load(d))
    result.update(bench_host_overhead())
    result["kernels"] = bench_kernel()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    print(f"\n== pyattn foundation benchmarks on {dev.name} ({dev.arch}) ==")
    print(f"cold NVRTC compile: first in process {result['first_compile_s']:.2f} s, "
          f"then median {result['compile_s_median_after_first']:.2f} s, max {result['compile_s_max']:.2f} s "
          f"(target <= 2 s)")
    print(f"warm load from disk cache, new process: {result['warm_load_s_median'] * 1e3:.1f} ms (target <= 20 ms); "
          f"driver init {result['driver_init_s'] * 1e3:.0f} ms not counted")
    print(f"host overhead, tiny device-resident call: {result['host_us_per_call']:.1f} us/call (target <= 20 us); "
          f"tiny kernel {result['tiny_kernel_us']:.1f} us; torch SDPA tiny call "
          f"{result.get('torch_sdpa_host_us_per_call', float('nan')):.1f} us")
    print(f"{'dtype':9} {'causal':6} {'pyattn ms':>9} {'TFLOP/s':>8} {'flash ms':>9} {'x flash':>8} {'cudnn ms':>9} {'x cudnn':>8}")
    for r in result["kernels"]:
        def f(key):
            val = r.get(key)
            return f"{val:9.3f}" if isinstance(val, float) else f"{'n/a':>9}"
        print(f"{r['dtype']:9} {str(r['causal']):6} {r['pyattn_ms']:9.3f} {r['pyattn_tflops']:8.1f} "
              f"{f('torch_flash_ms')} {f('ratio_vs_flash')} {f('torch_cudnn_ms')} {f('ratio_vs_cudnn')}")
    print("(x flash / x cudnn = torch time / pyattn time: above 1 means pyattn is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

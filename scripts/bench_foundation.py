"""Foundation benchmarks: compile time, warm start, host overhead, one kernel vs torch SDPA.

Usage: PYTHONPATH=. python scripts/bench_foundation.py [--json out.json] [--quick]

Each figure is measured the way its target in the foundation issue reads:
- cold NVRTC compile per variant, in a fresh process with an empty cache (``pyattn.jit.compile_spec``
  of four ``KernelSpec``s; the first program of a process pays NVRTC's start-up, reported apart);
- warm start in new processes (``bench_startup.measure``): CUDA context creation, then the first
  ``attention`` call with a warm disk cache (kernel load, plan, launch, result ready);
- host overhead of a tiny device-resident ``attention`` call: wall time per call over a loop of
  calls whose kernels are shorter than the host work, so the host is the bottleneck; torch
  SDPA's tiny call the same way;
- the tiny call's GPU time (behind the pre-roll), and the kernel time of (B=4, S=2048, H=16,
  D=128) next to torch SDPA's FA2 and cuDNN backends (``bench_prefill.bench_config``).
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np

import bench_prefill
import bench_startup
import harness
import pyattn
from harness import fmt

CHILD_COMPILE = r"""
import json, time
import pyattn
from pyattn import jit
from pyattn.kernels.specs import KernelSpec
arch = pyattn.get_device().arch
times = []
for dtype, d in [("f16", 64), ("f16", 128), ("bf16", 128), ("f32", 256)]:
    t = time.perf_counter()
    jit.compile_spec(KernelSpec("attn_fwd_simt", dtype, d, arch))
    times.append(time.perf_counter() - t)
print("PYATTN_STARTUP " + json.dumps({"times": times}))
"""


def bench_compile(cache_dir: str) -> dict:
    times = bench_startup.run_child(cache_dir, CHILD_COMPILE)["times"]
    return {"first_compile_s": times[0], "compile_s_median_after_first": float(np.median(times[1:])),
            "compile_s_max": max(times)}


def bench_host(bench) -> dict:
    """Host time per tiny device-resident call (pyattn, torch SDPA) and the tiny kernel's GPU time."""
    q = pyattn.asarray(np.random.default_rng(0).standard_normal((1, 4, 1, 64)).astype(np.float16),
                       stream=bench.stream)
    fn = lambda: pyattn.attention(q, q, q, stream=bench.stream)  # noqa: E731
    res = {"host_us_per_call": bench.wall_ms(fn, loop=2000, reps=3, warmup=50) * 1e3,
           "tiny_kernel_us": bench.gpu_ms(fn, loop=50, label="tiny call").ms * 1e3}
    torch = bench.torch
    if torch is not None:
        tq = torch.randn(1, 1, 4, 64, device="cuda", dtype=torch.float16)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        res["torch_sdpa_host_us_per_call"] = bench.wall_ms(lambda: sdpa(tq, tq, tq), loop=2000, reps=3,
                                                           warmup=50) * 1e3
    return res


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    bench = harness.open_bench()
    if bench is None:
        return 1
    result = {"date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as d:
        result.update(bench_compile(d))
        start = bench_startup.measure(2 if args.quick else 3, d + "/warm")
        result.update(first_call_ms=start["median"].get("first_call_ms"), context_ms=start["median"].get("context_ms"))
    result.update(bench_host(bench))
    reps = 3 if args.quick else 7
    result["kernels"] = [bench_prefill.bench_config(bench, dtype, 4, 2048, 16, 128, causal, reps)
                         for dtype in ("float16", "bfloat16") for causal in (False, True)]
    result["environment"] = env = harness.environment(bench)
    harness.save_json(args.json, result)

    print(f"\n== pyattn foundation benchmarks: {harness.env_line(env)}")
    print(f"cold NVRTC compile: first in process {result['first_compile_s']:.2f} s, "
          f"then median {result['compile_s_median_after_first']:.2f} s, max {result['compile_s_max']:.2f} s "
          f"(target <= 2 s)")
    print(f"warm start, new process: first attention call {fmt(result['first_call_ms'], '.1f')} ms with a warm "
          f"cache (target <= 15 ms); CUDA context {fmt(result['context_ms'], '.0f')} ms not counted")
    print(f"host overhead, tiny device-resident call: {result['host_us_per_call']:.1f} us/call (target <= 20 us); "
          f"tiny kernel {result['tiny_kernel_us']:.1f} us; torch SDPA tiny call "
          f"{fmt(result.get('torch_sdpa_host_us_per_call'), '.1f')} us")
    print(f"{'dtype':9} {'causal':6} {'pyattn ms':>9} {'TFLOP/s':>8} {'flash ms':>9} {'x flash':>8} {'cudnn ms':>9} "
          f"{'x cudnn':>8}")
    for r in result["kernels"]:
        py = r.get("pyattn_ms")
        x = {n: r[f"{n}_ms"] / py if py and f"{n}_ms" in r else None for n in harness.SDPA_BACKENDS}
        print(f"{r['dtype']:9} {str(r['causal']):6} {fmt(py, '9.3f'):>9} {fmt(r.get('pyattn_tflops'), '8.1f'):>8} "
              f"{fmt(r.get('fa2_ms'), '9.3f'):>9} {fmt(x['fa2'], '8.3f'):>8} {fmt(r.get('cudnn_ms'), '9.3f'):>9} "
              f"{fmt(x['cudnn'], '8.3f'):>8}")
    print("(x flash / x cudnn = torch time / pyattn time: above 1 means pyattn is faster)")
    print(harness.unheld_note(bench), end="")
    return 0 if all("pyattn_ms" in r for r in result["kernels"]) else 1


if __name__ == "__main__":
    sys.exit(main())

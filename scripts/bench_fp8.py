"""fp8 prefill benchmark: pyattn on fp8 e4m3 inputs against pyattn bf16 and torch SDPA's FlashAttention-2
and cuDNN backends (bf16) on the same values, one GPU, one run. Needs torch and an sm_90a GPU.

Usage: PYTHONPATH=. python scripts/bench_fp8.py [--json out.json] [--quick]

- Shapes as ``bench_prefill.py``: batch = max(1, 16384 // seqlen), hidden 2048 (heads = 2048 //
  head_dim), bshd; head_dim 128 at 1k / 4k / 16k and 256 at 4k / 16k, causal and not.
- Inputs: torch draws normal q, k, v on the device and quantizes each to e4m3 with a per-tensor
  descale (amax / 448); pyattn's fp8 call reads those torch tensors zero-copy (the fp8_vt pass that
  transposes V is part of every call, so of its time). The bf16 calls (pyattn's and torch's) take
  the same dequantized values, so the outputs compare (max abs diff fp8 - bf16, printed).
- GPU time per call: harness.Bench.gpu_ms (warm-up, pre-roll, median of repeats, inputs rotated
  past the L2). Ceilings measured in the same run: the bf16 matmul and the fp8 one
  (``torch._scaled_mm``, 8192^3, bf16 out); fp8 TFLOP/s are also given as a % of the fp8 ceiling.
"""

from __future__ import annotations

import sys
import time

import harness
import pyattn
from harness import fmt

SHAPES = ((128, 1024), (128, 4096), (128, 16384), (256, 4096), (256, 16384))


def fp8_matmul_tflops(bench, n: int = 8192, reps: int = 5) -> float:
    """Dense n^3 fp8 e4m3 matrix product TFLOP/s (torch._scaled_mm, per-tensor scales, bf16 out)."""
    torch = bench.torch
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    t = bench.gpu_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), loop=10,
                     reps=reps, preroll=False)
    return 2 * n ** 3 / t.ms / 1e9


def _inputs(torch, stream, shape, n: int):
    """``n`` sets of fp8 (pyattn views of torch tensors, descales) and the bf16 values (torch)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    fp8, bf16 = [], []
    for _ in range(n):
        x = [torch.randn(*shape, device="cuda", generator=g) for _ in range(3)]
        ds = [t.abs().max().item() / 448.0 for t in x]
        codes = [(t / d).to(torch.float8_e4m3fn) for t, d in zip(x, ds)]
        fp8.append(([harness.to_pyattn(c, stream) for c in codes], ds))
        bf16.append([(c.float() * d).to(torch.bfloat16) for c, d in zip(codes, ds)])
    return fp8, bf16


def bench_shape(bench, D: int, S: int, causal: bool, reps: int) -> dict:
    torch = bench.torch
    B, H = max(1, 16384 // S), 2048 // D
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    row = {"head_dim": D, "seqlen": S, "causal": causal, "batch": B, "heads": H, "flops": flops}
    fp8, bf16 = _inputs(torch, bench.stream, (B, S, H, D), bench.replicas(4 * B * S * H * D, cap=4))
    label = f"d{D} S{S}{' causal' if causal else ''}"

    def fp8_call(s):
        (q, k, v), (dq, dk, dv) = s
        return lambda: pyattn.attention(q, k, v, causal=causal, descale_q=dq, descale_k=dk, descale_v=dv,
                                        stream=bench.stream)

    pb = [[harness.to_pyattn(t, bench.stream) for t in s] for s in bf16]
    runs = {"fp8": [fp8_call(s) for s in fp8],
            "bf16": [lambda s=s: pyattn.attention(*s, causal=causal, stream=bench.stream) for s in pb]}
    for name in harness.SDPA_BACKENDS:
        runs[name] = [harness.sdpa(torch, name, *(x.transpose(1, 2) for x in s), is_causal=causal) for s in bf16]
    for name, fns in runs.items():
        t = harness.attempt(row, name, lambda: bench.gpu_ms(fns, loop=10, reps=reps, label=f"{name} {label}"))
        if t:
            row[f"{name}_ms"], row[f"{name}_tflops"] = t.ms, flops / t.ms / 1e9
    if "fp8_ms" in row and "bf16_ms" in row:
        a, b = (harness.to_torch(runs[n][0]()) for n in ("fp8", "bf16"))
        row["max_abs_diff_fp8_bf16"] = (a.float() - b.float()).abs().max().item()
    torch.cuda.empty_cache()
    return row


def print_report(result: dict) -> None:
    ceil = result["ceilings"]
    print(f"\n== pyattn fp8 prefill: {harness.env_line(result['environment'])}")
    print(f"ceilings: matmul bf16 {fmt(ceil.get('matmul_bfloat16_tflops'), '.0f')} TFLOP/s, fp8 "
          f"{fmt(ceil.get('matmul_fp8_tflops'), '.0f')} TFLOP/s (8192^3)")
    head = (f"{'d':>3} {'seqlen':>6} {'causal':6} | {'fp8 ms':>7} {'TFLOP/s':>7} {'%mm8':>4} | {'bf16 ms':>7} | "
            f"{'FA2 ms':>7} | {'cuDNN ms':>8} | {'x bf16':>6} {'x FA2':>5} {'x cuDNN':>7} | {'diff':>7}")
    print(head + "\n" + "-" * len(head))
    mm8 = ceil.get("matmul_fp8_tflops")
    for r in result["rows"]:
        f8 = r.get("fp8_ms")
        x = {n: r[f"{n}_ms"] / f8 if f"{n}_ms" in r and f8 else None for n in ("bf16", *harness.SDPA_BACKENDS)}
        pct = r["fp8_tflops"] / mm8 * 100 if mm8 and f8 else None
        print(f"{r['head_dim']:>3} {r['seqlen']:>6} {str(r['causal']):6} | {fmt(f8, '7.3f'):>7} "
              f"{fmt(r.get('fp8_tflops'), '7.1f'):>7} {fmt(pct, '4.0f'):>4} | {fmt(r.get('bf16_ms'), '7.3f'):>7} | "
              f"{fmt(r.get('fa2_ms'), '7.3f'):>7} | {fmt(r.get('cudnn_ms'), '8.3f'):>8} | {fmt(x['bf16'], '6.2f'):>6} "
              f"{fmt(x['fa2'], '5.2f'):>5} {fmt(x['cudnn'], '7.2f'):>7} | {fmt(r.get('max_abs_diff_fp8_bf16'), '7.1e')}"
              + (f"  FAILED: {r['errors'][0][:100]}" if r.get("errors") else ""))
    print("(x bf16 / x FA2 / x cuDNN = that call's time / the fp8 call's: above 1 means fp8 is faster; FA2 and "
          "cuDNN run bf16 on the same values)")


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    t0 = time.perf_counter()
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    reps = 3 if args.quick else 5
    ceil = bench.ceilings(matmul=("bfloat16",), reps=reps)
    ceil["matmul_fp8_tflops"] = harness.attempt(ceil, "matmul fp8", lambda: fp8_matmul_tflops(bench, reps=reps))
    result = {"quick": args.quick, "ceilings": ceil, "rows": [], "t0": t0}
    for D, S in SHAPES[:2] if args.quick else SHAPES:
        for causal in (False, True):
            row = bench_shape(bench, D, S, causal, reps)
            result["rows"].append(row)
            print(f"  d={D} S={S} causal={causal}: fp8 {fmt(row.get('fp8_ms'), '.3f')} ms, bf16 "
                  f"{fmt(row.get('bf16_ms'), '.3f')} ms, cuDNN {fmt(row.get('cudnn_ms'), '.3f')} ms", flush=True)
    failures = sum("fp8_ms" not in r for r in result["rows"])
    result["environment"] = harness.environment(bench)
    print_report(result)
    return harness.end_run(bench, result, args.json, failures, f"{failures} pyattn failure(s); ")


if __name__ == "__main__":
    sys.exit(main())

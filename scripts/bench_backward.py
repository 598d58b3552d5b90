"""Backward benchmark: pyattn.attention_backward against torch SDPA's FlashAttention-2 and cuDNN backward, one run.

Usage: PYTHONPATH=. python scripts/bench_backward.py [--json out.json] [--quick] [--dims 64 128] [--seqlens 1024 ...]

- Shapes as bench_prefill.py (FlashAttention's benchmark): batch = 16384 // seqlen, heads =
  2048 // head_dim (32 at d=64, 16 at d=128), bshd, bf16, seqlen 1k/4k/16k, causal and not.
  torch's ``is_causal`` is top-left; with seqlen_q == seqlen_k it equals pyattn's causal.
- Only the backward is timed. pyattn: ``attention_backward(dout, q, k, v, out, lse)`` on the
  (out, lse) of one pyattn forward, all three of its kernels (pre, main, convert) and its
  allocations. torch: one forward with ``requires_grad`` under ``sdpa_kernel(backend)``, then
  ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` timed on the retained graph (the
  backend's backward op, its preprocessing and the gradients' allocation; autograd's host work is
  hidden behind the pre-roll). GPU time per call: ``harness.Bench.gpu_ms`` (warm-up, pre-roll,
  median of repeats, inputs rotated past the L2).
- TFLOP/s count the backward as 2.5x the forward's 4 B H S^2 D (five matrix products to the
  forward's two), halved for causal.
- Extra rows (d=128, 4k, causal): ``deterministic=True`` (the cost of ordered dQ sums), and the
  call on torch tensors through the public API (``stream=None``: torch's current stream; host
  cost of reading six tensors included, as a user pays it).
- Every pyattn config is checked once against FA2's gradients (max |diff| / max |FA2|, per
  gradient; a loud warning above 2e-2). A failing config prints its error and the run goes on;
  the exit code is 1 when any pyattn config failed.
"""

from __future__ import annotations

import sys
import time
import traceback

import harness
import pyattn
from harness import fmt

TOL = 2e-2  # relative max diff against FA2's gradients above which a result is called suspect


def _sets(bench, shape, n: int, seed: int):
    """``n`` sets of bf16 (q, k, v, dout) torch tensors of ``shape`` (B, S, H, D)."""
    torch = bench.torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [tuple(torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            for _ in range(n)]


def _torch_bwd(bench, name, q, k, v, dout, causal):
    """A callable running only the backward of SDPA on backend ``name`` (a graph retained once)."""
    torch = bench.torch
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    out = harness.sdpa(torch, name, qt, kt, vt, is_causal=causal)()
    do = dout.transpose(1, 2)
    return lambda: torch.autograd.grad(out, (qt, kt, vt), do, retain_graph=True)


def bench_config(bench, D: int, S: int, causal: bool, reps: int, extras: bool = False) -> dict:
    B, H = 16384 // S, 2048 // D
    flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
    row = {"dtype": "bfloat16", "head_dim": D, "seqlen": S, "causal": causal, "batch": B, "heads": H, "flops": flops}
    label = f"bf16 d{D} S{S}{' causal' if causal else ''}"
    n = bench.replicas(8 * B * S * H * D * 2, cap=3)
    tsets = _sets(bench, (B, S, H, D), n, 0)
    psets = []
    for q, k, v, do in tsets:
        pq, pk, pv, pdo = (harness.to_pyattn(x, bench.stream) for x in (q, k, v, do))
        out, lse = pyattn.attention(pq, pk, pv, causal=causal, return_lse=True, stream=bench.stream)
        psets.append((pdo, pq, pk, pv, out, lse))
    fn = [lambda s=s: pyattn.attention_backward(*s, causal=causal, stream=bench.stream) for s in psets]
    t = harness.attempt(row, "pyattn", lambda: bench.gpu_ms(fn, loop=5, reps=reps, label=f"pyattn {label}"))
    if t:
        row.update(pyattn_ms=t.ms, pyattn_tflops=flops / t.ms / 1e9)
    for name in harness.SDPA_BACKENDS:
        try:
            tfns = [_torch_bwd(bench, name, *ts, causal) for ts in tsets]
            t = bench.gpu_ms(tfns, loop=5, reps=reps, label=f"{name} {label}")
            row[f"{name}_ms"], row[f"{name}_tflops"] = t.ms, flops / t.ms / 1e9
            if name == "fa2" and "pyattn_ms" in row:
                _compare(row, fn[0](), tfns[0]())
        except Exception as exc:  # noqa: BLE001 - a backend torch cannot run here is "n/a"
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if extras and "pyattn_ms" in row:
        t = harness.attempt(row, "deterministic", lambda: bench.gpu_ms(
            [lambda s=s: pyattn.attention_backward(*s, causal=causal, deterministic=True, stream=bench.stream)
             for s in psets], loop=5, reps=reps, label=f"pyattn deterministic {label}"))
        if t:
            row["deterministic_ms"] = t.ms
        tin = [(do, q, k, v, harness.to_torch(p[4]), harness.to_torch(p[5])) for (q, k, v, do), p in zip(tsets, psets)]
        t = harness.attempt(row, "torch in", lambda: bench.gpu_ms(
            [lambda s=s: pyattn.attention_backward(*s, causal=causal) for s in tin], loop=5, reps=reps,
            label=f"pyattn torch-in {label}"))
        if t:
            row.update(torch_in_ms=t.ms, torch_in_host_ms=t.host_ms)
    return row


def _compare(row, mine, theirs) -> None:
    """Max |pyattn - FA2| / max |FA2| per gradient (FA2's are (B, H, S, D) views)."""
    diffs = []
    for a, b in zip(mine, theirs):
        a = harness.to_torch(a).float()
        b = b.transpose(1, 2).float()
        diffs.append(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    row["rel_diff_vs_fa2"] = diffs
    if not max(diffs) <= TOL:
        print(f"!!!!! WARNING: pyattn's gradients differ from FA2's by {max(diffs):.3e} (relative) for "
              f"d{row['head_dim']} S{row['seqlen']} causal={row['causal']} !!!!!")


def configs(args):
    dims = args.dims or ((128,) if args.quick else (64, 128))
    lens = args.seqlens or ((1024, 4096) if args.quick else (1024, 4096, 16384))
    for d in dims:
        for s in lens:
            for causal in (False, True):
                yield d, s, causal


def print_report(result: dict) -> list:
    env = result["environment"]
    print(f"\n== pyattn backward benchmark: {harness.env_line(env)}")
    head = (f"{'d':>3} {'seqlen':>6} {'causal':6} {'B':>3} {'H':>3} | {'pyattn ms':>9} {'TFLOP/s':>7} | {'FA2 ms':>7} "
            f"{'TFLOP/s':>7} | {'cuDNN ms':>8} {'TFLOP/s':>7} | {'x FA2':>5} {'x cuDNN':>7} | {'rel diff':>8}")
    print(head + "\n" + "-" * len(head))
    targets = []
    for r in result["configs"]:
        py = r.get("pyattn_ms")
        x = {n: r[f"{n}_ms"] / py if f"{n}_ms" in r and py else None for n in harness.SDPA_BACKENDS}
        diff = max(r["rel_diff_vs_fa2"]) if r.get("rel_diff_vs_fa2") else None
        line = (f"{r['head_dim']:>3} {r['seqlen']:>6} {str(r['causal']):6} {r['batch']:>3} {r['heads']:>3} | "
                f"{fmt(py, '9.3f'):>9} {fmt(r.get('pyattn_tflops'), '7.1f'):>7} | {fmt(r.get('fa2_ms'), '7.3f'):>7} "
                f"{fmt(r.get('fa2_tflops'), '7.1f'):>7} | {fmt(r.get('cudnn_ms'), '8.3f'):>8} "
                f"{fmt(r.get('cudnn_tflops'), '7.1f'):>7} | {fmt(x['fa2'], '5.2f'):>5} {fmt(x['cudnn'], '7.2f'):>7} | "
                f"{fmt(diff, '8.1e'):>8}")
        if r.get("errors"):
            line += f"  PYATTN FAILED: {r['errors'][0][:100]}"
        print(line)
        targets.append({"pass": None if x["fa2"] is None else x["fa2"] >= 1.0,
                        "text": f">= 1.0x FA2 backward, bf16 d{r['head_dim']} S{r['seqlen']} causal={r['causal']}: "
                                f"{fmt(x['fa2'], '.2f')}x (cuDNN {fmt(x['cudnn'], '.2f')}x)"})
        if "deterministic_ms" in r:
            print(f"    deterministic=True: {r['deterministic_ms']:.3f} ms ({r['deterministic_ms'] / py:.2f}x the "
                  f"atomic dQ)")
        if "torch_in_ms" in r:
            print(f"    torch tensors in, stream=None: {r['torch_in_ms']:.3f} ms GPU ({r['torch_in_ms'] / py:.2f}x), "
                  f"host {1e3 * r['torch_in_host_ms']:.0f} us per call")
    print("(x FA2 / x cuDNN = torch backward time / pyattn backward time: above 1 means pyattn is faster; rel diff = "
          "max over dq, dk, dv of max|pyattn - FA2| / max|FA2|)")
    return targets


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--dims", type=int, nargs="*", help="head dims (default 64 128)")
    ap.add_argument("--seqlens", type=int, nargs="*", help="sequence lengths (default 1024 4096 16384)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    reps = 3 if args.quick else 5
    failures, rows = 0, []
    for d, s, causal in configs(args):
        try:
            row = bench_config(bench, d, s, causal, reps, extras=(d, s, causal) == (128, 4096, True))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory creating the inputs
            traceback.print_exc()
            row = {"dtype": "bfloat16", "head_dim": d, "seqlen": s, "causal": causal, "batch": 16384 // s,
                   "heads": 2048 // d, "errors": [f"{type(exc).__name__}: {exc}"]}
        failures += "pyattn_ms" not in row
        rows.append(row)
        print(f"  d={d} S={s} causal={causal}: pyattn {fmt(row.get('pyattn_ms'), '.3f')} ms, FA2 "
              f"{fmt(row.get('fa2_ms'), '.3f')} ms, cuDNN {fmt(row.get('cudnn_ms'), '.3f')} ms", flush=True)
        bench.torch.cuda.empty_cache()
    result = {"quick": args.quick, "configs": rows, "environment": harness.environment(bench),
              "pyattn_failures": failures, "preroll_ran_out": bench.unheld}
    targets = print_report(result)
    harness.print_targets(targets)
    result.update(targets=targets, seconds=time.perf_counter() - t0)
    harness.save_json(args.json, result)
    print(harness.unheld_note(bench) + f"({result['seconds']:.0f} s; {failures} pyattn failure(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

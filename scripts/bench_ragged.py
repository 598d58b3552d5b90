"""Ragged decode benchmark: one decode step over a batch of very different lengths (issue 12).

Usage: PYTHONPATH=. python scripts/bench_ragged.py [--json out.json] [--quick] [--batch 64] [--page 16]

- The batch: ``--batch`` sequences (64) of log-uniform lengths 128..65536 tokens (seeded), bf16,
  D 128, Hq 32, Hkv 8, q_len 1, in a pyattn.PagedKVCache of ``--page``-token pages (16), each
  sequence appended whole in turn.
- GPU us (harness.Bench.gpu_ms: pre-roll, median of repeats) of ``pyattn.decode(q, cache, ids)``
  with the automatic split count and with ``num_splits`` forced to 1, 2, 4, 8, 16, 32: the split
  choice against the best of the sweep. KV bytes = total tokens x Hkv x D x 2 (K, V) x 2 bytes;
  GB/s and % of the device-to-device copy rate measured at start.
- torch SDPA (FA2, cuDNN) on the batch padded to its longest sequence, (B, Hkv, 65536, D) with
  ``enable_gqa``: what a dense API without per-sequence lengths costs; its output is not compared
  (the padding is attended).
- Correct: the decode's rows of the shortest, the longest and two middle sequences against fp32
  attention over their own K/V (flagged above 2e-2).
- PASS/MISS: the automatic split count at >= 85% of the copy rate (the issue's target).
"""

from __future__ import annotations

import math
import sys
import time
import traceback

import numpy as np

import harness
import pyattn
from harness import attempt, fmt

HQ, HKV, D = 32, 8, 128
LO, HI = 128, 65536
SWEEP = (1, 2, 4, 8, 16, 32)
TOL = 2e-2


def lengths(batch: int) -> np.ndarray:
    """Log-uniform lengths in [LO, HI], seeded; the longest is HI (the batch's span is fixed)."""
    rng = np.random.default_rng(12)
    lens = np.exp(rng.uniform(math.log(LO), math.log(HI), batch)).astype(np.int64)
    lens[int(np.argmax(lens))] = HI
    return lens


def build(bench, lens, page: int):
    """The cache, its sequence ids, q, and the K/V of the checked sequences {index: (k, v)}."""
    torch = bench.torch
    g = torch.Generator(device="cuda").manual_seed(7)
    cache = pyattn.PagedKVCache(int(sum(-(-n // page) for n in lens)) + 1, page, HKV, D, "bfloat16")
    ids = [cache.add_sequence() for _ in lens]
    order = np.argsort(lens)
    checked = {int(order[0]), int(order[-1]), int(order[len(order) // 2]), int(order[len(order) // 4])}
    kept = {}
    for i, (sid, n) in enumerate(zip(ids, lens)):
        k, v = (torch.randn(1, int(n), HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        cache.append([sid], harness.to_pyattn(k, bench.stream), harness.to_pyattn(v, bench.stream),
                     stream=bench.stream)
        if i in checked:
            kept[i] = (k, v)
    q = torch.randn(len(lens), 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bench.sync()
    return cache, ids, q, kept


def check(out, q, kept) -> float:
    """Max abs error (relative to max |ref| where larger) of the checked rows against fp32 attention."""
    import torch

    o = harness.to_torch(out).float()
    worst = 0.0
    for i, (k, v) in kept.items():
        qi = q[i, 0].float().view(HKV, HQ // HKV, D)
        kk, vv = k[0].float().transpose(0, 1), v[0].float().transpose(0, 1)  # (Hkv, n, D)
        p = torch.softmax(qi @ kk.transpose(1, 2) / math.sqrt(D), dim=-1)
        ref = (p @ vv).reshape(HQ, D)
        err = (o[i, 0] - ref).abs().max().item()
        worst = max(worst, err / max(1.0, ref.abs().max().item()))
    return worst


def torch_padded(bench, q, lens, args) -> dict:
    """SDPA FA2 / cuDNN times on the batch padded to its longest sequence (random K/V)."""
    torch, res = bench.torch, {}
    B, L = len(lens), int(lens.max())
    if torch.cuda.mem_get_info()[0] < 2 * B * HKV * L * D * 2 * 1.2 + (2 << 30):
        return {"error": "not enough free memory for the padded K/V"}
    k, v = (torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qs = q.view(B, HQ, 1, D)
    for name in harness.SDPA_BACKENDS:
        fn = harness.sdpa(torch, name, qs, k, v, enable_gqa=True)
        t = attempt(res, f"torch {name}", lambda: bench.gpu_ms(fn, loop=args.loop, reps=args.reps, label=name))
        if t:
            res[f"{name}_us"] = t.ms * 1e3
    k = v = None
    torch.cuda.empty_cache()
    return res


def run(bench, args, result) -> None:
    lens = lengths(args.batch)
    total = int(lens.sum())
    result.update(batch=args.batch, page=args.page, total_tokens=total, max_len=int(lens.max()),
                  mean_fill=float(lens.mean() / lens.max()), kv_bytes=total * HKV * D * 2 * 2)
    print(f"  {args.batch} sequences, {total} tokens (mean {lens.mean():.0f}, longest {lens.max()}), "
          f"{result['kv_bytes'] / 1e9:.2f} GB of K/V", flush=True)
    t0 = time.perf_counter()
    cache, ids, q, kept = build(bench, lens, args.page)
    print(f"  cache filled in {time.perf_counter() - t0:.1f} s", flush=True)
    qd = harness.to_pyattn(q, bench.stream)
    for splits in (None, *SWEEP):
        row = {"splits": splits or "auto"}
        fn = lambda s=splits: pyattn.decode(qd, cache, ids, num_splits=s, stream=bench.stream)  # noqa: E731
        t = attempt(row, f"decode splits={row['splits']}",
                    lambda: bench.gpu_ms(fn, loop=args.loop, reps=args.reps, label=f"splits {row['splits']}"))
        if t:
            row["us"], row["held"] = t.ms * 1e3, t.held
            row["gbs"] = result["kv_bytes"] / t.ms / 1e6
            row["pct_copy"] = row["gbs"] / result["copy_gbs"] * 100 if result["copy_gbs"] else None
        err = attempt(row, "check", lambda: check(fn(), q, kept))
        row["err"] = err
        row["flagged"] = err is None or not err <= TOL
        result["rows"].append(row)
        print(f"  splits {row['splits']}: {fmt(row.get('us'), '.1f')} us, {fmt(row.get('gbs'), '.0f')} GB/s "
              f"({fmt(row.get('pct_copy'), '.1f')}% of copy), err {fmt(err, '.1e')}", flush=True)
    result["torch"] = torch_padded(bench, q, lens, args)


def report(result) -> int:
    rows, tr = result["rows"], result.get("torch", {})
    print(f"\n== ragged decode: {result['batch']} sequences of {LO}..{HI} tokens (log-uniform; {result['total_tokens']} "
          f"tokens, mean fill {result['mean_fill']:.3f}), bf16, D={D}, Hq={HQ}, Hkv={HKV}, page {result['page']}; "
          f"{harness.env_line(result['environment'])}; d2d copy {fmt(result['copy_gbs'], '.0f')} GB/s")
    auto = rows[0] if rows else {}
    pad = {n: tr.get(f"{n}_us") for n in harness.SDPA_BACKENDS}
    print("\n".join(harness.md_table("", ("num_splits", "GPU us", "GB/s", "% of copy", "x FA2 padded",
                                           "x cuDNN padded", "max err"), [
        (r["splits"], fmt(r.get("us"), ".1f") + ("" if r.get("held") else "~"), fmt(r.get("gbs"), ".0f"),
         fmt(r.get("pct_copy"), ".1f"),
         *(fmt(pad[n] / r["us"] if pad[n] and r.get("us") else None, ".2f") for n in harness.SDPA_BACKENDS),
         fmt(r.get("err"), ".1e") + (" !" if r.get("flagged") else "")) for r in rows])[1:]))
    print(f"(torch SDPA on the batch padded to {HI} tokens: FA2 {fmt(pad.get('fa2'), '.1f')} us, cuDNN "
          f"{fmt(pad.get('cudnn'), '.1f')} us; x = torch time / pyattn time; ~ = the pre-roll ran out; "
          f"! = error > {TOL})" + (f"; torch: {tr['error']}" if "error" in tr else ""))
    best = min((r for r in rows[1:] if r.get("us")), key=lambda r: r["us"], default=None)
    result["targets"] = [{"pass": None if auto.get("pct_copy") is None else auto["pct_copy"] >= 85,
                          "text": f"ragged batch, automatic splits: {fmt(auto.get('pct_copy'), '.1f')}% of the copy "
                                  f"rate (target >= 85%; best of the sweep: {fmt(best and best.get('pct_copy'), '.1f')}% "
                                  f"at {best and best['splits']} splits)"}]
    harness.print_targets(result["targets"])
    return sum(bool(r.get("errors")) or bool(r.get("flagged")) for r in rows) + (0 if rows else 1)


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--page", type=int, default=16)
    args = p.parse_args(argv)
    args.reps, args.loop = (3, 5) if args.quick else (7, 10)
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    result = {"args": vars(args), "rows": [], "t0": time.perf_counter(),
              "copy_gbs": bench.ceilings(matmul=(), reps=args.reps).get("d2d_copy_gbs")}
    print(f"== pyattn ragged decode benchmark; d2d copy {fmt(result['copy_gbs'], '.0f')} GB/s", flush=True)
    try:
        run(bench, args, result)
    except Exception:  # noqa: BLE001 - report what was measured
        traceback.print_exc()
        result.setdefault("errors", []).append("run aborted")
    result["environment"] = harness.environment(bench)
    failures = report(result) + bool(result.get("errors"))
    return harness.end_run(bench, result, args.json, failures)


if __name__ == "__main__":
    sys.exit(main())

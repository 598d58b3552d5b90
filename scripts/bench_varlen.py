"""Varlen benchmark: ``pyattn.attention_varlen`` against FlashAttention-2's varlen kernel (torch SDPA on
jagged nested tensors), one GPU, one run.

Usage: PYTHONPATH=. python scripts/bench_varlen.py [--json out.json] [--quick]

- Batches, bf16, head_dim 128, 16 heads (MHA: torch's jagged SDPA takes no GQA), causal and not:
  "ragged" 16 sequences of lengths log-uniform in 128..8192 (fixed seed), "short" 64 sequences of
  256..1024, "long" 4 of 8192. Inputs are packed (total, H, D) torch tensors made on the device,
  the offsets an int32 torch tensor.
- pyattn: ``attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=, max_seqlen_k=)``, the offsets
  unread on the host (FlashAttention's contract). torch: ``torch.nested.nested_tensor_from_jagged``
  views of the same tensors, (B, H, j, D), under SDPA's FLASH_ATTENTION backend, which runs FA2's
  varlen kernel over the offsets (and CUDNN_ATTENTION where torch takes jagged tensors there).
  GPU ms by ``harness.Bench.gpu_ms`` (pre-roll, median of repeats); TFLOP/s count 4 * H * D per
  visible (query, key) pair; x = torch time / pyattn time.
- Host: wall us per call of a loop of calls and one synchronisation, for pyattn's unchecked call
  and the checked one (no maxima: the offsets copied back each call, a synchronisation), beside
  the GPU time; the checked call cannot queue ahead of the GPU.
- Each pyattn output is compared with torch's (max abs difference; flagged above 2e-2).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import harness
import pyattn

H, D = 16, 128
TOL = 2e-2


def batches(quick: bool) -> dict:
    rng = np.random.default_rng(0)
    out = {"ragged": np.exp(rng.uniform(np.log(128), np.log(8192), 16)).astype(int),
           "short": rng.integers(256, 1025, 64), "long": np.full(4, 8192)}
    return {"ragged": out["ragged"]} if quick else out


def pairs(lens, causal: bool) -> int:
    return int(sum(n * (n + 1) // 2 if causal else n * n for n in lens))


def run_batch(bench, name: str, lens, causal: bool, quick: bool) -> dict:
    torch = bench.torch
    row = {"batch": name, "causal": causal, "seqs": len(lens), "tokens": int(sum(lens)), "max": int(max(lens))}
    total, longest = row["tokens"], row["max"]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64, device="cuda")
    cu = offsets.to(torch.int32)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * H * D * pairs(lens, causal)
    reps, loop = (3, 5) if quick else (7, 10)
    ours = lambda: pyattn.attention_varlen(q, k, v, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,  # noqa: E731
                                           causal=causal)
    t = harness.attempt(row, "pyattn", lambda: bench.gpu_ms(ours, loop=loop, reps=reps, label=f"pyattn {name}"))
    if t is not None:
        row["pyattn_ms"], row["pyattn_tflops"] = t.ms, flops / t.ms / 1e9
        out = harness.to_torch(ours())
    nested = [torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (q, k, v)]
    for be in ("fa2", "cudnn"):
        run = harness.sdpa(torch, be, *nested, is_causal=causal)
        tt = harness.attempt(row, be, lambda: bench.gpu_ms(run, loop=loop, reps=reps, label=f"{be} {name}"))
        if tt is not None:
            row[f"{be}_ms"], row[f"x_{be}"] = tt.ms, tt.ms / row["pyattn_ms"] if "pyattn_ms" in row else None
            if t is not None:
                ref = run().transpose(1, 2).values()
                row[f"diff_{be}"] = (out.float() - ref.float()).abs().max().item()
    checked = lambda: pyattn.attention_varlen(q, k, v, cu, cu, causal=causal)  # noqa: E731
    for label, fn in (("host_unchecked_us", ours), ("host_checked_us", checked)):
        row[label] = harness.attempt(row, label, lambda: bench.wall_ms(fn, loop=loop, reps=reps) * 1e3)
    row["flagged"] = any(row.get(f"diff_{be}", 0) > TOL for be in ("fa2", "cudnn"))
    return row


def main() -> int:
    args = harness.parser(__doc__).parse_args()
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 0
    result = {"env": harness.environment(bench), "t0": time.perf_counter(), "rows": []}
    print(harness.env_line(result["env"]))
    for name, lens in batches(args.quick).items():
        for causal in (False, True):
            row = run_batch(bench, name, lens, causal, args.quick)
            result["rows"].append(row)
            print(f"  {name} {'causal' if causal else 'full'}: pyattn {harness.fmt(row.get('pyattn_ms'), '.3f')} ms "
                  f"({harness.fmt(row.get('pyattn_tflops'), '.0f')} TFLOP/s), FA2 {harness.fmt(row.get('fa2_ms'), '.3f')}, "
                  f"cuDNN {harness.fmt(row.get('cudnn_ms'), '.3f')}", flush=True)
    rows = [(f"{r['batch']} ({r['seqs']} seqs, {r['tokens']} tokens, longest {r['max']})",
             "causal" if r["causal"] else "full", harness.fmt(r.get("pyattn_ms"), ".3f"),
             harness.fmt(r.get("pyattn_tflops"), ".0f"), harness.fmt(r.get("fa2_ms"), ".3f"),
             harness.fmt(r.get("x_fa2"), ".2f"), harness.fmt(r.get("cudnn_ms"), ".3f"), harness.fmt(r.get("x_cudnn"), ".2f"),
             harness.fmt(r.get("diff_fa2"), ".1e") + (" FLAGGED" if r["flagged"] else ""),
             harness.fmt(r.get("host_unchecked_us"), ".0f"), harness.fmt(r.get("host_checked_us"), ".0f"))
            for r in result["rows"]]
    print("\n".join(harness.md_table(
        "\n== attention_varlen, bf16, H 16, D 128 (GPU ms a call; x = torch / pyattn; host: wall us a call in a loop)",
        ("batch", "mask", "pyattn ms", "TFLOP/s", "FA2 ms", "x FA2", "cuDNN ms", "x cuDNN", "max diff vs FA2",
         "host us, maxima given", "host us, checked"), rows)))
    failures = sum("pyattn_ms" not in r or r["flagged"] for r in result["rows"])
    return harness.end_run(bench, result, args.json, failures)


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: attn_fwd_tma with persistent blocks (one an SM walking the query tiles) against the
same rows launching a block per query tile, on the prefill benchmark's shapes (batch = 16k / S,
hidden 2048), with cuDNN in the run.

Usage: PYTHONPATH=. python dev/probe_persist.py [--dims 64 128 256] [--seqlens 1024 4096 16384]
       [--dtype bfloat16] [--d64-from 0]

For each shape: ms with attn_fwd_tma's table as it is, with every row's ``persistent`` off
(``override_tiles``), SDPA cuDNN's ms, and the largest difference between the two outputs.
``--d64-from N`` also times the d=64 row from N keys (its ``min_keys``; below it d=64 runs the
cp.async kernel), persistent and not.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="*", default=[1024, 4096, 16384])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--d64-from", type=int, default=None)
    args = ap.parse_args()
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    tdt = getattr(torch, args.dtype)
    rows = tile_table("attn_fwd_tma", "sm_90a")
    variants = {"table": rows, "per-tile": tuple(r._replace(persistent=False) for r in rows)}
    if args.d64_from is not None:
        d64 = tuple(r._replace(min_keys=args.d64_from) if r.max_head_dim == 64 else r for r in rows)
        variants["d64 persist"] = tuple(r._replace(persistent=True) if r.max_head_dim == 64 else r for r in d64)
        variants["d64 per-tile"] = tuple(r._replace(persistent=False) if r.max_head_dim == 64 else r for r in d64)
    names = list(variants)
    print(f"{'shape':34} " + " ".join(f"{n:>12}" for n in names) + f" {'cuDNN':>8} | per-tile/table  x cuDNN  "
          "TFLOP/s  maxdiff", flush=True)
    for D in args.dims:
        for S in args.seqlens:
            for causal in (False, True):
                B, H = max(1, 16384 // S), 2048 // D
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                g = torch.Generator(device="cuda").manual_seed(0)
                ts = [torch.randn(B, S, H, D, device="cuda", dtype=tdt, generator=g) for _ in range(3)]
                xs = [harness.to_pyattn(t, bench.stream) for t in ts]
                fn = lambda: pyattn.attention(*xs, causal=causal, stream=bench.stream)  # noqa: E731
                ms, outs = {}, {}
                for name in names:
                    with override_tiles("attn_fwd_tma", "sm_90a", variants[name]):
                        ms[name] = bench.gpu_ms(fn, loop=10, reps=5).ms
                        outs[name] = harness.to_torch(fn()).float()
                diff = max((outs[n] - outs["table"]).abs().max().item() for n in names)
                f = harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts), is_causal=causal)
                try:
                    cudnn = bench.gpu_ms(f, loop=10, reps=5).ms
                except Exception:  # noqa: BLE001
                    cudnn = float("nan")
                t = ms["table"]
                print(f"{args.dtype[:4]} d{D} S{S} B{B} H{H} {'causal' if causal else '      '} "
                      + " ".join(f"{ms[n]:12.3f}" for n in names) + f" {cudnn:8.3f} | "
                      f"{ms['per-tile'] / t:13.3f}x {cudnn / t:7.3f}x {flops / t / 1e9:7.0f}  {diff:.1e}", flush=True)
                del ts, xs, outs
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: what the persistent prefill's last, partial round of query tiles costs.

Usage: PYTHONPATH=. python dev/probe_tail_rounds.py [--shapes B:S:H:D,...] [--causal] [--cudnn] [--rounds 3]

Times pyattn (and torch SDPA's cuDNN backend with ``--cudnn``) on bf16 shapes whose query-tile
counts (128-row tiles at d = 128) fill whole rounds of the GPU's SMs or leave a part of a round,
and prints each call's time per (query tile x key). Without a rounding loss that figure would be
one for every shape of a head dim and key count; a shape that runs 15.5 rounds as 16 pays up to
1 / 16 more. The shapes and backends are timed in ``--rounds`` passes, every other pass in reverse
order, each keeping its best (the GPU slows as it heats: a single pass favours the first shapes).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402

SHAPES = "4:4096:16:128,6:4096:11:128,4:4096:17:128,1:16384:16:128,1:16896:16:128,2:16384:9:128"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cudnn", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-m", type=int, default=128)
    args = ap.parse_args()
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 0
    torch, sms = bench.torch, bench.device.sm_count
    cases, best = [], {}
    for spec in args.shapes.split(","):
        B, S, H, D = map(int, spec.split(":"))
        g = torch.Generator(device="cuda").manual_seed(0)
        ts = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        xs = [harness.to_pyattn(t, bench.stream) for t in ts]
        fns = {"pyattn": lambda xs=xs: pyattn.attention(*xs, stream=bench.stream, causal=args.causal)}
        if args.cudnn:
            fns["cudnn"] = harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts), is_causal=args.causal)
        cases += [((B, S, H, D), name, fn) for name, fn in fns.items()]
    for _, (shape, name, fn) in harness.alternating(cases, args.rounds):
        ms = bench.gpu_ms(fn, loop=20, reps=5).ms
        best[shape, name] = min(ms, best.get((shape, name), ms))
    for shape in dict.fromkeys(s for s, _, _ in cases):
        B, S, H, D = shape
        tiles = B * H * -(-S // args.block_m)
        row = [f"{B}x{S}x{H}x{D}", f"tiles {tiles} rounds {tiles / sms:.2f}"]
        for (s, name), ms in best.items():
            if s == shape:
                row.append(f"{name} {ms * 1e3:.1f} us ({ms * 1e9 / (tiles * S):.3f} ps/tile-key)")
        print(" | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: what the persistent prefill's last, partly filled round costs (issue 15, N >= 4k).

The persistent attn_fwd_tma rows at d = 128 / 256 walk units of one 128-row query block against
all keys, gridDim.x = 132 blocks a round. The benchmark's shapes (batch 16k / S, hidden 2048) give
2048 units at d = 128 (15.5 rounds) and 1024 at d = 256 (7.8): if a unit's time is the same
everywhere, the last round's idle blocks cost up to half a round. This times (1, 4096, H, d) bf16
non-causal calls for head counts H whose units straddle round boundaries (32 units a head at 4k:
H = 62 -> 1984 units, 15.03 rounds; 66 -> 2112, 16.0) against torch SDPA cuDNN on the same
inputs, so that ms per round (ceil) and ms per unit can be compared: if time follows rounds, a
scheduler that splits the last round's units along the keys (stream-K) would gain up to
(ceil(r) - r) / ceil(r).

Usage: PYTHONPATH=. python dev/probe_rounds.py [--heads 60,62,64,66] [--dims 128,256] [--seq 4096]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="28,30,31,32,33,34,60,62,64,66,68")
    ap.add_argument("--dims", default="128,256")
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    sms = bench.device.sm_count
    S = args.seq
    res: dict = {}
    cases = [(d, h) for d in map(int, args.dims.split(",")) for h in map(int, args.heads.split(","))]
    for _, (d, h) in harness.alternating(cases, 3):  # the best of each case's rounds
        g = torch.Generator(device="cuda").manual_seed(0)
        ts = [torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        xs = [harness.to_pyattn(t, bench.stream) for t in ts]
        ms = bench.gpu_ms(lambda: pyattn.attention(*xs, stream=bench.stream), loop=10, reps=5).ms  # noqa: B023
        cu = bench.gpu_ms(harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts)), loop=10, reps=5).ms
        for key, t in (((d, h, "pyattn"), ms), ((d, h, "cudnn"), cu)):
            res[key] = min(res.get(key, 1e9), t)
    print(f"(1, {S}, H, d) bf16 non-causal, {sms} SMs, units of 128 query rows; ms (best of 3 rounds)")
    for d, h in cases:
        units = h * math.ceil(S / 128)
        rounds = units / sms
        p, c = res[(d, h, "pyattn")], res[(d, h, "cudnn")]
        print(f"d {d} H {h:3d}: units {units:5d} = {rounds:6.2f} rounds | pyattn {p:.4f} ms, "
              f"{p / math.ceil(rounds) * 1e3:.2f} us a round, {p / units * 1e3:.3f} us a unit | "
              f"cuDNN {c:.4f} ms, {c / units * 1e3:.3f} us a unit | x cuDNN {c / p:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

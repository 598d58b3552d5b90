"""Dev probe (GPU): a decode call's fixed cost, the kernel's own time against the time per call (issue 12).

Per-call GPU time of back-to-back decodes is linear in the bytes read with a fixed part of 10-14 us
(bench_quant, thirty-second session: int8 B1 x 32k 33.3 us, B8 x 32k 147.2 for 8x the bytes), which
is what keeps B1 / B8 of the 8-bit caches under 1.8x the bf16 cache and bf16 B1 under cuDNN. This
splits it: per point (``kind:BxL``, Hq 32, Hkv 8, D 128, page 16, q_len 1 or ``--qlen``) the GPU us per call at
the automatic split count and at ``--splits``, beside the GPU us per call of torch's smallest
kernel (one element's add: the floor of a launch back to back); ``--between``: also each decode
behind such an add, a predecessor that is no programmatic-launch primary (the TMA decode launches
as its stream's previous kernel's dependent: kernels_src/pdl.cuh). Data under the L2's size stays
there between calls (no replicas, unlike bench_quant: this is about latency). Under Nsight
Compute (``--ncu``: each point's decode three times, untimed) ``gpu__time_duration`` gives the
kernel's own time:

    ncu --clock-control none -k regex:attn_decode --metrics gpu__time_duration.sum,sm__cycles_active.avg \\
        python dev/probe_decode_fixed.py --ncu

    PYTHONPATH=. python dev/probe_decode_fixed.py [--points bf16:1x1024,int8:1x1024,...] [--splits 1,8] [--between]
                                                  [--qlen 4]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "scripts")
import harness  # noqa: E402
import quant_caches as qc  # noqa: E402

import pyattn  # noqa: E402

POINTS = "bf16:1x1024,int8:1x1024,bf16:1x4096,int8:1x4096,bf16:1x32768,int8:1x32768,int8:8x4096,int8:8x32768"


def decode_point(bench, point: str, q_len: int = 1) -> tuple:
    """Point ``kind:BxL`` -> (its cache filled as bench_quant fills it, the sequence ids, a bf16 q of
    (B, 1, Hq, D) on the bench's stream, B, L, kind). dev/probe_decode_timeline.py uses it too."""
    kind, shape = point.split(":")
    B, L = (int(v) for v in shape.split("x"))
    cache, seqs = qc.new_cache(kind, B, L)
    qc.fill(bench, cache, seqs, L, 1)
    q = pyattn.asarray(torch.randn(B, q_len, qc.HQ, qc.D, device="cuda", dtype=torch.bfloat16), stream=bench.stream)
    return cache, seqs, q, B, L, kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--splits", default="1,8", help="forced split counts timed beside the automatic one")
    ap.add_argument("--ncu", action="store_true", help="each point's decode 3 times, untimed (run under ncu)")
    ap.add_argument("--qlen", type=int, default=1, help="query tokens a sequence (GQA 4: 4 x q_len rows a KV head)")
    ap.add_argument("--between", action="store_true",
                    help="also time each decode behind torch's one-element add (a predecessor that is no "
                         "programmatic-launch primary: what a decode after a framework's kernel sees)")
    args = ap.parse_args()
    bench = harness.Bench(torch)
    us = lambda fn: bench.gpu_ms(fn, loop=40, reps=7).ms * 1e3  # noqa: E731
    x = torch.zeros(1, device="cuda")  # (torch queues on the bench's stream: harness.Bench)
    add = us(lambda: x.add_(1)) if not args.ncu else 0.0
    if not args.ncu:
        print(f"torch one-element add, back to back: {add:.2f} us per call", flush=True)
    for point in args.points.split(","):
        cache, seqs, q, B, L, kind = decode_point(bench, point, args.qlen)
        call = lambda n=None: pyattn.decode(q, cache, seqs, num_splits=n, stream=bench.stream)  # noqa: E731
        if args.ncu:
            for _ in range(3):
                call()
            bench.sync()
            print(f"{point}: 3 calls", flush=True)
        else:
            cells = [f"auto {us(call):.1f}"]
            cells += [f"splits {n} {us(lambda: call(n)):.1f}" for n in (int(v) for v in args.splits.split(",") if v)]
            if args.between:
                behind = us(lambda: (x.add_(1), call()))
                cells.append(f"behind an add {behind:.1f} (minus the add's {add:.1f}: {behind - add:.1f})")
            mb = qc.read_bytes(B, L, kind) / 1e6
            print(f"{point} ({mb:.1f} MB): GPU us per call: " + ", ".join(cells), flush=True)
        cache = seqs = q = None
        qc.drop(bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())

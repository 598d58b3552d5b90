"""Dev probe (GPU): contiguous_decode's view page against a PagedKVCache's page 16 (issue 12).

    PYTHONPATH=. python dev/probe_contiguous.py [--views 16,64,128,256,0] [--points 1x4096,8x32768]
                                                [--rounds 2]

bf16 GQA 32/8 D 128, q_len 1. Per point: ``pyattn.decode`` over a page-16 PagedKVCache, then
``pyattn.contiguous_decode`` over contiguous (B, L, Hkv, D) caches with one int length, once per
``pyattn.ops._contiguous.VIEW_PAGE`` in ``--views`` (0: no cap, one page a sequence when L is a
power of two), and the same with ragged NumPy lengths (the longest L, the others L/2: the upload
path), and with one int length L - 1 and one new token a sequence written by the call (``k_new`` /
``v_new``: a decode step's append and attention; the token already at L - 1 in the first replica).
GPU us through ``harness.Bench.gpu_ms`` (caches replicated past 4x the L2, calls rotating),
``--rounds`` alternating rounds, each figure the round's; outputs checked against the first view's.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

sys.path.insert(0, "scripts")
import harness  # noqa: E402

import pyattn  # noqa: E402
import pyattn.ops._contiguous as contiguous  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--views", default="16,64,128,256,0")
    ap.add_argument("--points", type=harness.batch_lengths, default="1x4096,1x32768,8x4096,8x32768,64x4096,64x32768")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    bench, views = harness.Bench(torch), [int(x) for x in args.views.split(",")]
    for B, L in args.points:
        n_rep, g, k, v = harness.random_kv(bench, B, L, HKV, D)
        q = harness.to_pyattn(torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g), bench.stream)
        # one new token a sequence, written at position L - 1 (the token already there: the output is the same)
        kn, vn = (harness.to_pyattn(x[:B, L - 1:L].contiguous(), bench.stream) for x in (k, v))
        kd, vd = (harness.to_pyattn(x, bench.stream) for x in (k, v))
        reps = harness.replica_views((kd, vd), B, n_rep)
        caches = harness.paged_replicas(bench, k, v, B, n_rep, 16, 4096)
        ragged = np.full(B, L // 2, np.int32)
        ragged[0] = L
        for rnd in range(args.rounds):
            cells = []
            t = bench.gpu_ms([lambda c=c, i=i: pyattn.decode(q, c, i, stream=bench.stream) for c, i in caches],
                             loop=10, reps=3)
            cells.append(f"p16 cache {t.ms * 1e3:.1f}")
            first = None
            for view in (views if rnd % 2 == 0 else views[::-1]):
                contiguous.VIEW_PAGE = view or (1 << 30)
                for name, lens in (("int", L), ("ragged", ragged), ("int + k_new", L - 1)):
                    new = dict(k_new=kn, v_new=vn) if name == "int + k_new" else {}
                    fns = [lambda kv=kv, n=lens, new=new: pyattn.contiguous_decode(q, *kv, n, stream=bench.stream,
                                                                                   **new) for kv in reps]
                    t = bench.gpu_ms(fns, loop=10, reps=3)
                    out = harness.to_torch(fns[0]()).float()
                    first = out if first is None and name == "int" else first
                    err = (out - first).abs().max().item() if name != "ragged" else float("nan")
                    cells.append(f"v{view or 'L'} {name} {t.ms * 1e3:.1f}" + (f" (d {err:.0e})" if err > 0 else ""))
            contiguous.VIEW_PAGE = 128
            print(f"B{B} x {L} round {rnd}: " + ", ".join(cells), flush=True)
        del caches, reps, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

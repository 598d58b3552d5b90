"""Dev probe (GPU): does a head's page laid out contiguously (HND) stream faster than NHD? (issue 12)

    PYTHONPATH=. python dev/probe_decode_layout.py [--points 1x32768,8x32768,64x4096,64x32768]
                                                   [--views 16,128] [--rounds 2]

bf16 GQA 32/8 D 128, q_len 1. Per point, GPU us of: ``pyattn.decode`` over a page-16 PagedKVCache
(pages (page, slot, head, dim): a head's page is 16 rows of 256 bytes, 2 KB apart);
``pyattn.contiguous_decode`` over (B, L, Hkv, D) caches ("nhd", the same strides) and over
(B, Hkv, L, D) caches ("hnd": a head's 16-slot page is one 4 KB run), at each view page in
``--views``; and torch SDPA's cuDNN backend over (B, Hkv, L, D) in the same round. Caches
replicated past 4x the L2 (calls rotating), rounds alternating the order; outputs checked against
the page-16 cache's.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "scripts")
import harness  # noqa: E402

import pyattn  # noqa: E402
import pyattn.ops._contiguous as contiguous  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=harness.batch_lengths, default="1x32768,8x32768,64x4096,64x32768")
    ap.add_argument("--views", default="16,128")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    bench, views = harness.Bench(torch), [int(x) for x in args.views.split(",")]
    for B, L in args.points:
        n_rep, g, k, v = harness.random_kv(bench, B, L, HKV, D)
        kh, vh = (x.transpose(1, 2).contiguous() for x in (k, v))  # (n_rep B, Hkv, L, D)
        qt = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q = harness.to_pyattn(qt, bench.stream)
        nhd = harness.replica_views([harness.to_pyattn(x, bench.stream) for x in (k, v)], B, n_rep)
        hnd = harness.replica_views([harness.to_pyattn(x, bench.stream) for x in (kh, vh)], B, n_rep)
        caches = harness.paged_replicas(bench, k, v, B, n_rep, 16, 4096)
        ref = harness.to_torch(pyattn.decode(q, *caches[0], stream=bench.stream)).float()
        qs = qt.transpose(1, 2)
        sdpa = [harness.sdpa(torch, "cudnn", qs, kh[r * B:(r + 1) * B], vh[r * B:(r + 1) * B], enable_gqa=True)
                for r in range(n_rep)]
        cases = [("p16 cache", [lambda c=c, i=i: pyattn.decode(q, c, i, stream=bench.stream) for c, i in caches],
                  None)]
        for view in views:
            for name, kvs, lay in (("nhd", nhd, "nhd"), ("hnd", hnd, "hnd")):
                cases.append((f"{name} v{view}", [lambda kv=kv, lay=lay: pyattn.contiguous_decode(
                    q, *kv, L, layout=lay, stream=bench.stream) for kv in kvs], view))
        for rnd in range(args.rounds):
            cells = []
            torch.cuda.synchronize()
            t = bench.gpu_ms(sdpa, loop=10, reps=3)
            cells.append(f"cuDNN {t.ms * 1e3:.1f}")
            for name, fns, view in (cases if rnd % 2 == 0 else cases[::-1]):
                contiguous.VIEW_PAGE = view or 128
                t = bench.gpu_ms(fns, loop=10, reps=3)
                err = (harness.to_torch(fns[0]()).float() - ref).abs().max().item()
                cells.append(f"{name} {t.ms * 1e3:.1f}" + (f" (d {err:.0e})" if err > 1e-2 else ""))
            contiguous.VIEW_PAGE = 128
            print(f"B{B} x {L} round {rnd}: " + ", ".join(cells), flush=True)
        del caches, nhd, hnd, k, v, kh, vh, sdpa
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

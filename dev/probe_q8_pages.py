"""Dev probe (GPU): decode time against the cache's page size, per cache kind (issues 12, 13).

    PYTHONPATH=. python dev/probe_q8_pages.py [--kinds int8,fp8,int8c,bf16] [--pages 16,32,64,128]
                                              [--points 64x32768,8x32768] [--qlen 1,3]

Times ``pyattn.decode`` over PagedKVCaches filled as ``scripts/bench_quant.py`` fills them (random bf16
K/V appended from torch; Hq 32, Hkv 8, D 128) at each page size (``quant_caches.PAGE`` set before
``new_cache``), bf16 queries of each ``--qlen`` (1: the swapped-role blocks for GQA 4; 3: 12 rows, the
m16 ones), GPU us through ``harness.Bench.gpu_ms``. Found with it (BENCHMARKS.md, thirty-fifth
session): the per-token 8-bit kernels lost 10-14% at B64 x 32k from pages of 32 on; the thirty-sixth
traced that to the pool maps' 256-byte L2 promotion and the slot-major scale pools (page 128 now
2-3% behind page 16).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "scripts")
import harness  # noqa: E402
import quant_caches as qc  # noqa: E402

import pyattn  # noqa: E402


def time_page(bench, kind: str, B: int, L: int, page: int, queries: dict) -> list:
    """GPU us of one decode per query length over a fresh ``kind`` cache of pages of ``page`` slots."""
    qc.PAGE = page
    cache, seqs = qc.new_cache(kind, B, L)
    qc.fill(bench, cache, seqs, L, 1)
    return [bench.gpu_ms(lambda q=q: pyattn.decode(q, cache, seqs, stream=bench.stream), loop=10, reps=3).ms * 1e3
            for q in queries.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="int8,fp8,int8c,bf16")
    ap.add_argument("--pages", default="16,32,64,128")
    ap.add_argument("--points", type=harness.batch_lengths, default="64x32768,8x32768")
    ap.add_argument("--qlen", default="1", help="comma list of query tokens a sequence")
    args = ap.parse_args()
    bench = harness.Bench(torch)
    for B, L in args.points:
        queries = {ql: pyattn.asarray(torch.randn(B, ql, qc.HQ, qc.D, device="cuda", dtype=torch.bfloat16),
                                      stream=bench.stream) for ql in (int(x) for x in args.qlen.split(","))}
        for kind in args.kinds.split(","):
            cells = []
            for page in (int(x) for x in args.pages.split(",")):
                us = time_page(bench, kind, B, L, page, queries)
                torch.cuda.empty_cache()
                cells += [f"p{page}" + (f" q_len {ql}" if len(queries) > 1 else "") + f" {t:.1f}"
                          for ql, t in zip(queries, us)]
            print(f"B{B} x {L} {kind}: " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

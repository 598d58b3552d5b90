"""Dev probe (GPU): ``pyattn.decode`` over caches of small pages (gathered rows or the cp.async kernel).

    PYTHONPATH=. python dev/probe_small_pages.py [--points 8x32768,1x32768,64x4096] [--pages 1,8,16]
                                                 [--rows 16x4x2x3,...] [--q-len 1] [--cache int8]
                                                 [--head-dim 128]

Hq 32, Hkv 8, D 128 (``--head-dim``), random bf16 K/V appended from torch (as ``scripts/bench_quant.py`` fills its
caches); GPU us per call behind a pre-roll (``harness.Bench.gpu_ms``) and TB/s of K + V (of their
codes and scales for an 8-bit cache). On sm_90a pages of 16 and more take the TMA kernels' page
boxes; smaller or odd pages the same kernels with their producers gathering the rows
(``KernelSpec.gather``: 8-bit caches, and 16-bit ones up to 8 query rows a KV head), else (and on
every other arch) attn_decode, the cp.async kernel; this probe times their page-table reads.
``--rows KEYSxWARPSxSTAGESxBLOCKS,...``: the same calls again with each of these in the d <= 128
row of attn_decode's 16-bit table (which takes small pages at more than 8 rows: ``--q-len 3`` and
up), alternating with the table as it is (two rounds); ``--q-len``: query tokens a sequence
(speculative rows); ``--cache``: the cache's dtype (``int8`` or ``fp8_e4m3``; not with ``--rows``).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "scripts")
import harness  # noqa: E402

import pyattn  # noqa: E402
from _rows import decode_rows  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402

HQ, HKV, CHUNK = 32, 8, 2048


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=harness.batch_lengths, default="8x32768,1x32768,64x4096")
    ap.add_argument("--pages", default="1,8,16")
    ap.add_argument("--rows", default="")
    ap.add_argument("--q-len", type=int, default=1)
    ap.add_argument("--cache", default="bfloat16")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    D = args.head_dim
    if args.rows and args.cache != "bfloat16":
        ap.error("--rows tunes the 16-bit table: not with an 8-bit --cache")
    bench = harness.Bench(torch)
    variants = {"table": tile_table("attn_decode", "sm_90a"), **decode_rows(args.rows)}
    for B, L in args.points:
        q = pyattn.asarray(torch.randn(B, args.q_len, HQ, D, device="cuda", dtype=torch.bfloat16),
                           stream=bench.stream)
        cells = []
        size = 2 if args.cache == "bfloat16" else 1  # bytes a K or V element
        for ps in (int(x) for x in args.pages.split(",")):
            cache = pyattn.PagedKVCache(B * -(-L // ps) + 8, ps, HKV, D, args.cache)
            ids = [cache.add_sequence() for _ in range(B)]
            for t0 in range(0, L, CHUNK):
                k, v = (torch.randn(B, min(CHUNK, L - t0), HKV, D, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
                cache.append(ids, harness.to_pyattn(k, bench.stream), harness.to_pyattn(v, bench.stream),
                             stream=bench.stream)
            best: dict = {}
            for _ in range(2 if len(variants) > 1 else 1):
                for name, rows in variants.items():
                    with override_tiles("attn_decode", "sm_90a", rows):
                        fn = lambda: pyattn.decode(q, cache, ids, stream=bench.stream)  # noqa: E731
                        best[name] = min(best.get(name, 1e9), bench.gpu_ms([fn], loop=10, reps=5).ms * 1e3)
            for name, us in best.items():
                cells.append(f"page {ps}{'' if len(variants) == 1 else ' ' + name}: {us:.1f} us "
                             f"{B * L * HKV * (D * 2 * size + (8 if size == 1 else 0)) / us / 1e6:.2f} TB/s")
            del cache
            torch.cuda.empty_cache()
        print(f"B{B} x {L}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

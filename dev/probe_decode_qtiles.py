"""Dev probe (GPU): the TMA decode with more than 16 query rows per KV head (q_tiles = 2).

On sm_90a attn_decode_tma's two-row-tile variant (32 rows: a GQA group of 4 x q_len 8, or 8 x 4)
is capped at 168 registers (10 warps an SM) and spills; this times it against the alternatives
the d <= 128 row allows (``override_tiles`` on attn_decode_tma's "dense" table): one row tile a
block (``max_q_tiles`` 1: the K/V read once per 16 rows), and one block an SM (``min_blocks`` 1: no
register cap below 255). bf16 PagedKVCaches filled as ``scripts/bench_quant.py`` fills them; Hq 32,
Hkv 8, D 128, page 16; q_len 1 and 4 beside as controls. ``--producers 1,2,3`` times the table's row
at those producer-warp counts instead (both TMA decodes' tables: q_len 1 takes the swapped-role
blocks), in order, ``--rounds`` times over.

    PYTHONPATH=. python dev/probe_decode_qtiles.py [--points 8x32768,64x4096] [--qlens 1,4,8]
                                                   [--producers 1,2,3 [--rounds 2]]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

sys.path.insert(0, "scripts")
import bench_quant as bq  # noqa: E402
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=harness.batch_lengths, default="8x32768,64x4096,1x32768")
    ap.add_argument("--qlens", default="1,4,8")
    ap.add_argument("--producers", default="", help="producer-warp counts to time the row at instead")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    bench = harness.Bench(torch)
    base = tile_table("attn_decode_tma", "sm_90a", "dense")
    variants = {"table": base[0], "max_q_tiles 1": base[0]._replace(max_q_tiles=1),
                "min_blocks 1": base[0]._replace(min_blocks=1)}
    if args.producers:
        variants = {f"producers {n}": base[0]._replace(producer=int(n)) for n in args.producers.split(",")}
    variants = [(name, row) for _ in range(args.rounds) for name, row in variants.items()]
    for B, L in args.points:
        cache = bq.new_cache("bf16", B, L)
        bq.fill(bench, *cache, L, 1)
        for q_len in (int(x) for x in args.qlens.split(",")):
            q = pyattn.asarray(torch.randn(B, q_len, bq.HQ, bq.D, device="cuda", dtype=torch.bfloat16),
                               stream=bench.stream)
            cells = []
            for name, row in variants:
                with contextlib.ExitStack() as rows:
                    for family in ("attn_decode_tma", "attn_decode_swap"):
                        rows.enter_context(override_tiles(family, "sm_90a", (row,) + base[1:], table="dense"))
                    t = bench.gpu_ms(lambda: pyattn.decode(q, *cache, stream=bench.stream), loop=20, reps=5).ms
                    cells.append(f"{name} {t * 1e3:.1f}")
            print(f"B{B} x {L}, q_len {q_len} ({q_len * bq.HQ // bq.HKV} rows a kv head): " + " | ".join(cells),
                  flush=True)
        del cache
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe (GPU): the TMA-fed 8-bit decode's rows for per-channel keys, and its split counts.

Times ``pyattn.decode`` over int8 PagedKVCaches filled as ``scripts/bench_quant.py`` fills them
(random bf16 K/V appended from torch), at Hq 32, Hkv 8, D 128, page 16:

* per-channel keys (``key_scales="channel"``) with each ``--channel`` row (keys per warp x stages,
  put in the sm_90a d <= 128 row of attn_decode_tma's "kv8" table through ``override_tiles``),
  beside per-token keys on the table as it is (the 10% target of issue 13);
* per-token keys at the forced split counts of ``--splits`` (0: the automatic choice), and with
  each ``--token`` row (keys per warp x warps x stages x blocks an SM, the row's fields);
* ``--family attn_decode_swap``: the rows of the swapped-role kernel (<= 8 query rows) instead.
A ``--channel`` row ``KxS`` may add ``xB``: the row's blocks an SM too; ``--channel-splits`` times each
at the ``--splits`` counts as well.

    PYTHONPATH=. python dev/probe_q8_rows.py [--points 1x32768,8x32768,64x32768] [--channel 32x2,16x3,16x4]
                                             [--splits 0,2,4,6,8,12] [--kind int8|fp8|bf16]
                                             [--family attn_decode_swap] [--token 32x4x2x3,16x4x4x3]
                                             [--channel-splits]
"""

from __future__ import annotations

import argparse
import sys

import torch  # noqa: F401  (bench_quant's fill makes K/V with it)

sys.path.insert(0, "scripts")
import bench_quant as bq  # noqa: E402
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=harness.batch_lengths, default="1x32768,8x32768,64x32768")
    ap.add_argument("--channel", default="32x2,16x3,16x4,16x2")
    ap.add_argument("--splits", default="0,2,4,6,8,12")
    ap.add_argument("--kind", default="int8", help="the per-token cache: int8, fp8 or bf16 (the split sweep's)")
    ap.add_argument("--family", default="attn_decode_tma", help="whose kv8 table the rows go into")
    ap.add_argument("--token", default="", help="per-token rows KWxWxSxB (keys per warp, warps, stages, blocks/SM)")
    ap.add_argument("--channel-splits", action="store_true", help="each --channel row at each --splits count too")
    args = ap.parse_args()
    bench = harness.Bench(torch)
    fam, table = args.family, "dense" if args.kind == "bf16" else "kv8"
    base = tile_table(fam, "sm_90a", table)
    for B, L in args.points:
        q = pyattn.asarray(torch.randn(B, 1, bq.HQ, bq.D, device="cuda", dtype=torch.bfloat16), stream=bench.stream)
        cells = []
        token = bq.new_cache(args.kind, B, L)
        bq.fill(bench, *token, L, 1)
        us = lambda fn: bench.gpu_ms(fn, loop=20, reps=5).ms * 1e3  # noqa: E731
        t_token = us(lambda: pyattn.decode(q, *token, stream=bench.stream))
        cells.append(f"{args.kind} per-token {t_token:.1f}")
        for splits in (int(x) for x in args.splits.split(",") if x):
            if splits:
                t = us(lambda: pyattn.decode(q, *token, num_splits=splits, stream=bench.stream))
                cells.append(f"splits {splits}: {t:.1f}")
        for row in filter(None, args.token.split(",")):
            kpw, w, st, mb = (int(x) for x in row.split("x"))
            rows = (base[0]._replace(keys_per_warp=kpw, warps=w, stages=st, min_blocks=mb),) + base[1:]
            with override_tiles(fam, "sm_90a", rows, table=table):
                t = us(lambda: pyattn.decode(q, *token, stream=bench.stream))
                cells.append(f"token {row}: {t:.1f}")
        del token
        chan = bq.new_cache(args.kind + "c", B, L) if args.kind != "bf16" and args.channel else None
        if chan is not None:
            bq.fill(bench, *chan, L, 1)
        for row in filter(None, args.channel.split(",") if args.kind != "bf16" else []):
            kpw, st, *mb = (int(x) for x in row.split("x"))
            rows = (base[0]._replace(channel=(kpw, st), min_blocks=mb[0] if mb else base[0].min_blocks),) + base[1:]
            with override_tiles(fam, "sm_90a", rows, table="kv8"):
                for splits in [0] + ([int(x) for x in args.splits.split(",") if x and int(x)]
                                     if args.channel_splits else []):
                    at = f" splits {splits}" if splits else ""
                    try:
                        t = us(lambda: pyattn.decode(q, *chan, num_splits=splits or None, stream=bench.stream))
                        cells.append(f"channel {row}{at}: {t:.1f} ({t_token / t:.3f}x per-token)")
                    except Exception as e:  # a row that does not fit: say so, go on
                        cells.append(f"channel {row}{at}: {type(e).__name__} {str(e)[:80]}")
        del chan
        print(f"B{B} x {L}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

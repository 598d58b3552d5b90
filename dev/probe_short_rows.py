"""Dev probe: attn_fwd_tma's d = 64 rows for calls of few keys, through ``override_tiles``: the table
as it is, one consumer warpgroup a block (two blocks an SM; persistent or a block a tile), and the
128-row row persistent, each checked against the table's output on odd shapes (GQA, Sq != Sk,
causal), then timed at S = 1k / 2k / 4k / 16k (bf16, batch 16k / S, 32 heads) with SDPA cuDNN.

Usage: PYTHONPATH=. python dev/probe_short_rows.py

The variants change the "dense" table's d = 64 row (``min_keys`` 0, so that they serve every call);
the "short" table the library uses is not overridden, so below its ``max_keys`` the table column
is the short row itself.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from _rows import time_shape  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    rows = tile_table("attn_fwd_tma", "sm_90a")
    short = tile_table("attn_fwd_tma", "sm_90a", table="short")

    def d64(**kw):
        return tuple(r._replace(**kw) if r.max_head_dim == 64 else r for r in rows)

    variants = {"table": rows, "1wg pers": d64(warpgroups=1, min_blocks=2, persistent=True, min_keys=0),
                "1wg tile": d64(warpgroups=1, min_blocks=2, persistent=False, min_keys=0),
                "2wg pers": d64(warpgroups=2, warpgroups_mods=0, persistent=True, min_keys=0)}
    no_short = tuple(r._replace(max_keys=0) for r in short)  # the variants above serve every call

    def run(name, fn):
        with override_tiles("attn_fwd_tma", "sm_90a", variants[name]):
            if name == "table":
                return fn()
            with override_tiles("attn_fwd_tma", "sm_90a", no_short, table="short"):
                return fn()

    for B, Sq, Sk, Hq, Hk, causal in [(2, 333, 1000, 4, 2, False), (1, 77, 3001, 8, 1, True), (3, 500, 500, 2, 2, True)]:
        g = torch.Generator(device="cuda").manual_seed(1)
        ts = [torch.randn(B, s, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)
              for s, h in ((Sq, Hq), (Sk, Hk), (Sk, Hk))]
        xs = [harness.to_pyattn(t, bench.stream) for t in ts]
        outs = {n: [harness.to_torch(x).float() for x in run(n, lambda: pyattn.attention(
            *xs, causal=causal, stream=bench.stream, return_lse=True))] for n in variants}
        diffs = {n: tuple(round((a - b).abs().max().item(), 4) for a, b in zip(o, outs["table"]))
                 for n, o in outs.items()}
        print(f"check B{B} Sq{Sq} Sk{Sk} causal={causal}: max |out|, |lse| difference to the table {diffs}")
    for S in (1024, 2048, 4096, 16384):
        for causal in (False, True):
            time_shape(bench, variants, run, f"S{S} {'causal' if causal else 'full  '}", max(1, 16384 // S), S, 32,
                       64, causal=causal)
    return 0


if __name__ == "__main__":
    sys.exit(main())

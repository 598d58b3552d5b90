"""Dev probe: prefill calls with few query tiles (one prompt of 32 heads at 1-4k, a small model's
(2, 2048, 8, 64)), where a persistent grid of causal pairs holds fewer units than the GPU has SMs.

Variants (``override_tiles`` on attn_fwd_tma's dense and short tables): "table" as it is; "tile":
every row's ``persistent`` off (a block a query tile, longest first); "wg1": the short table's
d = 64 row replaced by its one-warpgroup ``mods_row`` (64-row tiles, two blocks an SM); "wg1_any":
that row at any number of keys (the short table's limits lifted); "no_sg": the short rows'
``small_grid_rate`` 0 (no small-grid switch). Each shape bf16, timed beside
SDPA cuDNN (``_rows.time_shape``).

Usage: PYTHONPATH=. python dev/probe_small_grid.py [--shapes 1x1024x32x128,2x2048x8x64] [--variants table,wg1_any]
       [--causal 0,1]
"""

from __future__ import annotations

import sys

from _rows import harness, time_shape

from pyattn.kernels.families import override_tiles, tile_table

_SHAPES = "2x2048x8x64,1x1024x32x128,1x2048x32x128,1x4096x32x128,1x1024x32x64,1x2048x32x64,4x512x32x128"


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    arg = lambda name, default: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default  # noqa: E731
    shapes = [tuple(int(x) for x in s.split("x")) for s in arg("--shapes", _SHAPES).split(",")]
    names = arg("--variants", "table,tile,wg1,wg1_any").split(",")
    modes = [int(c) for c in arg("--causal", "1,0").split(",")]
    dense, short = tile_table("attn_fwd_tma", "sm_90a"), tile_table("attn_fwd_tma", "sm_90a", table="short")
    variants = {
        "tile": (tuple(r._replace(persistent=False) for r in dense),
                 tuple(r._replace(persistent=False) for r in short)),
        "wg1": (dense, tuple(r.mods_row._replace(max_keys=r.max_keys, max_keys_causal=r.max_keys_causal)
                             if r.mods_row else r for r in short)),
        # the tables without the small-grid switch (small_grid_rate 0: the rows as before it)
        "no_sg": (dense, tuple(r._replace(small_grid_rate=0) for r in short)),
        # the same row at any number of keys (the short table's limits lifted)
        "wg1_any": (dense, tuple(r.mods_row._replace(max_keys=1 << 30, max_keys_causal=1 << 30)
                                 if r.mods_row else r for r in short)),
    }

    def run(name, fn):
        if name == "table":
            return fn()
        d, s = variants[name]
        with override_tiles("attn_fwd_tma", "sm_90a", d), override_tiles("attn_fwd_tma", "sm_90a", s, table="short"):
            return fn()

    for B, S, H, D in shapes:
        for causal in (True, False):
            if int(causal) not in modes:
                continue
            time_shape(bench, names, run, f"B{B} S{S} H{H} d{D} causal={int(causal)}",
                       B, S, H, D, causal=causal)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: a "short" row for d = 128 (one consumer warpgroup, 64-key tiles, 2 stages with K and V on
barriers of their own, two blocks an SM: 81 KiB each; 3 stages would be 128 bytes over two blocks)
against the table's d = 128 row for calls of few keys, through ``override_tiles``: checked against
the fp64 reference on odd shapes, then timed at S = 1k / 2k / 4k
(bf16, batch 16k / S, 16 heads) with SDPA cuDNN in the same run.

Usage: PYTHONPATH=. python dev/probe_short_d128.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

from _rows import check, time_shape  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    short = tile_table("attn_fwd_tma", "sm_90a", table="short")
    base = short[0].mods_row or short[0]  # one warpgroup: the d = 64 short row's mods_row
    variants = {"table": None}
    for name, kw in (("1wg n64 s2kv pers", dict(block_n=64, stages=2, split_kv=True)),
                     ("1wg n64 s2kv tile", dict(block_n=64, stages=2, split_kv=True, persistent=False))):
        row = base._replace(max_head_dim=128, max_keys=1 << 30, max_keys_mods=0, **kw)
        variants[name] = tuple(short) + (row,)

    def run(name, fn):
        if variants[name] is None:
            return fn()
        with override_tiles("attn_fwd_tma", "sm_90a", variants[name], table="short"):
            return fn()

    bad = 0
    for B, Sq, Sk, Hq, Hk, causal in [(2, 333, 1000, 4, 2, False), (1, 77, 1500, 8, 1, True),
                                      (3, 500, 500, 2, 2, True)]:
        bad += check(bench, variants, run, (B, Sq, Sk, Hq, Hk, 128), causal=causal)
    for S in (1024, 2048, 4096):
        for causal in (False, True):
            time_shape(bench, variants, run, f"S{S} {'causal' if causal else 'full  '}", max(1, 16384 // S), S, 16,
                       128, causal=causal)
    print("checks:", "ok" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: d = 128 on wider key tiles (144 / 160 / 176 keys, FlashAttention-3's non-causal d = 128 tile
is 128 x 176) on a 2-stage ring with K and V on barriers of their own (``split_kv``), against the
table's row (128 keys, 3 stages), through ``override_tiles``. ``kernels_src/wgmma.cuh`` must have the
N = 144 / 160 / 176 shapes (``wgmma_header`` with them added) for the variants to compile. Each
variant is checked against the fp64 reference on odd shapes, then timed (bf16, batch 16k / S, 16
heads) with SDPA cuDNN in the same run, with and without a soft-cap.

Usage: PYTHONPATH=. python dev/probe_d128_wide.py
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
    rows = tile_table("attn_fwd_tma", "sm_90a")

    def d128(**kw):
        return tuple(r._replace(**kw) if r.max_head_dim == 128 else r for r in rows)

    variants = {"table": None}
    for bn in (176, 160, 144):
        variants[f"n{bn}"] = d128(block_n=bn, stages=2, split_kv=True)
    variants["n176 tile"] = d128(block_n=176, stages=2, split_kv=True, persistent=False)

    def run(name, fn):
        if variants[name] is None:
            return fn()
        with override_tiles("attn_fwd_tma", "sm_90a", variants[name]):
            return fn()

    bad = 0
    for B, Sq, Sk, Hq, Hk, causal, cap in [(2, 333, 1000, 4, 2, False, None), (1, 77, 3001, 8, 1, True, None),
                                          (3, 500, 500, 40, 40, True, 15.0), (1, 1000, 4999, 6, 3, False, 20.0)]:
        bad += check(bench, variants, run, (B, Sq, Sk, Hq, Hk, 128), causal=causal, softcap=cap)
    for S in (1024, 4096, 16384):
        for causal in (False, True):
            for cap in (None, 30.0):  # (cuDNN: without the soft-cap only)
                time_shape(bench, variants, run, f"S{S} {'causal' if causal else 'full  '} {'cap' if cap else '   '}",
                           max(1, 16384 // S), S, 16, 128, cudnn=cap is None, causal=causal, softcap=cap)
    print("checks:", "ok" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

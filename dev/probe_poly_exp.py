"""Dev probe: the soft-capped softmax's exp2s partly on the FMA pipe (attn_fwd_tma rows' ``poly_exp``:
of every 8 key pairs, that many through ``poly_exp2`` instead of the SFU, which the soft-cap's tanh
loads too). Each variant sets ``poly_exp`` and ``poly_exp_max`` (the bounded soft-cap's and the one
with a row max) on the rows of the BUCKETS head dims in the dense and short tables, is checked
against the fp64 reference on odd soft-capped bf16 shapes, then timed (batch 16k / S, hidden 2048)
with the same call's dense time beside it.

Usage: PYTHONPATH=. python dev/probe_poly_exp.py [--variants 0,2,3,4] [--buckets 64,128] [--no-check]
       [--dtype float16] [--sizes 4096,16384]

"table" is the library as it is; "eN" sets N on the rows (e0: every exp2 on the SFU).
"""

from __future__ import annotations

import sys

from _rows import check, harness, time_shape

from pyattn.kernels.families import override_tiles, tile_table


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    arg = lambda name, default: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default  # noqa: E731
    polys = [int(x) for x in arg("--variants", "0,2,3,4").split(",")]
    buckets = [int(x) for x in arg("--buckets", "64,128").split(",")]
    dense, short = tile_table("attn_fwd_tma", "sm_90a"), tile_table("attn_fwd_tma", "sm_90a", table="short")

    def set_poly(rows, n):
        return tuple(r._replace(poly_exp=n, poly_exp_max=n) if r.max_head_dim in buckets else r for r in rows)

    names = ["table"] + [f"e{n}" for n in polys]
    dtype = arg("--dtype", "bfloat16")
    sizes = [int(x) for x in arg("--sizes", "1024,4096,16384").split(",")]

    def run(name, fn):
        if name == "table":
            return fn()
        n = int(name[1:])
        with override_tiles("attn_fwd_tma", "sm_90a", set_poly(dense, n)), \
                override_tiles("attn_fwd_tma", "sm_90a", set_poly(short, n), table="short"):
            return fn()

    bad = 0
    if "--no-check" not in sys.argv:
        for D in buckets:
            for B, Sq, Sk, Hq, Hk, causal, cap in ((2, 333, 1000, 4, 2, False, 20.0), (1, 1000, 4999, 6, 3, True, 30.0),
                                                   (2, 4100, 4100, 2, 1, True, 0.5), (1, 77, 3001, 8, 1, False, 50.0)):
                bad += check(bench, names, run, (B, Sq, Sk, Hq, Hk, D), causal=causal, softcap=cap)
    for D in buckets:
        for S in sizes:
            for causal in (False, True):
                head = f"{dtype} d{D} S{S} causal={int(causal)}"
                time_shape(bench, ["table"], run, head + " dense", 16384 // S, S, 2048 // D, D, causal=causal,
                           dtype=dtype)
                time_shape(bench, names, run, head + " cap30", 16384 // S, S, 2048 // D, D, cudnn=False,
                           causal=causal, softcap=30.0, dtype=dtype)
    print("BAD" if bad else "checks ok")
    return bad


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: attn_fwd_tma's d = 64 rows with three consumer warpgroups (192 query rows a block, round-robin
GEMM turns) against the table's rows, through ``override_tiles``: each variant checked against the
fp64 reference on odd shapes (GQA, Sq != Sk, causal, a soft-cap), then timed at S = 1k / 2k / 4k /
16k (bf16, batch 16k / S, 32 heads) with SDPA cuDNN in the same run.

Usage: PYTHONPATH=. python dev/probe_d64_rows.py [--quick] [--sizes 2048,8192] [--causal] [--softcap]
       [--variants "3wg tile,3wg pers"] [--no-check]

``--causal`` times causal calls only; ``--softcap`` adds a soft-cap of 30 (no cuDNN then);
``--variants`` keeps the named ones (comma-separated); "3wg n64" is the dense row on the d = 64 mask
rows' tile (64-key tiles, 3 stages: what a float mask's call pays for its tile shape alone); "3wg s2"
the dense row on 2 stages of 128-key tiles, K and V split (what a 16-bit mask's 48 KiB tile a
stage leaves room for at three warpgroups).

"table" is the library as it is (the short row below 2048 keys, the dense row from there); the
other variants replace the "dense" table's d = 64 row with ``min_keys`` 0 and switch the short row
off, so they serve every call.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from _rows import check, time_shape  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    rows = tile_table("attn_fwd_tma", "sm_90a")
    short = tile_table("attn_fwd_tma", "sm_90a", table="short")

    def d64(**kw):
        return tuple(r._replace(**dict(dict(min_keys=0), **kw)) if r.max_head_dim == 64 else r for r in rows)

    variants = {"table": None, "2wg tile": d64(warpgroups=2, warpgroups_mods=0),
                "3wg tile": d64(warpgroups=3), "3wg pers": d64(warpgroups=3, persistent=True),
                "3wg pers s4": d64(warpgroups=3, persistent=True, stages=4),
                "3wg n64": d64(warpgroups=3, block_n=64, stage_bits=False),
                "3wg s2": d64(warpgroups=3, stages=2, split_kv=True, stage_bits=False)}
    # max_keys_causal zeroed where the tree has it (the probe also runs on trees from before it, A/B)
    no_short = tuple(r._replace(max_keys=0, **{f: 0 for f in ("max_keys_causal",) if f in r._fields}) for r in short)
    if "--variants" in sys.argv:
        keep = sys.argv[sys.argv.index("--variants") + 1].split(",")
        variants = {n: v for n, v in variants.items() if n in keep}

    def run(name, fn):
        if variants[name] is None:
            return fn()
        with override_tiles("attn_fwd_tma", "sm_90a", variants[name]), \
                override_tiles("attn_fwd_tma", "sm_90a", no_short, table="short"):
            return fn()

    bad = 0
    checks = [(2, 333, 1000, 4, 2, False, None), (1, 77, 3001, 8, 1, True, None), (3, 500, 500, 2, 2, True, None),
              (1, 1000, 4999, 6, 3, False, 20.0), (2, 4100, 4100, 2, 1, True, None)]
    for B, Sq, Sk, Hq, Hk, causal, cap in checks if "--no-check" not in sys.argv and "table" in variants else ():
        bad += check(bench, variants, run, (B, Sq, Sk, Hq, Hk, 64), causal=causal, softcap=cap)
    sizes = (1024, 4096) if "--quick" in sys.argv else (1024, 2048, 4096, 16384)
    if "--sizes" in sys.argv:
        sizes = tuple(int(x) for x in sys.argv[sys.argv.index("--sizes") + 1].split(","))
    cap = dict(softcap=30.0) if "--softcap" in sys.argv else {}
    for S in sizes:
        for causal in (True,) if "--causal" in sys.argv else (False, True):
            time_shape(bench, variants, run, f"S{S} {'causal' if causal else 'full  '}{' softcap' if cap else ''}",
                       max(1, 16384 // S), S, 32, 64, causal=causal, cudnn=not cap, **cap)
    if "--mods" in sys.argv:
        mods_rows(bench, d64)
    print("checks:", "all within 2x the table's error" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


def mods_rows(bench, d64) -> None:
    """Score modifiers on two or three warpgroups (``warpgroups_mods`` 3 forces the spilling row
    on a mask tensor or ALiBi), with the dense time of the same row, at 4k and 16k."""
    torch = bench.torch
    rows = {"2wg": d64(warpgroups=2, warpgroups_mods=0), "3wg": d64(warpgroups=3, warpgroups_mods=3)}
    for S in (4096, 16384):
        B, H = max(1, 16384 // S), 32
        g = torch.Generator(device="cuda").manual_seed(0)
        ts = [torch.randn(B, S, H, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        xs = [harness.to_pyattn(t, bench.stream) for t in ts]
        bits = torch.rand(S, S, device="cuda", generator=g) < 0.5
        slopes = torch.rand(H, device="cuda", generator=g) * 0.1
        mask = harness.to_pyattn(bits, bench.stream)
        sl = harness.to_pyattn(slopes, bench.stream)
        cases = {"dense": {}, "softcap": dict(softcap=30.0), "bool mask": dict(mask=mask),
                 "alibi": dict(alibi_slopes=sl), "causal softcap": dict(causal=True, softcap=30.0)}
        line = []
        for name, kw in cases.items():
            best = {}
            for _ in range(2):
                for rn, r in rows.items():
                    with override_tiles("attn_fwd_tma", "sm_90a", r):
                        fn = lambda: pyattn.attention(*xs, stream=bench.stream, **kw)  # noqa: E731
                        best[rn] = min(best.get(rn, 1e9), bench.gpu_ms(fn, loop=10, reps=5).ms)
            line.append(f"{name} " + "/".join(f"{best[rn]:.3f}" for rn in rows))
        print(f"mods S{S} (2wg/3wg ms): " + " | ".join(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: attn_fwd_tma with K and V on barriers of their own (``split_kv``: overlap and ping-pong
on a 2-stage ring) against the table's rows, through ``override_tiles``: d = 192 / 256 (2 stages
without overlap in the table until this probe's run: they have taken split_kv since), d = 128 (3
stages with overlap), and d = 128 with a bf16 mask tile (the "mask2" table: 2 stages, no overlap). Each variant is first checked against the fp64 reference on
odd shapes (GQA, Sq != Sk, causal, a soft-cap, a float mask), then timed (bf16, batch 16k / S,
hidden 2048; SDPA cuDNN in the same run; the masked case against the dense time).

Usage: PYTHONPATH=. python dev/probe_split_kv.py [--quick]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from _rows import check, time_shape  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def _variants():
    dense = tile_table("attn_fwd_tma", "sm_90a")
    mask2 = tile_table("attn_fwd_tma", "sm_90a", table="mask2")

    def at(rows, d, **kw):
        return tuple(r._replace(**kw) if r.max_head_dim == d else r for r in rows)

    split = dict(stages=2, overlap=True, split_kv=True)
    return {
        "table": {},
        "split 2": {"dense": at(at(at(dense, 256, **split), 192, **split), 128, **split),
                    "mask2": at(mask2, 128, **split)},
        "split 3 (d128)": {"dense": at(dense, 128, stages=3, overlap=True, split_kv=True)},
    }


def run(tables, fn):
    if not tables:
        return fn()
    items = list(tables.items())

    def nest(i):
        if i == len(items):
            return fn()
        name, rows = items[i]
        with override_tiles("attn_fwd_tma", "sm_90a", rows, table=name):
            return nest(i + 1)
    return nest(0)


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    variants = _variants()

    def by_name(name, fn):
        return run(variants[name], fn)

    bad = 0
    for B, Sq, Sk, Hq, Hk, D, causal, cap, mask in [
            (2, 333, 1000, 4, 2, 256, False, None, False), (1, 77, 3001, 8, 1, 256, True, None, False),
            (2, 500, 700, 2, 2, 192, True, 20.0, False), (1, 1000, 4999, 6, 3, 128, False, 20.0, False),
            (2, 600, 1100, 4, 2, 128, True, None, True), (1, 300, 2000, 2, 1, 256, False, None, False),
            (3, 400, 400, 40, 40, 256, True, None, False)]:
        bad += check(bench, variants, by_name, (B, Sq, Sk, Hq, Hk, D), mask=mask, causal=causal, softcap=cap)
    sizes = (4096,) if "--quick" in sys.argv else (1024, 4096, 16384)
    for D in (256, 192, 128):
        for S in sizes:
            for causal in (False, True):  # (SDPA's cuDNN takes no d = 192)
                time_shape(bench, variants, by_name, f"d{D} S{S} {'causal' if causal else 'full  '}",
                           max(1, 16384 // S), S, 2048 // D, D, cudnn=D != 192, causal=causal)
    # float mask tiles (d = 128, the mask2 table), S 16k: bf16 zeros / random, against the dense time
    S, H, D = 16384, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = harness.to_pyattn(torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g), bench.stream)
    masks = {"zeros": torch.zeros(S, S, device="cuda", dtype=torch.bfloat16),
             "random": (torch.rand(S, S, device="cuda", generator=g) * 4 - 2).to(torch.bfloat16)}
    line = []
    for n, tables in variants.items():
        dense = run(tables, lambda: bench.gpu_ms(lambda: pyattn.attention(q, q, q, stream=bench.stream), loop=5,
                                                 reps=3).ms)
        parts = [f"dense {dense:.3f}"]
        for mn, mt in masks.items():
            dm = harness.to_pyattn(mt, bench.stream)
            t = run(tables, lambda: bench.gpu_ms(lambda: pyattn.attention(q, q, q, mask=dm, stream=bench.stream),
                                                 loop=5, reps=3).ms)
            parts.append(f"{mn} {t:.3f} ({t / dense:.2f}x)")
        line.append(f"{n}: " + ", ".join(parts))
    print("bf16 mask d128 S16k: " + " | ".join(line))
    print("checks:", "all within 2x the table's error" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

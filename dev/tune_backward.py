"""Dev probe (GPU): time the backward's main-kernel tile variants, and warm the kernel cache.

Usage:
  PYTHONPATH=. python dev/tune_backward.py --warm            # compile every backward variant (modifiers
                                                             # included) and the forward ones the GPU tests
                                                             # use, on all CPU cores
  PYTHONPATH=. python dev/tune_backward.py [--dims 64 128] [--seqlen 4096] [--rows ROW ...]

ROW is 'BM,BN,W,SPLIT,DQM,ST' for attn_bwd_mma and 'BM,WG,ST' for attn_bwd_wgmma (the family the
arch selects for the head dim). Each variant replaces the d row of the arch's table
(``override_tiles``) and is timed through the public ``attention_backward`` (bf16, B = 16384 // S,
H = 2048 // d, causal and not, harness.Bench), with its gradients compared to the table's own row
(max relative difference), so a variant that is fast because it is wrong shows. Rows given with --rows are tried for every --dims.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import harness  # noqa: E402
import pyattn  # noqa: E402
from pyattn import jit  # noqa: E402
from pyattn.kernels.families import BwdTile, BwdWgmmaTile, override_tiles, tile_table  # noqa: E402
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, select_attention_spec, select_backward_specs  # noqa: E402

DEFAULT_ROWS = {("attn_bwd_mma", 64): ["64,128,8,1,4,2", "128,128,8,1,4,2", "128,128,16,2,4,2"],
                ("attn_bwd_mma", 128): ["64,128,8,1,2,2", "64,128,8,2,2,2", "64,128,16,2,4,2"],
                ("attn_bwd_wgmma", 64): ["64,1,2"], ("attn_bwd_wgmma", 128): ["64,1,2"]}
ROW_TYPES = {"attn_bwd_mma": BwdTile, "attn_bwd_wgmma": BwdWgmmaTile}


def warm(arch: str) -> None:
    specs = []
    for name in ("float16", "bfloat16", "float32"):
        for d in HEAD_DIM_BUCKETS:
            for cap in (False, True):
                for alibi in (False, True):
                    specs += select_backward_specs(name, d, arch, softcap=cap, alibi=alibi)
                    specs.append(select_attention_spec(name, d, arch, softcap=cap, alibi=alibi))
    specs = list(dict.fromkeys(specs))
    t0 = time.perf_counter()
    built = jit.build_many(specs)
    print(f"warm: {len(specs)} variants ({sum(b for *_, b in built)} compiled) in {time.perf_counter() - t0:.1f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--rows", nargs="*")
    args = ap.parse_args()
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    arch = bench.device.arch
    if args.warm:
        warm(arch)
        return 0
    torch, S = bench.torch, args.seqlen
    for d in args.dims:
        B, H = 16384 // S, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (harness.to_pyattn(torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, generator=g),
                                         bench.stream) for _ in range(4))
        family = select_backward_specs("bfloat16", d, arch)[1].family
        table = tile_table(family, arch)
        i = next(j for j, r in enumerate(table) if r.max_head_dim >= d)
        variants = [None] + [ROW_TYPES[family](table[i].max_head_dim, *map(int, r.split(",")), "tuning")
                             for r in (args.rows or DEFAULT_ROWS.get((family, d), []))]
        for causal in (False, True):
            flops = 2.5 * 4 * B * H * S * S * d / (2 if causal else 1)
            out, lse = pyattn.attention(q, k, v, causal=causal, return_lse=True, stream=bench.stream)
            base = None
            for row in variants:
                rows = table if row is None else table[:i] + (row,) + table[i + 1:]
                label = "table" if row is None else ",".join(map(str, row[1:-1]))
                try:
                    with override_tiles(family, arch, rows):
                        fn = lambda: pyattn.attention_backward(do, q, k, v, out, lse, causal=causal,  # noqa: E731
                                                               stream=bench.stream)
                        grads = [harness.to_torch(x).float() for x in fn()]
                        t = bench.gpu_ms(fn, loop=5, reps=5, label=label)
                except Exception as exc:  # noqa: BLE001 - a variant that does not fit or compile
                    print(f"d={d} S={S} causal={causal} {label:>16}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                base = grads if base is None else base
                diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, base))
                print(f"d={d} S={S} causal={causal} {label:>16}: {t.ms:8.3f} ms  {flops / t.ms / 1e9:6.1f} TFLOP/s  "
                      f"rel diff vs table {diff:.1e}", flush=True)
                if row is None:  # the cost of ordered dQ sums, on the table's row
                    det = bench.gpu_ms(lambda: pyattn.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                                         deterministic=True, stream=bench.stream),
                                       loop=5, reps=5, label="deterministic")
                    print(f"d={d} S={S} causal={causal} {'deterministic':>16}: {det.ms:8.3f} ms  "
                          f"({det.ms / t.ms:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: what a mask tensor costs the sm_90a prefill, (1, 16k, 2048 / D, D) bf16.

Usage: PYTHONPATH=. python dev/probe_mask_cost.py [--seqlen 16384] [--dims 128] [--kinds bool bf16 f32]
       [--no-cp] [--row D,BLOCK_N,WARPGROUPS,STAGES,OVERLAP,SPLIT_KV ...] [--mods-warpgroups N]
       [--flip-stage-bits] [--softcap CAP] [--alibi]

Times (scripts/harness.py) the dense call, then per mask kind (bool, bf16, f32) and content (all
visible: the tiles' per-score work skipped; random: every tile does it; a key-padding mask
(1, 1, 1, S); bool also causal) the mask call on attn_fwd_tma (its table as it is: a bool mask
packed to bits on the dense row, float masks' tiles in the ring) and on attn_fwd_wgmma (the
bucket's row taken out of attn_fwd_tma's table with ``override_tiles``, so the cp.async kernel
copies the tiles), each against the dense (or causal) time timed again right after it (the clock
drifts down as the GPU heats: 10% over a run). ``--row`` adds a column per row given: the float-mask
call on attn_fwd_tma with that row in its table (e.g. ``128,128,2,2,0,0`` for 2 stages without
overlap; a seventh field 1: persistent blocks, an eighth 1: Q in registers, q_regs); ``--no-cp``
drops the cp.async column;
``--mods-warpgroups N`` adds a bool-mask column with the dense row's ``warpgroups_mods`` set to N
(the warpgroups of its variants with a mask tensor or ALiBi: 2 at d = 64, where 3 spilled);
``--flip-stage-bits`` adds a bool-mask column with the dense row's ``stage_bits`` flipped (the
packed words in the ring against the consumers' loads from L2). ``--softcap`` / ``--alibi`` add that
modifier to every call, the dense ones included (the ratios are then against the modified
dense call).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402
from _rows import rows_with  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402
from pyattn.kernels.families.wgmma import WgmmaTile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--dims", type=int, nargs="*", default=[128])
    ap.add_argument("--kinds", nargs="*", default=["bool", "bf16", "f32"])
    ap.add_argument("--no-cp", action="store_true", help="skip the attn_fwd_wgmma (cp.async) column")
    ap.add_argument("--row", nargs="*", default=[], help="float-mask rows to time as well: D,BLOCK_N,WARPGROUPS,"
                    "STAGES,OVERLAP,SPLIT_KV[,PERSISTENT[,Q_REGS]] (warp-specialized)")
    ap.add_argument("--mods-warpgroups", type=int, default=0, help="bool masks also with the dense row's "
                    "warpgroups_mods set to this (0: not)")
    ap.add_argument("--flip-stage-bits", action="store_true", help="bool masks also with the dense row's "
                    "stage_bits flipped")
    ap.add_argument("--softcap", type=float, default=None, help="every call soft-capped so")
    ap.add_argument("--alibi", action="store_true", help="every call with ALiBi slopes")
    args = ap.parse_args()
    rows = [WgmmaTile(d, n, w, st, bool(ov), 1, "probe", ws=True, split_kv=bool(sp), persistent=bool(pe and pe[0]),
                      q_regs=bool(pe[1:] and pe[1]))
            for d, n, w, st, ov, sp, *pe in (map(int, r.split(",")) for r in args.row)]
    bench = harness.open_bench()
    for D in args.dims:
        probe(bench, args.seqlen, D, args.kinds, not args.no_cp, [r for r in rows if r.max_head_dim == D],
              args.mods_warpgroups, args.flip_stage_bits, args.softcap, args.alibi)


def probe(bench, S: int, D: int, kinds, cp_column: bool = True, rows=(), mods_wg: int = 0,
          flip_bits: bool = False, softcap=None, alibi: bool = False) -> None:
    H = 2048 // D
    rng = np.random.default_rng(0)
    import ml_dtypes

    q = pyattn.asarray(rng.standard_normal((1, S, H, D), np.float32).astype(ml_dtypes.bfloat16), stream=bench.stream)

    extra = {"softcap": softcap} if softcap else {}
    if alibi:
        extra["alibi_slopes"] = pyattn.asarray(np.geomspace(0.5, 0.002, H).astype(np.float32), stream=bench.stream)

    def run(opts):
        return bench.gpu_ms(lambda: pyattn.attention(q, q, q, stream=bench.stream, **opts, **extra), loop=5,
                            reps=3).ms

    dense = run({})
    causal = run({"causal": True})
    print(f"{f'd={D} dense':40} {dense:8.3f} ms | causal {causal:8.3f} ms", flush=True)
    random = rng.random((S, S), dtype=np.float32)
    for kind, dtype in (("bool", bool), ("bf16", ml_dtypes.bfloat16), ("f32", np.float32)):
        if kind not in kinds or (kind == "f32" and D > 192):
            continue
        table = {"bool": "dense", "bf16": "mask2", "f32": "mask4"}[kind]
        no_d = tuple(r for r in tile_table("attn_fwd_tma", "sm_90a", table) if r.max_head_dim != D)
        if kind == "bool":
            masks = {"all True": np.ones((S, S), bool), "random 50%": random < 0.5,
                     "key padding (1,1,1,S) 90%": (np.arange(S) < 0.9 * S)[None, None, None, :],
                     "causal + all True": np.ones((S, S), bool), "causal + random 50%": random < 0.5}
        else:
            masks = {"zeros": np.zeros((S, S), dtype), "random normal": (random * 4 - 2).astype(dtype),
                     "key padding (1,1,1,S) 90%": np.where(np.arange(S) < 0.9 * S, 0, -np.inf)[None, None, None, :]
                     .astype(dtype), "causal + random normal": (random * 4 - 2).astype(dtype)}
        for name, host in masks.items():
            m = pyattn.asarray(host, stream=bench.stream)
            is_causal = name.startswith("causal")
            opts, base_opts = ({"mask": m, "causal": True}, {"causal": True}) if is_causal else ({"mask": m}, {})
            cols = [("tma", run(opts), run(base_opts))]
            if cp_column:
                with override_tiles("attn_fwd_tma", "sm_90a", no_d, table=table):
                    cols.append(("cp.async", run(opts), run(base_opts)))
            # bool masks: the dense row's d = D entry changed one field at a time (label, change)
            dense_d = next(r for r in tile_table("attn_fwd_tma", "sm_90a", "dense") if r.max_head_dim == D)
            changes = ([(f"mods {mods_wg} WG", {"warpgroups_mods": mods_wg})] if mods_wg else []) + \
                ([("from L2" if dense_d.stage_bits else "staged", {"stage_bits": not dense_d.stage_bits})]
                 if flip_bits else [])
            for label, change in changes if kind == "bool" else ():
                tab = tuple(r._replace(**change) if r.max_head_dim == D else r
                            for r in tile_table("attn_fwd_tma", "sm_90a", "dense"))
                with override_tiles("attn_fwd_tma", "sm_90a", tab, table="dense"):
                    cols.append((label, run(opts), run(base_opts)))
            for row in rows if kind != "bool" else ():
                tab = rows_with(tile_table("attn_fwd_tma", "sm_90a", table), D, row)
                with override_tiles("attn_fwd_tma", "sm_90a", tab, table=table):
                    cols.append((f"{row.block_n}x{row.stages}{'+ov' if row.overlap else ''}"
                                 f"{'+split' if row.split_kv else ''}{'+pers' if row.persistent else ''}", run(opts),
                                 run(base_opts)))
            print(f"{kind + ' ' + name:40} " + " | ".join(f"{c} {t:8.3f} ms {t / b:5.2f}x" for c, t, b in cols),
                  flush=True)
            del m


if __name__ == "__main__":
    main()

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

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402
from pyattn.reference import attention_ref  # noqa: E402


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
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
        rng = np.random.default_rng(1)
        hs = [rng.standard_normal((B, s, h, 128)).astype(np.float32) for s, h in ((Sq, Hq), (Sk, Hk), (Sk, Hk))]
        ts = [torch.from_numpy(h).to("cuda", torch.bfloat16) for h in hs]
        ref = attention_ref(*[t.float().cpu().numpy().astype(np.float64) for t in ts], causal=causal, softcap=cap)
        xs = [harness.to_pyattn(t, bench.stream) for t in ts]
        errs = {}
        for n in variants:
            o = run(n, lambda: pyattn.attention(*xs, causal=causal, softcap=cap, stream=bench.stream))
            errs[n] = float(np.abs(harness.to_torch(o).float().cpu().numpy() - ref).max())
        bad += max(errs.values()) > 2 * errs["table"] + 1e-3
        print(f"check B{B} Sq{Sq} Sk{Sk} causal={causal} cap={cap}: "
              + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    for S in (1024, 4096, 16384):
        for causal in (False, True):
            for cap in (None, 30.0):
                B, H = max(1, 16384 // S), 16
                g = torch.Generator(device="cuda").manual_seed(0)
                ts = [torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
                xs = [harness.to_pyattn(t, bench.stream) for t in ts]
                fn = lambda: pyattn.attention(*xs, causal=causal, softcap=cap, stream=bench.stream)  # noqa: E731
                ms = {}
                for _ in range(2):
                    for n in variants:
                        ms.setdefault(n, []).append(run(n, lambda: bench.gpu_ms(fn, loop=10, reps=5).ms))
                cu = 0.0
                if cap is None:
                    f = harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts), is_causal=causal)
                    cu = bench.gpu_ms(f, loop=10, reps=5).ms
                head = f"S{S} {'causal' if causal else 'full  '} {'cap' if cap else '   '} cuDNN {cu:.3f} | "
                print(head + " | ".join(
                    f"{n} {min(t):.3f}" + (f" ({cu / min(t):.2f})" if cu else "") for n, t in ms.items()), flush=True)
    print("checks:", "ok" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

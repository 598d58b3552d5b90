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

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402
from pyattn.reference import attention_ref  # noqa: E402


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    short = tile_table("attn_fwd_tma", "sm_90a", table="short")
    base = short[0]
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
    shapes = [(2, 333, 1000, 4, 2, False), (1, 77, 1500, 8, 1, True), (3, 500, 500, 2, 2, True)]
    for B, Sq, Sk, Hq, Hk, causal in shapes:
        rng = np.random.default_rng(1)
        hs = [rng.standard_normal((B, s, h, 128)).astype(np.float32) for s, h in ((Sq, Hq), (Sk, Hk), (Sk, Hk))]
        ts = [torch.from_numpy(h).to("cuda", torch.bfloat16) for h in hs]
        ref = attention_ref(*[t.float().cpu().numpy().astype(np.float64) for t in ts], causal=causal)
        xs = [harness.to_pyattn(t, bench.stream) for t in ts]
        errs = {}
        for n in variants:
            o = run(n, lambda: pyattn.attention(*xs, causal=causal, stream=bench.stream))
            errs[n] = float(np.abs(harness.to_torch(o).float().cpu().numpy() - ref).max())
        bad += max(errs.values()) > 2 * errs["table"] + 1e-3
        print(f"check B{B} Sq{Sq} Sk{Sk} causal={causal}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    for S in (1024, 2048, 4096):
        for causal in (False, True):
            B, H = max(1, 16384 // S), 16
            g = torch.Generator(device="cuda").manual_seed(0)
            ts = [torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
            xs = [harness.to_pyattn(t, bench.stream) for t in ts]
            fn = lambda: pyattn.attention(*xs, causal=causal, stream=bench.stream)  # noqa: E731
            ms = {}
            for _ in range(2):
                for n in variants:
                    ms.setdefault(n, []).append(run(n, lambda: bench.gpu_ms(fn, loop=10, reps=5).ms))
            f = harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts), is_causal=causal)
            cu = bench.gpu_ms(f, loop=10, reps=5).ms
            print(f"S{S} {'causal' if causal else 'full  '} cuDNN {cu:.3f} | " + " | ".join(
                f"{n} {min(t):.3f} ({cu / min(t):.2f})" for n, t in ms.items()), flush=True)
    print("checks:", "ok" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

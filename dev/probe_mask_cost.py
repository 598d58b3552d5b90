"""Dev probe: where the wgmma kernel's time goes with a mask tensor, (1, 16k, 16, 128) bf16.

Usage: PYTHONPATH=. python dev/probe_mask_cost.py

Times (scripts/harness.py) the dense call against bool masks that differ in one thing each: a
full (S, S) mask (tiles staged through shared memory), a key-padding mask (1, 1, 1, S) (staged,
a few KiB: L1/L2-resident), the full mask read in place (an odd-stride view, not staged), and
the mask and dense tables with other tiles, warp-specialized or not (``override_tiles``), to
separate DRAM traffic, the per-element work and the tile shape.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import WgmmaTile, override_tiles, tile_table  # noqa: E402


def main() -> None:
    bench = harness.open_bench()
    S, H, D = 16384, 16, 128
    rng = np.random.default_rng(0)
    import ml_dtypes

    q = pyattn.asarray(rng.standard_normal((1, S, H, D), np.float32).astype(ml_dtypes.bfloat16), stream=bench.stream)
    full = pyattn.asarray(np.ones((S, S), bool), stream=bench.stream)
    pad = pyattn.asarray(np.ones((1, 1, 1, S), bool), stream=bench.stream)
    torch = bench.torch  # a strided view: row stride S + 1, so rows are not 16-byte aligned (read in place)
    odd = torch.ones((S, S + 1), dtype=torch.bool, device="cuda")[:, :S] if torch is not None else full
    cases = [("dense", {}), ("softcap 30", {"softcap": 30.0}), ("bool (S, S) staged", {"mask": full}),
             ("bool (1,1,1,S) staged", {"mask": pad}), ("bool (S, S) in place", {"mask": odd})]
    base = None
    for name, opts in cases:
        t = bench.gpu_ms(lambda: pyattn.attention(q, q, q, stream=bench.stream, **opts), loop=5, reps=3, label=name)
        base = base or t.ms
        print(f"{name:28} {t.ms:8.3f} ms {t.ms / base:5.2f}x", flush=True)
    for rows in ((WgmmaTile(128, 128, 2, 2, False, 1, "probe"),), (WgmmaTile(128, 64, 2, 4, True, 1, "probe"),),
                 (WgmmaTile(128, 64, 2, 4, True, 1, "probe", True),), (WgmmaTile(128, 128, 2, 2, False, 1, "probe", True),)):
        r = rows[0]
        with override_tiles("attn_fwd_wgmma", "sm_90a", rows + tile_table("attn_fwd_wgmma", "sm_90a", "mask1")[2:],
                            table="mask1"):
            t = bench.gpu_ms(lambda: pyattn.attention(q, q, q, stream=bench.stream, mask=full), loop=5, reps=3)
        print(f"bool (S,S) n{r.block_n} s{r.stages} ovl={r.overlap} ws={r.ws}  {t.ms:8.3f} ms {t.ms / base:5.2f}x", flush=True)
        with override_tiles("attn_fwd_wgmma", "sm_90a", rows + tile_table("attn_fwd_wgmma", "sm_90a", "dense")[2:],
                            table="dense"):
            t = bench.gpu_ms(lambda: pyattn.attention(q, q, q, stream=bench.stream), loop=5, reps=3)
        print(f"dense      n{r.block_n} s{r.stages} ovl={r.overlap} ws={r.ws}  {t.ms:8.3f} ms {t.ms / base:5.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""Time tile variants of the tensor-core kernel side by side (one subprocess per variant).

Usage: PYTHONPATH=. python dev/tune_mma.py
Each variant replaces the big-shared-memory archs' attn_fwd_mma tile table in a child process
(``pyattn.kernels.families.override_tiles``); the cache key covers the rendered source, so
variants never collide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import contextlib, json, sys, numpy as np, ml_dtypes
import pyattn
from pyattn.kernels.families import MmaTile, override_tiles
entry = json.loads(sys.argv[1])
rows = tuple(MmaTile(*e, "tuning") for e in entry["table"])
s = pyattn.Stream()
rng = np.random.default_rng(0)
out = {}
with contextlib.ExitStack() as tables:
    for arch in ("sm_80", "sm_90a", "sm_100a"):  # the archs that share the big-shared-memory table
        tables.enter_context(override_tiles("attn_fwd_mma", arch, rows))
    for D in entry["dims"]:
        B, S, H = 4, 4096 if D <= 64 else 2048, 16
        q, k, v = (pyattn.asarray(rng.standard_normal((B, S, H, D)).astype(np.float16), stream=s) for _ in range(3))
        for causal in (False, True):
            f = lambda: pyattn.attention(q, k, v, causal=causal, stream=s)
            f(); f()
            ts = []
            for _ in range(15):
                a, b = s.record(timing=True), None
                f()
                b = s.record(timing=True)
                ts.append(a.elapsed_ms(b))
            ms = sorted(ts)[len(ts) // 2]
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            out[f"d{D}{'c' if causal else ''}"] = round(flops / ms / 1e9, 1)
print(json.dumps(out))
"""

VARIANTS = {
    # name: MmaTile rows without the reason (max head_dim, block_n, warps, m_tiles, min_blocks)
    "n64w4m2b2": [(128, 64, 4, 2, 2), (256, 32, 8, 1, 1)],
    "n32w4m2b2": [(128, 32, 4, 2, 2), (256, 32, 8, 1, 1)],
    "n64w4m2b1": [(128, 64, 4, 2, 1), (256, 32, 8, 1, 1)],
    "n64w8m1b2": [(128, 64, 8, 1, 2), (256, 32, 8, 1, 1)],
    "n64w8m2b1": [(128, 64, 8, 2, 1), (256, 32, 8, 1, 1)],
}


def main() -> int:
    env = dict(os.environ)
    rows = {}
    for name, table in VARIANTS.items():
        arg = json.dumps({"table": table, "dims": [64, 128]})
        res = subprocess.run([sys.executable, "-c", CHILD, arg], env=env, capture_output=True, text=True)
        rows[name] = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else {"error": res.stderr[-300:]}
        print(name, rows[name], flush=True)
    print("\nTFLOP/s (fp16; d64 at S=4096, d128 at S=2048; B=4, H=16; 'c' = causal)")
    for name, r in rows.items():
        print(f"  {name:12} " + "  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe: what the d = 64 short row's last row block costs (issue 15, d = 64 at 1k keys).

The short row (three consumer warpgroups, 192 query rows a block) splits 1024 query rows into five
whole blocks and one of 64 rows, where one warpgroup works and two wait. This times the table's
kernel on bf16 (16, Sq, 32, 64) queries against 1024 keys, non-causal, for Sq = 960 (five whole
blocks), 1024, 1088 and 1152 (six whole blocks): the step 960 -> 1024 against 960 -> 1152 is the
tail's cost in whole blocks. Then the short row on two warpgroups (128 rows a block, no tail at
1024) through ``override_tiles``, and SDPA cuDNN at Sq = Sk = 1024.

Usage: PYTHONPATH=. python dev/probe_tail.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    short = tile_table("attn_fwd_tma", "sm_90a", table="short")
    variants = {"table": None,
                "short 2wg": tuple(r._replace(warpgroups=2) if r.max_head_dim == 64 else r for r in short)}
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(16, 1024, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    xk, xv = (harness.to_pyattn(t, bench.stream) for t in (k, v))
    res = {}
    for _ in range(3):  # alternating rounds, the best of each
        for sq in (960, 1024, 1088, 1152):
            q = torch.randn(16, sq, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            xq = harness.to_pyattn(q, bench.stream)
            for name, rows in variants.items():
                for causal in (False, True):
                    if causal and sq != 1024:
                        continue
                    fn = lambda: pyattn.attention(xq, xk, xv, causal=causal, stream=bench.stream)  # noqa: E731
                    if rows is None:
                        ms = bench.gpu_ms(fn, loop=20, reps=5).ms
                    else:
                        with override_tiles("attn_fwd_tma", "sm_90a", rows, table="short"):
                            ms = bench.gpu_ms(fn, loop=20, reps=5).ms
                    key = (name, sq, causal)
                    res[key] = min(res.get(key, 1e9), ms)
    q = torch.randn(16, 1024, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = {c: bench.gpu_ms(harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in (q, k, v)), is_causal=c),
                          loop=20, reps=5).ms for c in (False, True)}
    for name in variants:
        t = {sq: res[(name, sq, False)] for sq in (960, 1024, 1088, 1152)}
        tail = (t[1024] - t[960]) / (t[1152] - t[960])
        print(f"{name}: Sq 960/1024/1088/1152 ms " + " / ".join(f"{x:.4f}" for x in t.values())
              + f" | tail block = {tail:.2f} of a whole one | 1k x cuDNN {cu[False] / t[1024]:.3f}"
              f" | causal 1k {res[(name, 1024, True)]:.4f} ms x cuDNN {cu[True] / res[(name, 1024, True)]:.3f}",
              flush=True)
    print(f"cuDNN 1k {cu[False]:.4f} ms, causal {cu[True]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

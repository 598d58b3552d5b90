"""Dev probe: does the order of timings in one process move them? bench_prefill times pyattn, then
SDPA FA2, then cuDNN on each shape; the row probes (``_rows.time_shape``) time the library's table
first. This times identical calls in several orders on bench_prefill's shapes and inputs: pyattn
and cuDNN alternating from either end, and pyattn under an ``override_tiles`` that installs the
table unchanged (what a row probe's variant costs by itself). Prints every timing in call order.

Usage: PYTHONPATH=. python dev/probe_order.py [--rounds 3]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_prefill  # noqa: E402
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    bench = harness.open_bench(need_torch=True)
    table = tile_table("attn_fwd_tma", "sm_90a")
    for D, S, causal in ((128, 1024, False), (128, 4096, False), (64, 4096, False), (128, 4096, True)):
        B, H = 16384 // S, 2048 // D
        n = bench.replicas(4 * B * S * H * D * 2, cap=4)
        sets, tsets = bench_prefill.make_qkv(bench, (B, S, H, D), "bfloat16", 0, n)
        fns = [lambda s=s: pyattn.attention(*s, causal=causal, stream=bench.stream) for s in sets]
        cu = [harness.sdpa(bench.torch, "cudnn", *(x.transpose(1, 2) for x in ts), is_causal=causal) for ts in tsets]

        def pa():
            return bench.gpu_ms(fns, loop=10, reps=7).ms

        def cd():
            return bench.gpu_ms(cu, loop=10, reps=7).ms

        def pa_override():
            with override_tiles("attn_fwd_tma", "sm_90a", table):
                return pa()

        for r in range(rounds):
            for order in (("pyattn", "cudnn", "pyattn", "cudnn"), ("cudnn", "pyattn", "cudnn", "pyattn"),
                          ("pyattn", "pyattn_same_table", "pyattn", "pyattn_same_table")):
                fn = {"pyattn": pa, "cudnn": cd, "pyattn_same_table": pa_override}
                print(f"d{D} S{S} causal={int(causal)} round {r}: "
                      + " | ".join(f"{name} {fn[name]():.3f}" for name in order), flush=True)


if __name__ == "__main__":
    main()

"""Dev probe: attn_fwd_fp8's tile rows through ``override_tiles``: the table as it is, a 4-stage ring
at d = 128, at d = 256 a 2-stage ring without overlap and a 3-stage one with overlap and ping-pong
(ptxas: 12 bytes of spill, 208 with a soft-cap), and a per-tile launch instead of persistent
blocks; each checked against the table's output, then timed (fp8 inputs, batch 16k / S, hidden
2048) at S = 1k / 4k / 16k, causal and not, and with a soft-cap at d = 256, rounds alternating.

Usage: PYTHONPATH=. python dev/probe_fp8_rows.py [--wg3]

``--wg3``: the table against d = 128 on three consumer warpgroups (192 query rows; a block a tile or
persistent) instead.
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
    rows = tile_table("attn_fwd_fp8", "sm_90a")

    def at(d, **kw):
        return tuple(r._replace(**kw) if r.max_head_dim == d else r for r in rows)

    variants = {"table": rows, "d128 s4": at(128, stages=4), "d256 s2": at(256, stages=2, overlap=False),
                "d256 s3 overlap": at(256, stages=3, overlap=True),
                "per tile": tuple(r._replace(persistent=False) for r in rows)}
    if "--wg3" in sys.argv:  # d = 128 on three consumer warpgroups (ptxas: 144 / 172 bytes of spill)
        variants = {"table": rows, "d128 3wg tile": at(128, warpgroups=3, persistent=False),
                    "d128 3wg pers": at(128, warpgroups=3)}
    shapes = [(d, s, c, None) for d, ss in ((128, (1024, 4096, 16384)), (256, (4096, 16384))) for s in ss
              for c in (False, True)] + [(256, 16384, False, 30.0), (256, 16384, True, 30.0)]
    inputs = {}
    for d, s, *_ in shapes:
        if (d, s) not in inputs:
            B, H = max(1, 16384 // s), 2048 // d
            x = [torch.randn(B, s, H, d, device="cuda") for _ in range(3)]
            ds = [t.abs().max().item() / 448 for t in x]
            inputs[d, s] = [harness.to_pyattn((t / f).to(torch.float8_e4m3fn), bench.stream) for t, f in zip(x, ds)], ds

    def call(d, s, c, cap):
        (q, k, v), (dq, dk, dv) = inputs[d, s]
        return pyattn.attention(q, k, v, causal=c, softcap=cap, descale_q=dq, descale_k=dk, descale_v=dv,
                                stream=bench.stream)

    want = {sh: harness.to_torch(call(*sh)).float() for sh in shapes}
    times = {(n, sh): [] for n in variants for sh in shapes}
    diffs = {}
    for rnd in range(3):
        for name, table in variants.items():
            with override_tiles("attn_fwd_fp8", "sm_90a", table):
                for sh in shapes:
                    if rnd == 0:  # the same kernel code: results equal the table's bit for bit or nearly
                        diffs[name] = max(diffs.get(name, 0.0),
                                          (harness.to_torch(call(*sh)).float() - want[sh]).abs().max().item())
                    times[name, sh].append(bench.gpu_ms(lambda sh=sh: call(*sh), loop=10, reps=3).ms)
    print("max |output - the table's| over the shapes: " + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))
    print(f"{'shape':28}" + "".join(f"{n:>17}" for n in variants))
    for sh in shapes:
        print(f"{str(sh):28}" + "".join(f"{min(times[n, sh]):17.3f}" for n in variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())

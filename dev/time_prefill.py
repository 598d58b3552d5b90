"""Dev probe: dense prefill times of the tree on PYTHONPATH, one JSON line, for A/B runs of two
source trees in alternating processes (the GPU's clock drifts as it heats, so trees are compared
round by round, never a whole run against another).

Usage: PYTHONPATH=<tree> PYATTN_CACHE_DIR=<dir per tree> python dev/time_prefill.py TAG [--cudnn]
       [--shapes D:S:CAUSAL[:SOFTCAP],...] [--dtype float16]

Shapes: the prefill benchmark's (batch 16k / S, hidden 2048, bf16) at d = 128 / 64 / 256, S = 1k /
4k / 16k, causal or not (``--shapes`` names others, e.g. ``128:1920:1``, or ``128:16384:1:30`` with a
soft-cap of 30; a soft-capped shape's key ends in its cap), on torch-made tensors as
pyattn arrays (``--dtype``: bfloat16 unless named; ``--alibi``: every shape with ALiBi's slopes
2^(-8 (h + 1) / H), its keys marked ``alibi``). ``--cudnn`` times torch SDPA's cuDNN backend on
the same shapes instead. A tree is extracted with e.g. ``mkdir .head && git archive HEAD | tar -x -C
.head`` (``.head/`` kept out of git by .git/info/exclude, carried to the GPU).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402

SHAPES = [(d, s, c) for d in (128, 64, 256) for s in (1024, 4096, 16384) for c in (False, True)]


def main() -> int:
    tag, cudnn = sys.argv[1], "--cudnn" in sys.argv[2:]
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    out = {}
    shapes = SHAPES
    dtype = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "bfloat16"
    if "--shapes" in sys.argv:
        shapes = [(int(d), int(s), bool(int(c)), *map(float, cap)) for d, s, c, *cap in
                  (x.split(":") for x in sys.argv[sys.argv.index("--shapes") + 1].split(","))]
    alibi = "--alibi" in sys.argv
    for D, S, causal, *cap in shapes:
        opts = {"causal": causal, "softcap": cap[0]} if cap else {"causal": causal}
        B, H = max(1, 16384 // S), 2048 // D
        if alibi:
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda")
            opts["alibi_slopes"] = harness.to_pyattn(slopes, bench.stream)
        g = torch.Generator(device="cuda").manual_seed(0)
        ts = [torch.randn(B, S, H, D, device="cuda", dtype=getattr(torch, dtype), generator=g) for _ in range(3)]
        if cudnn:
            if cap:
                raise SystemExit("--cudnn: torch SDPA takes no soft-cap")
            fn = harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts), is_causal=causal)
        else:
            xs = [harness.to_pyattn(t, bench.stream) for t in ts]
            fn = lambda: pyattn.attention(*xs, stream=bench.stream, **opts)  # noqa: E731
        out[f"{D} {S} {int(causal)}" + (f" {cap[0]:g}" if cap else "") + (" alibi" if alibi else "")] = round(bench.gpu_ms(fn, loop=20, reps=5).ms, 4)
    print("RESULT", tag, json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

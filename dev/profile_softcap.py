"""Dev probe (GPU): the sm_90a prefill with and without a soft-cap, to run under Nsight Compute
(issue 15: soft-cap costs 1.31x the dense time at (1, 16k, 16, 128) bf16; is it the MUFU pipe?).

    /opt/nvidia/nsight-compute/2025.3.1/ncu --clock-control none -k regex:attn_fwd_tma --launch-skip 1 \\
        --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section InstructionStats --page raw python dev/profile_softcap.py [--softcap 30] [--causal] \\
        [--head-dim 64] [--warpgroups 2] [--batch 16 --seqlen 1024] [--mask ones|random] [--mask-dtype bf16]

``--mask``: a (seqlen, seqlen) mask on every call too: bool all True or half True at random (the
packing kernel then runs before each call: ``-k regex:attn_fwd_tma`` leaves it out); with
``--mask-dtype bf16|f32`` an additive mask of zeros or of standard normal values instead.
Two calls (the first compiles and warms), NumPy-made bf16 device arrays, no torch.
"""

from __future__ import annotations

import argparse
import contextlib

import ml_dtypes
import numpy as np

import pyattn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1, help="bench_prefill's shapes: 16384 / seqlen")
    ap.add_argument("--head-dim", type=int, default=128, help="heads are 2048 / head_dim")
    ap.add_argument("--warpgroups", type=int, default=0,
                    help="force the TMA table's row for the bucket to this many consumer warpgroups")
    ap.add_argument("--mask", choices=("ones", "random"), default=None, help="a mask on every call too")
    ap.add_argument("--mask-dtype", choices=("bool", "bf16", "f32"), default="bool")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (a.batch, a.seqlen, 2048 // a.head_dim, a.head_dim)
    q, k, v = (pyattn.asarray(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)) for _ in range(3))
    mask = None
    if a.mask:
        S = a.seqlen
        if a.mask_dtype == "bool":
            host = np.ones((S, S), bool) if a.mask == "ones" else rng.random((S, S), np.float32) < 0.5
        else:  # additive: zeros (every tile's per-score work skipped) or standard normal values
            host = (np.zeros((S, S), np.float32) if a.mask == "ones" else rng.standard_normal((S, S), np.float32))
            host = host.astype(ml_dtypes.bfloat16 if a.mask_dtype == "bf16" else np.float32)
        mask = pyattn.asarray(host)
    with contextlib.ExitStack() as stack:
        if a.warpgroups:
            from pyattn.kernels.families import override_tiles, tile_table

            rows = tuple(r._replace(warpgroups=a.warpgroups) if r.max_head_dim == a.head_dim else r
                         for r in tile_table("attn_fwd_tma", "sm_90a"))
            stack.enter_context(override_tiles("attn_fwd_tma", "sm_90a", rows))
        for _ in range(2):
            out = pyattn.attention(q, k, v, causal=a.causal, softcap=a.softcap, mask=mask)
        pyattn.get_device().synchronize()
    print("done", out.shape)


if __name__ == "__main__":
    main()

"""Per-token against per-channel 8-bit key caches, one decode kernel each, for Nsight Compute (dev tool).

    ncu --clock-control none -k regex:attn_decode.*kvint8 --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \\
        python3 dev/profile_key_channel.py [B] [ctx]

Fills an int8 PagedKVCache with per-token keys and one with per-channel keys (page 16, Hq 32, Hkv 8,
D 128) with the same random bf16 K/V, then decodes a bf16 query 3 times over each, per-token first:
the launch skip above leaves the per-token kernel's third launch and the per-channel kernel's first.
"""

from __future__ import annotations

import sys

import torch

import pyattn


def main() -> None:
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    L = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
    Hq, Hkv, D, PS, CHUNK = 32, 8, 128, 16, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q = pyattn.asarray(torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g))
    for scales in ("token", "channel"):
        cache = pyattn.PagedKVCache(B * L // PS + 8, PS, Hkv, D, "int8", key_scales=scales)
        seqs = [cache.add_sequence() for _ in range(B)]
        g.manual_seed(1)
        for _ in range(0, L, CHUNK):
            k, v = (torch.randn(B, CHUNK, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            cache.append(seqs, pyattn.asarray(k), pyattn.asarray(v))
        for _ in range(3):
            pyattn.decode(q, cache, seqs)
        torch.cuda.synchronize()
        del cache


if __name__ == "__main__":
    main()

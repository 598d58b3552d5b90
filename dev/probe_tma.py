"""Dev probe: the TMA-fed kernel (attn_fwd_tma) against the cp.async wgmma kernel per head-dim
bucket, on the prefill benchmark's shapes (batch = 16k / S, hidden 2048), with cuDNN in the run.

Usage: PYTHONPATH=. python dev/probe_tma.py [--dims 64 128 192 256] [--seqlens 1024 2048 4096 16384]

For each shape: ms with attn_fwd_tma's table as it is, and with the bucket's row taken out of it
(``override_tiles``: the call then runs attn_fwd_wgmma), and SDPA cuDNN's ms.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128, 192, 256])
    ap.add_argument("--seqlens", type=int, nargs="*", default=[1024, 2048, 4096, 16384])
    args = ap.parse_args()
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    rows = tile_table("attn_fwd_tma", "sm_90a")
    print(f"{'shape':36} {'tma ms':>8} {'wgmma ms':>8} {'cuDNN ms':>8} | tma/wgmma  x cuDNN  TFLOP/s")
    for D in args.dims:
        without = tuple(r for r in rows if r.max_head_dim != D)
        for S in args.seqlens:
            for causal in (False, True):
                B, H = max(1, 16384 // S), 2048 // D
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                g = torch.Generator(device="cuda").manual_seed(0)
                ts = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
                xs = [harness.to_pyattn(t, bench.stream) for t in ts]
                fn = lambda: pyattn.attention(*xs, causal=causal, stream=bench.stream)  # noqa: E731
                tma = bench.gpu_ms(fn, loop=10, reps=5).ms
                out_t = harness.to_torch(fn()).float()
                with override_tiles("attn_fwd_tma", "sm_90a", without):
                    base = bench.gpu_ms(fn, loop=10, reps=5).ms
                    out_b = harness.to_torch(fn()).float()
                diff = (out_t - out_b).abs().max().item()
                f = harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts), is_causal=causal)
                try:
                    cudnn = bench.gpu_ms(f, loop=10, reps=5).ms
                except Exception:  # noqa: BLE001
                    cudnn = float("nan")
                print(f"bf16 d{D} S{S} B{B} H{H} {'causal' if causal else '      '} {tma:8.3f} {base:8.3f} {cudnn:8.3f} | "
                      f"{base / tma:8.2f}x {cudnn / tma:7.2f}x {flops / tma / 1e9:7.0f}  maxdiff {diff:.1e}", flush=True)
                del ts, xs
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

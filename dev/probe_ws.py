"""Dev probe: the warp-specialized wgmma kernel (a producer warpgroup, mbarrier ring) against the
one where all threads load, on the prefill benchmark's shapes, with torch SDPA in the same run.

Usage: PYTHONPATH=. python dev/probe_ws.py [--quick]

First a correctness pass of the WS rows (``override_tiles`` on the dense table) against the
float64 reference with the 2x rule (odd lengths, Sq != Sk, causal, GQA, head dims 64/128/256),
then per shape: ms of the current table, of the WS rows, and of SDPA's FA2 and cuDNN backends.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.kernels.families import WgmmaTile, override_tiles, tile_table  # noqa: E402
from pyattn.reference import attention_ref, error_bound  # noqa: E402

WS_ROWS = (WgmmaTile(64, 64, 2, 4, True, 1, "probe", True), WgmmaTile(128, 128, 2, 3, True, 1, "probe", True))


def ws_table():
    rest = tile_table("attn_fwd_wgmma", "sm_90a")[2:]  # d 192 / 256 rows as they are
    return override_tiles("attn_fwd_wgmma", "sm_90a", WS_ROWS + rest)


def check() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    with ws_table():
        for (B, Sq, Sk, Hq, Hkv, D, causal) in ((1, 1, 1, 1, 1, 64, False), (2, 129, 300, 4, 2, 64, True),
                                                (1, 333, 333, 2, 1, 128, True), (2, 77, 1000, 4, 4, 128, False),
                                                (1, 1000, 65, 2, 2, 128, True), (1, 256, 513, 8, 2, 96, False)):
            q = rng.standard_normal((B, Sq, Hq, D), np.float32).astype(np.float16)
            k = rng.standard_normal((B, Sk, Hkv, D), np.float32).astype(np.float16)
            v = rng.standard_normal((B, Sk, Hkv, D), np.float32).astype(np.float16)
            out, lse = pyattn.attention(q, k, v, causal=causal, return_lse=True)
            ref = attention_ref(q, k, v, causal=causal)
            err = float(np.abs(out.astype(np.float64) - ref).max())
            bound = error_bound(q, k, v, causal=causal)
            ok = err <= bound and not np.isnan(out).any()
            bad += not ok
            print(f"check {(B, Sq, Sk, Hq, Hkv, D, causal)}: err {err:.2e} bound {bound:.2e} {'ok' if ok else 'FAIL'}",
                  flush=True)
    return bad


def main() -> int:
    quick = "--quick" in sys.argv
    bad = check()
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    torch = bench.torch
    print(f"{'shape':34} {'table ms':>9} {'WS ms':>9} {'FA2 ms':>8} {'cuDNN ms':>8} | WS TFLOP/s  x table  x cuDNN")
    for D in (64, 128):
        for S in (1024, 4096) if quick else (1024, 4096, 16384):
            for causal in (False, True):
                B, H = 16384 // S, 2048 // D
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                g = torch.Generator(device="cuda").manual_seed(0)
                ts = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
                xs = [harness.to_pyattn(t, bench.stream) for t in ts]
                fn = lambda: pyattn.attention(*xs, causal=causal, stream=bench.stream)  # noqa: E731
                base = bench.gpu_ms(fn, loop=10, reps=5).ms
                with ws_table():
                    ws = bench.gpu_ms(fn, loop=10, reps=5).ms
                    out_ws = harness.to_torch(fn()).float()
                out_base = harness.to_torch(fn()).float()
                diff = (out_ws - out_base).abs().max().item()
                sd = {}
                for name in harness.SDPA_BACKENDS:
                    f = harness.sdpa(torch, name, *(t.transpose(1, 2) for t in ts), is_causal=causal)
                    try:
                        sd[name] = bench.gpu_ms(f, loop=10, reps=5).ms
                    except Exception:  # noqa: BLE001
                        sd[name] = float("nan")
                fa2, cudnn = sd.get("fa2", float("nan")), sd.get("cudnn", float("nan"))
                print(f"bf16 d{D} S{S} B{B} H{H} {'causal' if causal else '      '} {base:9.3f} {ws:9.3f} {fa2:8.3f} "
                      f"{cudnn:8.3f} | {flops / ws / 1e9:7.0f}  {base / ws:6.2f}x  {cudnn / ws:6.2f}x  "
                      f"maxdiff {diff:.1e}", flush=True)
                del ts, xs
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

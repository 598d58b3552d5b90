"""Time decode-kernel tile variants on the GPU (development tool; the winner goes into
pyattn/kernels/families/decode.py).

Puts each candidate in the sm_90a decode tile table's d <= 128 row (``override_tiles``, which also
forgets loaded kernels; plans and decode specs key on the registry's generation, so they rebuild),
and times ``run_decode`` (kernel + split combine, CUDA events over back-to-back calls) on paged
bf16 KV, D=128, Hq=32, Hkv=8, page size 16, at the issue's batch/context points.

    PYTHONPATH=. python3 dev/tune_decode.py [--kv int8|fp8e4m3]

On sm_90a, 16-bit pages of 16+ slots go to attn_decode_tma, whose rows `dev/probe_decode_bw.py --tiles`
times; without ``--kv`` this tool's rows serve the contiguous and page-1..8 layouts only there.

With ``--kv`` the 8-bit-cache tables (``"kv8"``) are overridden instead: attn_decode's with the
TMA-fed kernel turned off, or attn_decode_tma's (rows marked ``tma``); the pools hold random codes
with positive scales (timing only: fp8 codes may decode to NaN, which costs nothing).
"""

from __future__ import annotations

import sys

import torch  # first: importing torch after pyattn had loaded NVRTC once failed inside torch

import numpy as np

import pyattn
from pyattn.kernels.families import DecodeTile, override_tiles, tile_table
from pyattn.ops import _decode
from pyattn.ops import decode as dec
from pyattn.interop.inputs import read
from pyattn.validate.paged import check_pools, check_query
from pyattn.runtime.stream import Event, default_stream

# DecodeTile fields after max_head_dim: (keys per warp, warps, stages, max q_tiles, min blocks)
CANDIDATES = [(32, 2, 3, 2, 2), (16, 2, 6, 2, 2), (16, 4, 3, 2, 2)]
# 8-bit rows: (kw, warps, stages, mt, minb, producer); producer rows go to attn_decode_tma's "kv8"
# table (warps: its consumer warps), the others to attn_decode's with the TMA kernel turned off.
CANDIDATES_Q8 = [(32, 4, 2, 1, 2, False), (32, 4, 2, 1, 2, True), (32, 4, 3, 1, 2, True), (16, 4, 4, 1, 2, True),
                 (16, 4, 3, 1, 2, True), (32, 2, 4, 1, 2, True), (16, 8, 2, 1, 2, True), (32, 4, 2, 1, 3, True)]
POINTS = [(1, 32768), (8, 4096), (8, 32768), (64, 4096)]
Hq, Hkv, D, PS = 32, 8, 128, 16


def time_us(fn, s, dev, n=20, reps=5):
    fn()
    s.synchronize()
    best = float("inf")
    for _ in range(reps):
        e0, e1 = Event(dev, timing=True), Event(dev, timing=True)
        s.record(e0)
        for _ in range(n):
            fn()
        s.record(e1)
        e1.synchronize()
        best = min(best, e0.elapsed_ms(e1) / n)
    return best * 1e3


def _quantized_pool(pool, k, kv):
    """Timing stand-in for an 8-bit NHD pool: random codes, positive fp32 scales (head-major, as a
    PagedKVCache keeps them), and its PoolInfo."""
    import dataclasses

    codes = [torch.randint(-100, 100, k.shape, device="cuda", dtype=torch.int8) for _ in range(2)]
    n, ps, h = k.shape[:3]
    scales = [torch.rand((n, h, ps), device="cuda", dtype=torch.float32) + 0.01 for _ in range(2)]
    info = dataclasses.replace(pool, dtype=np.dtype(np.int8), kv=kv, ks_strides=(ps * h, 1, ps),
                               vs_strides=(ps * h, 1, ps))
    return info, [pyattn.asarray(x) for x in codes], [pyattn.asarray(x) for x in scales]


def main():
    kv = sys.argv[sys.argv.index("--kv") + 1] if "--kv" in sys.argv else ""
    tiles = "kv8" if kv else "dense"  # which decode tile table
    dev = pyattn.get_device()
    s = default_stream(dev)
    data = {}
    for B, L in POINTS + ([(64, 32768)] if kv else []):  # (B, L, layout, page size): NHD / HND pages of 16, and one page per sequence
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
        for layout, ps in (("nhd", PS),) if kv else (("nhd", PS), ("hnd", PS), ("nhd", L), ("hnd", L)):
            npages = B * L // ps
            shape = (npages, ps, Hkv, D) if layout == "nhd" else (npages, Hkv, ps, D)
            k = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
            table = torch.randperm(npages, device="cuda").int().reshape(B, L // ps)
            data[B, L, layout, ps] = (k, torch.randn_like(k), table, q)
    # Host floor: back-to-back calls cannot be timed below the host's cost per call.
    import time
    k, v, table, q = data[(*POINTS[0], "nhd", PS)]
    dq, dk, dv, dt = (pyattn.asarray(x) for x in (q, k, v, table))
    tiny = pyattn.asarray(np.full(1, 16, np.int32))
    pool = check_pools(read("k_pool", dk), read("v_pool", dv))
    for splits in (1, 8):
        P = check_query(read("q", dq), pool, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None,
                        num_splits=splits)
        fn = lambda: dec.run_decode(P, dev, dq.ptr, dk.ptr, dv.ptr, (dt, None, table.shape[1], tiny, None), 16,  # noqa: E731
                                    0, s, False)
        fn()
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200 * 1e6
        s.synchronize()
        print(f"host time per run_decode call (num_splits={splits}): {host:.1f} us")
    print("candidate (kw, warps, stages, mt, minb) | " + " | ".join(f"B{B} L{L} {lay} p{ps}: us (TB/s)"
                                                                for B, L, lay, ps in data))
    for kw, w, st, mt, mb, *producer in CANDIDATES_Q8 if kv else CANDIDATES:
        tma = bool(producer and producer[0])
        family = "attn_decode_tma" if tma else "attn_decode"
        rows = (DecodeTile(128, kw, w, st, mt, mb, "tuning", tma),) + tile_table(family, "sm_90a", tiles)[1:]
        serves = _decode.tma_decode_serves
        if kv and not tma:
            _decode.tma_decode_serves = lambda *a: False
        with override_tiles(family, "sm_90a", rows, table=tiles):
            cells = []
            for (B, L, layout, ps), (k, v, table, q) in data.items():
                try:
                    dq, dk, dv, dt = (pyattn.asarray(x) for x in (q, k, v, table))
                    dl = pyattn.asarray(np.full(B, L, np.int32))
                    pool = check_pools(read("k_pool", dk), read("v_pool", dv), layout)
                    scales = (0, 0)
                    if kv:
                        pool, (dk, dv), scale_pools = _quantized_pool(pool, k, kv)  # (kept alive here)
                        scales = tuple(x.ptr for x in scale_pools)
                    P = check_query(read("q", dq), pool, causal=True, window=None, softcap=None, alibi_slopes=None,
                                    scale=None, num_splits=None)
                    us = time_us(lambda: dec.run_decode(P, dev, dq.ptr, dk.ptr, dv.ptr, (dt, None, L // ps, dl, None),
                                                        L, 0, s, False, scales, total_len=B * L), s, dev)
                    nbytes = B * L * Hkv * (2 * D + 8 if kv else 4 * D)  # K + V (8-bit: codes + fp32 scales)
                    cells.append(f"{us:7.1f} ({nbytes / us / 1e6:.2f})")
                except Exception as e:  # keep going: one bad candidate must not end the run
                    cells.append(f"error {type(e).__name__}: {str(e)[:60]}")
            print(f"({kw}, {w}, {st}, {mt}, {mb}{', tma' if tma else ''}) | " + " | ".join(cells), flush=True)
        _decode.tma_decode_serves = serves
    return 0


if __name__ == "__main__":
    sys.exit(main())

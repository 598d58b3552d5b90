"""Where decode's bandwidth goes (development probe, issue 12).

    PYTHONPATH=. python3 dev/probe_decode_bw.py [--points 64x32768,8x32768] [--only NAME] [--once]

On bf16 K/V, Hq 32, Hkv 8, D 128, q_len 1, one run:
- the GPU's read ceiling: a CuPy kernel streaming the same bytes (16-byte loads, no writes);
- ``pyattn.paged_decode`` over the same K/V in four layouts: NHD / HND pools of 16-token pages
  (pages shuffled), and NHD / HND contiguous caches (one page a sequence);
- torch SDPA's cuDNN backend on (B, Hkv, L, D) K/V, enable_gqa.
GPU us by CUDA events over back-to-back calls (median of 5 loops of 10), TB/s of K/V bytes.
``--only NAME --once`` runs one case a few times, for Nsight Compute.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

import pyattn

HQ, HKV, D = 32, 8, 128

READ_SRC = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ x, long long n, unsigned* out) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 v = __ldg(x + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
"""


def gpu_us(fn, n=10, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / n * 1e3)
    return statistics.median(ts)


def cases(B, L):
    """name -> a callable doing one step, and the K/V bytes it reads."""
    g = torch.Generator(device="cuda").manual_seed(B * 7 + L)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=g)  # HND contiguous
    v = torch.randn_like(k)
    stream = torch.cuda.current_stream()
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    out = {}
    nbytes = 2 * k.numel() * 2

    from pyattn.interop.inputs import read
    from pyattn.ops import decode as dec
    from pyattn.runtime.stream import Stream
    from pyattn.validate.paged import check_pools, check_query
    dev = pyattn.get_device()
    ps = Stream(dev, handle=stream.cuda_stream)
    dlens = pyattn.asarray(lens)

    def pd(kp, vp, table, layout):
        """run_decode itself (paged_decode would copy device tables to the host to check them)."""
        dq, dk, dv, dt = (pyattn.asarray(x) for x in (q, kp, vp, table))
        pool = check_pools(read("k_pool", dk), read("v_pool", dv), layout)
        P = check_query(read("q", dq), pool, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None,
                        num_splits=None)
        return lambda: dec.run_decode(P, dev, dq.ptr, dk.ptr, dv.ptr, (dt, None, table.shape[1], dlens, None), L, 0,
                                      ps, False, total_len=B * L)[0]

    one = torch.arange(B, device="cuda", dtype=torch.int32).reshape(B, 1)
    out["hnd_contig"] = pd(k.view(B, HKV, L, D), v.view(B, HKV, L, D), one, "hnd")
    # 16-token pages, shuffled: page p of sequence b at pool slot perm[b * L / 16 + p]
    npg = B * L // 16
    perm = torch.randperm(npg, device="cuda", generator=g)
    table = perm.int().reshape(B, L // 16)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(npg, device="cuda")
    k_hnd16 = k.view(B, HKV, L // 16, 16, D).permute(0, 2, 1, 3, 4).reshape(npg, HKV, 16, D)[inv].contiguous()
    v_hnd16 = v.view(B, HKV, L // 16, 16, D).permute(0, 2, 1, 3, 4).reshape(npg, HKV, 16, D)[inv].contiguous()
    out["hnd_p16"] = pd(k_hnd16, v_hnd16, table, "hnd")
    k_nhd16, v_nhd16 = (x.transpose(1, 2).contiguous() for x in (k_hnd16, v_hnd16))
    out["nhd_p16"] = pd(k_nhd16, v_nhd16, table, "nhd")
    k_nhd, v_nhd = (x.transpose(1, 2).contiguous() for x in (k, v))
    out["nhd_contig"] = pd(k_nhd, v_nhd, one, "nhd")
    qs = q.view(B, HQ, 1, D)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
    out["cudnn"] = cudnn

    import cupy as cp
    kern = cp.RawKernel(READ_SRC, "read_all")
    sink = cp.zeros(1, dtype=cp.uint32)
    ptrs = [k.data_ptr(), v.data_ptr()]
    n16 = k.numel() * 2 // 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def read():
        with cp.cuda.ExternalStream(stream.cuda_stream):
            for p in ptrs:
                mem = cp.cuda.UnownedMemory(p, n16 * 16, None)
                kern((sms * 8,), (512,), (cp.cuda.MemoryPointer(mem, 0), np.int64(n16), sink))
    out["read_ceiling"] = read
    return out, nbytes, (k, v, k_hnd16, v_hnd16, k_nhd16, v_nhd16, k_nhd, v_nhd, q, table, lens)


def _override(tiles):
    """A context for row ``KWxWxS`` (``p``: of attn_decode_tma, else of attn_decode, the TMA kernel
    then left out) in the sm_90a d <= 128 decode table; ``cp``: attn_decode's own row, TMA left out;
    None: the tables as they are."""
    import contextlib
    from pyattn.kernels.families import DecodeTile, override_tiles, tile_table
    from pyattn.ops import _decode
    if not tiles:
        return contextlib.nullcontext()
    tma = tiles.endswith("p") and tiles != "cp"
    family = "attn_decode_tma" if tma else "attn_decode"
    base = tile_table(family, "sm_90a", "dense")
    if tiles == "cp":
        row = base[0]
    else:
        kw, w, st = (int(x) for x in tiles.rstrip("p").split("x"))
        ring = 16 * (D + 8) * 2 + 2 * st * kw * w * (D if tma else D + 8) * 2 + (1024 if tma else 0)
        row = DecodeTile(128, kw, w, st, 2, 2 if ring <= 113 * 1024 else 1, "probe", tma)

    @contextlib.contextmanager
    def ctx():
        serves = _decode.tma_decode_serves
        if not tma:
            _decode.tma_decode_serves = lambda *a: False
        try:
            with override_tiles(family, "sm_90a", (row,) + base[1:], table="dense"):  # (new plans)
                yield
        finally:
            _decode.tma_decode_serves = serves
    return ctx()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="64x32768,8x32768,8x4096")
    ap.add_argument("--only", default=None)
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--tiles", default="", help="sm_90a d<=128 decode rows to time besides the tables, e.g. "
                    "cp,32x2x3,32x2x3p (keys per warp x consumer warps x stages; p: attn_decode_tma's; cp: "
                    "attn_decode's own row)")
    a = ap.parse_args()
    for pt in a.points.split(","):
        B, L = map(int, pt.split("x"))
        fns, nbytes, keep = cases(B, L)
        ref = fns["cudnn"]().float().reshape(B, HQ, D)
        rows = ([] if a.once and a.tiles else [None]) + [t for t in a.tiles.split(",") if t]
        for tiles in rows:
            with _override(tiles):
                for name, fn in fns.items():
                    if (a.only and name != a.only) or (tiles and name in ("cudnn", "read_ceiling")):
                        continue
                    if a.once:  # for Nsight Compute: --nvtx --nvtx-include probe/
                        fn()
                        torch.cuda.synchronize()
                        torch.cuda.nvtx.range_push("probe")
                        for _ in range(3):
                            fn()
                        torch.cuda.nvtx.range_pop()
                        torch.cuda.synchronize()
                        continue
                    us = gpu_us(fn)
                    err = ""
                    if name not in ("cudnn", "read_ceiling"):
                        o = torch.from_dlpack(fn()).float().reshape(B, HQ, D)
                        err = f" err {(o - ref).abs().max().item():.1e}"
                    print(f"B{B} L{L} {tiles or 'table':8s} {name:13s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s{err}",
                          flush=True)
        del keep, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Dev probe (GPU): the memory's rate for SparQ's reads alone: the score stage's sampled kt rows, the chosen keys' rows.

Usage: python dev/probe_kt_layout.py [--points 8x32768,4x131072,1x32768] [--page 64] [--r 32]

SparQ's score stage reads, for each (sequence, kv head), the r chosen channel rows of every page
of the transposed keys kt: a thread 8 keys (16 bytes) of a row, a block 2048 keys. This probe
does only those reads (CuPy raw kernels, an XOR of the words kept), no arithmetic, so its figure is
what the memory gives the pattern (the fiftieth session found the stage itself bound elsewhere):

- ``page-major``: kt [page][kv head][channel][slot] (the cache's layout): a chosen row is
  page_size * 2 bytes, and the next page's row of that channel lies H * D * page_size * 2 bytes on.
  Also timed at the score stage's occupancy (dynamic shared memory that leaves 2 blocks of 256
  threads an SM, 4 steps a block) with 8, 16 and 32 rows in flight a thread.
- ``channel-major``: kt [kv head][channel][page][slot], a layout the cache does not have: a
  channel's rows of consecutive physical pages lie end to end.
- ``chosen K+V rows``: the decode over the chosen keys' reads: k = L / 8 random positions per
  (sequence, kv head), each one K and one V row of D * 2 bytes from [page][slot][kv head][D] pools.

Each with the page table as appends of whole prompts leave it (``runs``: a sequence's pages
consecutive) and shuffled. The ceiling beside them: reading all of kt contiguously. Shapes as
bench_sparq: Hkv 8, D 128, bf16; r chosen channels drawn at random per (sequence, kv head).
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

SRC = r"""
template <int DEPTH>
__device__ void sampled_body(const unsigned char* __restrict__ kt, const int* __restrict__ pages,
                             const long long* __restrict__ chan_off, int n_pages_seq, int ps, int R, long long stride_page,
                             long long stride_h, int hkv, int steps, unsigned* sink) {
  const int row = blockIdx.y, b = row / hkv, h = row % hkv;
  __shared__ long long off_s[256];
  if (threadIdx.x < R) off_s[threadIdx.x] = chan_off[row * R + threadIdx.x];
  __syncthreads();
  unsigned x = 0;
  for (int st = 0; st < steps; ++st) {
    const int key = (blockIdx.x * steps + st) * 2048 + threadIdx.x * 8;
    const int page = pages[b * n_pages_seq + key / ps];
    const unsigned char* base = kt + (page * stride_page + h * stride_h + key % ps) * 2;
#pragma unroll DEPTH
    for (int j = 0; j < R; ++j) {
      const uint4 w = *reinterpret_cast<const uint4*>(base + off_s[j] * 2);
      x ^= w.x ^ w.y ^ w.z ^ w.w;
    }
  }
  if (x == 0x12345678u) sink[0] = x;
}
// DEPTH: rows a thread has in flight (the loop's unroll). Launched with dynamic shared memory
// that leaves 2 blocks an SM, it has the score stage's occupancy (2 x 256 threads an SM).
#define SAMPLED(D)                                                                                          \
  extern "C" __global__ void __launch_bounds__(256) sampled##D(                                              \
      const unsigned char* kt, const int* pages, const long long* chan_off, int n_pages_seq, int ps, int R,  \
      long long stride_page, long long stride_h, int hkv, int steps, unsigned* sink) {                      \
    sampled_body<D>(kt, pages, chan_off, n_pages_seq, ps, R, stride_page, stride_h, hkv, steps, sink);      \
  }
SAMPLED(8)
SAMPLED(16)
SAMPLED(32)
// The chosen keys' rows: for each (sequence, kv head) k positions, their K and V rows (D * 2 bytes
// each) from pools [page][slot][kv head][D]; 16 threads a row, a block 128 keys.
extern "C" __global__ void __launch_bounds__(256)
rows(const uint4* __restrict__ kp, const uint4* __restrict__ vp, const int* __restrict__ pos, const int* __restrict__ pages,
     int n_pages_seq, int ps, int k, int hkv, unsigned* sink) {
  const int row = blockIdx.y, b = row / hkv, h = row % hkv, part = threadIdx.x % 16;
  unsigned x = 0;
  uint4 w[16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int j = blockIdx.x * 128 + i * 16 + threadIdx.x / 16;
    const int p = pos[row * k + min(j, k - 1)];
    const long long r = ((static_cast<long long>(pages[b * n_pages_seq + p / ps]) * ps + p % ps) * hkv + h) * 16 + part;
    w[i] = kp[r];
    w[8 + i] = vp[r];
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) x ^= w[i].x ^ w[i].y ^ w[i].z ^ w[i].w;
  if (x == 0x12345678u) sink[0] = x;
}
extern "C" __global__ void whole(const uint4* __restrict__ a, long long n, unsigned* sink) {
  unsigned x = 0;
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += 256LL * gridDim.x) {
    const uint4 w = a[i];
    x ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (x == 0x12345678u) sink[0] = x;
}
"""


def timed(fn, reps=20):
    fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    best = []
    for _ in range(3):
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        best.append(cp.cuda.get_elapsed_time(s, e) / reps)
    return min(best) * 1e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="8x32768,4x131072,1x32768")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--r", type=int, default=32)
    args = ap.parse_args()
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    whole, rows = mod.get_function("whole"), mod.get_function("rows")
    sampled = {d: mod.get_function(f"sampled{d}") for d in (8, 16, 32)}
    for f in sampled.values():
        f.max_dynamic_shared_size_bytes = 100 << 10
    sink = cp.zeros(1, cp.uint32)
    H, D, ps, R = 8, 128, args.page, args.r
    rng = np.random.default_rng(0)
    print(f"Hkv {H}, D {D}, page {ps}, r {R}: GPU s per pass, TB/s of the bytes asked for")
    for pt in args.points.split(","):
        B, L = (int(x) for x in pt.split("x"))
        npg = L // ps
        P = B * npg + 8
        kt = cp.random.randint(0, 2**31, size=(P * H * D * ps * 2 // 4,), dtype=cp.int64).astype(cp.uint32)  # P*H*D*ps bf16
        nbytes = kt.nbytes
        t_whole = timed(lambda: whole((264 * 4,), (256,), (kt, np.int64(nbytes // 16), sink)))
        asked = B * H * L * R * 2
        print(f"B{B} x {L}: whole kt {nbytes / 1e6:.0f} MB in {t_whole * 1e6:.1f} us = {nbytes / t_whole / 1e12:.2f} TB/s;"
              f" sampled reads ask {asked / 1e6:.1f} MB")
        chans = np.stack([np.sort(rng.choice(D, R, replace=False)) for _ in range(B * H)])
        for table in ("runs", "shuffled"):
            pages = np.arange(B * npg, dtype=np.int32)
            if table == "shuffled":
                pages = rng.permutation(P)[: B * npg].astype(np.int32)
            pages_d = cp.asarray(pages)
            for layout in ("page-major", "channel-major"):
                if layout == "page-major":  # [page][h][c][slot]
                    sp, sh, sc = H * D * ps, D * ps, ps
                else:  # [h][c][page][slot]
                    sp, sh, sc = ps, D * P * ps, P * ps
                off = cp.asarray((chans * sc).astype(np.int64))
                runs = [(8, 1, 0)] if table == "shuffled" or layout == "channel-major" else \
                    [(8, 1, 0), (8, 4, 2), (16, 4, 2), (32, 4, 2)]
                for depth, steps, per_sm in runs:
                    smem = (100 << 10) if per_sm == 2 else 0
                    fn = lambda: sampled[depth]((L // 2048 // steps, B * H), (256,),
                                                (kt, pages_d, off, np.int32(npg), np.int32(ps), np.int32(R), np.int64(sp),
                                                 np.int64(sh), np.int32(H), np.int32(steps), sink), shared_mem=smem)
                    t = timed(fn)
                    how = f"{depth} rows in flight, {steps} steps a block" + (", 2 blocks an SM" if per_sm else "")
                    print(f"  {table:8s} {layout:13s} {t * 1e6:8.1f} us  {asked / t / 1e12:.2f} TB/s  ({how})", flush=True)
            # the chosen keys' K and V rows (k = L / 8 at random, sorted, per (sequence, kv head))
            k = L // 8
            kp, vp = kt, cp.roll(kt, 12345)  # pools the size of kt: [page][slot][kv head][D] bf16
            pos = cp.asarray(np.stack([np.sort(rng.choice(L, k, replace=False)) for _ in range(B * H)]).astype(np.int32))
            fn = lambda: rows((k // 128, B * H), (256,), (kp, vp, pos, pages_d, np.int32(npg), np.int32(ps), np.int32(k),
                                                          np.int32(H), sink))
            t = timed(fn)
            got = B * H * k * D * 2 * 2
            print(f"  {table:8s} chosen K+V rows {t * 1e6:6.1f} us  {got / t / 1e12:.2f} TB/s ({got / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()

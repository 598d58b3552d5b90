// The wgmma kernel's loads and its producer/consumer pipeline (sm_90a): cp.async copies of
// 128-byte-swizzled K/V/Q tiles and of mask tiles, and the mbarriers through which a producer
// warpgroup hands ring stages to the consumer warpgroups (AttnFwdWgmmaTraits WS).
//
// Dense calls now run attn_fwd_tma (attention_fwd_tma.cuh), whose ring TMA fills: 1.05-1.6x faster
// than this producer on the H200 (BENCHMARKS.md). cp.async stays for what TMA maps do not carry
// here: mask tiles, paged K/V rows, block-sparse calls and short d = 64 calls (two blocks per SM).
// The producer makes its copies visible to the
// async proxy (wgmma reads shared memory through it) itself: it waits for its own copies, fences
// (fence.proxy.async) and only then arrives on the stage's "full" barrier, the documented order
// for generic-proxy writes that async-proxy reads consume.
// Requires wgmma.cuh (cp_async_16).
#pragma once
#include "mbarrier.cuh"

namespace pyattn {

// Copy rows [row0, row0 + ROWS) of a (seq, head_dim) slice into a 128-byte-swizzled tile at
// shared address `dst`; rows at or past `row_end` and columns at or past `head_dim` are
// zero-filled (padded dims and keys past the end then contribute exactly nothing). NT threads
// share the copy; this one is `tid`.
template <class Tr, int ROWS, int NT>
__device__ __forceinline__ void wgmma_load_tile(unsigned dst, const typename Tr::T* src, long long row_stride,
                                                int row0, int row_end, int head_dim, int tid) {
  constexpr int kChunksPerRow = Tr::kHeadDim / 8;  // 16-byte chunks
  if constexpr (NT % kChunksPerRow == 0) {
    // Each thread keeps one chunk column; consecutive threads walk one row (coalesced).
    constexpr int kRowsPerPass = NT / kChunksPerRow;
    constexpr int kPasses = (ROWS + kRowsPerPass - 1) / kRowsPerPass;
    const int cc = tid % kChunksPerRow, col = cc * 8, r0 = tid / kChunksPerRow;
    const bool col_ok = col < head_dim;
    // Addresses strength-reduced: one 64-bit product per tile, then a constant step per pass
    // (computed per chunk they were ~18 instructions per copy, a third of a tile's instructions).
    // With kRowsPerPass a multiple of 8 a thread's swizzle phase (r & 7) is the same every pass.
    const typename Tr::T* g = src + (row0 + r0) * row_stride + col;
    const long long step = kRowsPerPass * row_stride;
    const unsigned d = dst + (cc >> 3) * (ROWS * 128) + r0 * 128;
    const auto at = [&](int pass) {  // the chunk's swizzled shared address in pass `pass`
      const int r = pass * kRowsPerPass + r0;
      return d + pass * kRowsPerPass * 128 + (((cc & 7) ^ ((kRowsPerPass % 8 == 0 ? r0 : r) & 7)) << 4);
    };
    if (col_ok && row0 + ROWS <= row_end) {  // a whole tile in range: no per-row checks
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass)
        if (ROWS % kRowsPerPass == 0 || pass * kRowsPerPass + r0 < ROWS) wg::cp_async_16(at(pass), g + pass * step, true);
    } else {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int r = pass * kRowsPerPass + r0;
        if (ROWS % kRowsPerPass == 0 || r < ROWS) {
          const bool ok = col_ok && row0 + r < row_end;
          wg::cp_async_16(at(pass), ok ? g + pass * step : src, ok);
        }
      }
    }
  } else {  // e.g. HEAD_DIM 192: 24 chunks per row; walk the flat chunk index instead
    constexpr int kChunks = ROWS * kChunksPerRow;
#pragma unroll
    for (int c0 = 0; c0 < kChunks; c0 += NT) {
      const int c = c0 + tid;
      if (kChunks % NT == 0 || c < kChunks) {
        const int r = c / kChunksPerRow, cc = c % kChunksPerRow, col = cc * 8;
        const bool ok = col < head_dim && row0 + r < row_end;
        const typename Tr::T* g = ok ? src + (row0 + r) * row_stride + col : src;
        wg::cp_async_16(dst + (cc >> 3) * (ROWS * 128) + r * 128 + (((cc & 7) ^ (r & 7)) << 4), g, ok);
      }
    }
  }
}

// The query tile of a paged prefill: tile row r (packed row R = row0 + r) is token R / row_group
// of query head (q's head) + R % row_group, so one tile holds a GQA group's heads of some tokens.
// Rows at or past `row_end` (rows of the sequence) and columns past `head_dim` are zero-filled.
// Once per block: the divisions stay out of the main loop.
template <class Tr, int ROWS, int NT>
__device__ __forceinline__ void wgmma_load_q_rows(unsigned dst, const typename Tr::T* q, long long stride_s,
                                                  long long stride_h, int row_group, int row0, int row_end,
                                                  int head_dim, int tid) {
  constexpr int kChunksPerRow = Tr::kHeadDim / 8, kChunks = ROWS * kChunksPerRow;
#pragma unroll 4
  for (int c = tid; c < kChunks; c += NT) {
    const int r = c / kChunksPerRow, cc = c % kChunksPerRow, col = cc * 8, row = row0 + r;
    const bool ok = col < head_dim && row < row_end;
    const int tok = row / row_group;
    const typename Tr::T* g = ok ? q + tok * stride_s + (row - tok * row_group) * stride_h + col : q;
    wg::cp_async_16(dst + (cc >> 3) * (ROWS * 128) + r * 128 + (((cc & 7) ^ (r & 7)) << 4), g, ok);
  }
}

// Copy the mask tile of query rows [m0, m0 + BLOCK_M) and keys [n0, n0 + BLOCK_N) to shared
// address `dst` (rows kMaskRow bytes apart), by NT threads (this one: `tid`). The caller guarantees 16-byte aligned mask rows with
// consecutive keys; rows past `sq` are not read, a chunk crossing `sk` reads only its keys in range
// (the rest is zero-filled: those keys are masked by position anyway).
template <class Tr, int NT>
__device__ __forceinline__ void wgmma_load_mask(unsigned dst, const char* mask, long long row_stride, int m0, int sq,
                                                int n0, int sk, int tid) {
  constexpr int MB = Tr::kMaskBytes, CPR = Tr::kBlockN * MB / 16, CHUNKS = Tr::kBlockM * CPR;
#pragma unroll
  for (int c0 = 0; c0 < CHUNKS; c0 += NT) {
    const int c = c0 + tid;
    if (CHUNKS % NT == 0 || c < CHUNKS) {
      const int r = c / CPR, key0 = n0 + (c % CPR) * (16 / MB);
      const int bytes = m0 + r < sq ? max(0, min(16, (sk - key0) * MB)) : 0;
      const char* src = bytes > 0 ? mask + ((m0 + r) * row_stride + key0) * MB : mask;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + r * Tr::kMaskRow + (c % CPR) * 16),
                   "l"(src), "r"(bytes) : "memory");
    }
  }
}

}  // namespace pyattn

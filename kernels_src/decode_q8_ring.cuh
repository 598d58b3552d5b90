// Where an 8-bit decode ring stage keeps its codes and records, for both 8-bit kernels (the cp.async
// ring of attention_decode_q8.cuh and the TMA boxes of attention_decode_q8_tma.cuh, whose consumers
// are decode_q8_stage.cuh's and decode_q8_swap.cuh's), and the per-channel records' zero fill.
// Requires common.cuh; includes tma.cuh (fence_shared).
#pragma once
#include "tma.cuh"

namespace pyattn {

// The cp.async ring's swizzle: chunk c of row r (rows of D bytes) is stored at c ^ q8_swizzle(r).
// Rows 2i and 2i+1 land in opposite halves of the 128-byte bank window (K reads: 2 rows x 4
// chunks per phase); rows 0, 2, 4, 6 in four different chunk pairs (V reads: 4 rows x 2 chunks).
template <int CHUNKS>
__device__ __forceinline__ int q8_swizzle(int r) {
  const int x = (((r >> 1) & 3) << 1) ^ ((r & 1) << 2);
  return CHUNKS >= 8 ? x : (x & (CHUNKS - 1));
}

// Byte offset of 16-byte chunk c of ring row r in a stage. cp.async ring: rows of D bytes,
// q8_swizzle. TMA ring: the boxes as the copy writes them, [D / 128][BLOCK_N][128 bytes] with the
// 128-byte swizzle (chunk c % 8 of a 128-byte row at (c % 8) ^ (r % 8); the stage starts on a
// 1024-byte boundary, where that pattern starts).
template <class Tr, bool TMA>
__device__ __forceinline__ int q8_chunk_at(int r, int c) {
  if constexpr (TMA) {
    return (c >> 3) * (Tr::kBlockN * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  } else {
    return r * Tr::kHeadDim + ((c ^ q8_swizzle<Tr::kHeadDim / 16>(r)) << 4);
  }
}

// The chunk quad lane t reads for K fragment group gi (64 head-dim columns): a phase reads rows
// r, r + 1 and the same t's. cp.async ring: chunks 4 gi + t (q8_swizzle separates the two rows).
// TMA ring: rows r and r ^ 1 store chunk c at c ^ r and c ^ r ^ 1 -- for the same 4 consecutive
// chunks that is the same 4 positions (a 2-way conflict) -- so a group takes every other chunk
// of its 128-byte region (2t + gi % 2): one row's four land on even positions, the other's on odd.
template <bool TMA>
__device__ __forceinline__ int q8_kchunk(int gi, int t) {
  return TMA ? 8 * (gi >> 1) + 2 * t + (gi & 1) : 4 * gi + t;
}

// Per-channel keys: each 16-key segment's page record in the ring: [S, idx, 0, 0] (16 bytes), fp16
// r[D], then the segment's 16 slots x kKeptChannels fp16 kept values.
constexpr int kKeptChannels = 4;  // as kv_pages.cuh / pyattn.quant.KEPT_CHANNELS
template <int D>
struct SegRec {
  static constexpr int kR = 16, kKept = 16 + 2 * D, kBytes = kKept + 16 * kKeptChannels * 2, kChunks = kBytes / 16;
};

// Per-channel keys, TMA ring: r past head_dim in every stage's segment records set to zeros (the
// record copies bring head_dim entries), the consumer warps' share each.
template <class Tr>
__device__ __forceinline__ void q8_zero_r_tails(unsigned char* sSeg, int head_dim) {
  constexpr int D = Tr::kHeadDim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (head_dim >= D) return;
  for (int rec = warp; rec < Tr::kStages * (Tr::kBlockN / 16); rec += Tr::kWarps)
    for (int i = 16 + 2 * head_dim + 2 * lane; i < SegRec<D>::kKept; i += 64)
      *reinterpret_cast<__half*>(sSeg + rec * SegRec<D>::kBytes + i) = __ushort_as_half(0);
}

}  // namespace pyattn

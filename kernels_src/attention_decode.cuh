// Decode attention over a paged KV cache (flash-decoding), fp16/bf16 on tensor cores.
//
// A block owns one (split, kv head, row block, sequence). Its rows are the group * q_len query
// rows that share the kv head (GQA: K/V bytes are read once per group), padded to 16 * M_TILES:
// row r is (query token r / group, query head kv_head * group + r % group). Keys stream through
// a STAGES-deep cp.async ring of BLOCK_N = WARPS * KEYS_PER_WARP keys; each key row's address
// comes from the page table (any page size, NHD or HND pools through their strides). Warp w
// takes keys [w * KEYS_PER_WARP, ...) of every stage and keeps its own online softmax state
// (mma.m16n8k16 for S = Q K^T and O += P V, P kept in registers as in attention_fwd_mma.cuh);
// the warps' states are merged through shared memory at the end. With num_splits > 1 the
// sequence's visible key tiles are divided among the splits, and each split writes a
// normalised fp32 partial and its LSE for merge_states<float, T> to combine.
// Requires pyattn::DecodeParams, common.cuh and mma.cuh.
#pragma once
#include "decode_common.cuh"

namespace pyattn {

// Issue the cp.async copies of keys [n0, n0 + BLOCK_N) of K and V into one ring stage; keys at or
// past n_end (and head-dim padding) are zero-filled without reading memory. kTpr threads share a key
// row (one page-table lookup and address per row, not per chunk); chunk c of the row goes to thread
// c % kTpr. With 8 threads a row each warp-wide copy reads whole 128-byte lines (4 rows x 128
// bytes): with 4 (64 bytes of 8 rows) every line took two requests, and an H200 decode at B64 x 32k
// ran with the memory system 91% busy at 78% of the DRAM bandwidth (28% of the sectors L2 hits of
// the line's first half; ncu, issue 12).
template <class Tr>
__device__ __forceinline__ void load_kv_stage(typename Tr::T* sK, typename Tr::T* sV, const DecodeParams& p,
                                              const int* pages, int n0, int n_end, long long k_head,
                                              long long v_head) {
  using T = typename Tr::T;
  constexpr int kTpr = Tr::kChunksPerRow % 8 == 0 ? 8 : 4;
  constexpr int kRowsPerPass = Tr::kThreads / kTpr, kChunks = Tr::kChunksPerRow / kTpr;
  constexpr int kPasses = Tr::kBlockN / kRowsPerPass;
  static_assert(Tr::kBlockN % kRowsPerPass == 0, "whole rows per copy pass");
  // Every pass's page-table entry first, then the copies (decode_common.cuh stage_entries says why).
  int page[kPasses], slot[kPasses];
  const int row = threadIdx.x / kTpr;
  stage_entries(p, pages, n_end, [&](int pass) { return n0 + pass * kRowsPerPass + row; }, page, slot);
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = pass * kRowsPerPass + threadIdx.x / kTpr, key = n0 + r, lane_r = threadIdx.x % kTpr;
    const T* gk = static_cast<const T*>(p.k);
    const T* gv = static_cast<const T*>(p.v);
    const bool row_ok = key < n_end;
    if (row_ok) {
      const long long pg = pool_page(page[pass], p.num_pages);
      gk += pg * p.k_stride_page + slot[pass] * p.k_stride_slot + k_head;
      gv += pg * p.v_stride_page + slot[pass] * p.v_stride_slot + v_head;
    }
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int col = (kTpr * j + lane_r) * 8;
      const bool ok = row_ok && col < p.head_dim;
      cp_async_16(sK + r * Tr::kStride + col, ok ? gk + col : gk, ok);
    }
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int col = (kTpr * j + lane_r) * 8;
      const bool ok = row_ok && col < p.head_dim;
      cp_async_16(sV + r * Tr::kStride + col, ok ? gv + col : gv, ok);
    }
  }
}

// One ring stage's work of one warp: S = Q K^T over its KW keys (tK, tV: its first key row of the
// stage; n0: that key), the modifiers and masks, the online softmax and O += P V. Q's A fragments
// come from registers (qf, QREGS) or from sQ. K / V rows: padded (kStride elements, cp.async) or,
// SWZ, the TMA ring's [BLOCK_N / 16][head_dim / 64][16][64] 128-byte-swizzled boxes
// (attention_decode_tma.cuh).
template <class Tr, bool SOFTCAP, bool ALIBI, bool QREGS, bool SWZ = false>
__device__ __forceinline__ void decode16_stage(const typename Tr::T* sQ, const unsigned (&qf)[QREGS ? Tr::kHeadDim / 16 : 1][4],
                                               const typename Tr::T* tK, const typename Tr::T* tV, int n0,
                                               const DecodeParams& p, const DecodeRows<Tr::kMTiles, ALIBI>& rows,
                                               const Band& band, int qi_lo, int qi_hi, int kv_len, float sl2,
                                               float (&acc)[Tr::kMTiles][Tr::kHeadDim / 8][4],
                                               float (&row_max)[Tr::kMTiles][2], float (&row_sum)[Tr::kMTiles][2]) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles, LD = Tr::kStride;
  constexpr int NT = KW / 8, DT = D / 8;
  constexpr bool kMods = SOFTCAP || ALIBI;
  const int lane = threadIdx.x % 32, t = lane % 4;
  // Fragment loads are issued in batches ahead of their MMAs: the asm statements keep program
  // order, so interleaving ldmatrix and mma would stall every MMA on its load's latency.
  constexpr int KG = (D / 16) % 4 == 0 ? 4 : 2;  // k16 steps of K fragments per batch
  constexpr int VG = (D / 16) % 8 == 0 ? 8 : (D / 16) % 4 == 0 ? 4 : 2;  // ldmatrix.x4.trans of V per batch
  // Element (row r, column c) of a K / V tile; c is a multiple of 8 (a 16-byte chunk).
  const auto at = [](const T* base, int r, int c) {
    if constexpr (SWZ) {
      return swizzled_box_at<D>(base, r, c);
    } else {
      return base + r * LD + c;
    }
  };

  float s[MT][NT][4];
  zero_tiles<MT, NT>(s);
#pragma unroll
  for (int k0 = 0; k0 < D / 16; k0 += KG) {
    unsigned bk[KG][NT / 2][4];
#pragma unroll
    for (int kk = 0; kk < KG; ++kk)
#pragma unroll
      for (int np = 0; np < NT / 2; ++np)
        ldmatrix_x4(bk[kk][np], at(tK, np * 16 + (lane & 7) + ((lane >> 4) << 3), (k0 + kk) * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
    for (int kk = 0; kk < KG; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        if constexpr (QREGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mi][i] = qf[k0 + kk][i];
        } else {
          ldmatrix_x4(a[mi], sQ + (mi * 16 + (lane & 15)) * LD + (k0 + kk) * 16 + (lane >> 4) * 8);
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16816<T>(s[mi][2 * np], a[mi], bk[kk][np][0], bk[kk][np][1]);
          mma_16816<T>(s[mi][2 * np + 1], a[mi], bk[kk][np][2], bk[kk][np][3]);
        }
    }
  }

  // -- modifiers and masking: past the end, outside the band, or a padding row -> -inf
  if (kMods || !band_tile_full<KW>(band, qi_lo, qi_hi, n0, kv_len)) rows.template mask<NT, SOFTCAP>(s, p, band, n0 + 2 * t);

  // -- online softmax (the 4 lanes of a quad share rows g and g + 8)
  online_softmax<MT, NT, DT>(s, acc, row_max, row_sum, sl2);

  // -- O += P V
#pragma unroll
  for (int kk = 0; kk < KW / 16; ++kk) {
    unsigned a[MT][4];
    p_fragments<T, MT, NT>(s, kk, a);
#pragma unroll
    for (int d0 = 0; d0 < DT / 2; d0 += VG) {
      unsigned bv[VG][4];
#pragma unroll
      for (int dp = 0; dp < VG; ++dp)
        ldmatrix_x4_trans(bv[dp], at(tV, kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, (d0 + dp) * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int dp = 0; dp < VG; ++dp)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16816<T>(acc[mi][2 * (d0 + dp)], a[mi], bv[dp][0], bv[dp][1]);
          mma_16816<T>(acc[mi][2 * (d0 + dp) + 1], a[mi], bv[dp][2], bv[dp][3]);
        }
    }
  }
}

// One row tile at d <= 128: Q's A fragments stay in registers for the whole loop (32 registers),
// taking 8 ldmatrix per stage off the dependency chain; otherwise they are re-read per stage.
template <class Tr>
constexpr bool kDecodeQRegs = Tr::kMTiles == 1 && Tr::kHeadDim <= 128;

// Read Q's A fragments into registers (after Q landed in sQ for every warp).
template <class Tr>
__device__ __forceinline__ void decode16_q_fragments(const typename Tr::T* sQ, unsigned (&qf)[kDecodeQRegs<Tr> ? Tr::kHeadDim / 16 : 1][4]) {
  if constexpr (kDecodeQRegs<Tr>) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk)
      ldmatrix_x4(qf[kk], sQ + (lane & 15) * Tr::kStride + kk * 16 + (lane >> 4) * 8);
  }
}

template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void attn_decode16(const DecodeParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles;
  constexpr int ROWS = Tr::kRows, LD = Tr::kStride, S = Tr::kStages;
  constexpr int DT = D / 8;
  constexpr bool kMods = SOFTCAP || ALIBI, kQRegs = kDecodeQRegs<Tr>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // the host's shared_bytes and this layout disagree
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [ROWS][LD]
  T* sK = sQ + ROWS * LD;                  // [S][KB][LD]
  T* sV = sK + S * KB * LD;                // [S][KB][LD]

  const DecodeBlock<Tr> blk(p);
  const int n_tiles = blk.n_tiles, n_first = blk.n_first, end = blk.end;
  const int* pages = blk.pages;
  const long long k_head = blk.kv_head * p.k_stride_h, v_head = blk.kv_head * p.v_stride_h;
  const int warp = threadIdx.x / 32;

  // -- prologue: Q (zero rows past the group) and the first S - 1 stages in flight
  load_q<Tr>(sQ, p, blk);
  cp_async_commit();  // Q alone in group 0, so it can be read before stage 0 lands
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < n_tiles) load_kv_stage<Tr>(sK + st * KB * LD, sV + st * KB * LD, p, pages, n_first + st * KB, end, k_head, v_head);
    cp_async_commit();  // empty groups keep the wait counts uniform
  }

  const DecodeRows<MT, ALIBI> rows(p, blk.b, blk.kv_head, blk.r0, blk.n_rows, blk.kv_len);

  float acc[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
  init_softmax_state<MT, DT>(acc, row_max, row_sum);
  const float sl2 = kMods ? 1.f : p.scale_log2;  // with modifiers s is final (log2 units) before the softmax

  unsigned qf[kQRegs ? D / 16 : 1][4];
  if constexpr (kQRegs) {
    cp_async_wait<S - 1>();  // group 0 (Q) landed
    __syncthreads();
    decode16_q_fragments<Tr>(sQ, qf);
  }

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<S - 2>();
    __syncthreads();  // stage j landed for all, and every warp is done with stage j - 1
    if (j + S - 1 < n_tiles) {
      const int st = (j + S - 1) % S;
      load_kv_stage<Tr>(sK + st * KB * LD, sV + st * KB * LD, p, pages, n_first + (j + S - 1) * KB, end, k_head, v_head);
    }
    cp_async_commit();
    decode16_stage<Tr, SOFTCAP, ALIBI, kQRegs>(sQ, qf, sK + (j % S) * KB * LD + warp * KW * LD,
                                               sV + (j % S) * KB * LD + warp * KW * LD, n_first + j * KB + warp * KW,
                                               p, rows, blk.band, blk.qi_lo, blk.qi_hi, blk.kv_len, sl2, acc,
                                               row_max, row_sum);
  }

  decode_epilogue<Tr>(p, acc, row_max, row_sum, sl2, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, blk.n_rows);
}

}  // namespace pyattn

#include "attention_decode_q8.cuh"
#include "attention_decode_tma.cuh"
#include "decode_q8_swap.cuh"
#include "attention_decode_q8_tma.cuh"

namespace pyattn {

// The entry point: 16-bit caches or 8-bit codes with fp32 scales, each read by cp.async copies of
// the compute warps or by TMA copies of a producer warp.
template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void attn_decode(const DecodeParams& p) {
  if constexpr (Tr::kKv == 0 && Tr::kProducer) {
    attn_decode16_tma<Tr, SOFTCAP, ALIBI>(p);
  } else if constexpr (Tr::kKv == 0) {
    attn_decode16<Tr, SOFTCAP, ALIBI>(p);
  } else if constexpr (Tr::kProducer) {
    attn_decode_q8_tma<Tr, SOFTCAP, ALIBI>(p);
  } else {
    attn_decode_q8<Tr, SOFTCAP, ALIBI>(p);
  }
}

}  // namespace pyattn

// FlashAttention-2-style fused forward pass on CUDA cores (fp32 FMA for every input dtype).
//
// One block owns BLOCK_M query rows of one (batch, query head). It walks the key/value tiles
// that the causal mask leaves visible, keeps a running row max and row sum (online softmax) and
// a running output in registers, so no seqlen_q x seqlen_k matrix ever reaches global memory.
//
// Work split inside a block: warp w owns rows [w*ROWS, (w+1)*ROWS); within a warp, lane l owns
// key n0+l of the current tile for S = Q K^T, and head-dim elements l, l+32, ... for O += P V.
// Requires pyattn::AttnFwdParams (rendered by pyattn.jit.source) and common.cuh.
#pragma once
#include "attention_mask.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_>
struct AttnFwdSimtTraits {
  using T = T_;
  static constexpr int kHeadDim = HEAD_DIM_;  // compiled bucket; params.head_dim <= kHeadDim
  static constexpr int kBlockM = BLOCK_M_;
  static constexpr int kBlockN = BLOCK_N_;
  static constexpr int kWarps = WARPS_;
  static constexpr int kThreads = WARPS_ * 32;
  static constexpr int kRowsPerWarp = BLOCK_M_ / WARPS_;
  static constexpr int kDimsPerLane = HEAD_DIM_ / 32;
  // K rows padded by one float: lane l reads K[l][d], and the pad puts those 32 reads in 32 banks.
  static constexpr int kKStride = HEAD_DIM_ + 1;
  // Dynamic shared memory, fp32: Q [BLOCK_M][D], K [BLOCK_N][kKStride], V [BLOCK_N][D] (the kernel's carve-up).
  static constexpr int kSmemBytes = 4 * (BLOCK_M_ * HEAD_DIM_ + BLOCK_N_ * kKStride + BLOCK_N_ * HEAD_DIM_);
  static_assert(BLOCK_N_ == 32, "one key per lane");
  static_assert(HEAD_DIM_ % 32 == 0, "head-dim bucket must be a multiple of the warp width");
  static_assert(BLOCK_M_ % WARPS_ == 0, "rows must split evenly across warps");
};

template <class Traits, class Mods>
__device__ __forceinline__ void attn_fwd_simt(const AttnFwdParams& p) {
  using T = typename Traits::T;
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int ROWS = Traits::kRowsPerWarp, DPL = Traits::kDimsPerLane, KS = Traits::kKStride;

  extern __shared__ float smem[];
  float* sQ = smem;              // [BM][D], pre-scaled by scale*log2(e)
  float* sK = sQ + BM * D;       // [BN][KS]
  float* sV = sK + BN * KS;      // [BN][D]

  const int m0 = blockIdx.x * BM, head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  const int sq = seq.sq, sk = seq.sk;
  if (m0 >= sq) return;  // varlen: this sequence is shorter than the longest (whole block exits)
  const int kv_head = head / p.group;  // GQA/MQA: `group` query heads share one KV head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride_b + head * p.q_stride_h + seq.q_row0 * p.q_stride_s;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  T* o = static_cast<T*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + seq.q_row0 * p.o_stride_s;

  const Band band = make_band(p, sq, sk);
  int n_begin, n_end;  // key tiles outside every row's band are skipped
  band_key_range<BN>(band, m0, min(m0 + BM, sq) - 1, sk, n_begin, n_end);
  const ModState mods = make_mod_state<Mods>(p, batch, head, sq, sk);
  // Q is pre-scaled into log2 units, unless the modifiers need the natural-unit score first.
  const float q_scale = Mods::kAny ? 1.f : p.scale_log2;

  // -- load the Q tile (zero outside the problem, so padded rows and dims contribute nothing)
  for (int i = threadIdx.x; i < BM * D; i += Traits::kThreads) {
    const int r = i / D, d = i % D;
    float x = 0.f;
    if (m0 + r < sq && d < p.head_dim) x = to_float(q[(m0 + r) * p.q_stride_s + d]) * q_scale;
    sQ[i] = x;
  }

  float acc[ROWS][DPL];
  float row_max[ROWS], row_sum[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    row_max[r] = -inf();
    row_sum[r] = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) acc[r][j] = 0.f;
  }

  for (int n0 = n_begin; n0 < n_end; n0 += BN) {
    __syncthreads();  // every warp is done reading the previous K/V tile (and sQ is written)
    // -- load K and V tiles
    for (int i = threadIdx.x; i < BN * D; i += Traits::kThreads) {
      const int r = i / D, d = i % D;
      const bool ok = n0 + r < sk && d < p.head_dim;
      sK[r * KS + d] = ok ? to_float(k[(n0 + r) * p.k_stride_s + d]) : 0.f;
      sV[r * D + d] = ok ? to_float(v[(n0 + r) * p.v_stride_s + d]) : 0.f;
    }
    __syncthreads();

    // -- S = Q K^T for this lane's key, in log2 units
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) s[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      const float kd = sK[lane * KS + d];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) s[r] = fmaf(sQ[(warp * ROWS + r) * D + d], kd, s[r]);
    }

    // -- score modifiers, then keys past the end or outside the row's band
    const int key = n0 + lane;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = m0 + warp * ROWS + r;
      const bool ok = key < sk && row < sq && band.allows(row, key);
      if constexpr (Mods::kAny) s[r] = ok ? score_mod<Mods>(p, mods, s[r], row, key) : -inf();
      else if (!ok) s[r] = -inf();
    }

    // -- online softmax update: rescale what was accumulated under the old max
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float new_max = fmaxf(row_max[r], warp_max(s[r]));
      // A row with no visible key yet keeps max -inf; exponentiate against 0 so that
      // (-inf) - (-inf) never produces NaN. Its probabilities are all exp2(-inf) = 0.
      const float ref = new_max == -inf() ? 0.f : new_max;
      const float pr = exp2f(s[r] - ref);
      const float correction = exp2f(row_max[r] - ref);
      row_sum[r] = row_sum[r] * correction + warp_sum(pr);
      row_max[r] = new_max;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[r][j] *= correction;
      s[r] = pr;
    }

    // -- O += P V: each key's probability lives in its lane; broadcast it to the warp
#pragma unroll 4
    for (int j = 0; j < BN; ++j) {
      const float* vrow = sV + j * D;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float pj = __shfl_sync(kFullMask, s[r], j);
#pragma unroll
        for (int c = 0; c < DPL; ++c) acc[r][c] = fmaf(pj, vrow[c * 32 + lane], acc[r][c]);
      }
    }
  }

  // -- epilogue: normalise, store O and the natural-log LSE; a row that saw no key gets 0 / -inf
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = m0 + warp * ROWS + r;
    if (row >= sq) continue;
    const bool empty = row_sum[r] == 0.f;
    const float inv = empty ? 0.f : 1.f / row_sum[r];
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int d = c * 32 + lane;
      if (d < p.head_dim) o[row * p.o_stride_s + d] = from_float<T>(acc[r][c] * inv);
    }
    if (p.lse != nullptr && lane == 0) {
      const long long idx = batch * p.lse_stride_b + head * p.lse_stride_h + seq.q_row0 + row;
      p.lse[idx] = empty ? -inf() : (row_max[r] + log2f(row_sum[r])) * kLn2;
    }
  }
}

}  // namespace pyattn

// The backward pass on CUDA cores (fp32 FMA; pyattn's exact float32 path), same structure as
// attention_bwd_mma.cuh: one block owns BLOCK_N = 32 keys of one (batch, key/value head), keeps
// their K and V (fp32) in shared memory and dK, dV in registers, and walks every query tile of
// BLOCK_M rows that sees them, for each query head of the GQA group. Per query tile:
//   1. Q, dO (fp32), LSE (log2 units) and dsum of the tile -> shared memory
//   2. warp w, rows w * ROWS ..: lane l computes S and dP of key l (dot products over the head dim),
//      P = exp2(score - LSE), dS = P (dP - dsum) [* (1 - tanh^2)]  -> shared memory
//   3. thread (warp w, lane l) owns key l and head dims w, w + WARPS, ...: dV += P^T dO, dK += dS^T Q
//   4. thread (warp w, lane l) owns rows w * ROWS .. and head dims l, l + 32, ..: dQ = dS K, added to
//      the fp32 dq_acc (atomics, or in key-block order with `deterministic`)
// Requires pyattn::AttnBwdParams and common.cuh.
#pragma once
#include "attention_bwd_common.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_>
struct AttnBwdSimtTraits {
  using T = T_;
  static constexpr int kHeadDim = HEAD_DIM_, kBlockM = BLOCK_M_, kBlockN = BLOCK_N_, kWarps = WARPS_;
  static constexpr int kThreads = 32 * WARPS_;
  static constexpr int kRows = BLOCK_M_ / WARPS_;  // query rows per warp in steps 2 and 4
  static constexpr int kKS = HEAD_DIM_ + 1;       // K/V rows padded by a word: lane l reads row l conflict-free
  static constexpr int kPS = BLOCK_N_ + 1;        // P/dS rows
  static constexpr int kSmemBytes = 4 * (2 * BLOCK_N_ * kKS + 2 * BLOCK_M_ * HEAD_DIM_ + 2 * BLOCK_M_ * kPS + 2 * BLOCK_M_);
  static_assert(BLOCK_N_ == 32, "one key per lane");
  static_assert(HEAD_DIM_ % 32 == 0 && HEAD_DIM_ % WARPS_ == 0, "head-dim bucket splits over lanes and warps");
  static_assert(BLOCK_M_ % WARPS_ == 0 && BLOCK_M_ <= kBwdRowPad, "rows split evenly; padding covers a tile");
};

template <class Tr, class Mods>
__device__ __forceinline__ void attn_bwd_simt(const AttnBwdParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, W = Tr::kWarps, ROWS = Tr::kRows;
  constexpr int KS = Tr::kKS, PS = Tr::kPS, DW = D / W, DL = D / 32;

  extern __shared__ float smem[];
  float* sK = smem;              // [BN][KS]
  float* sV = sK + BN * KS;      // [BN][KS]
  float* sQ = sV + BN * KS;      // [BM][D]
  float* sdO = sQ + BM * D;      // [BM][D]
  float* sP = sdO + BM * D;      // [BM][PS]
  float* sDS = sP + BM * PS;     // [BM][PS]
  float* sL = sDS + BM * PS;     // [BM] LSE, log2 units
  float* sDsum = sL + BM;        // [BM]

  int n_block, kv_head, batch;
  bwd_block(p, n_block, kv_head, batch);
  const BwdSeq seq = bwd_seq(p, batch);
  const int sq = seq.sq, sk = seq.sk, n0 = n_block * BN;
  if (n0 >= sk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  for (int i = threadIdx.x; i < BN * D; i += Tr::kThreads) {
    const int r = i / D, d = i % D;
    const bool ok = n0 + r < sk && d < p.head_dim;
    sK[r * KS + d] = ok ? to_float(k[(n0 + r) * p.k_stride_s + d]) : 0.f;
    sV[r * KS + d] = ok ? to_float(v[(n0 + r) * p.v_stride_s + d]) : 0.f;
  }
  const Band band = make_band(p, sq, sk);
  int m_begin, m_end;
  band_query_tiles<BM>(band, n0, min(n0 + BN, sk) - 1, sq, m_begin, m_end);
  const int n_m = m_end - m_begin, iters = n_m * p.group, diag = sk - sq;

  float dk[DW], dv[DW];  // key `lane`, head dims warp + W * c
#pragma unroll
  for (int c = 0; c < DW; ++c) dk[c] = dv[c] = 0.f;

  for (int it = 0; it < iters; ++it) {
    const int hq = kv_head * p.group + it / n_m, m = m_begin + it % n_m, m0 = m * BM;
    // -- 1. the query tile (zero past the sequence and the head dim)
    __syncthreads();  // every thread is done with the previous tile (and sK/sV are written)
    const T *q, *dout;
    bwd_query_rows(p, seq, batch, hq, q, dout);
    for (int i = threadIdx.x; i < BM * D; i += Tr::kThreads) {
      const int r = i / D, d = i % D;
      const bool ok = m0 + r < sq && d < p.head_dim;
      sQ[i] = ok ? to_float(q[(m0 + r) * p.q_stride_s + d]) : 0.f;
      sdO[i] = ok ? to_float(dout[(m0 + r) * p.dout_stride_s + d]) : 0.f;
    }
    const long long r0 = acc_row(p, seq, batch, hq) + m0;
    for (int i = threadIdx.x; i < BM; i += Tr::kThreads) {
      sL[i] = p.lse_log2[r0 + i];
      sDsum[i] = p.dsum[r0 + i];
    }
    __syncthreads();

    // -- 2. P and dS of rows warp * ROWS + r, key lane
    float slope = 0.f;
    if constexpr (Mods::kAlibi) slope = p.alibi[batch * p.alibi_stride_b + hq];
    const int key = n0 + lane;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int i = warp * ROWS + r, row = m0 + i;
      float s = 0.f, dp = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        s = fmaf(sQ[i * D + d], sK[lane * KS + d], s);
        dp = fmaf(sdO[i * D + d], sV[lane * KS + d], dp);
      }
      float dcap = 1.f, sc;
      if constexpr (Mods::kAny) sc = bwd_score<Mods>(p, s, slope, row, key, diag, dcap);
      else sc = s * p.scale_log2;
      const bool ok = key < sk && row < sq && band.allows(row, key);
      const float pv = ok ? exp2f(sc - sL[i]) : 0.f;
      sP[i * PS + lane] = pv;
      sDS[i * PS + lane] = pv * (dp - sDsum[i]) * dcap;
    }
    __syncthreads();

    // -- 3. dV += P^T dO, dK += dS^T Q for key `lane`
#pragma unroll 4
    for (int i = 0; i < BM; ++i) {
      const float pv = sP[i * PS + lane], ds = sDS[i * PS + lane];
#pragma unroll
      for (int c = 0; c < DW; ++c) {
        dv[c] = fmaf(pv, sdO[i * D + warp + W * c], dv[c]);
        dk[c] = fmaf(ds, sQ[i * D + warp + W * c], dk[c]);
      }
    }

    // -- 4. dQ of rows warp * ROWS + r, head dims lane + 32 c, summed over the 32 keys in order
    float dq[ROWS][DL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int c = 0; c < DL; ++c) dq[r][c] = 0.f;
#pragma unroll 4
    for (int j = 0; j < BN; ++j)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float ds = sDS[(warp * ROWS + r) * PS + j];
#pragma unroll
        for (int c = 0; c < DL; ++c) dq[r][c] = fmaf(ds, sK[j * KS + lane + 32 * c], dq[r][c]);
      }
    int* sem = nullptr;
    if (p.deterministic) {
      sem = p.sem + (static_cast<long long>(batch) * p.heads_q + hq) * p.m_blocks + m;
      sem_wait(sem, n_block - band_first_key_tile<BN>(band, m0));
    }
    float* acc = p.dq_acc + r0 * p.head_dim;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int i = warp * ROWS + r;
      if (m0 + i >= sq) continue;
#pragma unroll
      for (int c = 0; c < DL; ++c)
        if (lane + 32 * c < p.head_dim) atomicAdd(acc + i * p.head_dim + lane + 32 * c, dq[r][c]);
    }
    if (p.deterministic) sem_arrive(sem);
  }

  // -- epilogue: dK (scaled) and dV of key n0 + lane
  const int key = n0 + lane;
  if (key < sk) {
    T* dkp = static_cast<T*>(p.dk) + batch * p.dk_stride_b + kv_head * p.dk_stride_h + (seq.k_row0 + key) * p.dk_stride_s;
    T* dvp = static_cast<T*>(p.dv) + batch * p.dv_stride_b + kv_head * p.dv_stride_h + (seq.k_row0 + key) * p.dv_stride_s;
#pragma unroll
    for (int c = 0; c < DW; ++c) {
      const int d = warp + W * c;
      if (d < p.head_dim) {
        dkp[d] = from_float<T>(dk[c] * p.scale);
        dvp[d] = from_float<T>(dv[c]);
      }
    }
  }
}

}  // namespace pyattn

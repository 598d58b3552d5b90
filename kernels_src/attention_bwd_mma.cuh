// FlashAttention-2-style backward pass on tensor cores (fp16/bf16 in, fp32 accumulate), mma.sync.
//
// One block owns BLOCK_N keys of one (batch, key/value head): their K and V tiles stay in shared
// memory, their dK and dV accumulate in registers, and the block walks every query tile of
// BLOCK_M rows that sees them, for each query head of the GQA group in turn (so dK and dV come
// out summed over the group, written once, no atomics). Per query tile, with S^T = K Q^T held
// as keys x queries (the keys a warp owns are the rows of its fragments):
//   dP^T = V dO^T;  S^T = K Q^T;  P^T = exp2(score - LSE);  dS^T = P^T (dP^T - dsum) [* (1 - tanh^2)]
//   dV += P^T dO;   dK += dS^T Q;  dQ = dS K  -> added to the fp32 dq_acc (atomics, or in key
//   block order under `deterministic`; see attention_bwd_common.cuh)
// P comes from the forward's LSE (pre-kernel: log2 units), so no softmax statistics are redone.
//
// Warps: SPLIT warps share each key slice of BLOCK_N / (WARPS / SPLIT) keys, splitting the
// queries of S^T and the head dim of dK/dV. With SPLIT 1 a warp's P^T and dS^T fragments are
// exactly the A operands of its dV and dK products and stay in registers (the C layout of two
// n8 tiles is the A layout of one k16 step, see mma.cuh); dS^T also goes to shared memory for
// dQ. With SPLIT > 1 (large head dims, whose dK + dV would not fit one warp's registers) both go
// through shared memory. dQ is split DQ_WARPS_M x (WARPS / DQ_WARPS_M) over (query rows, head dim).
// STAGES 2 prefetches the next Q/dO tile during this one (cp.async); 1 loads it in place.
// Requires pyattn::AttnBwdParams, common.cuh, mma.cuh.
#pragma once
#include "attention_bwd_common.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_, int SPLIT_, int DQ_WARPS_M_,
          int STAGES_>
struct AttnBwdMmaTraits {
  using T = T_;
  static constexpr int kHeadDim = HEAD_DIM_, kBlockM = BLOCK_M_, kBlockN = BLOCK_N_;
  static constexpr int kWarps = WARPS_, kThreads = 32 * WARPS_, kStages = STAGES_;
  static constexpr int kSplit = SPLIT_;
  static constexpr int kKeysPerWarp = BLOCK_N_ / (WARPS_ / SPLIT_);
  static constexpr int kQueriesPerWarp = BLOCK_M_ / SPLIT_;  // columns of S^T
  static constexpr int kDimsPerWarp = HEAD_DIM_ / SPLIT_;    // columns of dK, dV
  static constexpr int kDqWarpsM = DQ_WARPS_M_;
  static constexpr int kDqRows = BLOCK_M_ / DQ_WARPS_M_, kDqDims = HEAD_DIM_ / (WARPS_ / DQ_WARPS_M_);
  static constexpr bool kRegP = SPLIT_ == 1;
  // Rows padded by 8 elements (16 bytes): 8 ldmatrix row addresses then hit 8 distinct 16-byte bank groups.
  static constexpr int kStride = HEAD_DIM_ + 8;  // K, V, Q, dO rows
  static constexpr int kPStride = BLOCK_M_ + 8;  // P^T, dS^T rows (keys)
  static constexpr int kChunksPerRow = HEAD_DIM_ / 8;
  static constexpr int kSmemBytes =
      static_cast<int>(sizeof(T_)) * (2 * BLOCK_N_ * kStride + 2 * STAGES_ * BLOCK_M_ * kStride +
                                       (kRegP ? 1 : 2) * BLOCK_N_ * kPStride) + 8 * STAGES_ * BLOCK_M_;
  static_assert(WARPS_ % SPLIT_ == 0 && WARPS_ % DQ_WARPS_M_ == 0, "warp layouts");
  static_assert(kKeysPerWarp % 16 == 0 && BLOCK_N_ % (WARPS_ / SPLIT_) == 0, "whole m16 key tiles per warp");
  static_assert(kQueriesPerWarp % 16 == 0 && kDimsPerWarp % 16 == 0, "n8 tile pairs (one ldmatrix.x4 each)");
  static_assert(kDqRows % 16 == 0 && kDqDims % 16 == 0, "dQ: m16 row tiles, n8 tile pairs");
  static_assert(BLOCK_M_ <= kBwdRowPad, "the varlen scratch padding covers one query tile");
  static_assert(STAGES_ == 1 || STAGES_ == 2, "one or two Q/dO stages");
};

// rows [first, first + ROWS) of a (rows x head_dim) matrix -> shared memory, 16-byte cp.async
// chunks; rows past `end` and columns past head_dim are zero-filled.
template <class Tr, int ROWS>
__device__ __forceinline__ void bwd_load_rows(typename Tr::T* dst, const typename Tr::T* src, long long stride,
                                              int first, int end, int head_dim) {
  for (int c = threadIdx.x; c < ROWS * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = (c % Tr::kChunksPerRow) * 8;
    const bool ok = first + r < end && col < head_dim;
    cp_async_16(dst + r * Tr::kStride + col, ok ? src + (first + r) * stride + col : src, ok);
  }
}

template <class Tr, class Mods>
__device__ __forceinline__ void attn_bwd_mma(const AttnBwdParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, LD = Tr::kStride, LP = Tr::kPStride;
  constexpr int ST = Tr::kStages;
  constexpr int MTK = Tr::kKeysPerWarp / 16;    // m16 key tiles per warp (S^T, dP^T, dK, dV rows)
  constexpr int NTQ = Tr::kQueriesPerWarp / 8;  // n8 query tiles per warp (S^T columns)
  constexpr int NTD = Tr::kDimsPerWarp / 8;     // n8 head-dim tiles per warp (dK, dV columns)
  constexpr int MTQ = Tr::kDqRows / 16, NTDQ = Tr::kDqDims / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);  // [BN][LD]
  T* sV = sK + BN * LD;                    // [BN][LD]
  T* sQ = sV + BN * LD;                    // [ST][BM][LD]
  T* sdO = sQ + ST * BM * LD;              // [ST][BM][LD]
  T* sDS = sdO + ST * BM * LD;             // [BN][LP] dS^T
  T* sP = sDS + BN * LP;                   // [BN][LP] P^T (SPLIT > 1 only)
  float* sLse = reinterpret_cast<float*>(sDS + (Tr::kRegP ? 1 : 2) * BN * LP);  // [ST][BM], log2 units
  float* sDsum = sLse + ST * BM;                                                // [ST][BM]

  int n_block, kv_head, batch;
  bwd_block(p, n_block, kv_head, batch);
  const BwdSeq seq = bwd_seq(p, batch);
  const int sq = seq.sq, sk = seq.sk, n0 = n_block * BN;
  if (n0 >= sk) return;  // varlen: this sequence has fewer keys than the longest
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int key_base = (warp % (Tr::kWarps / Tr::kSplit)) * Tr::kKeysPerWarp;  // within the block
  const int split = warp / (Tr::kWarps / Tr::kSplit);
  const int q_base = split * Tr::kQueriesPerWarp, d_base = split * Tr::kDimsPerWarp;
  const int dq_rows = (warp % Tr::kDqWarpsM) * Tr::kDqRows, dq_dims = (warp / Tr::kDqWarpsM) * Tr::kDqDims;

  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  const BwdWalk<BM, BN> walk(p, sq, sk, n0);
  const Band band = walk.band;
  const int m_begin = walk.m_begin, m_end = walk.m_end, iters = walk.iters;

  // One query tile's operands: Q and dO rows, its LSE and dsum, all cp.async (one commit group).
  // Iterations walk (query head, query tile)
  // head-major: all tiles of the group's first head, then the next.
  auto load_tile = [&](int hq, int m, int stage) {
    const int m0 = m * BM;
    const T *q, *dout;
    bwd_query_rows(p, seq, batch, hq, q, dout);
    bwd_load_rows<Tr, BM>(sQ + stage * BM * LD, q, p.q_stride_s, m0, sq, p.head_dim);
    bwd_load_rows<Tr, BM>(sdO + stage * BM * LD, dout, p.dout_stride_s, m0, sq, p.head_dim);
    const long long r = acc_row(p, seq, batch, hq) + m0;  // padded rows exist up to the tile's end
    for (int i = threadIdx.x; i < BM; i += Tr::kThreads) {
      cp_async_4(sLse + stage * BM + i, p.lse_log2 + r + i);
      cp_async_4(sDsum + stage * BM + i, p.dsum + r + i);
    }
  };

  // -- prologue: K, V and the first query tile in flight
  bwd_load_rows<Tr, BN>(sK, k, p.k_stride_s, n0, sk, p.head_dim);
  bwd_load_rows<Tr, BN>(sV, v, p.v_stride_s, n0, sk, p.head_dim);
  if (iters > 0) load_tile(kv_head * p.group, m_begin, 0);
  cp_async_commit();

  float dk[MTK][NTD][4], dv[MTK][NTD][4];
  zero_tiles<MTK, NTD>(dk);
  zero_tiles<MTK, NTD>(dv);
  const int diag = sk - sq;

  int hq = kv_head * p.group, m = m_begin;  // this iteration's query head and tile
  for (int it = 0; it < iters; ++it) {
    const int m0 = m * BM, stage = ST == 2 ? (it & 1) : 0;
    const bool last_m = m + 1 == m_end;
    const int hq_next = last_m ? hq + 1 : hq, m_next = last_m ? m_begin : m + 1;
    if (ST == 1 && it > 0) {  // one stage: every warp is done with the previous tile, then load in place
      __syncthreads();
      load_tile(hq, m, 0);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();  // tile `it` landed for everyone; every warp is done with tile it - 1 (and sDS)
    if (ST == 2 && it + 1 < iters) {
      load_tile(hq_next, m_next, stage ^ 1);
      cp_async_commit();
    }
    const T* tQ = sQ + stage * BM * LD;
    const T* tdO = sdO + stage * BM * LD;
    const float* tL = sLse + stage * BM;
    const float* tDs = sDsum + stage * BM;

    // -- dP^T = V dO^T and S^T = K Q^T (fp32): A from the warp's key rows, B from the query rows
    float dp[MTK][NTQ][4], s[MTK][NTQ][4];
    zero_tiles<MTK, NTQ>(dp);
    zero_tiles<MTK, NTQ>(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned av[MTK][4], ak[MTK][4];
#pragma unroll
      for (int mi = 0; mi < MTK; ++mi) {
        const int row = key_base + mi * 16 + (lane & 15);
        ldmatrix_x4(av[mi], sV + row * LD + kk * 16 + (lane >> 4) * 8);
        ldmatrix_x4(ak[mi], sK + row * LD + kk * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int nt = 0; nt < NTQ; nt += 2) {  // one ldmatrix.x4 feeds two n8 tiles
        const int row = q_base + nt * 8 + (lane & 7) + ((lane >> 4) << 3);
        unsigned bo[4], bq[4];
        ldmatrix_x4(bo, tdO + row * LD + kk * 16 + ((lane >> 3) & 1) * 8);
        ldmatrix_x4(bq, tQ + row * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < MTK; ++mi) {
          mma_16816<T>(dp[mi][nt], av[mi], bo[0], bo[1]);
          mma_16816<T>(dp[mi][nt + 1], av[mi], bo[2], bo[3]);
          mma_16816<T>(s[mi][nt], ak[mi], bq[0], bq[1]);
          mma_16816<T>(s[mi][nt + 1], ak[mi], bq[2], bq[3]);
        }
      }
    }

    // -- P^T = exp2(score - LSE), dS^T = P^T (dP^T - dsum), both packed to T. Keys past the end
    // or outside the band get P = 0; a row that saw no key has LSE +inf, so P = 0 there too.
    // Branch-free: a masked exponent becomes -inf (a select), so the 4 x MTK x NTQ exp2 of a warp
    // issue back to back (a branch around each one serialised them behind their latency).
    const bool full = band_pair_full<BM, BN>(band, m0, n0, sq, sk);
    float slope = 0.f;
    if constexpr (Mods::kAlibi) slope = p.alibi[batch * p.alibi_stride_b + hq];
    unsigned pp[MTK][NTQ][2], dsp[MTK][NTQ][2];
#pragma unroll
    for (int mi = 0; mi < MTK; ++mi)
#pragma unroll
      for (int nt = 0; nt < NTQ; ++nt) {
        const int qc = q_base + nt * 8 + 2 * t;  // this lane's two query columns qc, qc + 1
        const float2 lse = *reinterpret_cast<const float2*>(tL + qc);
        const float2 dsum = *reinterpret_cast<const float2*>(tDs + qc);
        const int key0 = n0 + key_base + mi * 16 + g, row0 = m0 + qc;
        float x[4], dcap[4], pv[4], ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float l = (e & 1) ? lse.y : lse.x;
          dcap[e] = 1.f;
          if constexpr (Mods::kAny)
            x[e] = bwd_score<Mods>(p, s[mi][nt][e], slope, row0 + (e & 1), key0 + (e >> 1) * 8, diag, dcap[e]) - l;
          else
            x[e] = fmaf(s[mi][nt][e], p.scale_log2, -l);
        }
        if (!full) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + (e >> 1) * 8, row = row0 + (e & 1);
            x[e] = key < sk && row < sq && band.allows(row, key) ? x[e] : -inf();
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pv[e] = fast_exp2(x[e]);
          ds[e] = pv[e] * (dp[mi][nt][e] - ((e & 1) ? dsum.y : dsum.x));
          if constexpr (Mods::kSoftcap) ds[e] *= dcap[e];
        }
        pp[mi][nt][0] = pack2<T>(pv[0], pv[1]);
        pp[mi][nt][1] = pack2<T>(pv[2], pv[3]);
        dsp[mi][nt][0] = pack2<T>(ds[0], ds[1]);
        dsp[mi][nt][1] = pack2<T>(ds[2], ds[3]);
        // dS^T (and P^T) rows = keys, columns = queries
        T* at = sDS + (key_base + mi * 16 + g) * LP + qc;
        *reinterpret_cast<unsigned*>(at) = dsp[mi][nt][0];
        *reinterpret_cast<unsigned*>(at + 8 * LP) = dsp[mi][nt][1];
        if constexpr (!Tr::kRegP) {
          T* ap = sP + (key_base + mi * 16 + g) * LP + qc;
          *reinterpret_cast<unsigned*>(ap) = pp[mi][nt][0];
          *reinterpret_cast<unsigned*>(ap + 8 * LP) = pp[mi][nt][1];
        }
      }
    if constexpr (!Tr::kRegP) __syncthreads();  // P^T and dS^T of every warp's queries

    // -- dV += P^T dO and dK += dS^T Q over the tile's queries (k), this warp's keys x head dims
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {  // k: every query of the tile
      unsigned ap[MTK][4], as[MTK][4];
#pragma unroll
      for (int mi = 0; mi < MTK; ++mi) {
        if constexpr (Tr::kRegP) {  // the C fragments of query tiles 2kk, 2kk + 1 are this k16 step's A
          ap[mi][0] = pp[mi][2 * kk][0], ap[mi][1] = pp[mi][2 * kk][1];
          ap[mi][2] = pp[mi][2 * kk + 1][0], ap[mi][3] = pp[mi][2 * kk + 1][1];
          as[mi][0] = dsp[mi][2 * kk][0], as[mi][1] = dsp[mi][2 * kk][1];
          as[mi][2] = dsp[mi][2 * kk + 1][0], as[mi][3] = dsp[mi][2 * kk + 1][1];
        } else {
          const int row = key_base + mi * 16 + (lane & 15);
          ldmatrix_x4(ap[mi], sP + row * LP + kk * 16 + (lane >> 4) * 8);
          ldmatrix_x4(as[mi], sDS + row * LP + kk * 16 + (lane >> 4) * 8);
        }
      }
#pragma unroll
      for (int dt = 0; dt < NTD; dt += 2) {
        const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = d_base + dt * 8 + (lane >> 4) * 8;
        unsigned bo[4], bq[4];
        ldmatrix_x4_trans(bo, tdO + row * LD + col);
        ldmatrix_x4_trans(bq, tQ + row * LD + col);
#pragma unroll
        for (int mi = 0; mi < MTK; ++mi) {
          mma_16816<T>(dv[mi][dt], ap[mi], bo[0], bo[1]);
          mma_16816<T>(dv[mi][dt + 1], ap[mi], bo[2], bo[3]);
          mma_16816<T>(dk[mi][dt], as[mi], bq[0], bq[1]);
          mma_16816<T>(dk[mi][dt + 1], as[mi], bq[2], bq[3]);
        }
      }
    }
    if constexpr (Tr::kRegP) __syncthreads();  // dS^T of every warp's keys

    // -- dQ = dS K over the block's keys (k): dS read transposed from sDS, K transposed from sK
    float dq[MTQ][NTDQ][4];
    zero_tiles<MTQ, NTDQ>(dq);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[MTQ][4];
#pragma unroll
      for (int mi = 0; mi < MTQ; ++mi)  // stored [key][query]: the transposed load gives (query, key) fragments
        ldmatrix_x4_trans(a[mi], sDS + (kk * 16 + (lane & 7) + (lane >> 4) * 8) * LP + dq_rows + mi * 16 +
                                     ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int dt = 0; dt < NTDQ; dt += 2) {
        unsigned b[4];
        ldmatrix_x4_trans(b, sK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dq_dims + dt * 8 +
                                 (lane >> 4) * 8);
#pragma unroll
        for (int mi = 0; mi < MTQ; ++mi) {
          mma_16816<T>(dq[mi][dt], a[mi], b[0], b[1]);
          mma_16816<T>(dq[mi][dt + 1], a[mi], b[2], b[3]);
        }
      }
    }

    // -- add this block's share of dQ to dq_acc (unscaled; the convert kernel scales)
    int* sem = nullptr;
    if (p.deterministic) {
      sem = p.sem + (static_cast<long long>(batch) * p.heads_q + hq) * p.m_blocks + m;
      sem_wait(sem, n_block - band_first_key_tile<BN>(band, m0));
    }
    float* acc = p.dq_acc + (acc_row(p, seq, batch, hq) + m0) * p.head_dim;
#pragma unroll
    for (int mi = 0; mi < MTQ; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = dq_rows + mi * 16 + g + 8 * h;
        if (m0 + row >= sq) continue;
#pragma unroll
        for (int dt = 0; dt < NTDQ; ++dt) {
          const int d = dq_dims + dt * 8 + 2 * t;
          if (d < p.head_dim)  // head_dim is a multiple of 8: d + 1 is in range too
            red_add_pair(acc + row * p.head_dim + d, dq[mi][dt][2 * h], dq[mi][dt][2 * h + 1]);
        }
      }
    if (p.deterministic) sem_arrive(sem);
    hq = hq_next, m = m_next;
  }

  // -- epilogue: dK (scaled) and dV of this warp's keys, rounded to T, pairs of elements
  T* dkp = static_cast<T*>(p.dk) + batch * p.dk_stride_b + kv_head * p.dk_stride_h + seq.k_row0 * p.dk_stride_s;
  T* dvp = static_cast<T*>(p.dv) + batch * p.dv_stride_b + kv_head * p.dv_stride_h + seq.k_row0 * p.dv_stride_s;
#pragma unroll
  for (int mi = 0; mi < MTK; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = n0 + key_base + mi * 16 + g + 8 * h;
      if (key >= sk) continue;
#pragma unroll
      for (int dt = 0; dt < NTD; ++dt) {
        const int d = d_base + dt * 8 + 2 * t;
        if (d < p.head_dim) {
          *reinterpret_cast<unsigned*>(dkp + key * p.dk_stride_s + d) =
              pack2<T>(dk[mi][dt][2 * h] * p.scale, dk[mi][dt][2 * h + 1] * p.scale);
          *reinterpret_cast<unsigned*>(dvp + key * p.dv_stride_s + d) = pack2<T>(dv[mi][dt][2 * h], dv[mi][dt][2 * h + 1]);
        }
      }
    }
}

}  // namespace pyattn

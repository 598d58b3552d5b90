// FlashAttention-2-style fused forward pass for fp32 inputs on TF32 tensor cores (allow_tf32).
//
// A sibling of attention_fwd_mma.cuh with the same semantics and structure (block of
// BLOCK_M = 16 * M_TILES * WARPS rows, two-stage cp.async K/V pipeline, P kept in registers,
// online softmax, band skipping, compile-time score modifiers), but fp32 tiles in shared memory
// and mma.m16n8k8 with tf32 operands (10-bit mantissa, fp32 accumulate). Operands are rounded
// to nearest with cvt.rna (the MMA itself would truncate, which biases every product).
// Fragment layouts of m16n8k8.tf32 (g = lane / 4, t = lane % 4):
//   A 16x8 (row): a0 = (g, t)  a1 = (g+8, t)  a2 = (g, t+4)  a3 = (g+8, t+4)
//   B 8x8  (col): b0 = (k t, n g)  b1 = (k t+4, n g)
//   C 16x8 (f32): c0,c1 = (g, 2t..2t+1)  c2,c3 = (g+8, 2t..2t+1)
// ldmatrix (b16) over 32-bit data hands lane l the word (row l/4, word l%4) of each 8x4-float
// matrix: exactly A's (g, t) for Q rows and B's (n g, k t) for K rows, so Q and K load like the
// fp16 kernel. C of S does not match A of P (cols 2t.. vs t, t+4): a quad shuffle fixes it. V as B
// needs (k t, n g) = V[key t][d g], a transpose ldmatrix cannot do on 32-bit data: scalar loads.
// Host contract: q/k/v 16-byte aligned with strides in multiples of 4 floats (cp.async chunks),
// o 8-byte aligned with even strides (float2 stores).
// Requires pyattn::AttnFwdParams, common.cuh and mma.cuh (cp.async, ldmatrix, fast_exp2).
#pragma once
#include "attention_mask.cuh"

namespace pyattn {

template <int HEAD_DIM_, int BLOCK_N_, int WARPS_, int M_TILES_>
struct AttnFwdTf32Traits {
  using T = float;
  static constexpr int kHeadDim = HEAD_DIM_;
  static constexpr int kMTiles = M_TILES_;  // m16 row tiles per warp
  static constexpr int kBlockM = 16 * M_TILES_ * WARPS_;
  static constexpr int kBlockN = BLOCK_N_;
  static constexpr int kWarps = WARPS_;
  static constexpr int kThreads = 32 * WARPS_;
  // Q and K rows padded by 4 floats: stride = 4 * HEAD_DIM + 16 bytes = 16 (mod 128) since
  // HEAD_DIM % 32 == 0, so the 8 row addresses of one ldmatrix phase land at 16 * r (mod 128),
  // r = 0..7: 8 distinct 4-bank groups, no conflict.
  static constexpr int kStrideQK = HEAD_DIM_ + 4;
  // V rows padded by 8 floats: stride = 8 (mod 32 banks), so the scalar B loads
  // V[t][g] (t = 0..3, g = 0..7) hit banks 8t + g = 0..31, all distinct (and likewise V[t+4][g]).
  static constexpr int kStrideV = HEAD_DIM_ + 8;
  static constexpr int kChunksPerRow = HEAD_DIM_ / 4;  // 16-byte chunks (4 floats)
  static_assert(HEAD_DIM_ % 32 == 0, "head-dim bucket: the padding arithmetic above needs 4*D = 0 mod 128");
  static_assert(BLOCK_N_ % 16 == 0, "key tile: one K ldmatrix.x4 feeds two n8 tiles");
  // Dynamic shared memory: Q [BM][D+4], 2 stages of K [BN][D+4] and of V [BN][D+8], fp32.
  static constexpr int kSmemBytes = 4 * ((kBlockM + 2 * kBlockN) * kStrideQK + 2 * kBlockN * kStrideV);
};

// fp32 -> tf32 operand bits, rounded to nearest (ties away); only ever fed to the MMA, which
// reads the top 19 bits.
__device__ __forceinline__ unsigned tf32_round(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// D = A B + C on tf32 operands, fp32 accumulate (sm_80+).
__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <class Tr, int LD>
__device__ __forceinline__ void load_tile_tf32(float* dst, const float* src, long long row_stride, int rows,
                                               int first_row, int row_end, int head_dim) {
  // Every thread copies 16-byte chunks; rows past `row_end` and chunks past `head_dim` are zero-filled.
  for (int c = threadIdx.x; c < rows * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = (c % Tr::kChunksPerRow) * 4;
    const bool ok = first_row + r < row_end && col < head_dim;
    const float* g = ok ? src + (first_row + r) * row_stride + col : src;
    cp_async_16(dst + r * LD + col, g, ok);
  }
}

template <class Tr, class Mods>
__device__ __forceinline__ void attn_fwd_tf32(const AttnFwdParams& p) {
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN;
  constexpr int LD = Tr::kStrideQK, LV = Tr::kStrideV;
  constexpr int MT = Tr::kMTiles;
  constexpr int NT = BN / 8;  // n8 tiles of S per warp (= k8 steps of P V)
  constexpr int DT = D / 8;   // n8 tiles of O per warp

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);  // [BM][LD], tf32-rounded in place
  float* sK = sQ + BM * LD;                        // [2][BN][LD]
  float* sV = sK + 2 * BN * LD;                    // [2][BN][LV]

  // Causal blocks near the end of the sequence do the most work: start them first.
  const int m_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = m_block * BM, head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  const int sq = seq.sq, sk = seq.sk;
  if (m0 >= sq) return;  // varlen: this sequence is shorter than the longest (whole block exits)
  const int kv_head = head / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const float* q = static_cast<const float*>(p.q) + batch * p.q_stride_b + head * p.q_stride_h + seq.q_row0 * p.q_stride_s;
  const float* k = static_cast<const float*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  const float* v = static_cast<const float*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  float* o = static_cast<float*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + seq.q_row0 * p.o_stride_s;

  const Band band = make_band(p, sq, sk);
  int n_begin, n_end;  // key tiles some row of this block can see
  band_key_range<BN>(band, m0, min(m0 + BM, sq) - 1, sk, n_begin, n_end);
  const int n_blocks = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
  const ModState mods = make_mod_state<Mods>(p, batch, head, sq, sk);

  // -- prologue: Q (its own group) and the first K/V tile in flight
  load_tile_tf32<Tr, LD>(sQ, q, p.q_stride_s, BM, m0, sq, p.head_dim);
  cp_async_commit();
  if (n_blocks > 0) {
    load_tile_tf32<Tr, LD>(sK, k, p.k_stride_s, BN, n_begin, sk, p.head_dim);
    load_tile_tf32<Tr, LV>(sV, v, p.v_stride_s, BN, n_begin, sk, p.head_dim);
  }
  cp_async_commit();
  // Round Q to tf32 once, in place: each thread converts the chunks it copied itself (visible to
  // it after wait_group), and the loop's first __syncthreads publishes them. Saves a cvt per Q
  // fragment per key tile.
  cp_async_wait<1>();
  for (int c = threadIdx.x; c < BM * Tr::kChunksPerRow; c += Tr::kThreads) {
    float4* x = reinterpret_cast<float4*>(sQ + (c / Tr::kChunksPerRow) * LD + (c % Tr::kChunksPerRow) * 4);
    const float4 f = *x;
    *x = make_float4(__uint_as_float(tf32_round(f.x)), __uint_as_float(tf32_round(f.y)),
                     __uint_as_float(tf32_round(f.z)), __uint_as_float(tf32_round(f.w)));
  }

  float acc[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];  // rows g and g + 8 of each row tile
  init_softmax_state<MT, DT>(acc, row_max, row_sum);
  // With score modifiers, s is already final and in log2 units when the softmax sees it.
  const float sl2 = Mods::kAny ? 1.f : p.scale_log2;
  const int warp_row = warp * 16 * MT;  // first row of this warp within the block
  const int row0 = m0 + warp_row + g;   // this thread's row in tile 0; tile mi adds 16*mi, half h adds 8
  // P V shuffle sources (see the A build below): lanes of this quad with bits of t swapped, and ^2.
  const int src1 = (lane & ~3) | ((t & 1) << 1) | (t >> 1), src2 = src1 ^ 2;
  const bool odd = t & 1, hi = t & 2;

  for (int j = 0; j < n_blocks; ++j) {
    const int n0 = n_begin + j * BN, stage = j & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile j (and rounded Q) visible to everyone, and every warp is done with tile j-1
    if (j + 1 < n_blocks) {  // prefetch tile j+1 into the stage tile j-1 used
      load_tile_tf32<Tr, LD>(sK + (stage ^ 1) * BN * LD, k, p.k_stride_s, BN, n0 + BN, sk, p.head_dim);
      load_tile_tf32<Tr, LV>(sV + (stage ^ 1) * BN * LV, v, p.v_stride_s, BN, n0 + BN, sk, p.head_dim);
    }
    cp_async_commit();
    const float* tK = sK + stage * BN * LD;
    const float* tV = sV + stage * BN * LV;

    // -- S = Q K^T (raw scores, fp32); each K fragment feeds MT row tiles
    float s[MT][NT][4];
    zero_tiles<MT, NT>(s);
#pragma unroll
    for (int kk = 0; kk < D / 8; ++kk) {
      unsigned a[MT][4];  // matrices [rows 0-7 | 8-15] x [cols 0-3 | 4-7] -> a0, a1, a2, a3
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        ldmatrix_x4(a[mi], sQ + (warp_row + mi * 16 + (lane & 15)) * LD + kk * 8 + (lane >> 4) * 4);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {  // matrices [keys 0-7 | 8-15] x [d 0-3 | 4-7] -> b0, b1 of nt, nt+1
        unsigned b[4];
        ldmatrix_x4(b, tK + (nt * 8 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 8 + ((lane >> 3) & 1) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) b[e] = tf32_round(__uint_as_float(b[e]));
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_1688_tf32(s[mi][nt], a[mi], b[0], b[1]);
          mma_1688_tf32(s[mi][nt + 1], a[mi], b[2], b[3]);
        }
      }
    }

    // -- score modifiers; keys past the end or outside the band -> -inf (attention_mask.cuh)
    mask_scores<Mods>(s, p, mods, band, row0, n0 + 2 * t, sq, sk,
                      band_tile_full<BN>(band, m0 + warp_row, m0 + warp_row + 16 * MT - 1, n0, sk));

    // -- online softmax: the 4 lanes of a quad share rows g and g + 8
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      float corr[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[mi][h];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mi][nt][2 * h], s[mi][nt][2 * h + 1]));
        mx = quad_max(mx);
        // A row with no visible key yet keeps max -inf: exponentiate against 0, never (-inf) - (-inf).
        const float ref = mx == -inf() ? 0.f : mx * sl2;
        corr[h] = fast_exp2(fmaf(row_max[mi][h], sl2, -ref));
        row_max[mi][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          s[mi][nt][2 * h] = fast_exp2(fmaf(s[mi][nt][2 * h], sl2, -ref));
          s[mi][nt][2 * h + 1] = fast_exp2(fmaf(s[mi][nt][2 * h + 1], sl2, -ref));
          sum += s[mi][nt][2 * h] + s[mi][nt][2 * h + 1];
        }
        row_sum[mi][h] = row_sum[mi][h] * corr[h] + sum;  // quad-partial; reduced once in the epilogue
      }
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        acc[mi][dt][0] *= corr[0]; acc[mi][dt][1] *= corr[0];
        acc[mi][dt][2] *= corr[1]; acc[mi][dt][3] *= corr[1];
      }
    }

    // -- O += P V. A of k-step kk wants P cols t and t+4 of its quad's rows; lane 4g + t' holds
    // cols 2t', 2t'+1 (C of n-tile kk). Two shuffles per row half, every lane sending one value
    // each: round 1 lane t' sends col 2t' + (t'>>1) and lane t reads lane swap_bits(t), which
    // holds col t (t even) or t+4 (t odd); round 2 sends the other col, read from swap_bits(t)^2.
#pragma unroll
    for (int kk = 0; kk < NT; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float c0 = s[mi][kk][2 * h], c1 = s[mi][kk][2 * h + 1];
          const float x1 = __shfl_sync(kFullMask, hi ? c1 : c0, src1);
          const float x2 = __shfl_sync(kFullMask, hi ? c0 : c1, src2);
          a[mi][h] = tf32_round(odd ? x2 : x1);      // (row g + 8h, col t)
          a[mi][h + 2] = tf32_round(odd ? x1 : x2);  // (row g + 8h, col t + 4)
        }
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const float* vp = tV + (kk * 8 + t) * LV + dt * 8 + g;  // b0 = V[key t][d g], b1 = key t + 4
        const unsigned b0 = tf32_round(vp[0]), b1 = tf32_round(vp[4 * LV]);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) mma_1688_tf32(acc[mi][dt], a[mi], b0, b1);
      }
    }
  }

  // -- epilogue: full row sums, normalise, store O and the natural-log LSE
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(row_sum[mi][h]);
      const int row = row0 + mi * 16 + 8 * h;
      if (row >= sq) continue;
      const bool empty = sum == 0.f;
      const float inv = empty ? 0.f : 1.f / sum;
      float* orow = o + row * p.o_stride_s;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const int d = dt * 8 + 2 * t;
        if (d < p.head_dim)  // head_dim is a multiple of 8, so d + 1 is in range too
          *reinterpret_cast<float2*>(orow + d) = make_float2(acc[mi][dt][2 * h] * inv, acc[mi][dt][2 * h + 1] * inv);
      }
      if (p.lse != nullptr && t == 0) {
        const long long idx = batch * p.lse_stride_b + head * p.lse_stride_h + seq.q_row0 + row;
        p.lse[idx] = empty ? -inf() : (row_max[mi][h] * sl2 + log2f(sum)) * kLn2;
      }
    }
}

}  // namespace pyattn

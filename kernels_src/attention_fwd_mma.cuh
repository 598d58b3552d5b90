// FlashAttention-2-style fused forward pass on tensor cores (fp16/bf16 in, fp32 accumulate).
//
// One block owns BLOCK_M = 16 * M_TILES * WARPS query rows of one (batch, query head); warp w owns
// M_TILES m16 row tiles. Every K/V fragment a warp loads from shared memory feeds M_TILES MMAs, so
// two row tiles per warp halve the shared-memory traffic per MMA (which bounds the one-tile
// version). K/V tiles of BLOCK_N keys stream through shared memory in a two-stage
// cp.async pipeline (tile j+1 loads while tile j is used). Per tile, each warp computes
// S = Q K^T with mma.m16n8k16, updates the online softmax in registers, converts S into the
// A fragments of P in registers (no shared-memory round trip) and accumulates O += P V.
// Causal/window bands skip the key tiles no row of the block can see and mask only the tiles that
// cross a band edge; the score modifiers (Mods: mask tensor, soft-cap, ALiBi) are compile-time.
// Requires pyattn::AttnFwdParams, common.cuh and mma.cuh.
#pragma once
#include "attention_mask.cuh"
#include "block_sparse.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int BLOCK_N_, int WARPS_, int M_TILES_>
struct AttnFwdMmaTraits {
  using T = T_;
  static constexpr int kHeadDim = HEAD_DIM_;
  static constexpr int kMTiles = M_TILES_;  // m16 row tiles per warp
  static constexpr int kBlockM = 16 * M_TILES_ * WARPS_;
  static constexpr int kBlockN = BLOCK_N_;
  static constexpr int kWarps = WARPS_;
  static constexpr int kThreads = 32 * WARPS_;
  // Rows padded by 8 elements (16 bytes): the 8 row addresses of one ldmatrix then start
  // 16 bytes apart modulo 128, so they hit 8 distinct 4-bank groups (no conflicts).
  static constexpr int kStride = HEAD_DIM_ + 8;
  static constexpr int kChunksPerRow = HEAD_DIM_ / 8;  // 16-byte chunks
  static_assert(HEAD_DIM_ % 32 == 0, "head-dim bucket: whole k16 steps and ldmatrix.x4 pairs");
  static_assert(BLOCK_N_ % 16 == 0, "key tile: whole k16 steps of P V");
  static constexpr int kSmemElems = (kBlockM + 4 * kBlockN) * kStride;  // Q + 2 stages of K and V
  static constexpr int kSmemBytes = kSmemElems * static_cast<int>(sizeof(T_));
};

template <class Tr>
__device__ __forceinline__ void load_tile(typename Tr::T* dst, const typename Tr::T* src, long long row_stride,
                                          int rows, int first_row, int row_end, int head_dim) {
  // Every thread copies 16-byte chunks; rows past `row_end` and chunks past `head_dim` are zero-filled.
  for (int c = threadIdx.x; c < rows * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = (c % Tr::kChunksPerRow) * 8;
    const bool ok = first_row + r < row_end && col < head_dim;
    const typename Tr::T* g = ok ? src + (first_row + r) * row_stride + col : src;
    cp_async_16(dst + r * Tr::kStride + col, g, ok);
  }
}

template <class Tr, class Mods, bool SPARSE = false>
__device__ __forceinline__ void attn_fwd_mma(const AttnFwdParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, LD = Tr::kStride;
  constexpr int MT = Tr::kMTiles;
  constexpr int NT = BN / 8;  // n8 tiles of S per warp
  constexpr int DT = D / 8;   // n8 tiles of O per warp

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM][LD]
  T* sK = sQ + BM * LD;                    // [2][BN][LD]
  T* sV = sK + 2 * BN * LD;                // [2][BN][LD]

  // Causal blocks near the end of the sequence do the most work: start them first.
  const int m_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = m_block * BM, head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  const int sq = seq.sq, sk = seq.sk;
  if (m0 >= sq) return;  // varlen: this sequence is shorter than the longest (whole block exits)
  const int kv_head = head / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride_b + head * p.q_stride_h + seq.q_row0 * p.q_stride_s;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  T* o = static_cast<T*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + seq.q_row0 * p.o_stride_s;

  const Band band = make_band(p, sq, sk);
  int n_begin, n_end;  // key tiles some row of this block can see
  band_key_range<BN>(band, m0, min(m0 + BM, sq) - 1, sk, n_begin, n_end);
  KeyTiles<BM, BN, SPARSE> tiles;  // the band's tiles, or the block-sparse list of this query tile
  tiles.init(p, head, m_block, n_begin, n_end);
  const int n_blocks = tiles.count;
  const ModState mods = make_mod_state<Mods>(p, batch, head, sq, sk);

  // -- prologue: Q and the first K/V tile in flight
  load_tile<Tr>(sQ, q, p.q_stride_s, BM, m0, sq, p.head_dim);
  int n_next = n_blocks > 0 ? tiles.n0(0) : 0;
  if (n_blocks > 0) {
    load_tile<Tr>(sK, k, p.k_stride_s, BN, n_next, sk, p.head_dim);
    load_tile<Tr>(sV, v, p.v_stride_s, BN, n_next, sk, p.head_dim);
  }
  cp_async_commit();

  float acc[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];  // rows g and g + 8 of each row tile
  init_softmax_state<MT, DT>(acc, row_max, row_sum);
  // With score modifiers, s is already final and in log2 units when the softmax sees it.
  const float sl2 = Mods::kAny ? 1.f : p.scale_log2;
  const int warp_row = warp * 16 * MT;       // first row of this warp within the block
  const int row0 = m0 + warp_row + g;        // this thread's row in tile 0; tile mi adds 16*mi, half h adds 8

  for (int j = 0; j < n_blocks; ++j) {
    const int n0 = n_next, stage = j & 1;
    const unsigned long long sub = tiles.mask(j);  // issued early: its latency hides behind the wait
    cp_async_wait<0>();
    __syncthreads();  // tile j landed for everyone, and every warp is done with tile j-1
    if (j + 1 < n_blocks) {  // prefetch tile j+1 into the stage tile j-1 used
      n_next = tiles.n0(j + 1);
      load_tile<Tr>(sK + (stage ^ 1) * BN * LD, k, p.k_stride_s, BN, n_next, sk, p.head_dim);
      load_tile<Tr>(sV + (stage ^ 1) * BN * LD, v, p.v_stride_s, BN, n_next, sk, p.head_dim);
    }
    cp_async_commit();
    const T* tK = sK + stage * BN * LD;
    const T* tV = sV + stage * BN * LD;

    // -- S = Q K^T (raw scores, fp32); each K fragment feeds MT row tiles
    float s[MT][NT][4];
    zero_tiles<MT, NT>(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        ldmatrix_x4(a[mi], sQ + (warp_row + mi * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {  // one ldmatrix.x4 feeds two n8 tiles
        unsigned b[4];
        ldmatrix_x4(b, tK + (nt * 8 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16816<T>(s[mi][nt], a[mi], b[0], b[1]);
          mma_16816<T>(s[mi][nt + 1], a[mi], b[2], b[3]);
        }
      }
    }

    // -- score modifiers; keys past the end or outside the band -> -inf (attention_mask.cuh)
    mask_scores<Mods>(s, p, mods, band, row0, n0 + 2 * t, sq, sk,
                      band_tile_full<BN>(band, m0 + warp_row, m0 + warp_row + 16 * MT - 1, n0, sk));
    if (SPARSE && sub != tiles.kAll) {  // -- block-sparse: keys of invisible 16 x 16 sub-blocks -> -inf
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          if (!tiles.visible(sub, warp * MT + mi, nt * 8))
            s[mi][nt][0] = s[mi][nt][1] = s[mi][nt][2] = s[mi][nt][3] = -inf();
    }

    // -- online softmax: the 4 lanes of a quad share rows g and g + 8
    online_softmax<MT, NT, DT>(s, acc, row_max, row_sum, sl2);

    // -- O += P V, with P's A fragments built from S's C fragments in registers
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[MT][4];
      p_fragments<T, MT, NT>(s, kk, a);
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        unsigned b[4];
        ldmatrix_x4_trans(b, tV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dt * 8 + (lane >> 4) * 8);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16816<T>(acc[mi][dt], a[mi], b[0], b[1]);
          mma_16816<T>(acc[mi][dt + 1], a[mi], b[2], b[3]);
        }
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
      T* orow = o + row * p.o_stride_s;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const int d = dt * 8 + 2 * t;
        if (d < p.head_dim)  // head_dim is a multiple of 8, so d + 1 is in range too
          *reinterpret_cast<unsigned*>(orow + d) =
              pack2<T>(acc[mi][dt][2 * h] * inv, acc[mi][dt][2 * h + 1] * inv);
      }
      if (p.lse != nullptr && t == 0) {
        const long long idx = batch * p.lse_stride_b + head * p.lse_stride_h + seq.q_row0 + row;
        p.lse[idx] = empty ? -inf() : (row_max[mi][h] * sl2 + log2f(sum)) * kLn2;
      }
    }
}

}  // namespace pyattn

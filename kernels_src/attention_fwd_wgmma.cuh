// FlashAttention-3-style fused forward pass on Hopper warpgroup tensor cores (sm_90a only):
// fp16/bf16 in, fp32 accumulate, wgmma.mma_async.
//
// One block owns BLOCK_M = 64 * WARPGROUPS query rows of one (batch, query head); warpgroup w
// owns rows [64w, 64w + 64) (the M of one wgmma). Q, K and V tiles sit in shared memory with the
// 128-byte swizzle (wgmma.cuh), K/V tiles of BLOCK_N keys in a STAGES-deep cp.async ring that all
// threads fill (no producer warpgroup, no TMA: the parameter struct carries no tensor map).
// Per key tile j and warpgroup:
//   S_j = Q K_j^T        wgmma m64 n{BLOCK_N} k16, A = Q and B = K from shared memory (K-major)
//   online softmax on S_j in registers (fp32, base 2), P_j packed to 16 bits in registers
//   O += P_j V_j         wgmma m64 n{HEAD_DIM} k16, A = P from registers, B = V from shared
//                        memory read MN-major (transpose bit), so V needs no transposed copy
// OVERLAP (FA3's intra-warpgroup pipelining): O += P_{j-1} V_{j-1} is issued right behind
// S_j = Q K_j^T, so the tensor cores run it while the warpgroup does the softmax of tile j.
// That keeps tiles j-1 (V) and j (K) resident, so a tile loads STAGES - 2 tiles ahead
// (STAGES - 1 without OVERLAP).
//
// Semantics are attention_fwd_mma.cuh's without the score modifiers: GQA, bshd/bhsd strides,
// causal and sliding window (whole tiles skipped, per-element masks only on boundary tiles),
// varlen, natural-log LSE, empty rows -> 0 / -inf, head_dim padding, sequence tails.
// Requires pyattn::AttnFwdParams, common.cuh, mma.cuh (pack2, fast_exp2) and wgmma.cuh.
//
// Launch: Traits::kThreads = 128 * WARPGROUPS threads, Traits::kSmemBytes dynamic shared memory
// (opt in above 48 KiB), grid (ceil(max seqlen_q / BLOCK_M), heads_q, batch or varlen sequences);
// causal launches walk blockIdx.x from the last query tile down (most work first). The caller
// guarantees 16-byte aligned q/k/v/o and row strides that are multiples of 8 elements (cp.async
// and 4-byte output stores), and a HEAD_DIM bucket that is a multiple of 64 (64 / 128 / 192 / 256;
// smaller head dims run in the next bucket, zero-padded).
#pragma once
#include "attention_mask.cuh"
#include "block_sparse.cuh"
#include "wgmma.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPGROUPS_, int STAGES_ = 3,
          bool OVERLAP_ = true>
struct AttnFwdWgmmaTraits {
  using T = T_;
  static constexpr int kHeadDim = HEAD_DIM_;  // compiled bucket; params.head_dim <= kHeadDim
  static constexpr int kBlockM = BLOCK_M_;
  static constexpr int kBlockN = BLOCK_N_;
  static constexpr int kWarpgroups = WARPGROUPS_;
  static constexpr int kThreads = 128 * WARPGROUPS_;
  static constexpr int kStages = STAGES_;
  static constexpr bool kOverlap = OVERLAP_;
  // How many tiles ahead of the one in use a tile is loaded (see the header comment).
  static constexpr int kLookahead = OVERLAP_ ? STAGES_ - 2 : STAGES_ - 1;
  static_assert(sizeof(T_) == 2, "wgmma kernel: 16-bit inputs (fp16 / bf16)");
  static_assert(BLOCK_M_ == 64 * WARPGROUPS_, "one m64 wgmma row block per warpgroup");
  static_assert(WARPGROUPS_ >= 1 && WARPGROUPS_ <= 3, "1-3 consumer warpgroups");
  static_assert(HEAD_DIM_ % 64 == 0 && HEAD_DIM_ <= 256, "head dim: whole 128-byte swizzle rows, wgmma N <= 256");
  static_assert(BLOCK_N_ % 16 == 0 && BLOCK_N_ >= 16 && BLOCK_N_ <= 256, "key tile: whole k16 steps of P V");
  static_assert(kLookahead >= 1, "STAGES too small for the pipeline (OVERLAP needs 3)");
  // Shared memory (bytes): tiles are [HEAD_DIM / 64][rows][64 elements], 128-byte swizzled.
  static constexpr int kQBytes = BLOCK_M_ * HEAD_DIM_ * 2;
  static constexpr int kKVBytes = BLOCK_N_ * HEAD_DIM_ * 2;  // one K or one V tile
  static constexpr int kStageBytes = 2 * kKVBytes;
  // + 1024: the dynamic window is only guaranteed 16-byte aligned; swizzle atoms need 1024.
  static constexpr int kSmemBytes = kQBytes + STAGES_ * kStageBytes + 1024;
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "tiles keep 1024-byte alignment");
};

// Copy rows [row0, row0 + ROWS) of a (seq, head_dim) slice into a 128-byte-swizzled tile at
// shared address `dst`; rows at or past `row_end` and columns at or past `head_dim` are
// zero-filled (padded dims and keys past the end then contribute exactly nothing).
template <class Tr, int ROWS>
__device__ __forceinline__ void wgmma_load_tile(unsigned dst, const typename Tr::T* src, long long row_stride,
                                                int row0, int row_end, int head_dim) {
  constexpr int kChunksPerRow = Tr::kHeadDim / 8;  // 16-byte chunks
  if constexpr (Tr::kThreads % kChunksPerRow == 0) {
    // Each thread keeps one chunk column; consecutive threads walk one row (coalesced).
    constexpr int kRowsPerPass = Tr::kThreads / kChunksPerRow;
    constexpr int kPasses = (ROWS + kRowsPerPass - 1) / kRowsPerPass;
    const int cc = threadIdx.x % kChunksPerRow, col = cc * 8;
    const unsigned col_block = (cc >> 3) * (ROWS * 128);  // which 64-element column block
    const bool col_ok = col < head_dim;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = pass * kRowsPerPass + threadIdx.x / kChunksPerRow;
      if (ROWS % kRowsPerPass == 0 || r < ROWS) {
        const bool ok = col_ok && row0 + r < row_end;
        const typename Tr::T* g = ok ? src + (row0 + r) * row_stride + col : src;
        wg::cp_async_16(dst + col_block + r * 128 + (((cc & 7) ^ (r & 7)) << 4), g, ok);
      }
    }
  } else {  // e.g. HEAD_DIM 192: 24 chunks per row; walk the flat chunk index instead
    constexpr int kChunks = ROWS * kChunksPerRow;
#pragma unroll
    for (int c0 = 0; c0 < kChunks; c0 += Tr::kThreads) {
      const int c = c0 + threadIdx.x;
      if (kChunks % Tr::kThreads == 0 || c < kChunks) {
        const int r = c / kChunksPerRow, cc = c % kChunksPerRow, col = cc * 8;
        const bool ok = col < head_dim && row0 + r < row_end;
        const typename Tr::T* g = ok ? src + (row0 + r) * row_stride + col : src;
        wg::cp_async_16(dst + (cc >> 3) * (ROWS * 128) + r * 128 + (((cc & 7) ^ (r & 7)) << 4), g, ok);
      }
    }
  }
}

template <class Tr, bool SPARSE>
struct AttnFwdWgmmaMainloop {
  using T = typename Tr::T;
  static constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN;
  static constexpr int STAGES = Tr::kStages, AHEAD = Tr::kLookahead;
  static constexpr bool OVERLAP = Tr::kOverlap;
  static constexpr int S_REGS = BN / 2;  // f32 accumulator registers per thread of a m64 x BN tile
  static constexpr int O_REGS = D / 2;
  static constexpr int KS = BN / 16;     // k16 steps of P V

  // -- invariant
  const T* k;
  const T* v;
  long long k_stride, v_stride;
  Band band;
  KeyTiles<BM, BN, SPARSE> tiles;  // the band's key tiles, or this query tile's block-sparse list
  unsigned sKV;                    // shared address of stage 0 (K; V kKVBytes later)
  unsigned long long q_desc, k_desc0, v_desc0;
  int n_tiles, sk, head_dim;
  int wg_row0, row_a, t;           // warpgroup's first row; this thread's rows row_a, row_a + 8; lane % 4
  int sub_row;                     // this thread's row of 16 x 16 sub-blocks within the query tile
  float sl2;
  // -- running state
  float acc[O_REGS];
  float row_max[2], row_sum[2];
  unsigned pf[KS][4];              // P of the previous tile as wgmma A fragments (OVERLAP)
  int stage, prev_stage, load_stage;

  // O += P V with V in `st`'s stage.
  __device__ __forceinline__ void pv(int st) {
    const unsigned long long v_desc = wg::desc_add(v_desc0, st * Tr::kStageBytes);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) wg::Mma<T, D, 1>::rs(acc, pf[kk], wg::desc_add(v_desc, kk * 2048), 1);
  }

  // Key tile j. WITH_PV: also O += P_{j-1} V_{j-1} behind S_j (OVERLAP, j > 0). A compile-time
  // switch, not `if (j > 0)`: with a run-time condition around the waits ptxas cannot prove the
  // accumulators idle and serialises every wgmma (C7514).
  template <bool WITH_PV>
  __device__ __forceinline__ void step(const int j) {
    const int n0 = tiles.n0(j);
    const unsigned long long sub = tiles.mask(j);
    // Tile j landed (this thread's copies), is visible to the async proxy, and everyone's copies
    // are done; every warpgroup also finished the wgmmas that read the stage refilled below
    // (tile j + AHEAD - STAGES: j - 1, or j - 2 with OVERLAP).
    wg::cp_async_wait<AHEAD - 1>();
    wg::fence_proxy_async_smem();
    __syncthreads();

    // -- S = Q K_j^T (raw scores, fp32), and O += P_{j-1} V_{j-1} right behind it
    float s[S_REGS];
    wg::fence_operands(acc);
    wg::fence();
    const unsigned long long k_desc = wg::desc_add(k_desc0, stage * Tr::kStageBytes);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const unsigned off = (kk % 4) * 32;  // k16 step inside the 64-column block kk / 4
      wg::Mma<T, BN, 0>::ss(s, wg::desc_add(q_desc, (kk / 4) * (BM * 128) + off),
                            wg::desc_add(k_desc, (kk / 4) * (BN * 128) + off), kk > 0);
    }
    wg::commit();
    if constexpr (WITH_PV) {
      pv(prev_stage);
      wg::commit();
    }
    // -- refill the stage freed at the barrier with tile j + AHEAD, while the tensor cores run
    if (j + AHEAD < n_tiles) {
      const unsigned st = sKV + load_stage * Tr::kStageBytes;
      const int n_load = tiles.n0(j + AHEAD);
      wgmma_load_tile<Tr, BN>(st, k, k_stride, n_load, sk, head_dim);
      wgmma_load_tile<Tr, BN>(st + Tr::kKVBytes, v, v_stride, n_load, sk, head_dim);
    }
    wg::cp_async_commit();  // possibly empty: keeps one group per tile for wait<AHEAD-1>
    load_stage = load_stage + 1 == STAGES ? 0 : load_stage + 1;
    if constexpr (WITH_PV) {
      wg::wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
    } else {
      wg::wait<0>();
    }
    wg::fence_operands(s);

    // -- mask keys past the end and outside the band (only tiles that cross a boundary)
    if (!band_tile_full<BN>(band, wg_row0, wg_row0 + 63, n0, sk)) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + i * 8 + 2 * t + (e & 1), row = row_a + (e >> 1) * 8;
          if (key >= sk || !band.allows(row, key)) s[4 * i + e] = -inf();
        }
    }
    if (SPARSE && sub != tiles.kAll) {  // -- block-sparse: keys of invisible 16 x 16 sub-blocks -> -inf
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        if (!tiles.visible(sub, sub_row, i * 8)) s[4 * i] = s[4 * i + 1] = s[4 * i + 2] = s[4 * i + 3] = -inf();
    }

    // -- online softmax: the 4 lanes of a quad share rows row_a and row_a + 8
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[h];
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      // A row with no visible key yet keeps max -inf: exponentiate against 0, never (-inf) - (-inf).
      const float ref = mx == -inf() ? 0.f : mx * sl2;
      corr[h] = fast_exp2(fmaf(row_max[h], sl2, -ref));
      row_max[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        s[4 * i + 2 * h] = fast_exp2(fmaf(s[4 * i + 2 * h], sl2, -ref));
        s[4 * i + 2 * h + 1] = fast_exp2(fmaf(s[4 * i + 2 * h + 1], sl2, -ref));
        sum += s[4 * i + 2 * h] + s[4 * i + 2 * h + 1];
      }
      row_sum[h] = row_sum[h] * corr[h] + sum;  // quad-partial; reduced once in the epilogue
    }

    // -- O (tiles < j, under the old max) *= corr, once P_{j-1} V_{j-1} has landed
    if constexpr (WITH_PV) {
      wg::wait<0>();
      wg::fence_operands(acc);
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      acc[4 * i] *= corr[0], acc[4 * i + 1] *= corr[0];
      acc[4 * i + 2] *= corr[1], acc[4 * i + 3] *= corr[1];
    }
    // -- P_j as A fragments: n8 blocks 2kk and 2kk+1 of S form k16 step kk
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
    if constexpr (!OVERLAP) {  // -- O += P_j V_j now
      wg::fence_operands(acc);
      wg::fence();
      pv(stage);
      wg::commit();
      wg::wait<0>();
      wg::fence_operands(acc);
    }
    prev_stage = stage;
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
};

template <class Tr, class Mods, bool SPARSE = false>
__device__ __forceinline__ void attn_fwd_wgmma(const AttnFwdParams& p) {
  static_assert(!Mods::kAny, "score modifiers (mask, soft-cap, ALiBi) stay on the mma.sync kernel");
  using T = typename Tr::T;
  using Mainloop = AttnFwdWgmmaMainloop<Tr, SPARSE>;
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN;
  constexpr int STAGES = Tr::kStages, AHEAD = Tr::kLookahead;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned smem0 = (wg::smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned sQ = smem0;
  const unsigned sKV = smem0 + Tr::kQBytes;  // stage s: K at + s * kStageBytes, V kKVBytes later

  // Causal blocks near the end of the sequence do the most work: start them first.
  const int m_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = m_block * BM, head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  const int sq = seq.sq, sk = seq.sk;
  if (m0 >= sq) return;  // varlen: this sequence is shorter than the longest (whole block exits)
  const int kv_head = head / p.group;  // GQA/MQA: `group` query heads share one KV head
  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride_b + head * p.q_stride_h + seq.q_row0 * p.q_stride_s;
  T* o = static_cast<T*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + seq.q_row0 * p.o_stride_s;

  Mainloop ml;
  ml.k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  ml.v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  ml.k_stride = p.k_stride_s;
  ml.v_stride = p.v_stride_s;
  ml.band = make_band(p, sq, sk);
  int n_begin, n_end;  // key tiles outside every row's band are skipped
  band_key_range<BN>(ml.band, m0, min(m0 + BM, sq) - 1, sk, n_begin, n_end);
  ml.tiles.init(p, head, m_block, n_begin, n_end);
  ml.n_tiles = ml.tiles.count;
  ml.sk = sk;
  ml.head_dim = p.head_dim;
  ml.sKV = sKV;

  const int wgi = threadIdx.x / 128;  // warpgroup
  const int lane = threadIdx.x % 32, g = lane / 4;
  ml.t = lane % 4;
  ml.wg_row0 = m0 + wgi * 64;
  ml.row_a = ml.wg_row0 + (threadIdx.x % 128) / 32 * 16 + g;
  ml.sub_row = threadIdx.x / 32;  // warp w of the block owns rows [16w, 16w + 16) of the tile
  ml.sl2 = p.scale_log2;

  // Descriptors (128-byte swizzle). K-major operands step 32 B per k16 inside a 64-column block,
  // then jump to the next block; V is read MN-major: 16 keys = 2048 B per k16 step, LBO = the
  // distance between its 64-dim blocks.
  ml.q_desc = wg::make_desc_sw128(sQ + wgi * 64 * 128, 16, 1024);
  ml.k_desc0 = wg::make_desc_sw128(sKV, 16, 1024);
  ml.v_desc0 = wg::make_desc_sw128(sKV + Tr::kKVBytes, BN * 128, 1024);

#pragma unroll
  for (int i = 0; i < Mainloop::O_REGS; ++i) ml.acc[i] = 0.f;
  ml.row_max[0] = ml.row_max[1] = -inf();
  ml.row_sum[0] = ml.row_sum[1] = 0.f;
  ml.stage = ml.prev_stage = 0;
  ml.load_stage = AHEAD % STAGES;

  if (ml.n_tiles > 0) {  // CTA-uniform
    // -- prologue: Q with tile 0, then tiles 1 .. AHEAD-1, one cp.async group per tile
    wgmma_load_tile<Tr, BM>(sQ, q, p.q_stride_s, m0, sq, p.head_dim);
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {
      if (i < ml.n_tiles) {
        const unsigned st = sKV + i * Tr::kStageBytes;
        const int n_load = ml.tiles.n0(i);
        wgmma_load_tile<Tr, BN>(st, ml.k, ml.k_stride, n_load, sk, p.head_dim);
        wgmma_load_tile<Tr, BN>(st + Tr::kKVBytes, ml.v, ml.v_stride, n_load, sk, p.head_dim);
      }
      wg::cp_async_commit();
    }
    // -- main loop: tile 0 has no previous P V to overlap
    ml.template step<false>(0);
    for (int j = 1; j < ml.n_tiles; ++j) ml.template step<Mainloop::OVERLAP>(j);
    if constexpr (Mainloop::OVERLAP) {  // -- O += P_last V_last
      wg::fence_operands(ml.acc);
      wg::fence();
      ml.pv(ml.prev_stage);
      wg::commit();
      wg::wait<0>();
      wg::fence_operands(ml.acc);
    }
  }

  // -- epilogue: full row sums, normalise, store O and the natural-log LSE
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = ml.row_sum[h];
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    const int row = ml.row_a + 8 * h;
    if (row >= sq) continue;
    const bool empty = sum == 0.f;
    const float inv = empty ? 0.f : 1.f / sum;
    T* orow = o + row * p.o_stride_s;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int d = i * 8 + 2 * ml.t;
      if (d < p.head_dim)  // head_dim is a multiple of 8, so d + 1 is in range too
        *reinterpret_cast<unsigned*>(orow + d) =
            pack2<T>(ml.acc[4 * i + 2 * h] * inv, ml.acc[4 * i + 2 * h + 1] * inv);
    }
    if (p.lse != nullptr && ml.t == 0) {
      const long long idx = batch * p.lse_stride_b + head * p.lse_stride_h + seq.q_row0 + row;
      p.lse[idx] = empty ? -inf() : (ml.row_max[h] * ml.sl2 + log2f(sum)) * kLn2;
    }
  }
}

}  // namespace pyattn

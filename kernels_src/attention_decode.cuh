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
#include "band.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int KEYS_PER_WARP_, int WARPS_, int M_TILES_, int STAGES_, int KV_ = 0>
struct AttnDecodeTraits {
  using T = T_;
  static constexpr int kKv = KV_;  // cache elements: 0 = T, 1 = int8, 2 = fp8 e4m3 (attention_decode_q8.cuh)
  static constexpr int kHeadDim = HEAD_DIM_;
  static constexpr int kKeysPerWarp = KEYS_PER_WARP_;
  static constexpr int kWarps = WARPS_;
  static constexpr int kThreads = 32 * WARPS_;
  static constexpr int kMTiles = M_TILES_;
  static constexpr int kRows = 16 * M_TILES_;
  static constexpr int kBlockN = KEYS_PER_WARP_ * WARPS_;
  static constexpr int kStages = STAGES_;
  static constexpr int kStride = HEAD_DIM_ + 8;     // 16-byte row padding: conflict-free ldmatrix
  static constexpr int kAccStride = HEAD_DIM_ + 8;  // fp32 rows of the warp merge (2-way at worst)
  static constexpr int kChunksPerRow = HEAD_DIM_ / 8;
  // 16-bit: Q and the K/V ring, rows padded. 8-bit: Q, then per stage K and V codes (unpadded,
  // swizzled rows) and their fp32 scales.
  static constexpr int kPipeBytes = KV_ == 0 ? (kRows + 2 * STAGES_ * kBlockN) * kStride * 2
                                             : kRows * kStride * 2 + STAGES_ * kBlockN * 2 * (HEAD_DIM_ + 4);
  static constexpr int kMergeBytes = WARPS_ * kRows * (kAccStride + 2) * 4;
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static_assert(sizeof(T_) == 2, "tensor-core decode takes fp16/bf16");
  static_assert(HEAD_DIM_ % 32 == 0 && KEYS_PER_WARP_ % 16 == 0 && STAGES_ >= 2, "tile shape");
  static_assert(KV_ == 0 || HEAD_DIM_ % 64 == 0, "8-bit caches: head-dim buckets of 64 (whole 64-byte fragment groups)");
  static_assert(kBlockN % (kThreads / 4) == 0, "whole rows per copy pass (4 threads per key row)");
  // 8-bit V fragments: a lane reads kVGroup consecutive bytes of a row for kVGroup n8 output tiles.
  static constexpr int kVGroup = HEAD_DIM_ >= 128 ? 16 : 8;

  // Head-dim column of accumulator element (n8 tile dt, element e) of quad lane t: in order for
  // 16-bit caches; the 8-bit kernel reads V with its columns permuted (attention_decode_q8.cuh).
  __device__ __forceinline__ static int acc_col(int dt, int t, int e) {
    if constexpr (KV_ == 0) {
      return dt * 8 + 2 * t + (e & 1);
    } else {
      return (dt / kVGroup) * kVGroup * 8 + kVGroup * (2 * t + (e & 1)) + dt % kVGroup;
    }
  }
};

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

// Issue the cp.async copies of keys [n0, n0 + BLOCK_N) of K and V into one ring stage; keys at or
// past n_end (and head-dim padding) are zero-filled without reading memory. Four threads share a
// key row (one page-table lookup and address per row, not per chunk); chunk c of the row goes to
// thread c % 4, so each warp-wide copy reads 64 contiguous bytes of 8 rows.
template <class Tr>
__device__ __forceinline__ void load_kv_stage(typename Tr::T* sK, typename Tr::T* sV, const DecodeParams& p,
                                              const int* pages, int n0, int n_end, long long k_head,
                                              long long v_head) {
  using T = typename Tr::T;
  constexpr int kRowsPerPass = Tr::kThreads / 4, kChunks = Tr::kChunksPerRow / 4;
#pragma unroll
  for (int pass = 0; pass < Tr::kBlockN / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + threadIdx.x / 4, key = n0 + r, lane4 = threadIdx.x % 4;
    const T* gk = static_cast<const T*>(p.k);
    const T* gv = static_cast<const T*>(p.v);
    const bool row_ok = key < n_end;
    if (row_ok) {  // never reads a page-table entry past the sequence's pages
      int pi, slot;
      if (p.page_shift >= 0) {  // power-of-two pages: no division
        pi = key >> p.page_shift;
        slot = key & (p.page_size - 1);
      } else {
        pi = key / p.page_size;
        slot = key - pi * p.page_size;
      }
      const long long page = __ldg(pages + pi);
      gk += page * p.k_stride_page + slot * p.k_stride_slot + k_head;
      gv += page * p.v_stride_page + slot * p.v_stride_slot + v_head;
    }
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int col = (4 * j + lane4) * 8;
      const bool ok = row_ok && col < p.head_dim;
      cp_async_16(sK + r * Tr::kStride + col, ok ? gk + col : gk, ok);
      cp_async_16(sV + r * Tr::kStride + col, ok ? gv + col : gv, ok);
    }
  }
}

// Where one decode block works: its (split, kv head, row block, sequence), its sequence's pages,
// and its share of the key tiles some row of the block can see (divided among the splits).
template <class Tr>
struct DecodeBlock {
  int split, kv_head, b, r0, kv_len, n_rows, qi_lo, qi_hi, end, n_tiles, n_first;
  const int* pages;
  Band band;

  __device__ __forceinline__ explicit DecodeBlock(const DecodeParams& p) {
    constexpr int KB = Tr::kBlockN;
    split = blockIdx.x;
    kv_head = blockIdx.y / p.row_blocks;
    b = blockIdx.z;
    r0 = (blockIdx.y % p.row_blocks) * Tr::kRows;
    kv_len = p.kv_len[b];
    n_rows = p.group * p.q_len;
    pages = p.page_indptr != nullptr ? p.page_indices + p.page_indptr[b] : p.page_indices + b * p.table_stride;
    band = make_band(p, p.q_len, kv_len);
    qi_lo = r0 / p.group;
    qi_hi = (min(r0 + Tr::kRows, n_rows) - 1) / p.group;
    int begin;
    band_key_range<KB>(band, qi_lo, qi_hi, kv_len, begin, end);
    const int tiles_all = end > begin ? (end - begin + KB - 1) / KB : 0;
    const int per_split = (tiles_all + p.num_splits - 1) / p.num_splits;
    const int t_begin = min(tiles_all, split * per_split);
    n_tiles = min(tiles_all, t_begin + per_split) - t_begin;
    n_first = begin + t_begin * KB;
  }
};

// Copy the block's query rows into sQ ([kRows][kStride] of T); rows past the group are zeros.
template <class Tr>
__device__ __forceinline__ void load_q(typename Tr::T* sQ, const DecodeParams& p, const DecodeBlock<Tr>& blk) {
  using T = typename Tr::T;
  for (int c = threadIdx.x; c < Tr::kRows * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = (c % Tr::kChunksPerRow) * 8, gr = blk.r0 + r;
    const bool ok = gr < blk.n_rows && col < p.head_dim;
    const T* src = static_cast<const T*>(p.q);
    if (ok)
      src += blk.b * p.q_stride_b + (gr / p.group) * p.q_stride_s +
             (blk.kv_head * p.group + gr % p.group) * p.q_stride_h + col;
    cp_async_16(sQ + r * Tr::kStride + col, src, ok);
  }
}

// This lane's query rows (mi, h) -> block row mi * 16 + h * 8 + lane / 4, and the per-element
// score modifiers and masks of a warp's score tile.
template <int MT, bool ALIBI>
struct DecodeRows {
  int qi[MT][2];
  bool ok[MT][2];
  float slope[MT][2];
  int diag, kv_len;

  __device__ __forceinline__ DecodeRows(const DecodeParams& p, int b, int kv_head, int r0, int n_rows, int len) {
    const int g = (threadIdx.x % 32) / 4;
    diag = len - p.q_len;
    kv_len = len;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int gr = r0 + mi * 16 + h * 8 + g;
        ok[mi][h] = gr < n_rows;
        qi[mi][h] = gr / p.group;
        slope[mi][h] = 0.f;
        if constexpr (ALIBI)
          if (ok[mi][h]) slope[mi][h] = p.alibi[b * p.alibi_stride_b + kv_head * p.group + gr % p.group];
      }
  }

  // Scores of keys key0 + nt * 8 + (e & 1): past the end, outside the band, or a padding row -> -inf;
  // with modifiers the kept scores become final, in log2 units.
  template <int NT, bool SOFTCAP>
  __device__ __forceinline__ void mask(float (&s)[MT][NT][4], const DecodeParams& p, const Band& band,
                                       int key0) const {
    constexpr bool kMods = SOFTCAP || ALIBI;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + nt * 8 + (e & 1), h = e >> 1;
          const bool keep = ok[mi][h] && key < kv_len && band.allows(qi[mi][h], key);
          float x = s[mi][nt][e];
          if constexpr (kMods) {
            x *= p.scale;
            if constexpr (SOFTCAP) x = p.softcap * tanhf(x / p.softcap);
            if constexpr (ALIBI) x -= slope[mi][h] * fabsf(static_cast<float>(qi[mi][h] + diag - key));
            x *= kLog2e;
          }
          s[mi][nt][e] = keep ? x : -inf();
        }
  }
};

// Merge the warps' online-softmax states of one block through shared memory and store its rows:
// the output and LSE (num_splits == 1) or the split's fp32 partial and LSE.
template <class Tr>
__device__ __forceinline__ void decode_epilogue(const DecodeParams& p, float (&acc)[Tr::kMTiles][Tr::kHeadDim / 8][4],
                                                float (&row_max)[Tr::kMTiles][2], float (&row_sum)[Tr::kMTiles][2],
                                                float sl2, unsigned char* smem_raw, int split, int kv_head, int b,
                                                int r0, int n_rows) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, MT = Tr::kMTiles, ROWS = Tr::kRows, W = Tr::kWarps, AS = Tr::kAccStride;
  constexpr int DT = D / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // -- merge the warps' states: each warp leaves (max, sum, unnormalised O) in shared memory
  cp_async_wait<0>();
  __syncthreads();  // the ring is free to reuse
  float* sAcc = reinterpret_cast<float*>(smem_raw);  // [W][ROWS][AS]
  float* sM = sAcc + W * ROWS * AS;                   // [W][ROWS] max (log2 units), then weights
  float* sL = sM + W * ROWS;                          // [W][ROWS] row sums
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      const int rr = mi * 16 + h * 8 + g;
      if (t == 0) {
        sM[warp * ROWS + rr] = row_max[mi][h] == -inf() ? -inf() : row_max[mi][h] * sl2;
        sL[warp * ROWS + rr] = sum;
      }
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        float* dst = sAcc + (warp * ROWS + rr) * AS;
        if constexpr (Tr::kKv == 0) {
          *reinterpret_cast<float2*>(dst + dt * 8 + 2 * t) = make_float2(acc[mi][dt][2 * h], acc[mi][dt][2 * h + 1]);
        } else {  // permuted columns: two scalar stores
          dst[Tr::acc_col(dt, t, 0)] = acc[mi][dt][2 * h];
          dst[Tr::acc_col(dt, t, 1)] = acc[mi][dt][2 * h + 1];
        }
      }
    }
  __syncthreads();
  if (threadIdx.x < ROWS) {
    const int r = threadIdx.x, gr = r0 + r;
    float m = -inf(), l = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) m = fmaxf(m, sM[w * ROWS + r]);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float mw = sM[w * ROWS + r];
      l += mw == -inf() ? 0.f : fast_exp2(mw - m) * sL[w * ROWS + r];
    }
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float mw = sM[w * ROWS + r];
      sM[w * ROWS + r] = (l == 0.f || mw == -inf()) ? 0.f : fast_exp2(mw - m) / l;
    }
    if (gr < n_rows) {  // a row that saw no key: output 0, LSE -inf
      const float lse = l == 0.f ? -inf() : (m + log2f(l)) * kLn2;
      const int qi = gr / p.group, hq = kv_head * p.group + gr % p.group;
      if (p.num_splits == 1) {
        if (p.lse != nullptr) p.lse[b * p.lse_stride_b + hq * p.lse_stride_h + qi] = lse;
      } else {
        p.lse_part[((static_cast<long long>(split) * p.batch + b) * p.q_len + qi) * p.heads_q + hq] = lse;
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < ROWS * (D / 2); e += Tr::kThreads) {
    const int r = e / (D / 2), d = 2 * (e % (D / 2)), gr = r0 + r;
    if (gr >= n_rows || d >= p.head_dim) continue;
    float ox = 0.f, oy = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wt = sM[w * ROWS + r];
      const float2 a = *reinterpret_cast<const float2*>(sAcc + (w * ROWS + r) * AS + d);
      ox = fmaf(wt, a.x, ox);
      oy = fmaf(wt, a.y, oy);
    }
    const int qi = gr / p.group, hq = kv_head * p.group + gr % p.group;
    if (p.num_splits == 1) {
      T* o = static_cast<T*>(p.o) + b * p.o_stride_b + qi * p.o_stride_s + hq * p.o_stride_h + d;
      *reinterpret_cast<unsigned*>(o) = pack2<T>(ox, oy);
    } else {
      const long long row = ((static_cast<long long>(split) * p.batch + b) * p.q_len + qi) * p.heads_q + hq;
      *reinterpret_cast<float2*>(p.o_part + row * p.head_dim + d) = make_float2(ox, oy);
    }
  }
}

template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void attn_decode16(const DecodeParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles;
  constexpr int ROWS = Tr::kRows, LD = Tr::kStride, S = Tr::kStages, W = Tr::kWarps, AS = Tr::kAccStride;
  constexpr int NT = KW / 8, DT = D / 8;
  constexpr bool kMods = SOFTCAP || ALIBI;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // the host's shared_bytes and this layout disagree
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [ROWS][LD]
  T* sK = sQ + ROWS * LD;                  // [S][KB][LD]
  T* sV = sK + S * KB * LD;                // [S][KB][LD]

  const DecodeBlock<Tr> blk(p);
  const int split = blk.split, kv_head = blk.kv_head, b = blk.b, r0 = blk.r0, kv_len = blk.kv_len;
  const int n_rows = blk.n_rows, qi_lo = blk.qi_lo, qi_hi = blk.qi_hi, end = blk.end;
  const int n_tiles = blk.n_tiles, n_first = blk.n_first;
  const int* pages = blk.pages;
  const Band band = blk.band;
  const long long k_head = kv_head * p.k_stride_h, v_head = kv_head * p.v_stride_h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

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
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[mi][i][0] = acc[mi][i][1] = acc[mi][i][2] = acc[mi][i][3] = 0.f;
    row_max[mi][0] = row_max[mi][1] = -inf();
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }
  const float sl2 = kMods ? 1.f : p.scale_log2;  // with modifiers s is final (log2 units) before the softmax

  // One row tile at d <= 128: Q's A fragments stay in registers for the whole loop (32 registers),
  // taking 8 ldmatrix per stage off the dependency chain; otherwise they are re-read per stage.
  constexpr bool kQRegs = MT == 1 && D <= 128;
  unsigned qf[kQRegs ? D / 16 : 1][4];
  if constexpr (kQRegs) {
    cp_async_wait<S - 1>();  // group 0 (Q) landed
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], sQ + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
  }
  // Fragment loads are issued in batches ahead of their MMAs: the asm statements keep program
  // order, so interleaving ldmatrix and mma would stall every MMA on its load's latency.
  constexpr int KG = (D / 16) % 4 == 0 ? 4 : 2;  // k16 steps of K fragments per batch
  constexpr int VG = (D / 16) % 8 == 0 ? 8 : (D / 16) % 4 == 0 ? 4 : 2;  // ldmatrix.x4.trans of V per batch

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<S - 2>();
    __syncthreads();  // stage j landed for all, and every warp is done with stage j - 1
    if (j + S - 1 < n_tiles) {
      const int st = (j + S - 1) % S;
      load_kv_stage<Tr>(sK + st * KB * LD, sV + st * KB * LD, p, pages, n_first + (j + S - 1) * KB, end, k_head, v_head);
    }
    cp_async_commit();
    const T* tK = sK + (j % S) * KB * LD + warp * KW * LD;
    const T* tV = sV + (j % S) * KB * LD + warp * KW * LD;
    const int n0 = n_first + j * KB + warp * KW;  // this warp's first key

    float s[MT][NT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int i = 0; i < NT; ++i) s[mi][i][0] = s[mi][i][1] = s[mi][i][2] = s[mi][i][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < D / 16; k0 += KG) {
      unsigned bk[KG][NT / 2][4];
#pragma unroll
      for (int kk = 0; kk < KG; ++kk)
#pragma unroll
        for (int np = 0; np < NT / 2; ++np)
          ldmatrix_x4(bk[kk][np], tK + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + (k0 + kk) * 16 +
                                      ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if constexpr (kQRegs) {
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
          ldmatrix_x4_trans(bv[dp], tV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (d0 + dp) * 16 +
                                        (lane >> 4) * 8);
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

  decode_epilogue<Tr>(p, acc, row_max, row_sum, sl2, smem_raw, split, kv_head, b, r0, n_rows);
}

}  // namespace pyattn

#include "attention_decode_q8.cuh"

namespace pyattn {

// The entry point: 16-bit caches, or 8-bit codes with fp32 scales.
template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void attn_decode(const DecodeParams& p) {
  if constexpr (Tr::kKv == 0) {
    attn_decode16<Tr, SOFTCAP, ALIBI>(p);
  } else {
    attn_decode_q8<Tr, SOFTCAP, ALIBI>(p);
  }
}

}  // namespace pyattn

// What the paged-cache decode kernels share (attention_decode.cuh for 16-bit caches,
// attention_decode_q8.cuh for 8-bit ones): tile traits, page lookup, the block's share of the keys,
// the query load, per-row modifiers and masks, and the merge of the warps' softmax states.
// Requires pyattn::DecodeParams, common.cuh and mma.cuh.
#pragma once
#include "band.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int KEYS_PER_WARP_, int WARPS_, int M_TILES_, int STAGES_, int KV_ = 0,
          int PRODUCER_ = 0, int SWAP_ = 0>
struct AttnDecodeTraits {
  using T = T_;
  // cache elements: 0 = T, 1 = int8, 2 = fp8 e4m3 (attention_decode_q8.cuh); 3 / 4 = int8 / fp8 e4m3 whose
  // keys have per-(page, channel) scales (kCode: the code kind; kKeyChannel: the channel scales' ring).
  static constexpr int kKv = KV_;
  static constexpr int kCode = KV_ > 2 ? KV_ - 2 : KV_;
  static constexpr int kKeyChannel = KV_ > 2 ? 1 : 0;
  // 1: a producer warp (the last, past kThreads) fills the ring by TMA (attention_decode_tma.cuh
  // for 16-bit caches, attention_decode_q8_tma.cuh for 8-bit ones; sm_90a);
  // kWarps / kThreads count the consumer warps only.
  static constexpr int kProducer = PRODUCER_;
  static constexpr int kHeadDim = HEAD_DIM_;
  static constexpr int kKeysPerWarp = KEYS_PER_WARP_;
  static constexpr int kWarps = WARPS_;
  static constexpr int kThreads = 32 * WARPS_;
  static constexpr int kMTiles = M_TILES_;
  // 1: the TMA kernels' consumers with the MMA roles swapped (decode_swap.cuh): blocks of 8 query
  // rows on the MMAs' N side.
  static constexpr int kSwap = SWAP_;
  static constexpr int kRows = SWAP_ ? 8 : 16 * M_TILES_;
  static constexpr int kBlockN = KEYS_PER_WARP_ * WARPS_;
  static constexpr int kStages = STAGES_;
  static constexpr int kStride = HEAD_DIM_ + 8;     // 16-byte row padding: conflict-free ldmatrix
  // fp32 rows of the warp merge (2-way at worst). Swapped roles store rows 2t + j: the 8-bit
  // kernel float2 pairs at columns 16 g + .., which a stride of d + 2 spreads over 8 bank pairs of a
  // half warp (2-way; d + 8: 8-way), the 16-bit one scalars at columns g + .., which d + 4 puts on
  // 32 banks (d + 8: 2-way).
  static constexpr int kSwapPad = KV_ ? 2 : 4;
  static constexpr int kAccStride = SWAP_ ? HEAD_DIM_ + kSwapPad : HEAD_DIM_ + 8;
  static constexpr int kChunksPerRow = HEAD_DIM_ / 8;
  // 16-bit: Q and the K/V ring, rows padded. 8-bit: Q, then per stage K and V codes (unpadded,
  // swizzled rows) and their fp32 scales; per-channel keys add per stage each 16-key segment's page
  // record (decode_q8_stage.cuh SegRec: 16 bytes, fp16 r[HEAD_DIM_], 16 x 4 fp16 kept values).
  static constexpr int kSegBytes = kKeyChannel ? STAGES_ * (kBlockN / 16) * (HEAD_DIM_ * 2 + 144) : 0;
  // TMA ring (kProducer): Q, up to 1024 bytes to the swizzle's alignment, unpadded K and V boxes.
  static constexpr int kQBytes = kRows * kStride * 2;
  static constexpr int kRing16 = (kRows + 2 * STAGES_ * kBlockN) * kStride * 2;
  static constexpr int kRingTma = kQBytes + 1024 + 2 * STAGES_ * kBlockN * HEAD_DIM_ * 2;
  static constexpr int kRing8 = kQBytes + STAGES_ * kBlockN * 2 * (HEAD_DIM_ + 4) + kSegBytes;
  // 8-bit TMA ring: Q, the alignment slack, unpadded code boxes, the fp32 scales, the segment records.
  static constexpr int kRing8Tma = kQBytes + 1024 + STAGES_ * kBlockN * 2 * (HEAD_DIM_ + 4) + kSegBytes;
  static constexpr int kRing16Any = PRODUCER_ ? kRingTma : kRing16;
  static constexpr int kRing8Any = PRODUCER_ ? kRing8Tma : kRing8;
  static constexpr int kPipeBytes = KV_ == 0 ? kRing16Any : kRing8Any;
  static constexpr int kMergeBytes = WARPS_ * kRows * (kAccStride + 2) * 4;
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static_assert(sizeof(T_) == 2, "tensor-core decode takes fp16/bf16");
  static_assert(HEAD_DIM_ % 32 == 0 && KEYS_PER_WARP_ % 16 == 0 && STAGES_ >= 2, "tile shape");
  static_assert(KV_ == 0 || HEAD_DIM_ % 64 == 0, "8-bit caches: head-dim buckets of 64 (64-byte fragment groups)");
  static_assert(PRODUCER_ == 0 || KV_ == 0 || HEAD_DIM_ % 128 == 0,
                "the producer warp fills 16-bit rings, or 8-bit ones in 128-column boxes");
  static_assert(kBlockN % (kThreads / 4) == 0, "whole rows per copy pass (4 threads per key row)");
  static_assert(SWAP_ == 0 || (PRODUCER_ && M_TILES_ == 1), "swapped roles: the TMA kernels, 8 rows");
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

// A barrier of the warps that compute (all of the block's, or all but the producer warp, which has
// left by the epilogue: named barrier 1 over kThreads).
template <class Tr>
__device__ __forceinline__ void decode_sync() {
  if constexpr (Tr::kProducer) {
    asm volatile("bar.sync 1, %0;\n" ::"n"(Tr::kThreads) : "memory");
  } else {
    __syncthreads();
  }
}

// The pool page of key `key` of a sequence whose page list is `pages`, and its slot in that page.
__device__ __forceinline__ long long key_page(const DecodeParams& p, const int* pages, int key, int& slot) {
  int pi;
  if (p.page_shift >= 0) {  // power-of-two pages: no division
    pi = key >> p.page_shift;
    slot = key & (p.page_size - 1);
  } else {
    pi = key / p.page_size;
    slot = key - pi * p.page_size;
  }
  return __ldg(pages + pi);
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
    // A ragged batch runs its longest sequences first (batch_order: pyattn.ops._decode.run_decode),
    // so that their blocks are not the last to start; null keeps the batch's own order.
    b = p.batch_order != nullptr ? __ldg(p.batch_order + blockIdx.z) : blockIdx.z;
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

// The most splits of one sequence (pyattn.validate.paged.MAX_SPLITS; a CPU test keeps them equal).
constexpr int kMaxDecodeSplits = 256;

// Fused split combine. Each of a unit's num_splits blocks (a unit: one kv head, row block and
// sequence) stores its normalised fp32 partial and LSE, fences, and counts itself in
// p.split_counters[unit]; the block that counts last merges the unit's partials into the output
// (out = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s)) and sets the counter back to 0
// for the stream's next decode. One launch instead of decode + merge_states<float, T>: the
// second launch cost ~4 us of host time and its launch gap on the GPU (issue 12).
template <class Tr>
__device__ __forceinline__ void decode_combine_last(const DecodeParams& p, unsigned char* smem_raw, int kv_head,
                                                    int b, int r0, int n_rows) {
  using T = typename Tr::T;
  constexpr int ROWS = Tr::kRows, W = Tr::kWarps;
  // The weights of the first kCap splits of each row stay in shared memory (all of them but for
  // the smallest tiles at hundreds of splits); later ones are recomputed from their LSE.
  constexpr int kCap = Tr::kSmemBytes / (4 * ROWS) - 2 < kMaxDecodeSplits ? Tr::kSmemBytes / (4 * ROWS) - 2
                                                                           : kMaxDecodeSplits;
  static_assert(kCap >= 1, "combine: no room for split weights");
  __shared__ int s_last;
  __threadfence();  // this block's partial stores are visible device-wide before it is counted
  decode_sync<Tr>();
  unsigned* counter = static_cast<unsigned*>(p.split_counters) + blockIdx.z * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) s_last = atomicAdd(counter, 1u) == static_cast<unsigned>(p.num_splits - 1);
  decode_sync<Tr>();
  if (!s_last) return;
  __threadfence();  // every other split's stores (fenced before their counts) are read after this
  if (threadIdx.x == 0) *counter = 0u;
  const int S = p.num_splits, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sW = reinterpret_cast<float*>(smem_raw);  // [ROWS][kCap] weights exp(lse_s - max)
  float* sMax = sW + ROWS * kCap;                   // [ROWS] max of the splits' LSEs
  float* sInv = sMax + ROWS;                        // [ROWS] 1 / sum of the weights (0: no key seen)
  for (int r = warp; r < ROWS; r += W) {  // one warp per row (the condition is warp-uniform)
    const int gr = r0 + r;
    if (gr >= n_rows) continue;
    const int qi = gr / p.group, hq = kv_head * p.group + gr % p.group;
    const long long row0 = (static_cast<long long>(b) * p.q_len + qi) * p.heads_q + hq;
    const long long split_step = static_cast<long long>(p.batch) * p.q_len * p.heads_q;
    float m = -inf();
    for (int s = lane; s < S; s += 32) m = fmaxf(m, __ldcg(p.lse_part + row0 + s * split_step));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
    float l = 0.f;
    for (int s = lane; s < S; s += 32) {
      const float x = __ldcg(p.lse_part + row0 + s * split_step);
      const float w = x == -inf() ? 0.f : fast_exp2((x - m) * kLog2e);
      if (s < kCap) sW[r * kCap + s] = w;
      l += w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(kFullMask, l, o);
    if (lane == 0) {
      sMax[r] = m;
      sInv[r] = l == 0.f ? 0.f : 1.f / l;
      if (p.lse != nullptr) p.lse[b * p.lse_stride_b + hq * p.lse_stride_h + qi] = l == 0.f ? -inf() : m + logf(l);
    }
  }
  decode_sync<Tr>();
  // -- out = sum_s w_s o_s / l: a thread per (row, 4 columns); each loads U splits' partials before
  // using them, so the merge waits on L2 about S / U times per item instead of S times (with 33
  // splits and 2 warps a latency-bound loop cost the B=1 x 32k decode ~17 us on an H200).
  constexpr int D = Tr::kHeadDim, U = 16;
  const int n_valid = min(ROWS, n_rows - r0);
  const long long split_step = static_cast<long long>(p.batch) * p.q_len * p.heads_q;
  const long long step4 = split_step * p.head_dim / 4;  // one split's stride in float4s (head_dim % 8 == 0)
  for (int e = threadIdx.x; e < n_valid * (D / 4); e += Tr::kThreads) {
    const int r = e / (D / 4), d = 4 * (e % (D / 4)), gr = r0 + r;
    if (d >= p.head_dim) continue;
    const int qi = gr / p.group, hq = kv_head * p.group + gr % p.group;
    const long long row0 = (static_cast<long long>(b) * p.q_len + qi) * p.heads_q + hq;
    // Every split block wrote its rows' partials, zeros for a split that saw no key, so all are read.
    const float4* src = reinterpret_cast<const float4*>(p.o_part + row0 * p.head_dim + d);
    const float m = sMax[r];
    const auto weight = [&](int s) {
      if (s < kCap) return sW[r * kCap + s];
      const float x = __ldcg(p.lse_part + row0 + s * split_step);
      return x == -inf() ? 0.f : fast_exp2((x - m) * kLog2e);
    };
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const auto add = [&](float w, const float4& a) {
      acc.x = fmaf(w, a.x, acc.x);
      acc.y = fmaf(w, a.y, acc.y);
      acc.z = fmaf(w, a.z, acc.z);
      acc.w = fmaf(w, a.w, acc.w);
    };
    int s = 0;
    for (; s + U <= S; s += U) {
      float4 a[U];
#pragma unroll
      for (int u = 0; u < U; ++u) a[u] = __ldcg(src + (s + u) * step4);
#pragma unroll
      for (int u = 0; u < U; ++u) add(weight(s + u), a[u]);
    }
    for (; s + 4 <= S; s += 4) {  // the rest four at a time, then one at a time
      float4 a[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) a[u] = __ldcg(src + (s + u) * step4);
#pragma unroll
      for (int u = 0; u < 4; ++u) add(weight(s + u), a[u]);
    }
    for (; s < S; ++s) add(weight(s), __ldcg(src + s * step4));
    const float inv = sInv[r];
    T* o = static_cast<T*>(p.o) + b * p.o_stride_b + qi * p.o_stride_s + hq * p.o_stride_h + d;
    reinterpret_cast<unsigned*>(o)[0] = pack2<T>(acc.x * inv, acc.y * inv);
    reinterpret_cast<unsigned*>(o)[1] = pack2<T>(acc.z * inv, acc.w * inv);
  }
}

// The second phase of decode_epilogue (and of the swapped-role 8-bit decode's, decode_q8_swap.cuh),
// from the warps' states in shared memory ([W][ROWS][kAccStride] unnormalised O, then [W][ROWS]
// maxima in log2 units and [W][ROWS] row sums): the merge, the stores of the rows (output or
// split partial) and their LSE, and the fused split combine.
template <class Tr>
__device__ __forceinline__ void decode_merge(const DecodeParams& p, unsigned char* smem_raw, int split, int kv_head,
                                             int b, int r0, int n_rows) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, ROWS = Tr::kRows, W = Tr::kWarps, AS = Tr::kAccStride;
  float* sAcc = reinterpret_cast<float*>(smem_raw);
  float* sM = sAcc + W * ROWS * AS;
  float* sL = sM + W * ROWS;
  decode_sync<Tr>();
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
  decode_sync<Tr>();
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
  // Null counters: the host merges the splits in a second launch (pyattn.ops._decode.fused_combine).
  if (p.num_splits > 1 && p.split_counters != nullptr) decode_combine_last<Tr>(p, smem_raw, kv_head, b, r0, n_rows);
}

// Merge the warps' online-softmax states of one block through shared memory and store its rows:
// the output and LSE (num_splits == 1) or the split's fp32 partial and LSE.
template <class Tr>
__device__ __forceinline__ void decode_epilogue(const DecodeParams& p, float (&acc)[Tr::kMTiles][Tr::kHeadDim / 8][4],
                                                float (&row_max)[Tr::kMTiles][2], float (&row_sum)[Tr::kMTiles][2],
                                                float sl2, unsigned char* smem_raw, int split, int kv_head, int b,
                                                int r0, int n_rows) {
  constexpr int D = Tr::kHeadDim, MT = Tr::kMTiles, ROWS = Tr::kRows, W = Tr::kWarps, AS = Tr::kAccStride;
  constexpr int DT = D / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // -- merge the warps' states: each warp leaves (max, sum, unnormalised O) in shared memory
  cp_async_wait<0>();
  decode_sync<Tr>();  // the ring is free to reuse
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
  decode_merge<Tr>(p, smem_raw, split, kv_head, b, r0, n_rows);
}

}  // namespace pyattn

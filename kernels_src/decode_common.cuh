// What the paged-cache decode kernels share (attention_decode.cuh for 16-bit caches,
// attention_decode_q8.cuh for 8-bit ones): tile traits, page lookup, the block's share of the keys,
// the query load, per-row modifiers and masks, and the merge of the warps' softmax states.
// Requires pyattn::DecodeParams, common.cuh and mma.cuh.
#pragma once
#include "band.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int KEYS_PER_WARP_, int WARPS_, int M_TILES_, int STAGES_, int KV_ = 0,
          int PRODUCER_ = 0, int SWAP_ = 0, int GATHER_ = 0>
struct AttnDecodeTraits {
  using T = T_;
  // cache elements: 0 = T, 1 = int8, 2 = fp8 e4m3 (attention_decode_q8.cuh); 3 / 4 = int8 / fp8 e4m3 whose
  // keys have per-(page, channel) scales (kCode: the code kind; kKeyChannel: the channel scales' ring).
  static constexpr int kKv = KV_;
  static constexpr int kCode = KV_ > 2 ? KV_ - 2 : KV_;
  static constexpr int kKeyChannel = KV_ > 2 ? 1 : 0;
  // > 0: this many producer warps (the last, past kThreads) fill the ring by TMA, tiles dealt
  // round-robin (attention_decode_tma.cuh for 16-bit caches, attention_decode_q8_tma.cuh for 8-bit
  // ones; sm_90a); kWarps / kThreads count the consumer warps only.
  static constexpr int kProducer = PRODUCER_;
  static constexpr int kHeadDim = HEAD_DIM_;
  static constexpr int kKeysPerWarp = KEYS_PER_WARP_;
  static constexpr int kWarps = WARPS_;
  static constexpr int kThreads = 32 * WARPS_;
  static constexpr int kMTiles = M_TILES_;
  // 1: the TMA kernels' consumers with the MMA roles swapped (decode_swap.cuh): blocks of 8 query
  // rows on the MMAs' N side.
  static constexpr int kSwap = SWAP_;
  // 1: the TMA kernels' producers gather the ring's rows by cp.async instead of loading page boxes
  // (pages TMA boxes do not take; decode_gather16, attention_decode_q8_tma.cuh decode_gather_q8).
  static constexpr int kGather = GATHER_;
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
  static_assert(GATHER_ == 0 || (PRODUCER_ && KV_ <= 2), "gathered rows: the TMA kernels, per-token scales");
  // A producer's wait for stage s to be free (ProducerChunks::each_tile) is a parity wait: it is
  // sound while the stage's previous phase is known complete, which the producer's own previous
  // wait ensures when no more producers take turns than there are stages.
  static_assert(PRODUCER_ <= STAGES_, "no more producer warps than ring stages");
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

// Element (row r, column c; c a multiple of 8) of a TMA stage's K or V tile: [rows / 16][D / 64]
// boxes of [16][64], each 128-byte swizzled (a 16-byte chunk's index XOR the row's low 3 bits).
template <int D, class T>
__device__ __forceinline__ const T* swizzled_box_at(const T* base, int r, int c) {
  return base + (r >> 4) * (D * 16) + (c >> 6) * 1024 + (r & 15) * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3);
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

// The page-table entry of key `key` of a sequence whose page list is `pages`, as stored (not yet
// clamped into the pool: key_page does that), and the key's slot in that page.
__device__ __forceinline__ int key_entry(const DecodeParams& p, const int* pages, int key, int& slot) {
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

// A thread's page lookups for one ring stage (the cp.async decodes' copy passes, the gathered-row
// producers): the entries of keys key_of(0 .. N - 1), as stored, and their slots; keys at or past
// `end` read no entry (0, slot 0: never past the sequence's pages). All are issued before any copy:
// each copy's address waits on its entry, and looked up pass by pass they ran one L2 round trip
// after another (a page-size-1 table, SparQ's chosen keys: 1024 keys a block took 100 us at B8;
// BENCHMARKS.md). The caller clamps an entry into the pool where it makes the address
// (common.cuh pool_page), not here: clamped as loaded, ptxas put each clamp right behind its load
// and loaded every entry into one register, one after another again (page-1 decode B8 x 32k 267 ->
// 319 us, B64 x 4k 282 -> 360; sixty-first session).
template <int N, class KeyOf>
__device__ __forceinline__ void stage_entries(const DecodeParams& p, const int* pages, int end, KeyOf key_of,
                                              int (&entry)[N], int (&slot)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int key = key_of(i);
    entry[i] = slot[i] = 0;
    if (key < end) entry[i] = key_entry(p, pages, key, slot[i]);
  }
}

// The pool page of key `key` (its entry clamped: common.cuh pool_page), and its slot in that page.
__device__ __forceinline__ long long key_page(const DecodeParams& p, const int* pages, int key, int& slot) {
  return pool_page(key_entry(p, pages, key, slot), p.num_pages);
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
    // One length for the whole batch comes by value (contiguous_decode(..., cache_seqlens=int)):
    // a decode step then needs no per-call device table. Lengths from the device are clamped into
    // [0, uniform_len], their bound (DecodeParams: unchecked ones stay inside the tables).
    kv_len = p.kv_len != nullptr ? min(max(p.kv_len[b], 0), p.uniform_len) : p.uniform_len;
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

}  // namespace pyattn

#include "decode_merge.cuh"

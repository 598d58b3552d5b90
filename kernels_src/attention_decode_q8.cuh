// Decode attention over an 8-bit paged KV cache: int8 or fp8 e4m3 codes with one fp32 scale per
// (slot, kv head) for K and one for V (the value is code * scale), on fp16/bf16 tensor cores.
//
// Blocks, splits, band, modifiers and the warp merge are attention_decode.cuh's; the data path differs:
//  * the ring holds the codes (half a 16-bit cache's bytes) and the scales. Each key row's 16-byte
//    chunks are XOR-swizzled (q8_swizzle) so that both fragment read patterns below hit 8
//    distinct 16-byte bank groups per phase (no conflicts at head dims 128 / 256);
//  * K: a lane reads 16 bytes of one key row = 4 k16 steps of B fragments, because the head-dim
//    order inside each 64-column group is permuted (step kk, quad lane t takes columns
//    16t + 4kk .. +3). A dot product does not care about the order as long as Q's A fragments use
//    the same one. Codes become exact fp16/bf16 values; the K scale multiplies the score column.
//  * V: a lane reads kVGroup bytes of 4 key rows and so owns output column g of kVGroup n8 tiles:
//    the output columns are permuted (Traits::acc_col maps them back in the merge). Codes become
//    exact fp16; each key's V scale goes into its P instead, relative to a per-warp running power
//    of two (vref) so that P * scale / vref stays in [0, 1] (fp16's range); O is kept in units of
//    vref and rescaled when vref grows, like the online softmax's max.
//  * Both products therefore run on fp16 tensor cores whatever the query dtype (T: the output).
//  * Per-channel key scales (Traits::kKeyChannel; PagedKVCache(..., key_scales="channel")): a key's
//    value is code * S[page] * r[page][c]. S multiplies the score column of each 16-key segment, read
//    from the segment's page record in the ring (no per-row scale copy: sKs is unused); r multiplies
//    Q instead: each 16-key segment of a warp's keys lies in one page (page_size % 16 == 0), and
//    its Q fragments are rescaled by that page's r (r <= 1 keeps the power-of-two scaled query in
//    fp16's range) before the segment's Q K^T. The page's kKeptChannels largest channels (r = 0,
//    codes 0) come back as a rank-4 correction on the same score column: one m16n8k8 MMA per n8
//    tile of the scaled query's kept columns (gathered from shared memory) times their fp16 values
//    over S, accumulated before S is applied.
// Requires pyattn::DecodeParams, common.cuh, mma.cuh and cuda_fp8.h.
#pragma once
#include <cuda_fp8.h>
#include "q8_codes.cuh"

#include "decode_common.cuh"
#include "decode_q8_stage.cuh"

namespace pyattn {

__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}

// Issue the copies of keys [n0, n0 + BLOCK_N) into one ring stage: codes (swizzled chunks) and
// scales; keys at or past n_end are zero-filled (codes 0, scale 0) without reading memory.
// Per-channel keys: each 16-key segment's page record in the ring (SegRec, decode_q8_stage.cuh).
// Per-channel keys: a warp loads its own 16-key segments, one per kSegPasses passes (8 rows a pass:
// 4 threads a row), so it looks each segment's page up once and copies the segment's record in the
// same passes (lane l of pass h of the segment: chunk 32 h + l) -- every warp alike, no predicated
// copy on warps without a record. What a thread copies is worked out once per block and made opaque
// to the compiler: otherwise it rebuilds it from threadIdx in every pass (~30 instructions each).
template <bool WIDE>
struct SegBase {
  using type = long long;
};
template <>
struct SegBase<false> {
  using type = int;
};

template <class Tr>
struct SegCopy {
  static constexpr int kHalves = (SegRec<Tr::kHeadDim>::kChunks + 31) / 32;  // passes of a segment that copy
  // One copy pass (d <= 128): base includes the kv head's record offset (64-bit; fewest instructions
  // per copy). Two (d = 256): base is the offset inside the record, so that the opaque registers fit
  // (with the kv head's part in them, the modifier variant spilled 4 bytes).
  static constexpr bool kWide = kHalves == 1;
  typename SegBase<kWide>::type base[kHalves];  // bytes to the chunk (see kWide), without slot0
  int slot_mul[kHalves];    // slot0's multiplier (kept chunks: 8 bytes a slot)
  int copier[kHalves];      // whether this lane copies a chunk in that pass
  int r_ok[kHalves];        // whether that chunk holds real data (r chunks past p.head_dim: zero-filled)
  int dst;                  // this lane's offset in the warp's first segment record
  __device__ __forceinline__ SegCopy(const DecodeParams& p, int kv_head) : dst(0) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) base[h] = 0, slot_mul[h] = copier[h] = r_ok[h] = 0;
    if constexpr (!Tr::kKeyChannel) return;  // per-token scales: nothing to copy (and no opaque registers)
    using R = SegRec<Tr::kHeadDim>;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int i = 32 * h + lane;
      const bool is_r = i * 16 < R::kKept;
      copier[h] = i < R::kChunks;
      r_ok[h] = !is_r || (i - 1) * 8 < p.head_dim;
      base[h] = (kWide ? kv_head * p.ks_stride_h * 4 : 0) + (is_r ? i * 16 : 16 + 2 * p.head_dim + (i * 16 - R::kKept));
      slot_mul[h] = is_r ? 0 : kKeptChannels * 2;
      if constexpr (kWide) {
        asm volatile("" : "+l"(base[h]), "+r"(slot_mul[h]), "+r"(copier[h]), "+r"(r_ok[h]));
      } else {
        asm volatile("" : "+r"(base[h]), "+r"(slot_mul[h]), "+r"(copier[h]), "+r"(r_ok[h]));
      }
    }
    dst = (threadIdx.x / 32) * (Tr::kBlockN / 16 / Tr::kWarps) * R::kBytes + lane * 16;
    asm volatile("" : "+r"(dst));
  }
};

template <class Tr>
__device__ __forceinline__ void load_kv_stage_q8(unsigned char* sK, unsigned char* sV, float* sKs, float* sVs,
                                                 unsigned char* sSeg, const DecodeParams& p, const int* pages, int n0,
                                                 int n_end, int kv_head, const SegCopy<Tr>& sc) {
  constexpr int D = Tr::kHeadDim, CH = D / 16, kRowsPerPass = Tr::kThreads / 4;
  constexpr bool KC = Tr::kKeyChannel;
  constexpr int kSegPasses = 16 / 8, kSegsPerWarp = Tr::kBlockN / 16 / Tr::kWarps;
  static_assert(CH % 4 == 0, "four threads per key row, whole chunks each");
  static_assert(!KC || (Tr::kBlockN % (16 * Tr::kWarps) == 0 && SegCopy<Tr>::kHalves <= kSegPasses),
                "per-channel keys: whole segments per warp, each record copied in its segment's passes");
  constexpr int kPasses = Tr::kBlockN / kRowsPerPass;
  // Every lookup of the stage first (a row's entry a pass; per-channel keys: a 16-key segment's, its
  // keys all in one page), then the copies (decode_common.cuh stage_entries; looked up pass by pass,
  // ptxas loaded them into 3-5 registers one after another: sixty-second session).
  constexpr int kLookups = KC ? kSegsPerWarp : kPasses;
  int entry[kLookups], eslot[kLookups];
  stage_entries(p, pages, n_end, [&](int i) -> int {  // per-channel keys: segment i of this warp
    return n0 + (KC ? ((threadIdx.x / 32) * kSegsPerWarp + i) * 16 : i * kRowsPerPass + threadIdx.x / 4);
  }, entry, eslot);
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    // per-channel keys: rows 8 (pass % 2) .. +7 of this warp's segment pass / 2
    const int r = KC ? ((threadIdx.x / 32) * kSegsPerWarp + pass / kSegPasses) * 16 + (pass % kSegPasses) * 8 +
                           (threadIdx.x % 32) / 4
                     : pass * kRowsPerPass + threadIdx.x / 4;
    const int key = n0 + r, lane4 = threadIdx.x % 4;
    const unsigned char* gk = static_cast<const unsigned char*>(p.k);
    const unsigned char* gv = static_cast<const unsigned char*>(p.v);
    const float* gks = p.k_scale;
    const float* gvs = p.v_scale;
    const bool row_ok = key < n_end;
    // seg_ok: whether the segment has keys (else its entry was not read, and page / slot are 0)
    const int li = KC ? pass / kSegPasses : pass;
    const bool seg_ok = KC && n0 + (r & ~15) < n_end;
    const int seg_slot0 = eslot[li];
    const long long page = pool_page(entry[li], p.num_pages);
    const int slot = KC ? seg_slot0 + (r & 15) : eslot[li];
    if (row_ok) {
      gk += page * p.k_stride_page + slot * p.k_stride_slot + kv_head * p.k_stride_h;
      gv += page * p.v_stride_page + slot * p.v_stride_slot + kv_head * p.v_stride_h;
      gks += page * p.ks_stride_page + slot * p.ks_stride_slot + kv_head * p.ks_stride_h;
      gvs += page * p.vs_stride_page + slot * p.vs_stride_slot + kv_head * p.vs_stride_h;
    }
    // Per-channel keys: the segment's page record (its S is every key's scale: the scoring reads it
    // from the record, so no per-row scale copy); unread segments are zero-filled. seg_page and seg_slot0 are 0
    // where !seg_ok, and a chunk that is not ok reads nothing (from the pool's start).
    if (KC && pass % kSegPasses < SegCopy<Tr>::kHalves) {
      const int h = pass % kSegPasses;
      if (sc.copier[h]) {
        const bool ok = seg_ok && sc.r_ok[h];
        const long long off = page * (p.ks_stride_page * 4) + (SegCopy<Tr>::kWide ? 0 : kv_head * p.ks_stride_h * 4) +
                              sc.base[h] + seg_slot0 * sc.slot_mul[h];
        cp_async_16(sSeg + (pass / kSegPasses) * SegRec<D>::kBytes + 512 * h + sc.dst,
                    reinterpret_cast<const unsigned char*>(p.k_scale) + (ok ? off : 0), ok);
      }
    }
    const int swz = q8_swizzle<CH>(r);
#pragma unroll
    for (int j = 0; j < CH / 4; ++j) {
      const int c = 4 * j + lane4;
      const bool ok = row_ok && c * 16 < p.head_dim;  // head_dim is a multiple of 16 for 8-bit caches
      cp_async_16(sK + r * D + ((c ^ swz) << 4), ok ? gk + c * 16 : gk, ok);
      cp_async_16(sV + r * D + ((c ^ swz) << 4), ok ? gv + c * 16 : gv, ok);
    }
    if (!KC && lane4 == 0) cp_async_4(sKs + r, gks, row_ok);
    if (lane4 == 1) cp_async_4(sVs + r, gvs, row_ok);
  }
}

template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void attn_decode_q8(const DecodeParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles, KV = Tr::kCode;
  constexpr bool KC = Tr::kKeyChannel;
  constexpr int ROWS = Tr::kRows, LD = Tr::kStride, S = Tr::kStages;
  constexpr int NT = KW / 8, DT = D / 8, G64 = D / 64;
  constexpr bool kMods = SOFTCAP || ALIBI;
  static_assert(KV == 1 || KV == 2, "8-bit kinds: 1 = int8, 2 = fp8 e4m3");
  static_assert(!KC || KW % 16 == 0, "per-channel keys: whole 16-key segments per warp");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // the host's shared_bytes and this layout disagree
  T* sQ = reinterpret_cast<T*>(smem_raw);                          // [ROWS][LD]
  unsigned char* sK = smem_raw + ROWS * LD * 2;                    // [S][KB][D] codes
  unsigned char* sV = sK + S * KB * D;                             // [S][KB][D]
  float* sKs = reinterpret_cast<float*>(sV + S * KB * D);          // [S][KB] scales
  float* sVs = sKs + S * KB;                                       // [S][KB]
  unsigned char* sSeg = reinterpret_cast<unsigned char*>(sVs + S * KB);  // [S][KB / 16] SegRec (per-channel keys)
  constexpr int SEGB = SegRec<D>::kBytes;

  const DecodeBlock<Tr> blk(p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  const SegCopy<Tr> seg_copy(p, blk.kv_head);

  // -- prologue: Q, then the first S - 1 stages
  load_q<Tr>(sQ, p, blk);
  cp_async_commit();
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < blk.n_tiles)
      load_kv_stage_q8<Tr>(sK + st * KB * D, sV + st * KB * D, sKs + st * KB, sVs + st * KB,
                           sSeg + st * (KB / 16) * SEGB, p, blk.pages, blk.n_first + st * KB, blk.end, blk.kv_head,
                           seg_copy);
    cp_async_commit();
  }
  const DecodeRows<MT, ALIBI> rows(p, blk.b, blk.kv_head, blk.r0, blk.n_rows, blk.kv_len);

  float acc[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
  init_softmax_state<MT, DT>(acc, row_max, row_sum);
  const float sl2 = kMods ? 1.f : p.scale_log2;

  // Q's A fragments in the permuted head-dim order (decode_q8_stage.cuh), kept in registers
  unsigned qf[MT][D / 16][4];
  float row_inv[MT][2];
  cp_async_wait<S - 1>();  // group 0 (Q) landed
  __syncthreads();
  q8_query_fragments<Tr, false>(sQ, qf, row_inv);
  // Per-channel keys: the scaled fp16 query goes back into sQ (same size, same positions), where the
  // kept channels' correction gathers its columns; every warp has built its fragments first.
  __half* sQh = reinterpret_cast<__half*>(sQ);
  if constexpr (KC) {
    __syncthreads();
    if (warp == 0) q8_query_to_shared<Tr, false>(sQh, qf);
  }
  float vref = 0.f;  // this warp's running V-scale reference (a power of two; 0: no key yet)
  bool hi_rows[MT];  // whether row tile mi has real rows 8..15 (per-channel keys skip rescaling padding)
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) hi_rows[mi] = blk.r0 + mi * 16 + 8 < blk.n_rows;
  // per-channel keys: Q fragments times each segment's channel scales (rows 8..15 only where real)
  unsigned qs[KC ? MT : 1][KC ? D / 16 : 1][4];
#pragma unroll
  for (int mi = 0; mi < (KC ? MT : 1); ++mi)
#pragma unroll
    for (int ks = 0; ks < (KC ? D / 16 : 1); ++ks) qs[mi][ks][0] = qs[mi][ks][1] = qs[mi][ks][2] = qs[mi][ks][3] = 0u;

  for (int j = 0; j < blk.n_tiles; ++j) {
    cp_async_wait<S - 2>();
    __syncthreads();  // stage j landed for all, and every warp is done with stage j - 1
    if (j + S - 1 < blk.n_tiles) {
      const int st = (j + S - 1) % S;
      load_kv_stage_q8<Tr>(sK + st * KB * D, sV + st * KB * D, sKs + st * KB, sVs + st * KB,
                           sSeg + st * (KB / 16) * SEGB, p, blk.pages, blk.n_first + (j + S - 1) * KB, blk.end,
                           blk.kv_head, seg_copy);
    }
    cp_async_commit();
    const int st = j % S, wrow = warp * KW;  // this warp's first ring row
    const unsigned char* tK = sK + st * KB * D;
    const unsigned char* tV = sV + st * KB * D;
    const float* tKs = sKs + st * KB;
    const float* tVs = sVs + st * KB;
    const int n0 = blk.n_first + j * KB + wrow;  // this warp's first key

    // -- S = Q K^T: one 16-byte read per key row and 64-column group feeds 4 k16 steps
    float s[MT][NT][4];
    if constexpr (KC) {
      q8_scores_channel<Tr, false>(tK, sSeg + (st * (KB / 16) + wrow / 16) * SEGB, wrow, qf, row_inv, hi_rows, sQh,
                                   qs, s);
    } else {
      q8_scores<Tr, false>(tK, tKs, wrow, qf, row_inv, s);
    }

    // -- modifiers and masking (as the 16-bit kernel), then the online softmax
    if (kMods || !band_tile_full<KW>(blk.band, blk.qi_lo, blk.qi_hi, n0, blk.kv_len))
      rows.template mask<NT, SOFTCAP>(s, p, blk.band, n0 + 2 * t);
    q8_softmax_pv<Tr, false>(s, tV, tVs, wrow, vref, acc, row_max, row_sum, sl2);
  }

  q8_unscale(acc, vref);
  decode_epilogue<Tr>(p, acc, row_max, row_sum, sl2, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, blk.n_rows);
}

}  // namespace pyattn

// Paged-cache kernels that work per page or per sequence rather than per token row, run after
// kv_append on the same stream (kv_append has written every new token and copy-on-write slot):
//
// kv_key_pages<T, KV>: per-channel key scales (PagedKVCache(..., key_scales="channel")). One job per
//   (page written by the call): its n filled slots are (re)quantized together, each slot's key read
//   from a new token (k_src), from the page's 16-bit staging copy (fp32 rows: the open page is kept
//   exact while it fills), or, for a page reopened by truncate / fork, dequantized from the codes
//   of a source page. The page then holds codes, one fp32 page scale S, fp16 relative channel
//   scales r[c] and its kKeptChannels largest channels apart (their indices, and per slot their
//   values over S in fp16; pyattn.quant.quantize_page, bit for bit), stored as one record per
//   (page, kv head): float32 [S, idx (4 bytes), 0, 0], head_dim fp16 r values, then page_size x
//   kKeptChannels fp16 kept values, slot-major (16-byte aligned pieces for the decode's copies).
//   One warp per (job, kv head); lane l owns channels l, l + 32, ... (head_dim <= 256): the scale of
//   a channel is a reduction over the slots, which each lane does alone, so no slot is read by one
//   lane and written by another (a page reopened in place reads its old codes and writes new ones).
//
// kv_sparq<T>: the state SparQ needs (PagedKVCache(..., sparq=True)), for 16-bit caches:
//   * items: slots whose key row was just written -> the transposed key copy kt, (page, kv head,
//     channel, slot): the approximate scores read r channels of a page as r contiguous rows;
//   * jobs: per-sequence running sums of V (fp32, (row, kv head, channel)): sum[dst] = (src >= 0 ?
//     sum[src] : 0) + V of the listed slots, added one token after another in token order, so an
//     incremental sum and a recomputation from scratch agree bit for bit.
// Requires pyattn::KvPagesParams / KvSparqParams and common.cuh.
#pragma once
#include "kv_quant.cuh"

namespace pyattn {

constexpr int kKvLaneChannels = 8;  // channels per lane: head_dim <= 256
// Channels of each (page, kv head) kept apart in fp16 (pyattn.quant.KEPT_CHANNELS): one byte of the
// record's idx word each. 4 catches the measured outlier case; 8 gained nothing there (BENCHMARKS.md).
constexpr int kKeptChannels = 4;

// The source page of a job (a page reopened by truncate / fork): its scales as each lane needs them.
template <int M>
struct KvSourcePage {
  float e[M];          // S * r[c] of channel lane + 32 m
  int kpos[M];         // its rank among the page's kept channels, -1 if quantized
  float scale;         // S
  const __half* kept;  // [page_size][kKeptChannels] values over S
};

// The float value of slot source `code` at channel c of kv head h (see kv_key_pages above):
// code >= 0: new token row; -1 - x with x < stage_rows: staging row x; otherwise slot x - stage_rows
// of the source page: its code times e (S * r[c]), or for a kept channel its kept value times S.
template <typename T, int KV, class Params>
__device__ __forceinline__ float kv_page_value(const Params& p, int code, int h, int c, int src_page,
                                               float e_src, int kpos_src, const __half* kept_src, float s_src) {
  if (code >= 0)
    return to_float(static_cast<const T*>(p.k_src)[code * p.k_src_stride_t + h * p.k_src_stride_h + c]);
  const long long x = -1LL - code;
  if (x < p.stage_rows) return p.stage[(x * p.heads_kv + h) * p.head_dim + c];
  const long long slot = x - p.stage_rows;
  if (kpos_src >= 0) return __half2float(kept_src[slot * kKeptChannels + kpos_src]) * s_src;
  const unsigned char* k = static_cast<const unsigned char*>(p.k);
  return kv_decode1<KV>(k[src_page * p.k_stride_page + slot * p.k_stride_slot + h * p.k_stride_h + c]) * e_src;
}

template <typename T, int KV, class Params>  // Params: KvPagesParams (deduced: each unit declares only its own struct)
__device__ __forceinline__ void kv_key_pages(const Params& p) {
  static_assert(KV == 1 || KV == 2, "KV: 1 = int8, 2 = fp8 e4m3");
  constexpr int M = kKvLaneChannels;
  using Q = KvQuant<KV>;
  const int lane = threadIdx.x % 32, D = p.head_dim;
  const long long units = static_cast<long long>(p.n_jobs) * p.heads_kv;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  // Warp-uniform loop bound: the shuffles below need every lane.
  for (long long u = blockIdx.x * static_cast<long long>(blockDim.x / 32) + threadIdx.x / 32; u < units;
       u += warps) {
    const int h = static_cast<int>(u % p.heads_kv);
    const int* job = p.jobs + (u / p.heads_kv) * 5;
    const int dst_page = job[0], n = job[1], stage_slot = job[3], src_page = job[4];
    const int* src = p.src + job[2];
    // -- the source page's scales, read before anything of this job is written
    KvSourcePage<M> sp;
    sp.scale = 0.f;
    sp.kept = nullptr;
#pragma unroll
    for (int m = 0; m < M; ++m) sp.e[m] = 0.f, sp.kpos[m] = -1;
    if (src_page >= 0) {
      const float* rec = p.rec + src_page * p.rec_stride_page + h * p.rec_stride_h;
      const __half* r = reinterpret_cast<const __half*>(rec + 4);
      const unsigned idx = __float_as_uint(rec[1]);
      sp.scale = rec[0];
      sp.kept = r + D;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (lane + 32 * m < D) sp.e[m] = sp.scale * __half2float(r[lane + 32 * m]);
#pragma unroll
        for (int j = 0; j < kKeptChannels; ++j)
          if (((idx >> (8 * j)) & 0xffu) == static_cast<unsigned>(lane + 32 * m)) sp.kpos[m] = j;
      }
    }
    // -- pass 1: each channel's max |x| over the slots (NaN propagates)
    float amax[M];
#pragma unroll
    for (int m = 0; m < M; ++m) amax[m] = 0.f;
    for (int s = 0; s < n; ++s) {
      const int code = src[s];
#pragma unroll
      for (int m = 0; m < M; ++m)
        if (lane + 32 * m < D)
          amax[m] = max_keep_nan(amax[m], fabsf(kv_page_value<T, KV>(p, code, h, lane + 32 * m, src_page, sp.e[m],
                                                                     sp.kpos[m], sp.kept, sp.scale)));
    }
    float big = 0.f;
#pragma unroll
    for (int m = 0; m < M; ++m) big = max_keep_nan(big, amax[m]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) big = max_keep_nan(big, __shfl_xor_sync(kFullMask, big, offset));
    // -- the page's scales (big is warp-uniform: every branch is taken by the whole warp)
    const bool ok = big <= kv_flt_max() && big > 0.f;  // false for NaN / inf (S NaN) and all-zero pages (S 0)
    const float scale = !(big <= kv_flt_max()) ? kv_qnan() : (big == 0.f ? 0.f : big / Q::kMax);
    // -- the kept channels: kKeptChannels rounds of a warp argmax over (amax, lower channel first);
    // special pages keep channels 0, 1, ... (their kept values are 0). kpos[m]: rank of channel
    // lane + 32 m among the kept, -1 if quantized.
    int kpos[M];
#pragma unroll
    for (int m = 0; m < M; ++m) kpos[m] = -1;
    unsigned idx_word = 0;
#pragma unroll
    for (int j = 0; j < kKeptChannels; ++j) {
      float bv = -1.f;  // amax >= 0 on an ok page
      int bc = 1 << 30;
#pragma unroll
      for (int m = 0; m < M; ++m)  // ascending channels: strict > keeps the lower one on ties
        if (lane + 32 * m < D && kpos[m] < 0 && amax[m] > bv) bv = amax[m], bc = lane + 32 * m;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, bv, offset);
        const int oc = __shfl_xor_sync(kFullMask, bc, offset);
        if (ov > bv || (ov == bv && oc < bc)) bv = ov, bc = oc;
      }
      const int c = ok ? bc : j;  // warp-uniform
#pragma unroll
      for (int m = 0; m < M; ++m)
        if (lane + 32 * m == c) kpos[m] = j;
      idx_word |= static_cast<unsigned>(c) << (8 * j);
    }
    float inv[M];
    __half r[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      r[m] = __float2half_rz(0.f);
      inv[m] = 0.f;
      if (ok && kpos[m] < 0) {
        r[m] = __float2half_ru(amax[m] / big);  // IEEE division (no fast-math), then rounded up
        const float e = scale * __half2float(r[m]);
        inv[m] = e > 0.f ? fminf(1.f / e, kv_flt_max()) : 0.f;
      }
    }
    // -- pass 2: codes, kept values (and the staging copy of a page that stays open)
    unsigned char* kout = static_cast<unsigned char*>(p.k) + dst_page * p.k_stride_page + h * p.k_stride_h;
    float* rec = p.rec + dst_page * p.rec_stride_page + h * p.rec_stride_h;
    __half* kept = reinterpret_cast<__half*>(rec + 4) + D;  // [page_size][kKeptChannels]
    for (int s = 0; s < n; ++s) {
      const int code = src[s];
      float xs[M];
#pragma unroll
      for (int m = 0; m < M; ++m)
        xs[m] = lane + 32 * m < D ? kv_page_value<T, KV>(p, code, h, lane + 32 * m, src_page, sp.e[m], sp.kpos[m],
                                                         sp.kept, sp.scale) : 0.f;
      __syncwarp();  // a page reopened in place: slot s's kept values are read by other lanes than write them
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int c = lane + 32 * m;
        if (c < D) {
          const float x = xs[m];
          kout[s * p.k_stride_slot + c] = static_cast<unsigned char>(ok && kpos[m] < 0 ? kv_encode1<KV>(x * inv[m]) : 0u);
          if (kpos[m] >= 0) kept[s * kKeptChannels + kpos[m]] = __float2half_rn(ok ? x / scale : 0.f);
          if (stage_slot >= 0)
            p.stage[((static_cast<long long>(stage_slot) * p.page_size + s) * p.heads_kv + h) * D + c] = x;
        }
      }
    }
    // -- the page's record: [S, idx, 0, 0, r[0..D)] (its kept values went out in pass 2)
    if (lane < 4) rec[lane] = lane == 0 ? scale : (lane == 1 ? __uint_as_float(idx_word) : 0.f);
    __half* rout = reinterpret_cast<__half*>(rec + 4);
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (lane + 32 * m < D) rout[lane + 32 * m] = r[m];
  }
}

template <typename T, class Params>  // Params: KvSparqParams
__device__ __forceinline__ void kv_sparq(const Params& p) {
  constexpr int M = kKvLaneChannels;
  const int lane = threadIdx.x % 32, D = p.head_dim;
  const long long n_t = static_cast<long long>(p.n_items) * p.heads_kv;
  const long long units = n_t + static_cast<long long>(p.n_jobs) * p.heads_kv;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  for (long long u = blockIdx.x * static_cast<long long>(blockDim.x / 32) + threadIdx.x / 32; u < units;
       u += warps) {
    if (u < n_t) {
      // -- transposed key copy of one (slot, kv head) row
      const int h = static_cast<int>(u % p.heads_kv), slot = p.items[u / p.heads_kv];
      const long long page = slot / p.page_size, s = slot % p.page_size;
      const T* k = static_cast<const T*>(p.k) + page * p.k_stride_page + s * p.k_stride_slot + h * p.k_stride_h;
      T* kt = static_cast<T*>(p.kt) + page * p.kt_stride_page + h * p.kt_stride_h + s;
      for (int c = lane; c < D; c += 32) kt[static_cast<long long>(c) * p.page_size] = k[c];
    } else {
      // -- running V sum of one (sequence row, kv head), in token order
      const long long j = (u - n_t) / p.heads_kv;
      const int h = static_cast<int>((u - n_t) % p.heads_kv);
      const int* job = p.jobs + j * 4;
      const int dst = job[0], from = job[1], count = job[3];
      const int* slots = p.slots + job[2];
      float acc[M];
#pragma unroll
      for (int m = 0; m < M; ++m)
        acc[m] = (from >= 0 && lane + 32 * m < D) ? p.vsum[from * p.vsum_stride_row + h * D + lane + 32 * m] : 0.f;
      for (int t = 0; t < count; ++t) {
        const int slot = slots[t];
        const long long page = slot / p.page_size, s = slot % p.page_size;
        const T* v = static_cast<const T*>(p.v) + page * p.v_stride_page + s * p.v_stride_slot + h * p.v_stride_h;
#pragma unroll
        for (int m = 0; m < M; ++m)
          if (lane + 32 * m < D) acc[m] += to_float(v[lane + 32 * m]);
      }
#pragma unroll
      for (int m = 0; m < M; ++m)
        if (lane + 32 * m < D) p.vsum[dst * p.vsum_stride_row + h * D + lane + 32 * m] = acc[m];
    }
  }
}

}  // namespace pyattn

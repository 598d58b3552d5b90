// Paged KV-cache append: one launch writes the new tokens of several sequences into their pool
// slots and performs the copy-on-write page copies of the same call (see KvAppendParams). The
// host guarantees that no slot is both read and written, or written twice, by one launch, so
// items are independent. The same launch patches the decode's page table (n_patches writes).
//
// KV == 0 (fp16/bf16 pools, T = the pool type): one thread per 16-byte chunk of one (item, kv head)
// row, a plain copy.
// KV == 1 (int8) / 2 (fp8 e4m3): 8-bit codes plus one fp32 scale per (slot, kv head) row, T = the
// new tokens' type. One warp per row; lane l holds elements 8l .. 8l+7 (head_dim <= 256). A new
// row x is quantized as pyattn/quant.py documents, which reproduces it bit for bit:
//   amax = max |x|; inv = min(kMax / amax, FLT_MAX); code = encode(x * inv); scale = amax / kMax
// with amax == 0 -> codes 0, scale 0, and a row holding NaN or +-inf -> codes 0, scale NaN.
// A copy-on-write item copies codes and scale unchanged.
// Requires pyattn::KvAppendParams and common.cuh.
#pragma once
#include "kv_quant.cuh"

namespace pyattn {

// Quantize one row of the new tokens, ``raw`` = this lane's 8 elements (called by the whole warp;
// lanes >= n_lanes hold no data).
template <typename T, int KV>
__device__ __forceinline__ void kv_quantize_row(const uint4& raw, unsigned char* out, float* scale_out, int lane,
                                                int n_lanes) {
  using Q = KvQuant<KV>;
  float x[8];
  float amax = 0.0f;
  if (lane < n_lanes) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = to_float(e[i]);
      amax = max_keep_nan(amax, fabsf(x[i]));
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    amax = max_keep_nan(amax, __shfl_xor_sync(kFullMask, amax, offset));
  // -- amax is warp-uniform from here on: every branch below is taken by the whole warp
  uint2 codes = make_uint2(0u, 0u);
  float scale;
  if (!(amax <= kv_flt_max())) {
    scale = kv_qnan();  // NaN or inf in the row: codes 0, scale NaN -> every value dequantizes to NaN
  } else if (amax == 0.0f) {
    scale = 0.0f;  // kMax / 0 would be inf and 0 * inf NaN
  } else {
    // IEEE division (pyattn compiles without fast-math), as np.float32 does. The min keeps a tiny
    // amax (< kMax / FLT_MAX, bf16 only) from overflowing inv to inf (and 0 * inf to NaN).
    const float inv = fminf(Q::kMax / amax, kv_flt_max());
    scale = amax / Q::kMax;
    if (lane < n_lanes) {
      codes.x = Q::pack4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
      codes.y = Q::pack4(x[4] * inv, x[5] * inv, x[6] * inv, x[7] * inv);
    }
  }
  if (lane < n_lanes) *reinterpret_cast<uint2*>(out + lane * 8) = codes;  // rows start 8-byte aligned
  if (lane == 0) *scale_out = scale;
}

// Sequence b's shift of its items' slots: its device length (dst_base, a CUDA graph's lengths,
// read unchecked), clamped into [0, base_max] so that no write leaves the sequence's slots.
__device__ __forceinline__ int kv_append_base(const KvAppendParams& p, int b) {
  return min(max(p.dst_base[b], 0), p.base_max);
}

// Item `item`'s destination slot: dst[item], shifted by its sequence's base when dst_base is set.
__device__ __forceinline__ int kv_append_dst(const KvAppendParams& p, int item) {
  return p.dst_base != nullptr ? p.dst[item] + kv_append_base(p, item / p.per_seq) : p.dst[item];
}

template <typename T, int KV>
__device__ __forceinline__ void kv_append(const KvAppendParams& p) {
  static_assert(KV >= 0 && KV <= 2, "KV: 0 = 16-bit pool, 1 = int8, 2 = fp8 e4m3");
  // The decode table's patches (its new lengths and page entries, pyattn/paged/decode_table.py):
  // distinct int32 entries the decode reads only after this kernel (stream order), so any thread.
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < p.n_patches;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    p.table[p.patch[i]] = p.patch[p.n_patches + i];
  // With device lengths: the lengths after the append, for the decode behind this kernel.
  if (p.len_out != nullptr)
    for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < p.n_items / p.per_seq; b += gridDim.x * blockDim.x)
      p.len_out[b] = kv_append_base(p, b) + p.per_seq;
  if constexpr (KV == 0) {
    const int chunks = p.head_dim / 8;  // head_dim is a multiple of 8: rows are whole 16-byte chunks
    const long long total = static_cast<long long>(p.n_items) * p.heads_kv * chunks;
    for (long long c = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; c < total;
         c += static_cast<long long>(gridDim.x) * blockDim.x) {
      const int col = static_cast<int>(c % chunks) * 8;
      const int h = static_cast<int>((c / chunks) % p.heads_kv);
      const int item = static_cast<int>(c / (static_cast<long long>(chunks) * p.heads_kv));
      const int dst = kv_append_dst(p, item), src = p.src[item];
      const long long dpage = dst / p.page_size, dslot = dst % p.page_size;
      T* k_out = static_cast<T*>(p.k) + dpage * p.k_stride_page + dslot * p.k_stride_slot + h * p.k_stride_h + col;
      T* v_out = static_cast<T*>(p.v) + dpage * p.v_stride_page + dslot * p.v_stride_slot + h * p.v_stride_h + col;
      const T *k_in, *v_in;
      if (src >= 0) {
        k_in = static_cast<const T*>(p.k_src) + src * p.k_src_stride_t + h * p.k_src_stride_h + col;
        v_in = static_cast<const T*>(p.v_src) + src * p.v_src_stride_t + h * p.v_src_stride_h + col;
      } else {
        const int slot = -1 - src;
        const long long spage = slot / p.page_size, sslot = slot % p.page_size;
        k_in = static_cast<const T*>(p.k) + spage * p.k_stride_page + sslot * p.k_stride_slot + h * p.k_stride_h + col;
        v_in = static_cast<const T*>(p.v) + spage * p.v_stride_page + sslot * p.v_stride_slot + h * p.v_stride_h + col;
      }
      *reinterpret_cast<uint4*>(k_out) = *reinterpret_cast<const uint4*>(k_in);
      *reinterpret_cast<uint4*>(v_out) = *reinterpret_cast<const uint4*>(v_in);
    }
  } else {
    const int lane = threadIdx.x % 32, n_lanes = p.head_dim / 8;  // <= 32 for head_dim <= 256
    const long long rows = static_cast<long long>(p.n_items) * p.heads_kv;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    // Warp-uniform loop bound: the shuffles in kv_quantize_row need every lane of the warp.
    for (long long r = blockIdx.x * static_cast<long long>(blockDim.x / 32) + threadIdx.x / 32; r < rows;
         r += warps) {
      const int h = static_cast<int>(r % p.heads_kv);
      const int item = static_cast<int>(r / p.heads_kv);
      const int dst = kv_append_dst(p, item), src = p.src[item];
      const long long dpage = dst / p.page_size, dslot = dst % p.page_size;
      unsigned char* k_out = static_cast<unsigned char*>(p.k) + dpage * p.k_stride_page + dslot * p.k_stride_slot
                             + h * p.k_stride_h;
      unsigned char* v_out = static_cast<unsigned char*>(p.v) + dpage * p.v_stride_page + dslot * p.v_stride_slot
                             + h * p.v_stride_h;
      float* ks_out = p.k_scale + dpage * p.ks_stride_page + dslot * p.ks_stride_slot + h * p.ks_stride_h;
      float* vs_out = p.v_scale + dpage * p.vs_stride_page + dslot * p.vs_stride_slot + h * p.vs_stride_h;
      if (src >= 0) {
        // -- quantize a new token's K and V rows (both loads issued before the first store)
        uint4 k_raw = make_uint4(0u, 0u, 0u, 0u), v_raw = k_raw;
        if (lane < n_lanes) {
          k_raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.k_src) + src * p.k_src_stride_t
                                                  + h * p.k_src_stride_h + lane * 8);
          v_raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.v_src) + src * p.v_src_stride_t
                                                  + h * p.v_src_stride_h + lane * 8);
        }
        kv_quantize_row<T, KV>(k_raw, k_out, ks_out, lane, n_lanes);
        kv_quantize_row<T, KV>(v_raw, v_out, vs_out, lane, n_lanes);
      } else {
        // -- copy-on-write: codes and scales of pool slot -1 - src, unchanged
        const int slot = -1 - src;
        const long long spage = slot / p.page_size, sslot = slot % p.page_size;
        const unsigned char* k_in = static_cast<const unsigned char*>(p.k) + spage * p.k_stride_page
                                    + sslot * p.k_stride_slot + h * p.k_stride_h;
        const unsigned char* v_in = static_cast<const unsigned char*>(p.v) + spage * p.v_stride_page
                                    + sslot * p.v_stride_slot + h * p.v_stride_h;
        if (lane < n_lanes) {
          *reinterpret_cast<uint2*>(k_out + lane * 8) = *reinterpret_cast<const uint2*>(k_in + lane * 8);
          *reinterpret_cast<uint2*>(v_out + lane * 8) = *reinterpret_cast<const uint2*>(v_in + lane * 8);
        }
        if (lane == 0) {
          *ks_out = p.k_scale[spage * p.ks_stride_page + sslot * p.ks_stride_slot + h * p.ks_stride_h];
          *vs_out = p.v_scale[spage * p.vs_stride_page + sslot * p.vs_stride_slot + h * p.vs_stride_h];
        }
      }
    }
  }
}

}  // namespace pyattn

// pyattn common device helpers: element types, conversions, warp reductions.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace pyattn {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): scores are kept in base 2 so exp2f is one MUFU op
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): converts the base-2 log-sum-exp back to natural log
constexpr unsigned kFullMask = 0xffffffffu;
// A TMA tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned), as the host's
// cuTensorMapEncodeTiled made it; kernels take it inside their __grid_constant__ parameter struct.
struct alignas(64) TmaMap {
  unsigned long long opaque[16];
};
// fp8 e4m3 inputs (attn_fwd_tma): bytes handed to wgmma as they are, so no cuda_fp8.h (its
// templates cost compile time the kernel does not need).
struct fp8e4m3 {
  unsigned char bits;
};
// The output element type of an input type: fp8 inputs give bf16 outputs (FlashAttention-3's
// convention: an 8-bit output would round O to 3 mantissa bits).
template <typename T> struct OutOf {
  using type = T;
};
template <> struct OutOf<fp8e4m3> {
  using type = __nv_bfloat16;
};
// +inf without <cmath> (NVRTC has no INFINITY macro without the host headers).
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

// Merge two online-softmax states (max, sum of exp2(x - max)), log2 units; an empty state is (-inf, 0).
__device__ __forceinline__ void merge_exp2_state(float& m, float& z, float m2, float z2) {
  const float mn = fmaxf(m, m2);
  if (mn == -inf()) return;
  z = (m == -inf() ? 0.f : z * exp2f(m - mn)) + (m2 == -inf() ? 0.f : z2 * exp2f(m2 - mn));
  m = mn;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Two 16-bit values packed in a word (the first in the low half) as floats. A bf16 is the upper half
// of its fp32, so by its bits each takes one shift or one and, where __bfloat1622float2 took a PRMT
// and two IMAD.U32 a pair (NVRTC 13.0 SASS, thirty-seventh session).
template <typename T> __device__ __forceinline__ float2 pair_to_float2(unsigned w);
template <> __device__ __forceinline__ float2 pair_to_float2<__half>(unsigned w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <> __device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(unsigned w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// Round-to-nearest-even conversions back to the storage type.
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The last-block hand-over's count (a split decode's combine, SparQ's stages, the prefill's tail
// merge), made as a grid barrier makes it: one thread adds `amount` to `counter` between two
// barriers of the threads whose writes it hands over (a block's, or a warp's) and returns the count
// before its add. The release (cumulative) publishes device-wide every write the first barrier
// ordered before it; the acquire, with the second barrier, orders the writes of those counted
// before ahead of these threads' reads. ptxas: one MEMBAR.ALL.GPU in one warp and an L1 invalidate,
// where a __threadfence in every thread before and after the count cost a MEMBAR.SC.GPU a warp
// each (0.2-0.4 us a B1 decode call on an H200: BENCHMARKS.md, fifty-ninth session).
__device__ __forceinline__ unsigned count_acq_rel(void* counter, unsigned amount = 1) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(before) : "l"(counter), "r"(amount) : "memory");
  return before;
}

// A varlen sequence's rows, [lo, lo + len) of [cu[b], cu[b + 1]), clamped into the packed array's
// rows [0, total) and to at most `longest` rows. Offsets the host checked pass unchanged. Those it
// did not (pyattn.attention_varlen with max_seqlen_q / max_seqlen_k over device offsets, as a CUDA
// graph replays them) then address wrong rows of q, k, v, out and the LSE, never memory outside
// them, and never more rows than the grid (sized by `longest`) covers.
__device__ __forceinline__ void clamp_rows(const int* cu, int b, int total, int longest, int& lo, int& len) {
  lo = min(max(cu[b], 0), total);
  len = min(min(max(cu[b + 1], lo), total) - lo, longest);
}

// A page-table entry clamped into a pool of `num_pages` pages (an unsigned min: a negative entry
// too), so that a table no host check has seen (paged_decode's max_seqlen, paged_prefill's
// max_seqlen_k) never reads outside the pool; a checked one is unchanged.
__device__ __forceinline__ unsigned pool_page(int entry, int num_pages) {
  return min(static_cast<unsigned>(entry), static_cast<unsigned>(num_pages - 1));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// The sum / max over a quad: the 4 lanes (4r .. 4r + 3) that hold one row of an mma fragment.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullMask, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullMask, x, 2));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

}  // namespace pyattn

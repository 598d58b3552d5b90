// LSE merge of partial attention states: the combine step of split-KV and cascade attention.
//
// States s = 0 .. n_b: state 0 is "a", states 1 .. n_b are the stack "b" (state s at o_b +
// (s-1) * o_b_stride_n). For every row (a flat index over up to three leading dims):
//   lse = logaddexp_s(lse_s),   o = sum_s exp(lse_s - lse) * o_s
// A state with lse_s = -inf contributes nothing and its o is never read (it may hold garbage or
// NaN); a row whose states are all -inf gets o = 0, lse = -inf.
//
// One warp per row. Lanes split the states to find the max and the sum of exponentials (two warp
// reductions), then loop over the live states, each lane accumulating its own 16-byte chunks of
// the row in fp32. The kernel is memory-bound: every input byte is read once.
// Requires pyattn::MergeStatesParams (rendered by pyattn.jit.source) and common.cuh.
#pragma once

namespace pyattn {

namespace merge_detail {

// Load kVec elements of one 16-byte chunk as floats: one 128-bit load when the address allows.
template <typename T, int kVec>
__device__ __forceinline__ void load_chunk(const T* src, bool aligned16, float (&dst)[kVec]) {
  static_assert(kVec * sizeof(T) == 16, "a chunk is 16 bytes");
  if (aligned16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) dst[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) dst[i] = to_float(src[i]);
  }
}

template <int BYTES> struct VecOf;  // the vector type of a 16-, 8- or 4-byte store
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<4> { using type = unsigned; };

// Store kVec elements as one vector store (16, 8 or 4 bytes) when `aligned`, else element-wise.
template <typename T, int kVec>
__device__ __forceinline__ void store_chunk(T* dst, bool aligned, const float (&src)[kVec]) {
  constexpr int kBytes = kVec * sizeof(T);
  using Vec = typename VecOf<kBytes>::type;
  if (aligned) {
    Vec raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) e[i] = from_float<T>(src[i]);
    *reinterpret_cast<Vec*>(dst) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) dst[i] = from_float<T>(src[i]);
  }
}

__device__ __forceinline__ bool aligned_to(const void* p, unsigned long long bytes) {
  return (reinterpret_cast<unsigned long long>(p) & (bytes - 1)) == 0;
}

}  // namespace merge_detail

// TS: the states' element type; TO: the output's (a key-split prefill merges fp32 partials into T).
template <typename TS, typename TO, int HEAD_DIM, int WARPS>
__device__ __forceinline__ void merge_states(const MergeStatesParams& p) {
  constexpr int kVec = 16 / sizeof(TS);                   // elements per 16-byte chunk of a state
  constexpr int kChunksPerLane = (HEAD_DIM / kVec + 31) / 32;
  static_assert(HEAD_DIM % kVec == 0, "head-dim bucket must be whole 16-byte chunks");
  // params.head_dim is a multiple of 8 (checked on the host), so a chunk never straddles it.

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long row = static_cast<long long>(blockIdx.x) * WARPS + warp;
  if (row >= static_cast<long long>(p.dim0) * p.dim1 * p.dim2) return;  // whole warp leaves together
  const long long i2 = row % p.dim2, i1 = (row / p.dim2) % p.dim1, i0 = row / (static_cast<long long>(p.dim2) * p.dim1);

  const TS* o_a = static_cast<const TS*>(p.o_a) + i0 * p.o_a_stride_0 + i1 * p.o_a_stride_1 + i2 * p.o_a_stride_2;
  const TS* o_b = static_cast<const TS*>(p.o_b) + i0 * p.o_b_stride_0 + i1 * p.o_b_stride_1 + i2 * p.o_b_stride_2;
  const float* lse_a = p.lse_a + i0 * p.lse_a_stride_0 + i1 * p.lse_a_stride_1 + i2 * p.lse_a_stride_2;
  const float* lse_b = p.lse_b + i0 * p.lse_b_stride_0 + i1 * p.lse_b_stride_1 + i2 * p.lse_b_stride_2;
  TO* out = static_cast<TO*>(p.out) + i0 * p.out_stride_0 + i1 * p.out_stride_1 + i2 * p.out_stride_2;
  float* out_lse = p.out_lse + i0 * p.out_lse_stride_0 + i1 * p.out_lse_stride_1 + i2 * p.out_lse_stride_2;

  const int n_states = p.n_b + 1;
  auto lse_of = [&](int s) -> float { return s == 0 ? *lse_a : lse_b[(s - 1) * p.lse_b_stride_n]; };

  // -- lse = m + log(sum_s exp(lse_s - m)), m = max_s lse_s; lanes take states lane, lane+32, ...
  float m = -inf();
  bool nan_seen = false;
  for (int s = lane; s < n_states; s += 32) {
    const float l = lse_of(s);
    nan_seen |= l != l;
    m = fmaxf(m, l);
  }
  m = warp_max(m);
  // fmaxf drops NaN: a NaN LSE (never valid, not checked on the device) must reach the output
  // as NaN rather than vanish, or turn an otherwise all-dead row into a silent 0 / -inf.
  if (__any_sync(kFullMask, nan_seen)) m = __int_as_float(0x7fffffff);
  const bool all_dead = m == -inf();  // warp-uniform; also avoids -inf - -inf = NaN below
  float sum = 0.f;
  if (!all_dead)
    for (int s = lane; s < n_states; s += 32) sum += expf(lse_of(s) - m);  // a dead state adds exp(-inf) = 0
  sum = warp_sum(sum);  // >= 1 when a state is live: the max term is exp(0)
  const float inv_sum = 1.f / sum;

  // -- o = sum over live states of w_s * o_s, w_s = exp(lse_s - m) / sum; lane owns chunks lane + 32*c
  float acc[kChunksPerLane][kVec];
#pragma unroll
  for (int c = 0; c < kChunksPerLane; ++c)
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[c][i] = 0.f;

  // States go in groups of kGroup whose loads are all issued before their FMAs: a split-KV combine
  // of a few rows over many states would otherwise wait one memory latency per state.
  constexpr int kGroup = 8;
  if (!all_dead) {
    for (int s0 = 0; s0 < n_states; s0 += kGroup) {
      float w[kGroup];
      const TS* src[kGroup];
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const int s = s0 + i;
        const float l = s < n_states ? lse_of(s) : -inf();  // same address in every lane: a broadcast
        w[i] = l == -inf() ? 0.f : expf(l - m) * inv_sum;    // a dead state is never read (may hold NaN)
        src[i] = s == 0 ? o_a : o_b + (s - 1) * p.o_b_stride_n;
      }
#pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c) {
        const int d0 = (lane + 32 * c) * kVec;
        if (d0 < p.head_dim) {
          float x[kGroup][kVec];
#pragma unroll
          for (int i = 0; i < kGroup; ++i) {
            if (w[i] != 0.f) {
              merge_detail::load_chunk<TS, kVec>(src[i] + d0, merge_detail::aligned_to(src[i], 16), x[i]);
            } else {
#pragma unroll
              for (int e = 0; e < kVec; ++e) x[i][e] = 0.f;
            }
          }
#pragma unroll
          for (int i = 0; i < kGroup; ++i)
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[c][e] = fmaf(w[i], x[i][e], acc[c][e]);
        }
      }
    }
  }

  // -- write. Each lane writes only elements it read itself, and the lse store waits for every
  // lane's lse reads, so out may alias state a exactly (the host folds lists in place).
  const bool vec_out = merge_detail::aligned_to(out, kVec * sizeof(TO));
#pragma unroll
  for (int c = 0; c < kChunksPerLane; ++c) {
    const int d0 = (lane + 32 * c) * kVec;
    if (d0 < p.head_dim) merge_detail::store_chunk<TO, kVec>(out + d0, vec_out, acc[c]);
  }
  __syncwarp();
  if (lane == 0 && p.out_lse != nullptr) *out_lse = all_dead ? -inf() : m + logf(sum);
}

}  // namespace pyattn

// The end of a decode block, for every decode kernel (decode_common.cuh includes it): the merge of
// the warps' online-softmax states through shared memory, the stores of the block's rows (output or
// split partial) and their LSE, and the fused split combine of a unit's last block.
// Requires decode_common.cuh (AttnDecodeTraits, decode_sync), common.cuh and mma.cuh.
#pragma once

namespace pyattn {

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
    m = warp_max(m);
    float l = 0.f;
    for (int s = lane; s < S; s += 32) {
      const float x = __ldcg(p.lse_part + row0 + s * split_step);
      const float w = x == -inf() ? 0.f : fast_exp2((x - m) * kLog2e);
      if (s < kCap) sW[r * kCap + s] = w;
      l += w;
    }
    l = warp_sum(l);
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
      const float sum = quad_sum(row_sum[mi][h]);
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

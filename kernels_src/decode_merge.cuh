// The end of a decode block, for every decode kernel (decode_common.cuh includes it): the merge of
// the warps' online-softmax states through shared memory, the stores of the block's rows (output or
// split partial) and their LSE, and the fused split combine of a unit's last block; for SparQ's
// chosen-key decode, its finish.
// Requires decode_common.cuh (AttnDecodeTraits, decode_sync), common.cuh and mma.cuh.
#pragma once

namespace pyattn {

// SparQ's finish (kernels_src/sparq.cuh), folded into the last step of its chosen-key decode. That
// decode's units are SparQ rows of 2G query rows each: the exact queries q_0 .. q_{G-1}, then the
// approximate q~_0 .. q~_{G-1} (pyattn/ops/sparq.py), all in one block (2G <= its rows:
// validate/sparq.py). With p.sparq_fin set (16-bit caches only), row h < G is stored as
// alpha_h o_h + (1 - alpha_h) mean(V), alpha_h = exp2(lse2(q~_h) - lz_h) clamped to [0, 1], into
// p.o as (units, G, head_dim), contiguous; the q~ rows are only read for their LSE and nothing else
// of theirs is stored. The score stage's record of the unit (sparq_score.cuh) holds each lz_h (-inf:
// every key chosen, alpha 1), then the unit's mean of V, so that every load of this step goes out at
// once. As a launch of its own this step took 5-6 us a call, mostly hidden behind the decode's tail
// (BENCHMARKS.md, sixty-eighth session).
template <class Tr>
__device__ __forceinline__ bool sparq_fold(const DecodeParams& p) {
  if constexpr (Tr::kKv == 0) {
    return p.sparq_fin != nullptr;
  } else {
    return false;
  }
}

// The unit's record: lz_0 .. lz_{G-1}, then mean(V)[head_dim].
__device__ __forceinline__ const float* sparq_record(const DecodeParams& p, int unit) {
  return p.sparq_fin + static_cast<long long>(unit) * (p.group / 2 + p.head_dim);
}

__device__ __forceinline__ float sparq_alpha(float lse2, float lz) {
  return lz == -inf() ? 1.f : fminf(fmaxf(exp2f(lse2 - lz), 0.f), 1.f);
}

// Row h's N (2 or 4) outputs from column d on: o's first N (normalised, fp32) blended with mean's
// by alpha, stored.
template <class Tr, int N>
__device__ __forceinline__ void sparq_store(const DecodeParams& p, int unit, int h, int d, float alpha, float4 o,
                                            float4 mean) {
  using T = typename Tr::T;
  const float v[4] = {o.x, o.y, o.z, o.w}, mv[4] = {mean.x, mean.y, mean.z, mean.w};
  T* out = static_cast<T*>(p.o) + (static_cast<long long>(unit) * (p.group / 2) + h) * p.head_dim + d;
#pragma unroll
  for (int i = 0; i < N; i += 2)
    reinterpret_cast<unsigned*>(out)[i / 2] = pack2<T>(alpha * v[i] + (1.f - alpha) * mv[i],
                                                       alpha * v[i + 1] + (1.f - alpha) * mv[i + 1]);
}

// The fold's end in the fused combine, for lane g of a row's group of kW lanes (decode_combine_last):
// the q~ row's partial LSEs (from lse_t, a split_step apart; lane g takes splits g, g + kW, ...),
// merged over the group, give alpha; column d's four outputs o (normalised; d < 0: a lane past
// head_dim, which only shuffles) are blended and stored. Not inlined, and the q~ LSEs not read
// with the row's first partials, so that the fold adds little to the decodes' registers (ptxas,
// NVRTC 13.5, sm_90a bf16; before the fold -> inlined -> as here): the swapped-role d = 128 decode
// 128 -> 138 -> 127 registers (gathered rows; with a thread merging all the q~ LSEs itself, 16 more
// loads a round, 168 and a spill), the m16 one 162 -> 162; the gathered d = 64 swapped-role decode,
// capped at 96, spilled 56 / 108 bytes (stores / loads) -> 112 / 152 -> 76 / 124.
template <class Tr, int kW>
__device__ __noinline__ void sparq_combine_end(const DecodeParams& p, int unit, int h, int d, const float* lse_t,
                                               long long split_step, int g, float4 o) {
  const float* rec = sparq_record(p, unit);
  const float lz = rec[h];
  float4 mean = make_float4(0.f, 0.f, 0.f, 0.f);
  if (d >= 0) mean = make_float4(rec[p.group / 2 + d], rec[p.group / 2 + d + 1], rec[p.group / 2 + d + 2],
                                 rec[p.group / 2 + d + 3]);
  float mt = -inf(), lt = 0.f;  // this lane's (max, sum of exp2(lse2_s - max)), log2 units
  for (int s = g; s < p.num_splits; s += kW) merge_exp2_state(mt, lt, __ldcg(lse_t + s * split_step) * kLog2e, 1.f);
  const unsigned lanes = kW == 32 ? kFullMask : ((1u << kW) - 1u) << (threadIdx.x % 32 / kW * kW);
#pragma unroll
  for (int o2 = kW / 2; o2 > 0; o2 /= 2) {
    const float m2 = __shfl_xor_sync(lanes, mt, o2, kW), l2 = __shfl_xor_sync(lanes, lt, o2, kW);
    merge_exp2_state(mt, lt, m2, l2);
  }
  if (d >= 0) sparq_store<Tr, 4>(p, unit, h, d, sparq_alpha(lt == 0.f ? -inf() : mt + log2f(lt), lz), o, mean);
}

// Fused split combine. Each of a unit's num_splits blocks (a unit: one kv head, row block and
// sequence) stores its normalised fp32 partial and LSE, fences, and counts itself in
// p.split_counters[unit]; the block that counts last merges the unit's partials into the output
// (out = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s)) and sets the counter back to 0
// for the stream's next decode. One launch instead of decode + merge_states<float, T>: the
// second launch cost ~4 us of host time and its launch gap on the GPU (issue 12).
template <class Tr>
__device__ __forceinline__ void decode_combine_last(const DecodeParams& p, int kv_head, int b, int r0, int n_rows) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, ROWS = Tr::kRows, U = 16;
  __shared__ int s_last;
  decode_sync<Tr>();  // every thread's partial stores, before the count's release (common.cuh)
  unsigned* counter = static_cast<unsigned*>(p.split_counters) + blockIdx.z * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) s_last = count_acq_rel(counter) == static_cast<unsigned>(p.num_splits - 1);
  decode_sync<Tr>();  // the other splits' partials, acquired by the count, before this block's reads
  if (!s_last) return;
  if (threadIdx.x == 0) *counter = 0u;
  // -- out = sum_s w_s o_s / l, a thread per (row, 4 columns), U splits at a time: each thread
  // loads the chunk's LSEs beside its partials (one L2 round trip for both) and folds the chunk in
  // by an online max, as the softmax does. Before, a warp a row read the LSEs (twice) into shared
  // weights and a block sync preceded the partials' first load: three round trips more at 32
  // splits, the tail of a split decode (BENCHMARKS.md, forty-first session). U loads in flight:
  // with one at a time, 33 splits and 2 warps cost the B=1 x 32k decode ~17 us on an H200.
  // SparQ's fold: only the G exact rows. The lanes of a row (a group of kW = min(32, D / 4), whole
  // and aligned: D / 4 items a row) also merge its q~ row's LSEs, G rows further on, a share each
  // (sparq_combine_end, which says why so).
  const bool fold = sparq_fold<Tr>(p);
  constexpr int kW = D / 4 < 32 ? D / 4 : 32;
  const int S = p.num_splits, n_valid = fold ? p.group / 2 : min(ROWS, n_rows - r0), g = threadIdx.x % kW;
  const long long split_step = static_cast<long long>(p.batch) * p.q_len * p.heads_q;
  const long long step4 = split_step * p.head_dim / 4;  // one split's stride in float4s (head_dim % 8 == 0)
  for (int e = threadIdx.x; e < n_valid * (D / 4); e += Tr::kThreads) {
    const int r = e / (D / 4), d = 4 * (e % (D / 4)), gr = r0 + r;
    const bool live = d < p.head_dim;
    if (!live && !fold) continue;  // (the fold's lanes stay for the group's shuffles)
    const int qi = gr / p.group, hq = kv_head * p.group + gr % p.group;
    const long long row0 = (static_cast<long long>(b) * p.q_len + qi) * p.heads_q + hq;
    // Every split block wrote its rows' partials (zeros and LSE -inf for a split that saw no key).
    const float4* src = reinterpret_cast<const float4*>(p.o_part + row0 * p.head_dim + (live ? d : 0));
    const float* lse = p.lse_part + row0;
    float m = -inf(), l = 0.f;  // running max of the LSEs read, sum of exp(lse_s - m)
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < S; s += U) {
      float x[U];
      float4 a[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool in = s + u < S;
        x[u] = in ? __ldcg(lse + (s + u) * split_step) : -inf();
        a[u] = in ? __ldcg(src + (s + u) * step4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float mc = m;
      bool nan_seen = false;
#pragma unroll
      for (int u = 0; u < U; ++u) mc = fmaxf(mc, x[u]), nan_seen |= x[u] != x[u];
      // fmaxf drops NaN: a split's NaN LSE (a NaN key among seen ones) must reach the output as
      // NaN, as with one split and in merge_states, not vanish when every split has one.
      if (nan_seen) mc = __int_as_float(0x7fffffff);
      if (mc == -inf()) continue;  // no split so far saw a key
      const float c = fast_exp2((m - mc) * kLog2e);  // 0 while m is -inf
      l *= c;
      acc.x *= c, acc.y *= c, acc.z *= c, acc.w *= c;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float w = x[u] == -inf() ? 0.f : fast_exp2((x[u] - mc) * kLog2e);
        l += w;
        acc.x = fmaf(w, a[u].x, acc.x);
        acc.y = fmaf(w, a[u].y, acc.y);
        acc.z = fmaf(w, a[u].z, acc.z);
        acc.w = fmaf(w, a[u].w, acc.w);
      }
      m = mc;
    }
    const float inv = l == 0.f ? 0.f : 1.f / l;  // 0: no key seen (output 0, LSE -inf)
    if (fold) {
      sparq_combine_end<Tr, kW>(p, b, gr, live ? d : -1, lse + p.group / 2, split_step, g,
                                make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
      continue;
    }
    if (d == 0 && p.lse != nullptr)
      p.lse[b * p.lse_stride_b + hq * p.lse_stride_h + qi] = l == 0.f ? -inf() : m + logf(l);
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
  // SparQ's fold, one split: q~ row G + h leaves alpha_h in row h's first padding column of sAcc
  // (warp 0's rows; no thread reads a padding column), which row h's stores read.
  static_assert(AS > D, "a padding column of sAcc's rows");
  const bool fold = p.num_splits == 1 && sparq_fold<Tr>(p);
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
      if (fold) {
        if (gr >= p.group / 2)
          sAcc[(gr - p.group / 2) * AS + D] = sparq_alpha(m + log2f(l), sparq_record(p, b)[gr - p.group / 2]);
      } else if (p.num_splits == 1) {
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
    if (sparq_fold<Tr>(p) && gr >= p.group / 2) continue;  // a q~ row: its LSE is all that is read
    float ox = 0.f, oy = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wt = sM[w * ROWS + r];
      const float2 a = *reinterpret_cast<const float2*>(sAcc + (w * ROWS + r) * AS + d);
      ox = fmaf(wt, a.x, ox);
      oy = fmaf(wt, a.y, oy);
    }
    const int qi = gr / p.group, hq = kv_head * p.group + gr % p.group;
    if (fold) {
      const float* mean = sparq_record(p, b) + p.group / 2 + d;
      sparq_store<Tr, 2>(p, b, gr, d, sAcc[gr * AS + D], make_float4(ox, oy, 0.f, 0.f),
                         make_float4(mean[0], mean[1], 0.f, 0.f));
    } else if (p.num_splits == 1) {
      T* o = static_cast<T*>(p.o) + b * p.o_stride_b + qi * p.o_stride_s + hq * p.o_stride_h + d;
      *reinterpret_cast<unsigned*>(o) = pack2<T>(ox, oy);
    } else {
      const long long row = ((static_cast<long long>(split) * p.batch + b) * p.q_len + qi) * p.heads_q + hq;
      *reinterpret_cast<float2*>(p.o_part + row * p.head_dim + d) = make_float2(ox, oy);
    }
  }
  // Null counters: the host merges the splits in a second launch (pyattn.ops._decode.fused_combine).
  if (p.num_splits > 1 && p.split_counters != nullptr) decode_combine_last<Tr>(p, kv_head, b, r0, n_rows);
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

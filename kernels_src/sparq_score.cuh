// SparQ's first stage (sparq.cuh has the algorithm, the remaining stages and the entry point):
// score (stage 1: the row's r channels, the temperatures, the decode's query rows and q~, then the
// approximate scores of the keys from the chosen rows of kt, their histogram, the blocks' (max, sum
// exp2) and, in the row's last block, the threshold bin). Apart only to keep sparq.cuh short.
// P: pyattn::SparqParams.
#pragma once
#include "common.cuh"
#include "sparq_common.cuh"
#include "mma.cuh"  // fast_exp2

namespace pyattn {

// The score stage's prologue, run by every score block of a row alike (they all reach the same
// choice): the row's r channels with the largest sum over the group of |q| (ties: lower channel
// first), per head the temperature t_h = 1 / sqrt(sum_chosen |q_h| / sum |q_h|), and q~_h =
// round_T(q_h * t_h) on the chosen channels into qt_s [R][Gp] (heads past G zero), with the chosen
// kt rows' offsets in a page into off_s [R]. The row's block 0 also writes the decode's query rows
// qx[row] = (q_0 .. q_{G-1}, q~_0 .. q~_{G-1}) (q~ zero off the chosen channels).
// Why in every block rather than a stage of its own: at small batches a launch of its own cost more
// than the work (prep 7.8 us of a 69 us call at B1 x 32k, forty-ninth session), and the choice is a
// few hundred loads and compares. Its loops are kept short in code (a thread a channel, no runtime
// divisions, no unrolling): a block runs them once.
// qs: [G][D] floats of scratch; sc: 2 kSparqMaxDim + kSparqThreads + kSparqMaxGroup + kSparqWarps words.
template <typename T, class P>
__device__ __forceinline__ void sparq_choose(const P& p, int row, float* qs, int* sc, float* qt_s, int* off_s) {
  const int b = row / p.row_heads, rh = row % p.row_heads;
  const int G = p.group, D = p.head_dim, R = p.r, tid = threadIdx.x, Gp = (G + 3) & ~3;
  float* w = reinterpret_cast<float*>(sc);             // [D]
  int* flag = sc + kSparqMaxDim;                       // [D]
  int* chan_s = flag + kSparqMaxDim;                   // [R] (first the partial ranks)
  float* th = reinterpret_cast<float*>(chan_s + kSparqThreads);  // [G]
  int* wcount = reinterpret_cast<int*>(th + kSparqMaxGroup);     // [warps]
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b + static_cast<long long>(rh) * G * p.q_stride_h;
  static_assert(kSparqMaxDim <= kSparqThreads, "a thread a channel");
#pragma unroll 1
  for (int h = 0; h < G; ++h)
    if (tid < D) qs[h * D + tid] = to_float(q[h * p.q_stride_h + tid]);
  __syncthreads();
  // -- rank by (sum desc, channel asc). The ranks are counted by tpc threads a channel, a slice of
  // the D others each, and positions among the chosen come from warp ballots: one thread a channel
  // counting all D took 12 us at D 128.
  if (tid < D) {
    float s = 0.f;
#pragma unroll 1
    for (int h = 0; h < G; ++h) s += fabsf(qs[h * D + tid]);
    w[tid] = s;
  }
  __syncthreads();
  const int tpc = max(1, kSparqThreads / D), slice = (D + tpc - 1) / tpc;
  int* part = chan_s;  // [tpc][D] partial ranks (tpc * D <= kSparqThreads), then the chosen channels
  if (tid < tpc * D) {
    const int c = tid % D, c_lo = (tid / D) * slice, c_hi = min(D, c_lo + slice);
    const float wc = w[c];
    int rank = 0;
#pragma unroll 4
    for (int c2 = c_lo; c2 < c_hi; ++c2) rank += (w[c2] > wc || (w[c2] == wc && c2 < c));
    part[tid] = rank;
  }
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  bool chosen = false;
  if (tid < D) {
    int rank = 0;
#pragma unroll 1
    for (int t = 0; t < tpc; ++t) rank += part[t * D + tid];
    chosen = rank < R;
  }
  const unsigned ballot = __ballot_sync(kFullMask, chosen);
  if (lane == 0) wcount[warp] = __popc(ballot);
  __syncthreads();  // (every part[] read is done before chan_s is written below)
  if (tid < D) flag[tid] = chosen;
  if (chosen) {
    int pos = __popc(ballot & ((1u << lane) - 1u));
#pragma unroll 1
    for (int w2 = 0; w2 < warp; ++w2) pos += wcount[w2];
    chan_s[pos] = tid;
  }
  __syncthreads();
  // -- per head: the temperature (paper: softmax(q[i1] . K[:, i1] / sqrt(d * |q[i1]|_1 / |q|_1)))
#pragma unroll 1
  for (int h = warp; h < G; h += kSparqWarps) {
    float all = 0.f, sel = 0.f;
#pragma unroll 1
    for (int c = lane; c < D; c += 32) {
      const float a = fabsf(qs[h * D + c]);
      all += a;
      sel += flag[c] ? a : 0.f;
    }
    all = warp_sum(all);
    sel = warp_sum(sel);
    if (lane == 0) th[h] = (all > 0.f && sel > 0.f) ? 1.f / sqrtf(sel / all) : 0.f;
  }
  __syncthreads();
  if (blockIdx.x == 0) {  // the decode's query rows: q, then q~ (the chosen channels only)
    T* qx = static_cast<T*>(p.qx) + static_cast<long long>(row) * 2 * G * D;
#pragma unroll 1
    for (int hh = 0; hh < 2 * G && tid < D; ++hh) {
      const float x = hh < G ? qs[hh * D + tid] : (flag[tid] ? qs[(hh - G) * D + tid] * th[hh - G] : 0.f);
      qx[hh * D + tid] = from_float<T>(x);
    }
  }
  // -- q~ on the chosen channels as the scoring reads it, and the chosen kt rows' offsets
  if (tid < R) {
    const int c = chan_s[tid];
    off_s[tid] = c * p.page_size;
#pragma unroll 1
    for (int h = 0; h < Gp; ++h)
      qt_s[tid * Gp + h] = h < G ? to_float(from_float<T>(qs[h * D + c] * th[h])) : 0.f;
  }
  __syncthreads();  // (qs, the caller's histogram space, is free again)
}

template <typename T, class P>
__device__ __forceinline__ void sparq_score(const P& p, unsigned char* smem) {
  const int row = blockIdx.y, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int n = p.kv_len[b], c0 = blockIdx.x * kSparqChunk * p.chunk_steps;
  if (c0 >= n) return;  // block-uniform; such blocks are not counted below
  const int G = p.group, R = p.r, tid = threadIdx.x, ps = p.page_size, warp = tid / 32, lane = tid % 32;
  const int Gp = (G + 3) & ~3;
  float* qt_s = reinterpret_cast<float*>(smem);                           // [R][Gp]
  int* off_s = reinterpret_cast<int*>(qt_s + kSparqMaxGroup * kSparqMaxDim);  // [R] chosen kt rows' page offsets
  unsigned* hist_s = reinterpret_cast<unsigned*>(off_s + kSparqMaxDim);  // [bins]
  float* red = reinterpret_cast<float*>(hist_s + kSparqBins);             // [warps][G][2]: a warp's running state
  int* flag = reinterpret_cast<int*>(red + kSparqWarps * kSparqMaxGroup * 2);
  sparq_choose<T>(p, row, reinterpret_cast<float*>(hist_s), flag + 1, qt_s, off_s);
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist_s[i] = 0u;
  for (int i = tid; i < kSparqWarps * kSparqMaxGroup; i += kSparqThreads) red[2 * i] = -inf(), red[2 * i + 1] = 0.f;
  __syncthreads();
  unsigned* score = reinterpret_cast<unsigned*>(sparq_i(p, p.off_score)) + static_cast<long long>(row) * p.lpad;
  const T* kt = static_cast<const T*>(p.kt) + kvh * p.kt_stride_h;
  const int* pages = sparq_pages(p, b);

  // This thread's running (max, sum exp2) of the approximate logits (log2 units) of heads hc ..
  // hc + 3, kept across the steps when G <= 4 and reduced over the warp once at the end (else at
  // the end of each 4-head pass). A warp reduction for every step and head made the steps' ends
  // a quarter of the stage's instructions, with their shuffle chains' waits (Nsight Compute, H200,
  // B8 x 32k; BENCHMARKS.md, fiftieth session).
  float tm[4], tz[4];
  auto restart = [&] {
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) tm[hh] = -inf(), tz[hh] = 0.f;
  };
  // the warp's (max, sum) of heads hc .., merged into the warp's entries of red by lane 0
  auto flush = [&](int hc) {
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
      const float m = warp_max(tm[hh]);
      float z = 0.f;
      if (m != -inf()) z = warp_sum(tm[hh] == -inf() ? 0.f : tz[hh] * fast_exp2(tm[hh] - m));  // (warp-uniform)
      if (lane == 0 && hc + hh < G) {
        float* r2 = red + (warp * kSparqMaxGroup + hc + hh) * 2;
        sparq_merge(r2[0], r2[1], m, z);
      }
    }
  };
  restart();

  // Steps of kSparqChunk keys; a thread's 8 keys lie in one page (page_size % 8 == 0): 16 bytes of
  // each chosen kt row. A thread past the sequence's end reads the sequence's first keys instead
  // and never uses what it sums, so the loads take no predicate and no zeroed registers (slots past
  // the end inside the last page are read alike, never counted).
  for (int step = 0; step < p.chunk_steps && c0 + step * kSparqChunk < n; ++step) {
    const int i0 = c0 + step * kSparqChunk + kSparqKeys * tid, nv = max(0, min(kSparqKeys, n - i0));
    const int at = nv > 0 ? i0 : 0;
    const T* base = kt + pages[at / ps] * p.kt_stride_page + at % ps;
    float sel[kSparqKeys];
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e) sel[e] = 0.f;
    for (int hc = 0; hc < G; hc += 4) {  // 4 query heads at a time; later passes re-read kt from L1
      float acc[4][kSparqKeys];
#pragma unroll
      for (int hh = 0; hh < 4; ++hh)
#pragma unroll
        for (int e = 0; e < kSparqKeys; ++e) acc[hh][e] = 0.f;
#pragma unroll 8
      for (int j = 0; j < R; ++j) {
        const uint4 raw = *reinterpret_cast<const uint4*>(base + off_s[j]);
        const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
        float k8[kSparqKeys];
#pragma unroll
        for (int e = 0; e < kSparqKeys; e += 2) {
          const float2 f = pair_to_float2<T>(words[e / 2]);
          k8[e] = f.x, k8[e + 1] = f.y;
        }
        const float4 qv = *reinterpret_cast<const float4*>(qt_s + j * Gp + hc);
#pragma unroll
        for (int e = 0; e < kSparqKeys; ++e) {
          const float k = k8[e];
          acc[0][e] = fmaf(qv.x, k, acc[0][e]);
          acc[1][e] = fmaf(qv.y, k, acc[1][e]);
          acc[2][e] = fmaf(qv.z, k, acc[2][e]);
          acc[3][e] = fmaf(qv.w, k, acc[3][e]);
        }
      }
      // -- the selection score (heads past G have q~ = 0), and this thread's running (max, sum)
#pragma unroll
      for (int hh = 0; hh < 4; ++hh) {
        float m = tm[hh];
#pragma unroll
        for (int e = 0; e < kSparqKeys; ++e) {
          sel[e] += acc[hh][e];
          acc[hh][e] *= p.scale_log2;
          if (e < nv) m = fmaxf(m, acc[hh][e]);
        }
        float z = tm[hh] == -inf() ? 0.f : tz[hh] * fast_exp2(tm[hh] - m);
#pragma unroll
        for (int e = 0; e < kSparqKeys; ++e) z += e < nv ? fast_exp2(acc[hh][e] - m) : 0.f;
        tm[hh] = m, tz[hh] = z;
      }
      if (G > 4) {
        flush(hc);
        restart();
      }
    }
    // -- selection scores (order keys) and their histogram
    unsigned u[kSparqKeys];
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e) u[e] = sparq_order(sel[e]);
    // All 8 when any is real: those past the end inside the last octet are never read as scores
    // (the row's stride lpad has room). The element loop this replaces cost the stage ~5 us at
    // B8 x 32k (73 -> 68 us, forty-ninth session; 240 SASS instructions fewer).
    if (nv > 0) {
      *reinterpret_cast<uint4*>(score + i0) = make_uint4(u[0], u[1], u[2], u[3]);
      *reinterpret_cast<uint4*>(score + i0 + 4) = make_uint4(u[4], u[5], u[6], u[7]);
    }
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e)
      if (e < nv) atomicAdd(&hist_s[u[e] >> 20], 1u);
  }
  if (G <= 4) flush(0);
  __syncthreads();
  unsigned* hist = sparq_hist(p, row);
  for (int i = tid; i < kSparqBins; i += kSparqThreads)
    if (hist_s[i]) atomicAdd(&hist[i], hist_s[i]);
  float* part = sparq_f(p, p.off_part) + static_cast<long long>(row) * p.n_chunks * G * 2;
  if (tid < G) {
    float m = -inf(), z = 0.f;
    for (int w = 0; w < kSparqWarps; ++w)
      sparq_merge(m, z, red[(w * kSparqMaxGroup + tid) * 2], red[(w * kSparqMaxGroup + tid) * 2 + 1]);
    part[(blockIdx.x * G + tid) * 2] = m;
    part[(blockIdx.x * G + tid) * 2 + 1] = z;
  }
  // -- the row's last block: per head the row's (max, sum) into chunk 0's entry (warp h merges the
  // chunks, a lane each), and the bin holding the k-th largest score
  int* ctr = sparq_ctr(p, row);
  const int n_blocks = (n + kSparqChunk * p.chunk_steps - 1) / (kSparqChunk * p.chunk_steps);
  if (!sparq_last(ctr, n_blocks, flag)) return;
  if (tid == 0) ctr[0] = 0;  // every block has counted (the next call's score stage finds it zero)
  for (int h = warp; h < G; h += kSparqWarps) {
    float m = -inf(), z = 0.f;
    for (int c = lane; c < n_blocks; c += 32)
      sparq_merge(m, z, __ldcg(part + (c * G + h) * 2), __ldcg(part + (c * G + h) * 2 + 1));
    sparq_warp_merge(m, z);
    if (lane == 0) part[h * 2] = m, part[h * 2 + 1] = z;
  }
  int* info = sparq_i(p, p.off_info) + row * 4;
  const int k_eff = min(p.k, n);
  if (k_eff >= n) {  // every key is chosen
    if (tid == 0) info[0] = -1, info[1] = n, info[2] = k_eff;
    for (int i = tid; i < kSparqBins; i += kSparqThreads) hist[i] = 0u;
    return;
  }
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist_s[i] = __ldcg(hist + i);
  __syncthreads();
  // Zeroed for the next call (sparq_hist) in a loop of its own, after the loads: with each word's
  // store right behind its load in the loop above (the SASS issues them back to back, so the hold-up
  // is presumably each store waiting for its address's load in flight) this block, the row's last,
  // made the stage 24% slower at B8 x 32k (65-66 against 52.5-53 us; 188-190 against 134 with a row
  // per query head; BENCHMARKS.md, fifty-first session).
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist[i] = 0u;
  unsigned* sums = reinterpret_cast<unsigned*>(qt_s);  // 16 bins per thread (q~ is no longer read)
  static_assert(kSparqBins == 16 * kSparqThreads, "16 bins per thread");
  unsigned s16 = 0u;
  for (int i = 0; i < 16; ++i) s16 += hist_s[16 * tid + i];
  sums[tid] = s16;
  __syncthreads();
  if (tid < 32) {  // the 16-bin group holding the k-th largest, then the bin inside it
    int t;
    unsigned above;
    sparq_find256(sums, static_cast<unsigned>(k_eff), t, above);
    int bin = 16 * t + 15;
    for (int i = 0; i < 15 && above + hist_s[bin] < static_cast<unsigned>(k_eff); ++i) above += hist_s[bin--];
    if (tid == 0) {
      info[0] = bin;
      info[1] = static_cast<int>(above);
      info[2] = k_eff;
    }
  }
}

}  // namespace pyattn

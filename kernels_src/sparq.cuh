// SparQ attention (Ribar et al., "SparQ Attention: Bandwidth-Efficient LLM Inference") over a paged
// 16-bit KV cache that keeps a transposed key copy kt (page, kv head, channel, slot) and running V
// sums (PagedKVCache(..., sparq=True)). One kernel, launched once per stage (params.stage); the
// attention over the chosen keys in between is the paged decode kernel (attention_decode.cuh).
// A "row" is one (sequence b, row head rh) whose G query heads share the row's choices: with
// select="group" the row heads are the kv heads and G the GQA group; with select="head" every query
// head is a row (G = 1, kv head rh / kv_div), the paper's algorithm for each head
// (pyattn/reference_sparq.py defines both, and why):
//
//  0 prep   (grid rows): the r channels with the largest sum over the group of |q| (ties: lower
//           channel first); per head the temperature t_h = 1 / sqrt(sum_chosen |q_h| / sum |q_h|);
//           q~_h = round_T(q_h * t_h) on the chosen channels, 0 elsewhere. Writes the decode's
//           query rows qx[row] = (q_0 .. q_{G-1}, q~_0 .. q~_{G-1}), the chosen channels and their
//           q~ values, and zeroes the row's histogram and counters.
//  1 score  (grid blocks x rows; a block takes chunk_steps steps of kSparqChunk keys, 8 a thread:
//           one 16-byte load per chosen kt row; the host sizes the grid to about one wave):
//           reads only the r chosen rows of kt per page. Per key the selection
//           score a_i = sum_h q~_h . k_i (fp32), stored as an order-preserving uint32; a 4096-bin
//           histogram of its top 12 bits; per head the block's (max, sum exp2) of the approximate
//           logits scale*log2e * q~_h . k_i. The row's last block (threadfence pattern) finds the
//           bin holding the k-th largest key and merges the blocks' (max, sum) per head.
//  2 select (grid chunks x rows): keys above that bin are chosen, keys in it become candidates
//           (one counter claim per block, positions in order inside it); the row's last block picks
//           the remaining ones among the candidates exactly (radix select on (score, -index): ties
//           go to the lower position; in shared memory when they fit) and writes the row's count.
//           Chosen keys are written as decode "pages": (pool slot * heads_kv + kv head), each one
//           row of the NHD pool (page size 1), plus their positions.
//  (decode  over the chosen keys: rows q (exact attention) and q~ (the log-sum-exp of the chosen
//           keys' approximate logits, for alpha).)
//  4 finish (grid rows): alpha_h = exp(lse_chosen(q~_h) - lse_all(q~_h)) (1 when every key is
//           chosen), out = alpha * o + (1 - alpha) * mean(V).
//
// Why the shape (H200, B8 x 32k, BENCHMARKS.md "SparQ selection"): with 4 keys and 8-byte loads a
// thread, 1024-key blocks, a counter claim a warp and a per-row refinement reading its candidates
// from L2 once a pass, score took 96 us and select 48 us for 134 MB of kt and 8 MB of scores;
// now 64-72 and 25. The score stage is latency-bound (a warp's 8 reads in flight, then its FMAs).
// Requires pyattn::SparqParams and common.cuh.
#pragma once

namespace pyattn {

constexpr int kSparqThreads = 256;
constexpr int kSparqKeys = 8;  // keys a thread scores / selects: one 16-byte load of a kt row (pages % 8 == 0)
constexpr int kSparqChunk = kSparqKeys * kSparqThreads;
constexpr int kSparqMaxGroup = 16;
constexpr int kSparqMaxDim = 256;
constexpr int kSparqBins = 4096;  // first-level histogram: the top 12 bits of a score's order key
constexpr int kSparqWarps = kSparqThreads / 32;
constexpr int kSparqCandMax = 4096;  // candidates the last select block refines in shared memory
// prep: q [G][D] + |q| sums, flags, partial ranks then channels, temperatures, warp counts;
// score: q~ [R][G padded to 4] + channels [D] + histogram + per-warp partials; select: a flag,
// 256 counts, 4 ints, candidates.
constexpr int kSparqPrepBytes = 4 * (kSparqMaxGroup * kSparqMaxDim + 2 * kSparqMaxDim + kSparqThreads +
                                     kSparqMaxGroup + kSparqWarps);
constexpr int kSparqScoreBytes = 4 * (kSparqMaxGroup * kSparqMaxDim + kSparqMaxDim + kSparqBins +
                                      kSparqWarps * kSparqMaxGroup * 2 + 1);
constexpr int kSparqSelectBytes = 2048 + 8 * kSparqCandMax;
constexpr int kSparqSmemBytes = kSparqPrepBytes > kSparqScoreBytes
                                    ? (kSparqPrepBytes > kSparqSelectBytes ? kSparqPrepBytes : kSparqSelectBytes)
                                    : (kSparqScoreBytes > kSparqSelectBytes ? kSparqScoreBytes : kSparqSelectBytes);

// float -> uint32 with the same order (negative floats reversed below the positive ones; -0 is +0).
__device__ __forceinline__ unsigned sparq_order(float x) {
  const unsigned b = x == 0.f ? 0u : __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Candidate key: larger score first, then the lower position (every key distinct).
__device__ __forceinline__ unsigned long long sparq_key(unsigned u, int i) {
  return (static_cast<unsigned long long>(u) << 32) | (0xFFFFFFFFu - static_cast<unsigned>(i));
}

template <class P>
__device__ __forceinline__ float* sparq_f(const P& p, long long off) {
  return reinterpret_cast<float*>(static_cast<unsigned char*>(p.ws) + off);
}

template <class P>
__device__ __forceinline__ int* sparq_i(const P& p, long long off) {
  return reinterpret_cast<int*>(static_cast<unsigned char*>(p.ws) + off);
}

template <class P>
__device__ __forceinline__ const int* sparq_pages(const P& p, int b) {
  return p.page_indices + p.page_indptr[b];
}

// Merge (max, sum of exp2(x - max)) pairs; an empty state is (-inf, 0).
__device__ __forceinline__ void sparq_merge(float& m, float& z, float m2, float z2) {
  const float mn = fmaxf(m, m2);
  if (mn == -inf()) return;
  z = (m == -inf() ? 0.f : z * exp2f(m - mn)) + (m2 == -inf() ? 0.f : z2 * exp2f(m2 - mn));
  m = mn;
}

__device__ __forceinline__ void sparq_warp_merge(float& m, float& z) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, o), z2 = __shfl_xor_sync(kFullMask, z, o);
    sparq_merge(m, z, m2, z2);
  }
}

// Block-wide append (every thread calls it): each thread adds `na` entries to list A and `nb` to
// list B (each < 65536 a block); one atomicAdd per list and block. Returns this thread's first
// positions. `sm`: 2 * kSparqWarps + 2 ints of shared memory.
__device__ __forceinline__ void sparq_block_claim(int* ctr_a, int* ctr_b, int na, int nb, int* sm, int& a, int& b) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int mine = na | (nb << 16);
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) sm[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int w = 0; w < kSparqWarps; ++w) {
      const int t = sm[w];
      sm[w] = run;
      run += t;
    }
    const int ta = run & 0xFFFF, tb = run >> 16;
    sm[kSparqWarps] = ta ? atomicAdd(ctr_a, ta) : 0;
    sm[kSparqWarps + 1] = tb ? atomicAdd(ctr_b, tb) : 0;
  }
  __syncthreads();
  const int before = sm[warp] + incl - mine;
  a = sm[kSparqWarps] + (before & 0xFFFF);
  b = sm[kSparqWarps + 1] + (before >> 16);
  __syncthreads();  // sm is free again
}

// Warp 0's search over 256 counts c[0..255] (called by a whole warp): the largest t with
// c[t] + ... + c[255] >= need (need <= the total), and above = c[t + 1] + ... + c[255]. Lane l sums
// the 8 counts c[248 - 8l .. 255 - 8l], so the lanes' inclusive scan runs from the top down.
__device__ __forceinline__ void sparq_find256(const unsigned* c, unsigned need, int& t, unsigned& above) {
  const int lane = threadIdx.x % 32;
  const int hi = 255 - 8 * lane;
  unsigned mine = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) mine += c[hi - i];
  unsigned incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned y = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += y;
  }
  const unsigned ballot = __ballot_sync(kFullMask, incl >= need);
  const int first = __ffs(ballot) - 1;  // the lane whose 8 counts hold the crossing
  unsigned cum = __shfl_sync(kFullMask, incl - mine, first);
  int bin = 255 - 8 * first;
  for (int i = 0; i < 7 && cum + c[bin] < need; ++i) cum += c[bin--];  // (every lane: same values)
  t = bin;
  above = cum;
}

// Whether this block is the last of its row to pass here (threadfence reduction pattern).
__device__ __forceinline__ bool sparq_last(int* counter, int blocks, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1) == blocks - 1;
  __syncthreads();
  const bool last = *flag;
  if (last) __threadfence();
  return last;
}

template <typename T, class P>
__device__ __forceinline__ void sparq_prep(const P& p, unsigned char* smem) {
  const int row = blockIdx.x, b = row / p.row_heads, rh = row % p.row_heads;
  const int G = p.group, D = p.head_dim, R = p.r, tid = threadIdx.x;
  float* qs = reinterpret_cast<float*>(smem);                  // [G][D]
  float* w = qs + kSparqMaxGroup * kSparqMaxDim;                // [D]
  int* flag = reinterpret_cast<int*>(w + kSparqMaxDim);         // [D]
  int* chan_s = flag + kSparqMaxDim;                            // [R] (first the partial ranks)
  float* th = reinterpret_cast<float*>(chan_s + kSparqThreads);  // [G], then [warps]
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b + static_cast<long long>(rh) * G * p.q_stride_h;
  for (int e = tid; e < G * D; e += kSparqThreads) qs[e] = to_float(q[(e / D) * p.q_stride_h + e % D]);
  unsigned* hist = reinterpret_cast<unsigned*>(sparq_i(p, p.off_hist)) + static_cast<long long>(row) * kSparqBins;
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist[i] = 0u;
  if (tid < 4) sparq_i(p, p.off_ctr)[row * 4 + tid] = 0;
  __syncthreads();
  // -- the r channels with the largest group sum of |q| (rank by (sum desc, channel asc)). The
  // ranks are counted by tpc threads a channel, a slice of the D others each, and positions among
  // the chosen come from warp ballots: one thread a channel counting all D took 12 us at D 128.
  for (int c = tid; c < D; c += kSparqThreads) {
    float s = 0.f;
    for (int h = 0; h < G; ++h) s += fabsf(qs[h * D + c]);
    w[c] = s;
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
  int* wcount = reinterpret_cast<int*>(th + kSparqMaxGroup);  // [warps]
  bool chosen = false;
  if (tid < D) {
    int rank = 0;
    for (int t = 0; t < tpc; ++t) rank += part[t * D + tid];
    chosen = rank < R;
  }
  const unsigned ballot = __ballot_sync(kFullMask, chosen);
  if (lane == 0) wcount[warp] = __popc(ballot);
  __syncthreads();  // (every part[] read is done before chan_s is written below)
  if (tid < D) flag[tid] = chosen;
  if (chosen) {
    int pos = __popc(ballot & ((1u << lane) - 1u));
    for (int w2 = 0; w2 < warp; ++w2) pos += wcount[w2];
    sparq_i(p, p.off_chan)[row * R + pos] = tid;
    chan_s[pos] = tid;
  }
  __syncthreads();
  // -- per head: the temperature (paper: softmax(q[i1] . K[:, i1] / sqrt(d * |q[i1]|_1 / |q|_1)))
  for (int h = warp; h < G; h += kSparqWarps) {
    float all = 0.f, sel = 0.f;
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
  // -- the decode's query rows: q, then q~ (the chosen channels only)
  T* qx = static_cast<T*>(p.qx) + static_cast<long long>(row) * 2 * G * D;
  for (int e = tid; e < 2 * G * D; e += kSparqThreads) {
    const int hh = e / D, c = e % D;
    const float x = hh < G ? qs[hh * D + c] : (flag[c] ? qs[(hh - G) * D + c] * th[hh - G] : 0.f);
    qx[e] = from_float<T>(x);
  }
  // -- q~ on the chosen channels, as the score stage reads them: [G][R]
  float* qt = sparq_f(p, 0) + static_cast<long long>(row) * G * R;
  for (int e = tid; e < G * R; e += kSparqThreads) {
    const int h = e / R;
    qt[e] = to_float(from_float<T>(qs[h * D + chan_s[e % R]] * th[h]));
  }
}

template <typename T, class P>
__device__ __forceinline__ void sparq_score(const P& p, unsigned char* smem) {
  const int row = blockIdx.y, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int n = p.kv_len[b], c0 = blockIdx.x * kSparqChunk * p.chunk_steps;
  if (c0 >= n) return;  // block-uniform; such blocks are not counted below
  const int G = p.group, R = p.r, tid = threadIdx.x, ps = p.page_size, warp = tid / 32, lane = tid % 32;
  const int Gp = (G + 3) & ~3;
  float* qt_s = reinterpret_cast<float*>(smem);                           // [R][Gp]
  int* chan_s = reinterpret_cast<int*>(qt_s + kSparqMaxGroup * kSparqMaxDim);  // [R]
  unsigned* hist_s = reinterpret_cast<unsigned*>(chan_s + kSparqMaxDim);  // [bins]
  float* red = reinterpret_cast<float*>(hist_s + kSparqBins);             // [warps][G][2]: a warp's running state
  int* flag = reinterpret_cast<int*>(red + kSparqWarps * kSparqMaxGroup * 2);
  const float* qt = sparq_f(p, 0) + static_cast<long long>(row) * G * R;
  for (int e = tid; e < R * Gp; e += kSparqThreads) {
    const int j = e / Gp, h = e % Gp;
    qt_s[e] = h < G ? qt[h * R + j] : 0.f;
  }
  for (int j = tid; j < R; j += kSparqThreads) chan_s[j] = sparq_i(p, p.off_chan)[row * R + j];
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist_s[i] = 0u;
  for (int i = tid; i < kSparqWarps * kSparqMaxGroup; i += kSparqThreads) red[2 * i] = -inf(), red[2 * i + 1] = 0.f;
  __syncthreads();
  unsigned* score = reinterpret_cast<unsigned*>(sparq_i(p, p.off_score)) + static_cast<long long>(row) * p.lpad;
  const T* kt = static_cast<const T*>(p.kt) + kvh * p.kt_stride_h;
  const int* pages = sparq_pages(p, b);

  // Steps of kSparqChunk keys; a thread's 8 keys lie in one page (page_size % 8 == 0): 16 bytes of
  // each chosen kt row.
  for (int step = 0; step < p.chunk_steps && c0 + step * kSparqChunk < n; ++step) {
    const int i0 = c0 + step * kSparqChunk + kSparqKeys * tid, nv = max(0, min(kSparqKeys, n - i0));
    const T* base = kt;
    if (nv > 0) base += pages[i0 / ps] * p.kt_stride_page + i0 % ps;
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
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);
        if (nv > 0)  // the slots past the sequence's end are in the page: read, never counted
          raw = *reinterpret_cast<const uint4*>(base + static_cast<long long>(chan_s[j]) * ps);
        const T* e8 = reinterpret_cast<const T*>(&raw);
        const float4 qv = *reinterpret_cast<const float4*>(qt_s + j * Gp + hc);
#pragma unroll
        for (int e = 0; e < kSparqKeys; ++e) {
          const float k = to_float(e8[e]);
          acc[0][e] = fmaf(qv.x, k, acc[0][e]);
          acc[1][e] = fmaf(qv.y, k, acc[1][e]);
          acc[2][e] = fmaf(qv.z, k, acc[2][e]);
          acc[3][e] = fmaf(qv.w, k, acc[3][e]);
        }
      }
      // -- the selection score (heads past G have q~ = 0), and per head the warp's running (max,
      // sum exp2) of the approximate logits (log2 units)
#pragma unroll
      for (int hh = 0; hh < 4; ++hh) {
        float m = -inf();
#pragma unroll
        for (int e = 0; e < kSparqKeys; ++e) {
          sel[e] += acc[hh][e];
          acc[hh][e] *= p.scale_log2;
          if (e < nv) m = fmaxf(m, acc[hh][e]);
        }
        float z = 0.f;
        if (nv > 0) {
#pragma unroll
          for (int e = 0; e < kSparqKeys; ++e) z += e < nv ? exp2f(acc[hh][e] - m) : 0.f;
        }
        sparq_warp_merge(m, z);
        if (lane == 0 && hc + hh < G) {
          float* r2 = red + (warp * kSparqMaxGroup + hc + hh) * 2;
          sparq_merge(r2[0], r2[1], m, z);
        }
      }
    }
    // -- selection scores (order keys) and their histogram
    unsigned u[kSparqKeys];
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e) u[e] = sparq_order(sel[e]);
    if (nv == kSparqKeys) {
      *reinterpret_cast<uint4*>(score + i0) = make_uint4(u[0], u[1], u[2], u[3]);
      *reinterpret_cast<uint4*>(score + i0 + 4) = make_uint4(u[4], u[5], u[6], u[7]);
    } else {
      for (int e = 0; e < nv; ++e) score[i0 + e] = u[e];
    }
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e)
      if (e < nv) atomicAdd(&hist_s[u[e] >> 20], 1u);
  }
  __syncthreads();
  unsigned* hist = reinterpret_cast<unsigned*>(sparq_i(p, p.off_hist)) + static_cast<long long>(row) * kSparqBins;
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
  int* ctr = sparq_i(p, p.off_ctr) + row * 4;
  const int n_blocks = (n + kSparqChunk * p.chunk_steps - 1) / (kSparqChunk * p.chunk_steps);
  if (!sparq_last(ctr, n_blocks, flag)) return;
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
    return;
  }
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist_s[i] = __ldcg(hist + i);
  __syncthreads();
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

// Candidate j of the select stage's last block: from shared memory when they fit there, else
// from the workspace (written by other blocks: read past L1).
__device__ __forceinline__ unsigned long long sparq_cand(const unsigned* cu, const int* ci,
                                                         const unsigned long long* cand_s, bool in_smem, int j) {
  return in_smem ? cand_s[j] : sparq_key(__ldcg(cu + j), __ldcg(ci + j));
}

// The select stage's last block: the `remaining` largest of the n_cand candidate keys (all in bin
// tbin, so their top 12 bits agree) by 8-bit radix passes below those bits; returns the smallest
// key taken (every candidate >= it is taken). Candidates come from shared memory when they fit
// (one L2 read each), else from the workspace on every pass.
__device__ __forceinline__ unsigned long long sparq_refine(const unsigned* cu, const int* ci, int n_cand, int remaining,
                                                           int tbin, bool in_smem, const unsigned long long* cand_s,
                                                           unsigned* h256, int* sh) {
  unsigned long long prefix = static_cast<unsigned long long>(tbin) << 52, pmask = 0xFFFull << 52;
  if (remaining >= n_cand) return prefix;  // they all fit
  const int tid = threadIdx.x;
  for (int shift = 44;; shift = shift >= 8 ? shift - 8 : 0) {  // 44, 36, ..., 4, then bits 7..0
    h256[tid] = 0u;  // kSparqThreads == 256 bins
    __syncthreads();
    for (int j = tid; j < n_cand; j += kSparqThreads) {
      const unsigned long long key = sparq_cand(cu, ci, cand_s, in_smem, j);
      if ((key & pmask) == prefix) atomicAdd(&h256[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid < 32) {
      int d;
      unsigned cum;
      sparq_find256(h256, static_cast<unsigned>(remaining), d, cum);
      if (tid == 0) {
        sh[0] = d;
        sh[1] = remaining - static_cast<int>(cum);
        sh[2] = static_cast<int>(h256[d]);
      }
    }
    __syncthreads();
    const int d = sh[0];
    remaining = sh[1];
    prefix |= static_cast<unsigned long long>(d) << shift;
    pmask |= 0xFFull << shift;
    const bool done = sh[2] == remaining || shift == 0;  // keys are distinct: bits 7..0 end it
    __syncthreads();  // everyone has read sh and h256 before the next pass clears them
    if (done) return prefix;
  }
}

// A select thread's 8 order keys of one step (0 past the sequence's end).
__device__ __forceinline__ void sparq_load8(const unsigned* score, int i0, int nv, unsigned (&u)[kSparqKeys]) {
  if (nv == kSparqKeys) {
    const uint4 a = *reinterpret_cast<const uint4*>(score + i0), c = *reinterpret_cast<const uint4*>(score + i0 + 4);
    u[0] = a.x, u[1] = a.y, u[2] = a.z, u[3] = a.w, u[4] = c.x, u[5] = c.y, u[6] = c.z, u[7] = c.w;
  } else {
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e) u[e] = e < nv ? score[i0 + e] : 0u;
  }
}

template <typename T, class P>
__device__ __forceinline__ void sparq_select(const P& p, unsigned char* smem) {
  const int row = blockIdx.y, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int n = p.kv_len[b], c0 = blockIdx.x * kSparqChunk * p.chunk_steps;
  if (c0 >= n) return;
  const int tid = threadIdx.x, ps = p.page_size, H = p.heads_kv;
  const int* info = sparq_i(p, p.off_info) + row * 4;
  const int tbin = info[0], k_eff = info[2];
  int* ctr = sparq_i(p, p.off_ctr) + row * 4;
  const int* pages = sparq_pages(p, b);
  int* sel = static_cast<int*>(p.sel) + static_cast<long long>(row) * p.k_max;
  int* sel_pos = static_cast<int*>(p.sel_pos) + static_cast<long long>(row) * p.k_max;
  unsigned* cu = reinterpret_cast<unsigned*>(sparq_i(p, p.off_cand_u)) + static_cast<long long>(row) * p.lpad;
  int* ci = sparq_i(p, p.off_cand_i) + static_cast<long long>(row) * p.lpad;
  const unsigned* score = reinterpret_cast<const unsigned*>(sparq_i(p, p.off_score)) + static_cast<long long>(row) * p.lpad;
  int* flag = reinterpret_cast<int*>(smem);
  unsigned* h256 = reinterpret_cast<unsigned*>(smem) + 4;
  int* sm = reinterpret_cast<int*>(h256 + 256);  // block claims (2 * warps + 2), then sh[3]
  unsigned long long* cand_s = reinterpret_cast<unsigned long long*>(smem + 2048);
  const int steps = min(p.chunk_steps, (n - c0 + kSparqChunk - 1) / kSparqChunk);

  // -- keys above the threshold bin are chosen; keys in it are candidates: count them over the
  // block's steps, claim once, then write them (the second read of the scores hits L1/L2)
  int ns = 0, nc = 0;
  for (int step = 0; step < steps; ++step) {
    const int i0 = c0 + step * kSparqChunk + kSparqKeys * tid, nv = max(0, min(kSparqKeys, n - i0));
    unsigned u[kSparqKeys];
    sparq_load8(score, i0, nv, u);
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e) {
      const int bin = static_cast<int>(u[e] >> 20);
      ns += e < nv && (tbin < 0 || bin > tbin);
      nc += e < nv && tbin >= 0 && bin == tbin;
    }
  }
  int at, ac;
  sparq_block_claim(ctr + 1, ctr + 2, ns, nc, sm, at, ac);
  for (int step = 0; step < steps && ns + nc > 0; ++step) {
    const int i0 = c0 + step * kSparqChunk + kSparqKeys * tid, nv = max(0, min(kSparqKeys, n - i0));
    unsigned u[kSparqKeys];
    sparq_load8(score, i0, nv, u);
#pragma unroll
    for (int e = 0; e < kSparqKeys; ++e) {
      const int i = i0 + e, bin = static_cast<int>(u[e] >> 20);
      if (e >= nv) continue;
      if (tbin < 0 || bin > tbin) {
        sel[at] = (pages[i / ps] * ps + i % ps) * H + kvh;
        sel_pos[at++] = i;
      } else if (bin == tbin) {
        cu[ac] = u[e];
        ci[ac++] = i;
      }
    }
  }
  // -- the row's last block: the remaining keys among the candidates, exactly
  const int n_blocks = (n + kSparqChunk * p.chunk_steps - 1) / (kSparqChunk * p.chunk_steps);
  if (!sparq_last(ctr + 3, n_blocks, flag)) return;
  if (tbin >= 0) {
    const int n_cand = __ldcg(ctr + 2), remaining = k_eff - __ldcg(ctr + 1);
    const bool in_smem = n_cand <= kSparqCandMax;
    if (in_smem) {
      for (int j = tid; j < n_cand; j += kSparqThreads) cand_s[j] = sparq_cand(cu, ci, cand_s, false, j);
      __syncthreads();
    }
    const unsigned long long prefix = sparq_refine(cu, ci, n_cand, remaining, tbin, in_smem, cand_s, h256,
                                                   sm + 2 * kSparqWarps + 2);
    // every candidate whose key is >= prefix: count this thread's, claim once, write
    int take = 0;
    for (int j = tid; j < n_cand; j += kSparqThreads) take += sparq_cand(cu, ci, cand_s, in_smem, j) >= prefix;
    int pos, unused;
    sparq_block_claim(ctr + 1, ctr + 1, take, 0, sm, pos, unused);
    for (int j = tid; j < n_cand && take > 0; j += kSparqThreads) {
      const unsigned long long key = sparq_cand(cu, ci, cand_s, in_smem, j);
      if (key < prefix) continue;
      const int i = static_cast<int>(0xFFFFFFFFu - static_cast<unsigned>(key));
      sel[pos] = (pages[i / ps] * ps + i % ps) * H + kvh;
      sel_pos[pos++] = i;
    }
  }
  if (tid == 0) static_cast<int*>(p.dec_len)[row] = k_eff;
}

template <typename T, class P>
__device__ __forceinline__ void sparq_finish(const P& p, unsigned char* smem) {
  const int row = blockIdx.x, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int G = p.group, D = p.head_dim, tid = threadIdx.x, n = p.kv_len[b], k_eff = min(p.k, n);
  float* alpha = reinterpret_cast<float*>(smem);
  if (tid < G) {
    // the row's (max, sum) of the approximate logits: the score stage's last block left it in chunk 0
    const float* part = sparq_f(p, p.off_part) + static_cast<long long>(row) * p.n_chunks * G * 2;
    const float m = part[tid * 2], z = part[tid * 2 + 1];
    float a = 1.f;
    if (k_eff < n) {
      const float l2 = p.dlse[static_cast<long long>(row) * 2 * G + G + tid] * kLog2e;
      a = (m == -inf() || !(z > 0.f)) ? 0.f : fminf(fmaxf(exp2f(l2 - (m + log2f(z))), 0.f), 1.f);
    }
    alpha[tid] = a;
  }
  __syncthreads();
  const float* vs = p.vsum + p.vrow[b] * p.vsum_stride_row + static_cast<long long>(kvh) * D;
  const T* o = static_cast<const T*>(p.o) + static_cast<long long>(row) * 2 * G * D;
  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + static_cast<long long>(rh) * G * p.out_stride_h;
  const float len = static_cast<float>(n);
  for (int e = tid; e < G * D; e += kSparqThreads) {
    const int h = e / D, c = e % D;
    const float a = alpha[h], mean = vs[c] / len;
    out[h * p.out_stride_h + c] = from_float<T>(a * to_float(o[e]) + (1.f - a) * mean);
  }
}

template <typename T, class P>  // P: SparqParams
__device__ __forceinline__ void sparq_stage(const P& p) {
  __shared__ __align__(16) unsigned char smem[kSparqSmemBytes];
  switch (p.stage) {
    case 0: sparq_prep<T>(p, smem); break;
    case 1: sparq_score<T>(p, smem); break;
    case 2: sparq_select<T>(p, smem); break;
    case 4: sparq_finish<T>(p, smem); break;
    default: __trap();
  }
}

}  // namespace pyattn

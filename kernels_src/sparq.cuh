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
//  1 score  (grid chunks x rows, 1024 keys a block): reads only the r chosen rows of kt per page.
//           Per key the selection score a_i = sum_h q~_h . k_i (fp32), stored as an order-preserving
//           uint32; a 4096-bin histogram of its top 12 bits; per head the block's (max, sum exp2) of
//           the approximate logits scale*log2e * q~_h . k_i. The row's last block (threadfence
//           pattern) finds the bin holding the k-th largest key.
//  2 select (grid chunks x rows): keys above that bin are chosen, keys in it become candidates;
//           the row's last block picks the remaining ones among the candidates exactly (radix
//           select on (score, -index): ties go to the lower position) and writes the row's count.
//           Chosen keys are written as decode "pages": (pool slot * heads_kv + kv head), each one
//           row of the NHD pool (page size 1), plus their positions.
//  (decode  over the chosen keys: rows q (exact attention) and q~ (the log-sum-exp of the chosen
//           keys' approximate logits, for alpha).)
//  4 finish (grid rows): alpha_h = exp(lse_chosen(q~_h) - lse_all(q~_h)) (1 when every key is
//           chosen), out = alpha * o + (1 - alpha) * mean(V).
// Requires pyattn::SparqParams and common.cuh.
#pragma once

namespace pyattn {

constexpr int kSparqThreads = 256;
constexpr int kSparqChunk = 4 * kSparqThreads;  // keys a block scores / selects: 4 per thread
constexpr int kSparqMaxGroup = 16;
constexpr int kSparqMaxDim = 256;
constexpr int kSparqBins = 4096;  // first-level histogram: the top 12 bits of a score's order key
constexpr int kSparqWarps = kSparqThreads / 32;
constexpr int kSparqSmemBytes = 4 * (kSparqMaxGroup * kSparqMaxDim + 2 * kSparqMaxDim + kSparqBins) +
                                4 * kSparqWarps * kSparqMaxGroup * 2 + 64;

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

// Warp-aggregated append: each lane adds `count` entries; returns this lane's first position.
__device__ __forceinline__ int sparq_claim(int* counter, int count) {
  const int lane = threadIdx.x % 32;
  int incl = count;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += y;
  }
  const int total = __shfl_sync(kFullMask, incl, 31);
  int base = 0;
  if (lane == 31 && total) base = atomicAdd(counter, total);
  return __shfl_sync(kFullMask, base, 31) + incl - count;
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
  const int row = blockIdx.x, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int G = p.group, D = p.head_dim, R = p.r, tid = threadIdx.x;
  float* qs = reinterpret_cast<float*>(smem);                  // [G][D]
  float* w = qs + kSparqMaxGroup * kSparqMaxDim;                // [D]
  int* flag = reinterpret_cast<int*>(w + kSparqMaxDim);         // [D]
  float* th = reinterpret_cast<float*>(flag + kSparqMaxDim);    // [G]
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b + static_cast<long long>(rh) * G * p.q_stride_h;
  for (int e = tid; e < G * D; e += kSparqThreads) qs[e] = to_float(q[(e / D) * p.q_stride_h + e % D]);
  __syncthreads();
  // -- the r channels with the largest group sum of |q| (rank by (sum desc, channel asc))
  for (int c = tid; c < D; c += kSparqThreads) {
    float s = 0.f;
    for (int h = 0; h < G; ++h) s += fabsf(qs[h * D + c]);
    w[c] = s;
  }
  __syncthreads();
  for (int c = tid; c < D; c += kSparqThreads) {
    const float wc = w[c];
    int rank = 0;
    for (int c2 = 0; c2 < D; ++c2) rank += (w[c2] > wc || (w[c2] == wc && c2 < c));
    flag[c] = rank < R;
  }
  __syncthreads();
  int* chan = sparq_i(p, p.off_chan) + row * R;
  for (int c = tid; c < D; c += kSparqThreads)
    if (flag[c]) {
      int pos = 0;
      for (int c2 = 0; c2 < c; ++c2) pos += flag[c2];
      chan[pos] = c;
    }
  // -- per head: the temperature (paper: softmax(q[i1] . K[:, i1] / sqrt(d * |q[i1]|_1 / |q|_1)))
  const int warp = tid / 32, lane = tid % 32;
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
  // -- q~ on the chosen channels (as the score stage reads them) and their sum over the group
  float* qt = sparq_f(p, 0) + static_cast<long long>(row) * G * R;  // [G][R]
  float* qbar = sparq_f(p, p.off_qbar) + static_cast<long long>(row) * R;
  for (int j = tid; j < R; j += kSparqThreads) {
    int c = 0, seen = 0;  // the j-th chosen channel (chan[] was written by other threads of this block)
    for (; c < D; ++c) {
      if (flag[c] && seen++ == j) break;
    }
    float s = 0.f;
    for (int h = 0; h < G; ++h) {
      const float v = to_float(from_float<T>(qs[h * D + c] * th[h]));
      qt[h * R + j] = v;
      s += v;
    }
    qbar[j] = s;
  }
  unsigned* hist = reinterpret_cast<unsigned*>(sparq_i(p, p.off_hist)) + static_cast<long long>(row) * kSparqBins;
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist[i] = 0u;
  if (tid < 4) sparq_i(p, p.off_ctr)[row * 4 + tid] = 0;
}

template <typename T, class P>
__device__ __forceinline__ void sparq_score(const P& p, unsigned char* smem) {
  const int row = blockIdx.y, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int n = p.kv_len[b], c0 = blockIdx.x * kSparqChunk;
  if (c0 >= n) return;  // block-uniform; such blocks are not counted below
  const int G = p.group, R = p.r, tid = threadIdx.x, ps = p.page_size, warp = tid / 32, lane = tid % 32;
  float* qt_s = reinterpret_cast<float*>(smem);                       // [G][R]
  float* qbar_s = qt_s + kSparqMaxGroup * kSparqMaxDim;                // [R]
  int* chan_s = reinterpret_cast<int*>(qbar_s + kSparqMaxDim);         // [R]
  unsigned* hist_s = reinterpret_cast<unsigned*>(chan_s + kSparqMaxDim);  // [bins]
  float* red = reinterpret_cast<float*>(hist_s + kSparqBins);           // [warps][G][2]
  int* flag = reinterpret_cast<int*>(red + kSparqWarps * kSparqMaxGroup * 2);
  const float* qt = sparq_f(p, 0) + static_cast<long long>(row) * G * R;
  for (int e = tid; e < G * R; e += kSparqThreads) qt_s[e] = qt[e];
  for (int j = tid; j < R; j += kSparqThreads) {
    qbar_s[j] = sparq_f(p, p.off_qbar)[static_cast<long long>(row) * R + j];
    chan_s[j] = sparq_i(p, p.off_chan)[row * R + j];
  }
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist_s[i] = 0u;
  __syncthreads();

  // -- this thread's 4 keys: one page (page_size % 8 == 0), 8 bytes of each chosen kt row
  const int i0 = c0 + 4 * tid, nv = max(0, min(4, n - i0));
  const T* base = static_cast<const T*>(p.kt);
  if (nv > 0) {
    const int page = sparq_pages(p, b)[i0 / ps];
    base += page * p.kt_stride_page + kvh * p.kt_stride_h + i0 % ps;
  }
  float sel[4] = {0.f, 0.f, 0.f, 0.f};
  for (int hc = 0; hc < G; hc += 4) {  // 4 query heads at a time; later passes re-read kt from L1
    float acc[4][4];
#pragma unroll
    for (int hh = 0; hh < 4; ++hh)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[hh][e] = 0.f;
#pragma unroll 4
    for (int j = 0; j < R; ++j) {
      float k4[4] = {0.f, 0.f, 0.f, 0.f};
      if (nv > 0) {  // the slots past the sequence's end are in the page: read, never counted
        const uint2 raw = *reinterpret_cast<const uint2*>(base + static_cast<long long>(chan_s[j]) * ps);
        const T* e4 = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < 4; ++e) k4[e] = to_float(e4[e]);
      }
      if (hc == 0) {
        const float qb = qbar_s[j];
#pragma unroll
        for (int e = 0; e < 4; ++e) sel[e] = fmaf(qb, k4[e], sel[e]);
      }
#pragma unroll
      for (int hh = 0; hh < 4; ++hh) {
        const float qv = hc + hh < G ? qt_s[(hc + hh) * R + j] : 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[hh][e] = fmaf(qv, k4[e], acc[hh][e]);
      }
    }
    // -- per head: this block's (max, sum exp2) of the approximate logits (log2 units)
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
      float m = -inf(), z = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (e < nv) sparq_merge(m, z, acc[hh][e] * p.scale_log2, 1.f);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(kFullMask, m, o), z2 = __shfl_xor_sync(kFullMask, z, o);
        sparq_merge(m, z, m2, z2);
      }
      if (lane == 0 && hc + hh < G) {
        red[(warp * kSparqMaxGroup + hc + hh) * 2] = m;
        red[(warp * kSparqMaxGroup + hc + hh) * 2 + 1] = z;
      }
    }
  }
  // -- selection scores (order keys) and their histogram
  unsigned* score = reinterpret_cast<unsigned*>(sparq_i(p, p.off_score)) + static_cast<long long>(row) * p.lpad;
  unsigned u[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) u[e] = sparq_order(sel[e]);
  if (nv == 4) {
    *reinterpret_cast<uint4*>(score + i0) = make_uint4(u[0], u[1], u[2], u[3]);
  } else {
    for (int e = 0; e < nv; ++e) score[i0 + e] = u[e];
  }
  for (int e = 0; e < nv; ++e) atomicAdd(&hist_s[u[e] >> 20], 1u);
  __syncthreads();
  unsigned* hist = reinterpret_cast<unsigned*>(sparq_i(p, p.off_hist)) + static_cast<long long>(row) * kSparqBins;
  for (int i = tid; i < kSparqBins; i += kSparqThreads)
    if (hist_s[i]) atomicAdd(&hist[i], hist_s[i]);
  if (tid < G) {
    float m = -inf(), z = 0.f;
    for (int w = 0; w < kSparqWarps; ++w)
      sparq_merge(m, z, red[(w * kSparqMaxGroup + tid) * 2], red[(w * kSparqMaxGroup + tid) * 2 + 1]);
    float* part = sparq_f(p, p.off_part) + ((static_cast<long long>(row) * p.n_chunks + blockIdx.x) * G + tid) * 2;
    part[0] = m;
    part[1] = z;
  }
  // -- the row's last block: the bin holding the k-th largest score
  int* ctr = sparq_i(p, p.off_ctr) + row * 4;
  if (!sparq_last(ctr, (n + kSparqChunk - 1) / kSparqChunk, flag)) return;
  int* info = sparq_i(p, p.off_info) + row * 4;
  const int k_eff = min(p.k, n);
  if (k_eff >= n) {  // every key is chosen
    if (tid == 0) info[0] = -1, info[1] = n, info[2] = k_eff;
    return;
  }
  for (int i = tid; i < kSparqBins; i += kSparqThreads) hist_s[i] = __ldcg(hist + i);
  __syncthreads();
  unsigned* sums = reinterpret_cast<unsigned*>(red);  // 16 bins per thread
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

template <typename T, class P>
__device__ __forceinline__ void sparq_select(const P& p, unsigned char* smem) {
  const int row = blockIdx.y, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int n = p.kv_len[b], c0 = blockIdx.x * kSparqChunk;
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

  // -- keys above the threshold bin are chosen; keys in it are candidates
  const int i0 = c0 + 4 * tid, nv = max(0, min(4, n - i0));
  unsigned u[4] = {0u, 0u, 0u, 0u};
  for (int e = 0; e < nv; ++e) u[e] = score[i0 + e];
  int ns = 0, nc = 0;
  for (int e = 0; e < nv; ++e) {
    const int bin = static_cast<int>(u[e] >> 20);
    ns += tbin < 0 || bin > tbin;
    nc += tbin >= 0 && bin == tbin;
  }
  int at = sparq_claim(ctr + 1, ns), ac = sparq_claim(ctr + 2, nc);
  for (int e = 0; e < nv; ++e) {
    const int i = i0 + e, bin = static_cast<int>(u[e] >> 20);
    if (tbin < 0 || bin > tbin) {
      sel[at] = (pages[i / ps] * ps + i % ps) * H + kvh;
      sel_pos[at++] = i;
    } else if (bin == tbin) {
      cu[ac] = u[e];
      ci[ac++] = i;
    }
  }
  // -- the row's last block: the remaining keys among the candidates, exactly
  int* flag = reinterpret_cast<int*>(smem);
  if (!sparq_last(ctr + 3, (n + kSparqChunk - 1) / kSparqChunk, flag)) return;
  if (tbin >= 0) {
    const int n_cand = __ldcg(ctr + 2);
    int remaining = k_eff - __ldcg(ctr + 1);
    unsigned long long prefix = 0ull, pmask = 0ull;
    unsigned* h256 = reinterpret_cast<unsigned*>(smem) + 4;
    int* sh = flag + 1;
    if (remaining < n_cand) {
      for (int shift = 56; shift >= 0; shift -= 8) {
        h256[tid] = 0u;  // kSparqThreads == 256 bins
        __syncthreads();
        for (int j = tid; j < n_cand; j += kSparqThreads) {
          const unsigned long long key = sparq_key(__ldcg(cu + j), __ldcg(ci + j));
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
        const bool done = sh[2] == remaining;
        __syncthreads();  // everyone has read sh and h256 before the next pass clears them
        if (done) break;
      }
    }
    // every candidate whose key is >= prefix (all of them when they all fit)
    for (int j0 = 0; j0 < n_cand; j0 += kSparqThreads) {
      const int j = j0 + tid;
      int i = 0;
      bool take = false;
      if (j < n_cand) {
        i = __ldcg(ci + j);
        take = sparq_key(__ldcg(cu + j), i) >= prefix;
      }
      const int pos = sparq_claim(ctr + 1, take ? 1 : 0);
      if (take) {
        sel[pos] = (pages[i / ps] * ps + i % ps) * H + kvh;
        sel_pos[pos] = i;
      }
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
    const float* part = sparq_f(p, p.off_part) + static_cast<long long>(row) * p.n_chunks * G * 2;
    float m = -inf(), z = 0.f;
    for (int c = 0; c < (n + kSparqChunk - 1) / kSparqChunk; ++c) sparq_merge(m, z, part[(c * G + tid) * 2],
                                                                               part[(c * G + tid) * 2 + 1]);
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

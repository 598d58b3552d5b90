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
// round_T(q_h * t_h) on the chosen channels into qt_s as the scoring's B operand (qb below), with
// the chosen kt rows' offsets in a page into off_s [16 R16]. The row's block 0 also writes the
// decode's query rows qx[row] = (q_0 .. q_{G-1}, q~_0 .. q~_{G-1}) (q~ zero off the chosen channels).
// Why in every block rather than a stage of its own: at small batches a launch of its own cost more
// than the work (prep 7.8 us of a 69 us call at B1 x 32k, forty-ninth session), and the choice is a
// few hundred loads and compares. Its loops are kept short in code (a thread a channel, no runtime
// divisions, no unrolling): a block runs them once.
// qs: [G][D] floats of scratch; sc: 2 kSparqMaxDim + kSparqThreads + kSparqMaxGroup + kSparqWarps words.
template <typename T, class P>
__device__ __forceinline__ void sparq_choose(const P& p, int row, float* qs, int* sc, float* qt_s, int* off_s) {
  const int b = row / p.row_heads, rh = row % p.row_heads;
  const int G = p.group, D = p.head_dim, R = p.r, tid = threadIdx.x;
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
  // -- q~ on the chosen channels as the scoring's B operand, and the chosen kt rows' offsets: qb
  // [R16][2][8][16] of T (k16 step, 8-head block, head, position in the step), positions past R
  // and heads past G zero; their rows' offsets name channel 0 (read, weighed by 0).
  const int R16 = (R + 15) / 16;
  if (tid < 16 * R16) off_s[tid] = tid < R ? chan_s[tid] * p.page_size : 0;
  T* qb = reinterpret_cast<T*>(qt_s);
#pragma unroll 1
  for (int i = tid; i < R16 * 256; i += kSparqThreads) {
    const int j = (i / 256) * 16 + i % 16, h = (i / 16) % 16;
    qb[i] = from_float<T>(j < R && h < G ? qs[h * D + chan_s[j]] * th[h] : 0.f);
  }
  __syncthreads();  // (qs, the caller's histogram space, is free again)
}

template <typename T, class P>
__device__ __forceinline__ void sparq_score(const P& p, unsigned char* smem) {
  const int row = blockIdx.y, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int n = p.kv_len[b], c0 = blockIdx.x * kSparqChunk * p.chunk_steps;
  if (c0 >= n) return;  // block-uniform; such blocks are not counted below
  const int G = p.group, R = p.r, tid = threadIdx.x, ps = p.page_size, warp = tid / 32, lane = tid % 32;
  float* qt_s = reinterpret_cast<float*>(smem);                           // q~ as qb (sparq_choose)
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

  // The scores on the tensor cores (mma.m16n8k16, fp32 sums of exact 16-bit products, as the FMAs
  // they replace): keys on M, the chosen channels on K, the row's heads on N (8 a block, zero past
  // G). Quad g of a warp takes 8 keys (one page: page_size % 8 == 0), lane t of the quad the
  // positions 4t .. 4t + 3 of each k16 step, a 16-byte load of each of those kt rows; the k order
  // inside a step is free as long as A and B agree (qb lists the positions in the same order), and
  // the quad's keys 2i / 2i + 1 are rows g / g + 8 of m16 tile i, so a PRMT a register makes the A
  // fragments from the loads. A warp takes 4 such 64-key groups a step (the 256 keys its 32 threads
  // took as 8 each): 4 loads, 16 PRMT, 1 shared load and 4 MMA a k16 step of a warp's 64 keys. Why
  // (H200, B8 x 32k, Nsight Compute): the FMA form issued 348 instructions a key (128 FFMA of them)
  // at 0.6 a scheduler a cycle, and was no faster without its loads (fiftieth session).
  const int g = lane / 4, t = lane % 4, NB = (G + 7) / 8, R16 = (R + 15) / 16;
  // q~ as [R16][2][8][4] uint2: lane (g, t)'s B fragment of k step ks, 8-head block hb at [ks][hb][g][t]
  const uint2* qb = reinterpret_cast<const uint2*>(qt_s);
  // This thread's running (max, sum exp2) of the approximate logits (log2 units) of heads
  // 8 hb + 2t + hh, kept across the groups and steps and reduced over the lanes of its t once at the
  // end: a reduction a step made the steps' ends a quarter of the stage's instructions, with their
  // shuffle chains' waits (Nsight Compute, H200, B8 x 32k; BENCHMARKS.md, fiftieth session).
  float tm[2][2], tz[2][2];
#pragma unroll
  for (int hb = 0; hb < 2; ++hb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) tm[hb][hh] = -inf(), tz[hb][hh] = 0.f;

  // The warp's 64-key groups in order: group gi is step gi / 4's keys warp * 256 + (gi % 4) * 64
  // on. A quad past the sequence's end reads the sequence's first keys instead and never uses what
  // it sums, so the loads take no predicate (slots past the end inside the last page are read
  // alike, never counted). The next group's first kPre k16 steps (all of them at r <= 32) are
  // loaded before this group's softmax terms, shuffles and histogram, so that those reads are in
  // flight under them. With the tensor cores the stage is bound by how many reads are in flight:
  // H200, B8 x 32k (dev/profile_sparq.py), none ahead 61.6 us (80 registers at 3 blocks an SM
  // 58.3), one step 54.5, two 50.1 (127 registers), the FMA form 51.6-52.0.
  auto group_key = [&](int gi) { return c0 + (gi / 4) * kSparqChunk + warp * (32 * kSparqKeys) + (gi % 4) * 64; };
  auto group_live = [&](int gi) { return gi / 4 < p.chunk_steps && group_key(gi) < n; };  // (warp-uniform)
  auto quad_base = [&](int i0) {
    const int at = i0 < n ? i0 : 0;
    return kt + pages[at / ps] * p.kt_stride_page + at % ps;
  };
  // l[c]: position 4t + c of step ks, keys (2w, 2w + 1) of the quad's 8 in word w
  auto load_step = [&](const T* base, int ks, uint4 (&l)[4]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) l[c] = *reinterpret_cast<const uint4*>(base + off_s[ks * 16 + 4 * t + c]);
  };
  constexpr int kPre = 2;
  uint4 pre[kPre][4];  // the current group's first k steps, loaded during the previous group
  const T* base = quad_base(group_key(0) + g * 8);
  if (group_live(0)) {
#pragma unroll
    for (int ks = 0; ks < kPre; ++ks) if (ks < R16) load_step(base, ks, pre[ks]);
  }
  for (int gi = 0; group_live(gi); ++gi) {
    const int i0 = group_key(gi) + g * 8, nv = max(0, min(8, n - i0));
    float v[8];  // this thread's heads' share of key k's selection score (heads past G weigh 0)
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = 0.f;
    // 8 heads a pass; a second (G > 8) loads the group's rows again (from L1)
#pragma unroll
    for (int hb = 0; hb < 2; ++hb) {
      if (hb >= NB) break;
      float d[4][4];  // [m16 tile i][C fragment]: keys 2i (rows g) / 2i + 1 (rows g + 8), heads 8 hb + 2t (+ 1)
#pragma unroll
      for (int i = 0; i < 4; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.f;
      auto mma_step = [&](int ks, const uint4 (&l)[4]) {
        const unsigned w[4][4] = {{l[0].x, l[0].y, l[0].z, l[0].w}, {l[1].x, l[1].y, l[1].z, l[1].w},
                                  {l[2].x, l[2].y, l[2].z, l[2].w}, {l[3].x, l[3].y, l[3].z, l[3].w}};
        const uint2 bq = qb[((ks * 2 + hb) * 8 + g) * 4 + t];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned a[4] = {__byte_perm(w[0][i], w[1][i], 0x5410), __byte_perm(w[0][i], w[1][i], 0x7632),
                                 __byte_perm(w[2][i], w[3][i], 0x5410), __byte_perm(w[2][i], w[3][i], 0x7632)};
          mma_16816<T>(d[i], a, bq.x, bq.y);
        }
      };
      if (hb == 0) {
#pragma unroll
        for (int ks = 0; ks < kPre; ++ks) if (ks < R16) mma_step(ks, pre[ks]);
      }
#pragma unroll 1
      for (int ks = hb == 0 ? kPre : 0; ks < R16; ++ks) {
        uint4 l[4];
        load_step(base, ks, l);
        mma_step(ks, l);
      }
      if (hb + 1 == NB && group_live(gi + 1)) {  // the next group's first kPre steps
        base = quad_base(group_key(gi + 1) + g * 8);
#pragma unroll
        for (int ks = 0; ks < kPre; ++ks) if (ks < R16) load_step(base, ks, pre[ks]);
      }
      // -- per head (max, sum exp2) of the scaled logits of this quad's keys < nv
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float m = tm[hb][hh];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float x = d[k / 2][2 * (k % 2) + hh];
          v[k] += x;
          if (k < nv) m = fmaxf(m, x * p.scale_log2);
        }
        float z = tm[hb][hh] == -inf() ? 0.f : tz[hb][hh] * fast_exp2(tm[hb][hh] - m);
#pragma unroll
        for (int k = 0; k < 8; ++k) z += k < nv ? fast_exp2(d[k / 2][2 * (k % 2) + hh] * p.scale_log2 - m) : 0.f;
        tm[hb][hh] = m, tz[hb][hh] = z;
      }
    }
    // -- the quad's sums, scattered: lane t keeps keys 2t, 2t + 1 (three shuffles a key pair)
    const bool hi2 = t & 2, hi1 = t & 1;
    float v4[4], sel[2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      v4[j] = (hi2 ? v[4 + j] : v[j]) + __shfl_xor_sync(kFullMask, hi2 ? v[j] : v[4 + j], 2);
#pragma unroll
    for (int j = 0; j < 2; ++j)
      sel[j] = (hi1 ? v4[2 + j] : v4[j]) + __shfl_xor_sync(kFullMask, hi1 ? v4[j] : v4[2 + j], 1);
    // -- selection scores (order keys) and their histogram; both keys stored when any of the
    // quad's is real (those past the end are never read as scores: the row's stride lpad has room)
    const unsigned u0 = sparq_order(sel[0]), u1 = sparq_order(sel[1]);
    if (nv > 0) *reinterpret_cast<uint2*>(score + i0 + 2 * t) = make_uint2(u0, u1);
    if (2 * t < nv) atomicAdd(&hist_s[u0 >> 20], 1u);
    if (2 * t + 1 < nv) atomicAdd(&hist_s[u1 >> 20], 1u);
  }
  // -- each head's (max, sum) over the warp (the lanes of one t hold the same heads), merged into
  // the warp's entries of red by lanes 0 .. 3
#pragma unroll
  for (int hb = 0; hb < 2; ++hb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float m = tm[hb][hh];
#pragma unroll
      for (int o = 4; o < 32; o *= 2) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
      float z = tm[hb][hh] == -inf() ? 0.f : tz[hb][hh] * fast_exp2(tm[hb][hh] - m);
#pragma unroll
      for (int o = 4; o < 32; o *= 2) z += __shfl_xor_sync(kFullMask, z, o);
      const int h = 8 * hb + 2 * t + hh;
      if (g == 0 && h < G) {
        float* r2 = red + (warp * kSparqMaxGroup + h) * 2;
        merge_exp2_state(r2[0], r2[1], m, z);
      }
    }
  __syncthreads();
  unsigned* hist = sparq_hist(p, row);
  for (int i = tid; i < kSparqBins; i += kSparqThreads)
    if (hist_s[i]) atomicAdd(&hist[i], hist_s[i]);
  float* part = sparq_f(p, p.off_part) + static_cast<long long>(row) * p.n_chunks * G * 2;
  if (tid < G) {
    float m = -inf(), z = 0.f;
    for (int w = 0; w < kSparqWarps; ++w)
      merge_exp2_state(m, z, red[(w * kSparqMaxGroup + tid) * 2], red[(w * kSparqMaxGroup + tid) * 2 + 1]);
    part[(blockIdx.x * G + tid) * 2] = m;
    part[(blockIdx.x * G + tid) * 2 + 1] = z;
  }
  // -- the row's last block: per head the row's (max, sum) into chunk 0's entry (warp h merges the
  // chunks, a lane each), and the bin holding the k-th largest score
  int* ctr = sparq_ctr(p, row);
  const int n_blocks = (n + kSparqChunk * p.chunk_steps - 1) / (kSparqChunk * p.chunk_steps);
  if (!sparq_last(ctr, n_blocks, flag)) return;
  if (tid == 0) ctr[0] = 0;  // every block has counted (the next call's score stage finds it zero)
  // The row's finish record, which the chosen-key decode's last step reads (decode_merge.cuh,
  // sparq_fold): per head the log2 of the approximate logits' total mass (-inf where every key is
  // chosen: alpha 1; +inf where no logit is finite: alpha 0), then the mean of the row's values
  // (its V sums over the length; their loads go out with the partials').
  const int k_eff = min(p.k, n);
  float* fin = sparq_f(p, p.off_fin) + static_cast<long long>(row) * (G + p.head_dim);
  const long long vrow = p.vrow[b] * p.vsum_stride_row + static_cast<long long>(kvh) * p.head_dim;
  const float vs = tid < p.head_dim ? p.vsum[vrow + tid] : 0.f;
  for (int h = warp; h < G; h += kSparqWarps) {
    float m = -inf(), z = 0.f;
    for (int c = lane; c < n_blocks; c += 32)
      merge_exp2_state(m, z, __ldcg(part + (c * G + h) * 2), __ldcg(part + (c * G + h) * 2 + 1));
    sparq_warp_merge(m, z);
    if (lane == 0) fin[h] = k_eff >= n ? -inf() : (m == -inf() || !(z > 0.f)) ? inf() : m + log2f(z);
  }
  if (tid < p.head_dim) fin[G + tid] = vs / static_cast<float>(n);
  int* info = sparq_i(p, p.off_info) + row * 4;
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

// SparQ's shared pieces (sparq.cuh has the algorithm and the stages' entry point): the stages'
// sizes (threads, keys a thread, histogram bins, the shared-memory budget of each stage) and the
// small device helpers more than one stage uses: order keys of scores, workspace views, the
// (max, sum of exp2) merge, a block-wide counter claim, the top-down search over 256 counts and
// the last-block test. Apart from the stages so that each stays a header of its own size.
// (The workspace views take the params as a template P: pyattn::SparqParams.)
#pragma once
#include "common.cuh"

namespace pyattn {

constexpr int kSparqThreads = 256;
constexpr int kSparqKeys = 8;  // keys a thread scores / selects: one 16-byte load of a kt row (pages % 8 == 0)
constexpr int kSparqChunk = kSparqKeys * kSparqThreads;
constexpr int kSparqMaxGroup = 16;
constexpr int kSparqMaxDim = 256;
constexpr int kSparqBins = 4096;  // first-level histogram: the top 12 bits of a score's order key
constexpr int kSparqWarps = kSparqThreads / 32;
constexpr int kSparqCandMax = 4096;  // candidates the last select block refines in shared memory
// score: q~ [R][G padded to 4] + channels [D] + histogram (first the choice's q [G][D]) + per-warp
// partials + a flag + the choice's scratch (sparq_choose); select: a flag, 256 counts, 4 ints,
// candidates, then a block's worth of them again (sparq_rank_pick).
constexpr int kSparqScoreBytes = 4 * (kSparqMaxGroup * kSparqMaxDim + kSparqMaxDim + kSparqBins +
                                      kSparqWarps * kSparqMaxGroup * 2 + 1 + 2 * kSparqMaxDim + kSparqThreads +
                                      kSparqMaxGroup + kSparqWarps);
constexpr int kSparqSelectBytes = 2048 + 8 * (kSparqCandMax + kSparqThreads);
static_assert(kSparqBins >= kSparqMaxGroup * kSparqMaxDim, "the choice's q fits in the histogram's space");
static_assert(kSparqThreads >= kSparqMaxDim, "the choice's partial ranks fit in kSparqThreads words");

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

// Row `row`'s histogram (kSparqBins words) and its counters (4: the score stage's count of finished
// blocks, the select stage's chosen and candidate claims, its count of finished blocks), in the
// stream's zeroed counter block (p.zeroed; every row's histogram, then every row's counters). They
// are zero when the score stage starts, with no memset a call: the score stage's last block of the
// row zeroes the histogram and its count once it has read them, the select stage's last block the
// rest. (A memset before the score stage was a stream operation of every call, and the score stage
// then followed a memset instead of launching as a kernel's programmatic dependent: without it the
// calls took 5% less at B1 x 32k, 2% at B8 x 32k, 1% at B4 x 128k; BENCHMARKS.md, fifty-first session.)
template <class P>
__device__ __forceinline__ unsigned* sparq_hist(const P& p, int row) {
  return static_cast<unsigned*>(p.zeroed) + static_cast<long long>(row) * kSparqBins;
}

template <class P>
__device__ __forceinline__ int* sparq_ctr(const P& p, int row) {
  const long long rows = static_cast<long long>(p.batch) * p.row_heads;
  return static_cast<int*>(p.zeroed) + rows * kSparqBins + row * 4;
}

template <class P>
__device__ __forceinline__ const int* sparq_pages(const P& p, int b) {
  return p.page_indices + p.page_indptr[b];
}

__device__ __forceinline__ void sparq_warp_merge(float& m, float& z) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, o), z2 = __shfl_xor_sync(kFullMask, z, o);
    merge_exp2_state(m, z, m2, z2);
  }
}

// A warp's inclusive prefix sum of x (every thread of the block calls it), each warp's total left
// in sm[warp] and the block past a barrier: the first half of the block-wide sums below.
__device__ __forceinline__ int sparq_warp_totals(int x, int* sm) {
  const int lane = threadIdx.x % 32;
  int incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) sm[threadIdx.x / 32] = incl;
  __syncthreads();
  return incl;
}

// Block-wide append (every thread calls it): each thread adds `na` entries to list A and `nb` to
// list B (each < 65536 a block); one atomicAdd per list and block. Returns this thread's first
// positions. `sm`: 2 * kSparqWarps + 2 ints of shared memory.
__device__ __forceinline__ void sparq_block_claim(int* ctr_a, int* ctr_b, int na, int nb, int* sm, int& a, int& b) {
  const int warp = threadIdx.x / 32;
  const int mine = na | (nb << 16);
  const int incl = sparq_warp_totals(mine, sm);
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

// Block-wide exclusive prefix sum of one count a thread (every thread calls it), in 32 bits and
// with no counter: the select stage's last block places its take after the row's chosen keys, whose
// number it knows; its take can pass sparq_block_claim's 16-bit lists (up to k keys).
// `sm`: kSparqWarps ints of shared memory.
__device__ __forceinline__ int sparq_block_offset(int n, int* sm) {
  const int warp = threadIdx.x / 32;
  const int incl = sparq_warp_totals(n, sm);
  int before = incl - n;
  for (int w = 0; w < warp; ++w) before += sm[w];
  __syncthreads();  // sm is free again
  return before;
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

// Whether this block is the last of its row to pass here (the hand-over of common.cuh's
// count_acq_rel: every write before, every other block's write after).
__device__ __forceinline__ bool sparq_last(int* counter, int blocks, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) *flag = count_acq_rel(counter) == static_cast<unsigned>(blocks - 1);
  __syncthreads();
  return *flag;
}

}  // namespace pyattn

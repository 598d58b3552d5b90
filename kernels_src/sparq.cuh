// SparQ attention (Ribar et al., "SparQ Attention: Bandwidth-Efficient LLM Inference") over a paged
// 16-bit KV cache that keeps a transposed key copy kt (page, kv head, channel, slot) and running V
// sums (PagedKVCache(..., sparq=True)). A kernel per stage (the entries at the end); the attention
// over the chosen keys, with the finish as its last step, is the paged decode kernel after them.
// A "row" is one (sequence b, row head rh) whose G query heads share the row's choices: with
// select="group" the row heads are the kv heads and G the GQA group; with select="head" every query
// head is a row (G = 1, kv head rh / kv_div), the paper's algorithm for each head
// (pyattn/reference_sparq.py defines both, and why):
//
//  1 score  (grid blocks x rows; a block takes chunk_steps steps of kSparqChunk keys, 8 a quad
//           of lanes: 16-byte loads of the chosen kt rows, summed on the tensor cores; the host
//           sizes the grid to about one wave). Each
//           block first makes its row's choice (sparq_choose; every block of a row alike): the r
//           channels with the largest sum over the group of |q| (ties: lower channel first); per
//           head the temperature t_h = 1 / sqrt(sum_chosen |q_h| / sum |q_h|); q~_h = round_T(q_h *
//           t_h) on the chosen channels, 0 elsewhere. Block 0 writes the decode's query rows
//           qx[row] = (q_0 .. q_{G-1}, q~_0 .. q~_{G-1}). Then it reads only the r chosen rows of
//           kt per page. Per key the selection score a_i = sum_h q~_h . k_i (fp32), stored as an
//           order-preserving uint32; a 4096-bin histogram of its top 12 bits (in the stream's
//           zeroed counter block, which the stages leave zero: sparq_hist); per head the block's
//           (max, sum exp2) of the approximate logits scale*log2e * q~_h . k_i. The row's last
//           block (threadfence pattern) finds the bin holding the k-th largest key and merges the
//           blocks' (max, sum) per head into the row's finish record (with the row's mean of V).
//  2 select (grid chunks x rows): keys above that bin are chosen, keys in it become candidates
//           (one counter claim per block, positions in order inside it); the row's last block picks
//           the remaining ones among the candidates exactly (radix select on (score, -index): ties
//           go to the lower position; in shared memory when they fit) and writes the row's count.
//           Chosen keys are written as decode "pages": (pool slot * heads_kv + kv head), each one
//           row of the NHD pool (page size 1), plus their positions.
//  3 decode over the chosen keys (the paged decode kernel): rows q (exact attention) and q~ (the
//           log-sum-exp of the chosen keys' approximate logits), then, as its last step (the
//           finish, decode_merge.cuh's sparq_fold): alpha_h = exp(lse_chosen(q~_h) - lse_all(q~_h))
//           (1 when every key is chosen), out = alpha * o + (1 - alpha) * mean(V). A kernel of its
//           own until the sixty-eighth session.
//
// Why the shape (H200, B8 x 32k, BENCHMARKS.md "SparQ selection"): with 4 keys and 8-byte loads a
// thread, 1024-key blocks, a counter claim a warp and a per-row refinement reading its candidates
// from L2 once a pass, score took 96 us and select 48 us for 134 MB of kt and 8 MB of scores;
// now 55 and 23. The score stage's reads alone (dev/probe_kt_layout.py) run at 3.7-4.0 TB/s, 3.25
// at its occupancy (2 blocks an SM, by registers): 41 us there. Until the fiftieth session its
// instructions bounded it (55 us with no loads at all); now its warps wait mostly on those reads,
// 8 rows in flight a thread. Its sums moved to the tensor cores in the sixty-seventh session
// (sparq_score.cuh): 51.6-52.0 -> 50.1-50.3 us, bound by the reads in flight (BENCHMARKS.md).
// The choice of channels was a stage of its own (0, prep) until the
// forty-ninth session (sparq_score.cuh says why it is not).
// The stages' sizes and shared helpers are in sparq_common.cuh, the score stage in sparq_score.cuh;
// select and the entry points follow here.
// Requires pyattn::SparqParams and common.cuh.
#pragma once
#include "sparq_common.cuh"
#include "sparq_score.cuh"

namespace pyattn {

// Candidate j of the select stage's last block: from shared memory when they fit there, else
// from the workspace (written by other blocks: read past L1).
__device__ __forceinline__ unsigned long long sparq_cand(const unsigned* cu, const int* ci,
                                                         const unsigned long long* cand_s, bool in_smem, int j) {
  return in_smem ? cand_s[j] : sparq_key(__ldcg(cu + j), __ldcg(ci + j));
}

// The select stage's last block, once a radix pass has left m <= kSparqThreads candidates in the
// running prefix: they are copied to cmp_s (any order) and a thread a key counts the larger ones;
// returns the `remaining`-th largest (keys are distinct). One pass over m keys in place of up to
// six more radix passes over every candidate (each of those a histogram over all of them).
__device__ __forceinline__ unsigned long long sparq_rank_pick(const unsigned* cu, const int* ci, int n_cand, bool in_smem,
                                                              const unsigned long long* cand_s, unsigned long long prefix,
                                                              unsigned long long pmask, int m, int remaining,
                                                              unsigned long long* cmp_s, int* sh) {
  const int tid = threadIdx.x;
  if (tid == 0) sh[0] = 0;
  __syncthreads();
  for (int j = tid; j < n_cand; j += kSparqThreads) {
    const unsigned long long key = sparq_cand(cu, ci, cand_s, in_smem, j);
    if ((key & pmask) == prefix) cmp_s[atomicAdd(sh, 1)] = key;
  }
  __syncthreads();
  if (tid < m) {
    const unsigned long long key = cmp_s[tid];
    int rank = 0;
#pragma unroll 4
    for (int i = 0; i < m; ++i) rank += cmp_s[i] > key;  // (every thread reads the same key: a broadcast)
    if (rank == remaining - 1) sh[1] = static_cast<int>(key >> 32), sh[2] = static_cast<int>(key & 0xFFFFFFFFull);
  }
  __syncthreads();
  return (static_cast<unsigned long long>(static_cast<unsigned>(sh[1])) << 32) | static_cast<unsigned>(sh[2]);
}

// The select stage's last block: the `remaining` largest of the n_cand candidate keys (all in bin
// tbin, so their top 12 bits agree) by 8-bit radix passes below those bits, until at most a block's
// worth share the prefix (then sparq_rank_pick); returns the smallest key taken (every candidate >=
// it is taken). Candidates come from shared memory when they fit (one L2 read each), else from the
// workspace on every pass.
__device__ __forceinline__ unsigned long long sparq_refine(const unsigned* cu, const int* ci, int n_cand, int remaining,
                                                           int tbin, bool in_smem, const unsigned long long* cand_s,
                                                           unsigned* h256, int* sh, unsigned long long* cmp_s) {
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
    const int d = sh[0], m = sh[2];
    remaining = sh[1];
    prefix |= static_cast<unsigned long long>(d) << shift;
    pmask |= 0xFFull << shift;
    const bool done = m == remaining || shift == 0;  // keys are distinct: bits 7..0 end it
    __syncthreads();  // everyone has read sh and h256 before the next pass clears them
    if (done) return prefix;
    if (m <= kSparqThreads)
      return sparq_rank_pick(cu, ci, n_cand, in_smem, cand_s, prefix, pmask, m, remaining, cmp_s, sh);
  }
}

// A select thread's 8 order keys of one step, as the score stage wrote them: whole octets, those
// past the sequence's end unused (the row's stride lpad has room); a thread wholly past the end
// reads the sequence's first 8 instead. No branch, so that unrolled steps issue their loads together.
__device__ __forceinline__ void sparq_load8(const unsigned* score, int i0, int nv, unsigned (&u)[kSparqKeys]) {
  const int at = nv > 0 ? i0 : 0;
  const uint4 a = *reinterpret_cast<const uint4*>(score + at), c = *reinterpret_cast<const uint4*>(score + at + 4);
  u[0] = a.x, u[1] = a.y, u[2] = a.z, u[3] = a.w, u[4] = c.x, u[5] = c.y, u[6] = c.z, u[7] = c.w;
}

template <typename T, class P>
__device__ __forceinline__ void sparq_select(const P& p, unsigned char* smem) {
  const int row = blockIdx.y, b = row / p.row_heads, rh = row % p.row_heads, kvh = rh / p.kv_div;
  const int n = p.kv_len[b], c0 = blockIdx.x * kSparqChunk * p.chunk_steps;
  if (c0 >= n) return;
  const int tid = threadIdx.x, ps = p.page_size, H = p.heads_kv;
  const int* info = sparq_i(p, p.off_info) + row * 4;
  const int tbin = info[0], k_eff = info[2];
  int* ctr = sparq_ctr(p, row);
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
  unsigned long long* cmp_s = cand_s + kSparqCandMax;  // [kSparqThreads] (sparq_rank_pick)
  const int steps = min(p.chunk_steps, (n - c0 + kSparqChunk - 1) / kSparqChunk);

  // -- keys above the threshold bin are chosen; keys in it are candidates: count them over the
  // block's steps, claim once, then write them (the second read of the scores hits L1/L2)
  int ns = 0, nc = 0;
#pragma unroll 4
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
  // A warp's keys go to the consecutive positions claimed for its lanes, from its first lane's, in
  // (step, key, lane) order by ballots: each store instruction of a warp then writes neighbouring
  // words (a thread's own run of positions scattered a warp's stores over 32 sectors: that pass was
  // 11 of the stage's 25 us at B8 x 32k, forty-ninth session). A thread's 8 keys lie in one page
  // (page_size % 8 == 0): one page lookup a step.
  const unsigned below = (1u << (tid % 32)) - 1u;
  at = __shfl_sync(kFullMask, at, 0);
  ac = __shfl_sync(kFullMask, ac, 0);
  if (__any_sync(kFullMask, ns + nc > 0)) {
#pragma unroll 4
    for (int step = 0; step < steps; ++step) {
      const int i0 = c0 + step * kSparqChunk + kSparqKeys * tid, nv = max(0, min(kSparqKeys, n - i0));
      unsigned u[kSparqKeys];
      sparq_load8(score, i0, nv, u);
      const int slot0 = nv > 0 ? pages[i0 / ps] * ps + i0 % ps : 0;
#pragma unroll
      for (int e = 0; e < kSparqKeys; ++e) {
        const int bin = static_cast<int>(u[e] >> 20);
        const bool chosen = e < nv && (tbin < 0 || bin > tbin), cand = e < nv && tbin >= 0 && bin == tbin;
        const unsigned mc = __ballot_sync(kFullMask, chosen), md = __ballot_sync(kFullMask, cand);
        if (chosen) {
          const int j = at + __popc(mc & below);
          sel[j] = (slot0 + e) * H + kvh;
          sel_pos[j] = i0 + e;
        } else if (cand) {
          const int j = ac + __popc(md & below);
          cu[j] = u[e];
          ci[j] = i0 + e;
        }
        at += __popc(mc);
        ac += __popc(md);
      }
    }
  }
  // -- the row's last block: the remaining keys among the candidates, exactly
  const int n_blocks = (n + kSparqChunk * p.chunk_steps - 1) / (kSparqChunk * p.chunk_steps);
  if (!sparq_last(ctr + 3, n_blocks, flag)) return;
  if (tbin >= 0) {
    const int n_cand = __ldcg(ctr + 2), chosen = __ldcg(ctr + 1), remaining = k_eff - chosen;
    const bool in_smem = n_cand <= kSparqCandMax;
    if (in_smem) {
      for (int j = tid; j < n_cand; j += kSparqThreads) cand_s[j] = sparq_cand(cu, ci, cand_s, false, j);
      __syncthreads();
    }
    const unsigned long long prefix = sparq_refine(cu, ci, n_cand, remaining, tbin, in_smem, cand_s, h256,
                                                   sm + 2 * kSparqWarps + 2, cmp_s);
    // every candidate whose key is >= prefix: count this thread's, place them after the chosen keys
    // (every other block of the row is done, so their count is final: a prefix sum, no claim; the
    // claim this replaced packed the take into 16 bits, and 65536 keys or more taken here overlapped),
    // write
    int take = 0;
    for (int j = tid; j < n_cand; j += kSparqThreads) take += sparq_cand(cu, ci, cand_s, in_smem, j) >= prefix;
    int pos = chosen + sparq_block_offset(take, sm);
    for (int j = tid; j < n_cand && take > 0; j += kSparqThreads) {
      const unsigned long long key = sparq_cand(cu, ci, cand_s, in_smem, j);
      if (key < prefix) continue;
      const int i = static_cast<int>(0xFFFFFFFFu - static_cast<unsigned>(key));
      sel[pos] = (pages[i / ps] * ps + i % ps) * H + kvh;
      sel_pos[pos++] = i;
    }
  }
  if (tid == 0) static_cast<int*>(p.dec_len)[row] = k_eff;
  __syncthreads();  // every claim of this block read its counter
  if (tid >= 1 && tid < 4) ctr[tid] = 0;  // left zero for the next call (sparq_ctr)
}

// The stages' entries (families sparq_score, sparq_select; P: SparqParams). Each is a kernel of its
// own, so that each gets its own registers and launch bounds: as one kernel switching on the stage,
// the select stage ran with the score stage's 127 registers (2 blocks an SM), and a change to one
// stage's code moved another's time (BENCHMARKS.md, forty-ninth and fiftieth sessions). Like every
// pyattn kernel, each entry waits first for the stream's previous kernel (pdl.cuh), so on sm_90+
// every stage and the decode after them launch as their predecessor's programmatic dependents, each
// launch overlapping the last one's tail.
template <typename T, class P>
__device__ __forceinline__ void sparq_score_stage(const P& p) {
  __shared__ __align__(16) unsigned char smem[kSparqScoreBytes];
  sparq_score<T>(p, smem);
}
template <typename T, class P>
__device__ __forceinline__ void sparq_select_stage(const P& p) {
  __shared__ __align__(16) unsigned char smem[kSparqSelectBytes];
  sparq_select<T>(p, smem);
}

}  // namespace pyattn

// The persistent attn_fwd_tma's last, partial round split by keys (stream-K's tail).
// A persistent launch of G blocks takes U equal query tiles in rounds of G (PersistentUnits): with
// U = R G + r, 0 < r < G, the call lasts R + 1 tiles' time while G - r blocks idle through the last
// one (H200, d = 128, 2048 tiles on 132 SMs: 15.5 rounds run as 16). With a tail split (the host
// sets sk_iters, attention's plan says when) the first R G units run whole as before and the last
// r units' key tiles, sk_iters = r x sk_tiles of them in (unit, key tile) order, are cut into G
// equal ranges, block b taking [b I / G, (b + 1) I / G): every block ends about R + r / G tiles in.
// A range crosses units, so a unit's key tiles may lie in two or three blocks' ranges ("pieces",
// the blocks first..last of it, consecutive; a piece's slot is its block's place among them). A
// piece stores its normalised fp32 O rows and their log2 LSEs in its slot, and each consumer warp
// adds the key tiles it covered to a counter of its 16 rows; the warp whose add completes the
// unit's sk_tiles merges every slot's rows (weighted by their LSEs) and stores O and the LSE as a
// whole tile would (wgmma_fwd_store). Not with a bounded soft-cap (FIXED_REF), whose O is
// normalised by other sums than its LSE's. The counters live in the stream's zeroed block
// (runtime.memory counters) and the merging warp zeroes its own again.
// Every unit must cost the same key tiles: non-causal calls, and causal ones whose units pair row
// blocks n - 1 - i and i of an even count n with as many keys as queries and 128-row / 128-key
// tiles (n + 1 key tiles a unit: side 0's n - i, then side 1's i + 1); no window, varlen or mask
// tensor. A causal piece may hold key tiles of both its unit's query tiles: each query tile
// ("tile": 2 t + side, or t) has its own slots and counters. The host's rule is
// pyattn/ops/_fwd_tail.py tail_split (it also keeps every block at least one key tile, so a
// tile's slots are all written).
// Requires AttnFwdTmaParams (sk_*), attention_fwd_wgmma.cuh (the Mainloop).
#pragma once

namespace pyattn {

// A block's work items walk the plain stride u = blockIdx.x + k G: units below sk_first whole,
// then u = sk_first + i G + blockIdx.x names the block's tail piece i (i < sk_pieces, the most any
// block has; a block with fewer skips the rest). Each piece is worked out from u by arithmetic on
// blockIdx and the parameters alone, so ptxas keeps it in uniform registers as it keeps the plain
// stride's unit (a first form that carried the walk in shared memory made the unit's tile, head,
// batch and pointers per-thread values, and its producer thread spilled at 24 registers).
// (The host keeps G x sk_iters below 2^31: 32-bit products.)
__device__ __forceinline__ bool tail_piece_of(const AttnFwdTmaParams& tp, int u, int& unit, int& j0, int& j1) {
  const int g = gridDim.x, b = blockIdx.x, i = (u - tp.sk_first) / g;
  const int start = b * tp.sk_iters / g, end = (b + 1) * tp.sk_iters / g;
  const int kt = tp.sk_tiles, t = start / kt + i;
  const int a = i == 0 ? start : t * kt;  // the piece's first key tile in the tail's order
  if (a >= end) return false;
  unit = tp.sk_first + t;
  j0 = a - t * kt;
  j1 = min(kt, end - t * kt);
  return true;
}

// The walk's end: past the whole units, or past the tail's pieces when the call splits.
__device__ __forceinline__ int tail_walk_end(const AttnFwdTmaParams& tp, int total) {
  return tp.sk_iters > 0 ? tp.sk_first + tp.sk_pieces * static_cast<int>(gridDim.x) : total;
}

// A tail item's key tiles [j0, j1) of its unit, as those of query tile `side` of it: [a, b) of that
// tile's own, false when the item holds none of them. c0: side 0's key tiles (causal: its row
// block m0 + 1 of the pair, with as many keys as queries and BM = BN; else all the unit's).
__device__ __forceinline__ bool tail_side(int side, int c0, int j0, int j1, int& a, int& b) {
  a = side ? max(j0 - c0, 0) : j0;
  b = side ? j1 - c0 : min(j1, c0);
  return a < b;
}

// The blocks whose ranges hold tail key tiles x0 and x0 + n - 1: block b holds key tile x of the
// tail when b I / G <= x < (b + 1) I / G (integer parts), i.e. b = ((x + 1) G - 1) / I.
__device__ __forceinline__ int tail_block_of(int x, const AttnFwdTmaParams& tp) {
  return ((x + 1) * static_cast<int>(gridDim.x) - 1) / tp.sk_iters;  // (G I < 2^31: the host's rule)
}

// A piece's end (consumer threads, before wgmma_fwd_store): store this block's slot of query tile
// `tile` of the tail, whose `count` key tiles are the tail's x0 on, and count the `done` of them it
// held; false, or where this warp's count completes the tile, merge every slot's rows into `ml` as
// a whole tile's state and return true (the caller stores it).
template <class Mainloop>
__device__ __forceinline__ bool tail_piece(Mainloop& ml, const AttnFwdTmaParams& tp, int tile, int x0, int count,
                                           int done) {
  constexpr int D = Mainloop::D, BM = Mainloop::BM, WARPS = BM / 16;
  static_assert(!Mainloop::FIXED_REF, "a tail split: not with a bounded soft-cap's tensor-core sums");
  const int first = tail_block_of(x0, tp), n = tail_block_of(x0 + count - 1, tp) - first + 1;
  const long long slot0 = static_cast<long long>(tile) * tp.sk_slots;  // the tile's first slot
  const long long mine = slot0 + blockIdx.x - first;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(ml.row_sum[h]);
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    const int r = ml.row_a + 8 * h - ml.m0;  // the row within the tile
    float* orow = tp.sk_part + (mine * BM + r) * D;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<float2*>(orow + i * 8 + 2 * ml.t) =
          make_float2(ml.acc[4 * i + 2 * h] * inv, ml.acc[4 * i + 2 * h + 1] * inv);
    if (ml.t == 0) tp.sk_lse[mine * BM + r] = sum == 0.f ? -inf() : ml.row_max[h] * ml.sl2 + log2f(sum);
  }
  // The warp's hand-over (count_acq_rel between two warp barriers): the barrier orders every
  // lane's stores before lane 0's release; the second orders lane 0's acquire before every lane's
  // reads of the other pieces. (A __threadfence in every lane before and after cost two
  // MEMBAR.SC.GPU a warp.)
  __syncwarp();
  unsigned* ctr = static_cast<unsigned*>(tp.sk_ctr) + static_cast<long long>(tile) * WARPS + warp;
  unsigned before = 0;
  if (lane == 0) before = count_acq_rel(ctr, static_cast<unsigned>(done));
  before = __reduce_max_sync(kFullMask, before);  // to every lane, warp-uniform (the caller's `continue`)
  if (before + done != static_cast<unsigned>(count)) return false;
  __syncwarp();
  if (lane == 0) *ctr = 0u;  // the block stays zeroed for the stream's next kernel
  // Each row half in one pass over the slots, a slot's LSE and O rows loaded together: one L2
  // round trip a slot, where a max pass and then a weighted pass took two. The weights rescale
  // online, as the softmax's running max does. (The merging warp is the last of its tile's pieces,
  // so its piece's end, store and merge set the split's end: 7-8 us from the piece's end to the
  // merged state, 0.6 us less in this form; BENCHMARKS.md, fifty-eighth session.)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = ml.row_a + 8 * h - ml.m0;
    float m = -inf(), w_sum = 0.f;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) ml.acc[4 * i + 2 * h] = ml.acc[4 * i + 2 * h + 1] = 0.f;
#pragma unroll 1
    for (int s = 0; s < n; ++s) {
      const float lse = __ldcg(tp.sk_lse + (slot0 + s) * BM + r);
      const float* orow = tp.sk_part + ((slot0 + s) * BM + r) * D;
      float2 o[D / 8];
#pragma unroll
      for (int i = 0; i < D / 8; ++i) o[i] = __ldcg(reinterpret_cast<const float2*>(orow + i * 8 + 2 * ml.t));
      // No branch on the row's values: a per-thread branch here (rows past the sequence's end,
      // which saw no key in any piece, m = -inf: weights 0) made ptxas move every wgmma
      // descriptor of the main loop through per-thread registers (+48 R2UR; nvdisasm, NVRTC 13.0).
      // The selects test the operands that are -inf, not m_new: a piece's NaN LSE (a NaN key
      // among its keys) must reach the row as NaN, as in a whole tile, and fmaxf drops it from
      // m_new (with m_new -inf there, a test on it zeroed the NaN piece's weight).
      const float m_new = fmaxf(m, lse);
      const float keep = m == -inf() ? 0.f : exp2f(m - m_new);
      const float w = lse == -inf() ? 0.f : exp2f(lse - m_new);
      w_sum = w_sum * keep + w;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        ml.acc[4 * i + 2 * h] = ml.acc[4 * i + 2 * h] * keep + w * o[i].x;
        ml.acc[4 * i + 2 * h + 1] = ml.acc[4 * i + 2 * h + 1] * keep + w * o[i].y;
      }
      m = m_new;
    }
    // As a whole tile's state: O over its reference m (row_max in score units), the quad's sum w_sum
    ml.row_max[h] = __fdividef(m, ml.sl2);  // (an IEEE division would add a slow-path call)
    ml.row_sum[h] = 0.25f * w_sum;
  }
  return true;
}

}  // namespace pyattn

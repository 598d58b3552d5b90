// Prefill over a paged KV cache on Hopper warpgroup tensor cores (sm_90a): the wgmma forward
// kernel (attention_fwd_wgmma.cuh: traits, ring, warp specialization, main loop) with
//   - K/V tiles gathered through the sequence's page list (AttnFwdWgmmaMainloop PAGED: one page
//     lookup per key row, shared by K and V; the producer warpgroup hides it with the copies),
//   - ragged new tokens per sequence (cu_seqlens_q) against kv_len[b] cached keys, the new tokens
//     being the last ones (bottom-right causal, window, soft-cap, ALiBi as the dense kernel),
//   - row groups: a block's rows pack row_group query heads of one GQA group per token (row r =
//     token r / row_group, head first + r % row_group), so a kv head's keys feed all its query
//     heads in one pass and a short chunk (a draft tree of 16 tokens x 4 heads) fills an m64 tile,
//   - TREE: each new token sees the keys before the tree plus its ancestors among the tree keys
//     (a 64-bit mask per token), instead of causal order among them,
//   - key splits (flash-decoding) for grids too small to fill the GPU: split s of a block's key
//     tiles writes fp32 partial rows and LSEs that a combine launch merges,
//   - on TMA traits (family attn_prefill_tma: pages of a power of two from 16), K/V as page boxes
//     through tensor maps over the pools (Mainloop::produce_tma_paged) instead of the producer
//     warpgroup's cp.async gather.
// Requires pyattn::PagedFwdParams (rendered), common.cuh, mma.cuh; grid: the batch's units
// (sequence, row group, query tile) x splits, one-dimensional (attention_mask.cuh paged_unit);
// Traits as attn_fwd_wgmma.
#pragma once
#include "attention_fwd_wgmma.cuh"

namespace pyattn {

template <class Tr, class Mods, bool TREE>
__device__ __forceinline__ void attn_prefill_wgmma(const PagedFwdParams& pp) {
  const AttnFwdParams& p = pp.fwd;
  using T = typename Tr::T;
  using Mainloop = AttnFwdWgmmaMainloop<Tr, Mods, false, true, TREE>;
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN;
  static_assert(Mods::kMask == kMaskNone, "paged prefill takes no mask tensor");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  static_assert(Tr::kMaskTileBytes == 0, "paged prefill: no mask tiles (sMask is the barriers' base)");
  const FwdSmem<Tr> sm(smem_raw);
  const unsigned sQ = sm.q, sKV = sm.kv, sMask = sm.mask;

  // -- which rows, heads, keys and split this block owns
  const int splits = pp.num_splits;
  int split;  // this block's unit of the batch: its sequence, row group, query tile (attention_mask.cuh)
  const PagedTile pt = paged_tile<BM>(p, pp, paged_unit(p, splits, split));
  if (pt.seq < 0) return;  // past the batch's last unit
  const int batch = pt.seq, m_block = pt.tile, q_row0 = pt.q_row0, sq = pt.sq, sk = pt.sk;
  const int rg = pp.row_group;
  const int rows = sq * rg, m0 = m_block * BM;
  const int head0 = pt.group * rg;  // the block's first query head; all share one kv head
  const int kv_head = head0 / p.group;
  const T* q = static_cast<const T*>(p.q) + q_row0 * p.q_stride_s + head0 * p.q_stride_h;

  Mainloop ml;
  ml.k = static_cast<const T*>(p.k) + kv_head * p.k_stride_h;
  ml.v = static_cast<const T*>(p.v) + kv_head * p.v_stride_h;
  ml.k_stride = pp.k_stride_slot;
  ml.v_stride = pp.v_stride_slot;
  ml.k_page = pp.k_stride_page;
  ml.v_page = pp.v_stride_page;
  ml.q_head_stride = p.q_stride_h;
  ml.pages = paged_pages(pp, batch);
  ml.num_pages = pp.num_pages;
  ml.page_size = pp.page_size;
  ml.page_shift = pp.page_shift;
  ml.rows_per_page = static_cast<int>(pp.k_stride_page / pp.k_stride_slot);  // once per block
  ml.row_group = rg;
  ml.band = make_band(p, sq, sk);
  int n_begin, n_end;  // key tiles some token of the block can see, then this split's share
  band_key_range<BN>(ml.band, m0 / rg, (min(m0 + BM, rows) - 1) / rg, sk, n_begin, n_end);
  const int n_all = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
  const int lo = n_all * split / splits, hi = n_all * (split + 1) / splits;
  ml.tiles.init(p, head0, m_block, n_begin + lo * BN, min(n_end, n_begin + hi * BN));
  ml.n_tiles = ml.tiles.count;
  ml.sq = rows;  // row bounds are on packed rows; the band on tokens (ml.tok)
  ml.sk = sk;
  ml.mods.init(p, batch, head0, sq, sk);
  ml.m0 = m0;
  ml.sMask = sMask;
  ml.mask_smem = smem_raw;
  ml.staged = false;
  ml.head_dim = p.head_dim;
  ml.sKV = sKV;
  if constexpr (Tr::kTma) {  // the pools' maps (K, V: boxes of min(page, BLOCK_N) slots) and the kv head
    static_assert(!Tr::kPersist && !TREE, "paged TMA: a block a query tile, no tree masks");
    ml.maps = static_cast<const TmaMap*>(pp.tmaps);
    ml.tma_k.head = kv_head;
  }

  // This thread's place, as Mainloop::set_thread / set_rows give it (in this order the paged
  // kernels' SASS stays the one measured; through the two calls ptxas schedules d = 128 otherwise).
  const int wgi = threadIdx.x / 128;
  ml.wgi = wgi;
  const int lane = threadIdx.x % 32, g = lane / 4;
  ml.t = lane % 4;
  ml.wg_row0 = m0 + wgi * 64;
  ml.row_a = ml.wg_row0 + (threadIdx.x % 128) / 32 * 16 + g;
  ml.sub_row = threadIdx.x / 32;
  ml.wg_tok0 = min(ml.wg_row0, rows - 1) / rg;
  ml.wg_tok1 = min(ml.wg_row0 + 63, rows - 1) / rg;
  ml.tree_k0 = sk - sq;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = ml.row_a + 8 * h;
    ml.tok[h] = row / rg;
    ml.tree_bits[h] = 0ull;
    if constexpr (TREE)
      if (row < rows) ml.tree_bits[h] = __ldg(pp.tree_mask + q_row0 + ml.tok[h]);
  }
  ml.set_sl2(p.scale_log2);

  if (!wgmma_block_run<Tr>(ml, sQ, sMask, q, p.q_stride_s,
                          [&] { ml.template load_q<Tr::kThreads>(sQ, q, p.q_stride_s, threadIdx.x); }))
    return;  // the producer warpgroup

  // -- epilogue: normalise; store O and the LSE, or this split's fp32 partial row and LSE
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(ml.row_sum[h]);
    const int row = ml.row_a + 8 * h;
    if (row >= rows) continue;
    const int tok = ml.tok[h], head = head0 + (row - tok * rg);
    const bool empty = sum == 0.f;
    const float inv = empty ? 0.f : 1.f / sum;
    const float lse = empty ? -inf() : (ml.row_max[h] * ml.sl2 + log2f(sum)) * kLn2;
    if (splits == 1) {
      T* orow = static_cast<T*>(p.o) + (q_row0 + tok) * p.o_stride_s + head * p.o_stride_h;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const int d = i * 8 + 2 * ml.t;
        if (d < p.head_dim)
          *reinterpret_cast<unsigned*>(orow + d) =
              pack2<T>(ml.acc[4 * i + 2 * h] * inv, ml.acc[4 * i + 2 * h + 1] * inv);
      }
      if (p.lse != nullptr && ml.t == 0)
        p.lse[q_row0 * p.lse_stride_b + head * p.lse_stride_h + tok] = lse;  // (PagedFwdExtra: no batch)
    } else {
      const long long prow = split * pp.part_stride + static_cast<long long>(q_row0 + tok) * p.heads_q + head;
      float* orow = pp.o_part + prow * p.head_dim;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const int d = i * 8 + 2 * ml.t;
        if (d < p.head_dim)
          *reinterpret_cast<float2*>(orow + d) =
              make_float2(ml.acc[4 * i + 2 * h] * inv, ml.acc[4 * i + 2 * h + 1] * inv);
      }
      if (ml.t == 0) pp.lse_part[prow] = lse;
    }
  }
}

}  // namespace pyattn

// Prefill over a paged KV cache on mma.sync tensor cores (sm_80 and later): the loop of
// attention_fwd_mma.cuh (traits, two-stage cp.async K/V ring, S = Q K^T, online softmax in
// registers, O += P V) with the paged-prefill semantics of attention_prefill_wgmma.cuh: K/V rows
// gathered through the sequence's page list (one lookup per key row for K and V), ragged new
// tokens (cu_seqlens_q) as the last of kv_len[b] keys, row groups (row r = token r / row_group
// of head first + r % row_group), TREE ancestor masks over the last sq keys, and key splits whose
// fp32 partials a combine launch merges.
// Requires pyattn::PagedFwdParams (rendered), common.cuh and mma.cuh; grid: the batch's units
// (sequence, row group, query tile) x splits, one-dimensional (attention_mask.cuh paged_unit).
#pragma once
#include "attention_fwd_mma.cuh"

namespace pyattn {

// K and V rows [first_row, first_row + ROWS) of one sequence's pages into sK / sV (rows padded
// as load_tile's); rows past `row_end` and chunks past `head_dim` are zero-filled. Every page
// lookup of the tile is issued before the first copy (one dependent load per copy, in turn, is
// what held the wgmma version to half speed), and clamped into the pool only where its address is
// made: clamped as loaded, ptxas loaded the lookups into one register one after another
// (attention_decode.cuh's load_kv_stage met the same; sixty-first session).
template <class Tr, int ROWS>
__device__ __forceinline__ void load_kv_paged(typename Tr::T* dk, typename Tr::T* dv, const typename Tr::T* k,
                                              const typename Tr::T* v, const PagedFwdParams& pp, const int* pages,
                                              int first_row, int row_end, int head_dim) {
  constexpr int CPR = Tr::kChunksPerRow, kChunks = ROWS * CPR;
  constexpr int kIters = (kChunks + Tr::kThreads - 1) / Tr::kThreads;
  const auto index_of = [&](int key) { return pp.page_shift >= 0 ? key >> pp.page_shift : key / pp.page_size; };
  int page[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int c = threadIdx.x + i * Tr::kThreads, key = first_row + c / CPR;
    page[i] = (kChunks % Tr::kThreads == 0 || c < kChunks) && key < row_end ? __ldg(pages + index_of(key)) : 0;
  }
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int c = threadIdx.x + i * Tr::kThreads;
    if (kChunks % Tr::kThreads == 0 || c < kChunks) {
      const int r = c / CPR, col = (c % CPR) * 8, key = first_row + r;
      const bool ok = key < row_end && col < head_dim;
      const long long slot = key - index_of(key) * pp.page_size;
      const long long pg = pool_page(page[i], pp.num_pages);  // clamped here, not as loaded: see above
      const long long ko = pg * pp.k_stride_page + slot * pp.k_stride_slot + col;
      const long long vo = pg * pp.v_stride_page + slot * pp.v_stride_slot + col;
      cp_async_16(dk + r * Tr::kStride + col, ok ? k + ko : k, ok);
      cp_async_16(dv + r * Tr::kStride + col, ok ? v + vo : v, ok);
    }
  }
}

// The query tile: tile row r (packed row R = first_row + r) is token R / rg of head (q's) + R % rg.
template <class Tr>
__device__ __forceinline__ void load_q_rows(typename Tr::T* dst, const typename Tr::T* q, long long stride_s,
                                            long long stride_h, int rg, int rows, int first_row, int row_end,
                                            int head_dim) {
  for (int c = threadIdx.x; c < rows * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = (c % Tr::kChunksPerRow) * 8, row = first_row + r;
    const bool ok = row < row_end && col < head_dim;
    const int tok = row / rg;
    cp_async_16(dst + r * Tr::kStride + col, ok ? q + tok * stride_s + (row - tok * rg) * stride_h + col : q, ok);
  }
}

template <class Tr, class Mods, bool TREE>
__device__ __forceinline__ void attn_prefill_mma(const PagedFwdParams& pp) {
  const AttnFwdParams& p = pp.fwd;
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, LD = Tr::kStride;
  constexpr int MT = Tr::kMTiles, NT = BN / 8, DT = D / 8;
  static_assert(Mods::kMask == kMaskNone, "paged prefill takes no mask tensor");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM][LD]
  T* sK = sQ + BM * LD;                    // [2][BN][LD]
  T* sV = sK + 2 * BN * LD;                // [2][BN][LD]

  // -- which rows, heads, keys and split this block owns
  const int splits = pp.num_splits;
  int split;  // this block's unit of the batch: its sequence, row group, query tile (attention_mask.cuh)
  const PagedTile pt = paged_tile_scan<BM>(p, pp, paged_unit(p, splits, split));
  if (pt.seq < 0) return;  // past the batch's last unit
  const int batch = pt.seq, m_block = pt.tile, q_row0 = pt.q_row0, sq = pt.sq, sk = pt.sk;
  const int rg = pp.row_group;
  const int rows = sq * rg, m0 = m_block * BM;
  const int head0 = pt.group * rg, kv_head = head0 / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + q_row0 * p.q_stride_s + head0 * p.q_stride_h;
  const T* k = static_cast<const T*>(p.k) + kv_head * p.k_stride_h;
  const T* v = static_cast<const T*>(p.v) + kv_head * p.v_stride_h;
  const int* pages = paged_pages(pp, batch);

  const Band band = make_band(p, sq, sk);
  int n_begin, n_end;  // key tiles some token of the block sees, then this split's share
  band_key_range<BN>(band, m0 / rg, (min(m0 + BM, rows) - 1) / rg, sk, n_begin, n_end);
  const int n_all = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
  const int lo = n_all * split / splits, hi = n_all * (split + 1) / splits;
  const int n_first = n_begin + lo * BN, n_blocks = hi - lo;
  const ModState mods = make_mod_state<Mods>(p, batch, head0, sq, sk);

  // This thread's rows (tile mi, half h): packed row, token, tree bits.
  const int warp_row = warp * 16 * MT;
  const int row0 = m0 + warp_row + g;
  int tok[MT][2];
  unsigned long long bits[MT][2];
  const int tree_k0 = sk - sq;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mi * 16 + 8 * h;
      tok[mi][h] = row / rg;
      bits[mi][h] = 0ull;
      if constexpr (TREE)
        if (row < rows) bits[mi][h] = __ldg(pp.tree_mask + q_row0 + tok[mi][h]);
    }
  const int wtok0 = min(m0 + warp_row, rows - 1) / rg, wtok1 = min(m0 + warp_row + 16 * MT - 1, rows - 1) / rg;

  // -- prologue: Q and the first K/V tile in flight
  load_q_rows<Tr>(sQ, q, p.q_stride_s, p.q_stride_h, rg, BM, m0, rows, p.head_dim);
  if (n_blocks > 0) load_kv_paged<Tr, BN>(sK, sV, k, v, pp, pages, n_first, sk, p.head_dim);
  cp_async_commit();

  float acc[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
  init_softmax_state<MT, DT>(acc, row_max, row_sum);
  const float sl2 = Mods::kAny ? 1.f : p.scale_log2;

  for (int j = 0; j < n_blocks; ++j) {
    const int n0 = n_first + j * BN, stage = j & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile j landed for everyone, and every warp is done with tile j-1
    if (j + 1 < n_blocks)
      load_kv_paged<Tr, BN>(sK + (stage ^ 1) * BN * LD, sV + (stage ^ 1) * BN * LD, k, v, pp, pages, n0 + BN, sk,
                            p.head_dim);
    cp_async_commit();
    const T* tK = sK + stage * BN * LD;
    const T* tV = sV + stage * BN * LD;

    // -- S = Q K^T (raw scores, fp32); each K fragment feeds MT row tiles
    float s[MT][NT][4];
    zero_tiles<MT, NT>(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        ldmatrix_x4(a[mi], sQ + (warp_row + mi * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        unsigned b[4];
        ldmatrix_x4(b, tK + (nt * 8 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16816<T>(s[mi][nt], a[mi], b[0], b[1]);
          mma_16816<T>(s[mi][nt + 1], a[mi], b[2], b[3]);
        }
      }
    }

    // -- modifiers; keys past the end, outside the band or not an ancestor -> -inf
    const bool full = band_tile_full<BN>(band, wtok0, wtok1, n0, sk) && (!TREE || n0 + BN <= tree_k0);
    if (Mods::kAny || !full) {
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = e >> 1, key = n0 + nt * 8 + 2 * t + (e & 1), tk = tok[mi][h];
            bool ok = key < sk && band.allows(tk, key);
            if constexpr (TREE) ok = ok && (key < tree_k0 || ((bits[mi][h] >> (key - tree_k0)) & 1ull));
            if constexpr (Mods::kAny)
              s[mi][nt][e] = ok && row0 + mi * 16 + 8 * h < rows ? score_mod<Mods>(p, mods, s[mi][nt][e], tk, key)
                                                                 : -inf();
            else if (!ok)
              s[mi][nt][e] = -inf();
          }
    }

    online_softmax<MT, NT, DT>(s, acc, row_max, row_sum, sl2);

    // -- O += P V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[MT][4];
      p_fragments<T, MT, NT>(s, kk, a);
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        unsigned b[4];
        ldmatrix_x4_trans(b, tV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dt * 8 + (lane >> 4) * 8);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16816<T>(acc[mi][dt], a[mi], b[0], b[1]);
          mma_16816<T>(acc[mi][dt + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }

  // -- epilogue: normalise; store O and the LSE, or this split's fp32 partial row and LSE
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(row_sum[mi][h]);
      const int row = row0 + mi * 16 + 8 * h;
      if (row >= rows) continue;
      const int tk = tok[mi][h], head = head0 + (row - tk * rg);
      const bool empty = sum == 0.f;
      const float inv = empty ? 0.f : 1.f / sum;
      const float lse = empty ? -inf() : (row_max[mi][h] * sl2 + log2f(sum)) * kLn2;
      if (splits == 1) {
        T* orow = static_cast<T*>(p.o) + (q_row0 + tk) * p.o_stride_s + head * p.o_stride_h;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          const int d = dt * 8 + 2 * t;
          if (d < p.head_dim)
            *reinterpret_cast<unsigned*>(orow + d) = pack2<T>(acc[mi][dt][2 * h] * inv, acc[mi][dt][2 * h + 1] * inv);
        }
        if (p.lse != nullptr && t == 0) p.lse[q_row0 * p.lse_stride_b + head * p.lse_stride_h + tk] = lse;
      } else {
        const long long prow = split * pp.part_stride + static_cast<long long>(q_row0 + tk) * p.heads_q + head;
        float* orow = pp.o_part + prow * p.head_dim;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          const int d = dt * 8 + 2 * t;
          if (d < p.head_dim)
            *reinterpret_cast<float2*>(orow + d) = make_float2(acc[mi][dt][2 * h] * inv, acc[mi][dt][2 * h + 1] * inv);
        }
        if (t == 0) pp.lse_part[prow] = lse;
      }
    }
}

}  // namespace pyattn

// AttnFwdWgmmaMainloop's memory side, its member functions defined out of class: the
// warp-specialized producers that fill the K/V ring (cp.async by the producer warpgroup, TMA by one
// thread, mask tiles included), the ring's barriers, and the consumers' gathers of a mask tensor's
// terms into S's register layout. The struct, its fields and its short members are in
// attention_fwd_wgmma_mainloop.cuh, which includes this header right after the struct; the bodies
// live here only to keep that header short (the code is as it was in the struct).
#pragma once
#include "attention_fwd_wgmma_mainloop.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma_pipe.cuh"

namespace pyattn {

// WS producer: Q and every key tile through the ring. A stage is reused once all consumer warps
// released it; it is handed over once this thread's copies into it landed and were fenced for
// the async proxy (each of the 128 producer threads arrives on "full"). PAGED: tile i + 1's page
// lookups are issued before the wait for tile i's stage, so its copies never wait on them.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::produce(unsigned sQ, const T* q, long long q_stride, int tid) {
  load_q<128>(sQ, q, q_stride, tid);  // with tile 0's group
  PagedKVLoad<Tr, BN, 128> pl;
  if constexpr (PAGED) {
    pl = paged_load<128>(tid);
    pl.fetch(tiles.n0(0), sk);
  }
  int st = 0;
  unsigned empty_parity = 1;  // a fresh barrier's "previous" phase counts as complete
  for (int i = 0; i < n_tiles; ++i) {
    if constexpr (PAGED) {
      const unsigned row = pl.take();
      if (i + 1 < n_tiles) pl.fetch(tiles.n0(i + 1), sk);
      pipe::wait(bar_empty + 8 * st, empty_parity);
      const unsigned kv = sKV + st * Tr::kStageBytes;
      pl.copy(kv, kv + Tr::kKVBytes, row, tiles.n0(i), sk);
    } else {
      pipe::wait(bar_empty + 8 * st, empty_parity);
      load<128>(st, tiles.n0(i), tid);
    }
    wg::cp_async_commit();
    if (i > 0) {  // tile i - 1 landed (one group may stay in flight): hand its stage over
      wg::cp_async_wait<1>();
      wg::fence_proxy_async_smem();
      pipe::arrive(bar_full + 8 * (st == 0 ? STAGES - 1 : st - 1));
    }
    if (++st == STAGES) st = 0, empty_parity ^= 1;
  }
  wg::cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  pipe::arrive(bar_full + 8 * (st == 0 ? STAGES - 1 : st - 1));
}

// WS producer with TMA, one thread: per tile, wait until the stage is free, announce its bytes
// on its "full" barrier (tile 0's also carry the query tile) and issue one copy per 64-wide
// column block of K and of V. The copies' arrival completes the phase; no thread waits for them
// here, and the async proxy that wgmma reads through is the one TMA writes through.
// A mask tensor's tile comes with its K/V tile: one copy per kMaskSwz-byte column block.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::produce_tma(unsigned sQ) {
  prefetch_maps();
  // A fresh barrier's "previous" phase counts as complete (bits 16 + s: SPLIT_KV's V barriers).
  unsigned empty_bits = ((1u << STAGES) - 1) * (Tr::kSplitKV ? 0x10001u : 1u);
  produce_tma_tiles(empty_bits, sQ, true);
}

// The block's key tiles through the ring from stage 0; bit s of `empty_bits` is the phase of
// stage s's "empty" barrier to wait for, bit 16 + s that of its V barrier with SPLIT_KV (carried
// on to the next query tile of a persistent block, whose tile may end at any stage).
// `q_with_tile0`: the query tile rides on tile 0's "full" barrier (a persistent block's has
// barriers of its own).
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::produce_tma_tiles(unsigned& empty_bits, unsigned sQ,
                                                                       bool q_with_tile0) {
  constexpr int kBlocks = D / CB;
  // What a stage's copies complete (SPLIT_KV: K's barrier K and the mask tile, V's V).
  constexpr unsigned stage_bytes = (Tr::kSplitKV ? Tr::kKVBytes : Tr::kStageBytes) + Tr::kMaskTileBytes;
  int st = 0;
  for (int i = 0; i < n_tiles; ++i) {
    const unsigned full = bar_full + 8 * st, kv = sKV + st * Tr::kStageBytes;
    pipe::wait(bar_empty + 8 * st, (empty_bits >> st) & 1u);
    empty_bits ^= 1u << st;
    const bool with_q = q_with_tile0 && i == 0;
    tma::arrive_expect(full, stage_bytes + (with_q ? Tr::kQBytes : 0));
    if (with_q) load_q_tma(sQ, full);
    const int n0 = tiles.n0(i);
    // One stage's ring: K and V copies by column block, the mask tile's after them. SPLIT_KV: K's
    // and the mask's, then V's on its own barrier once its slot is free (bits 16 + s).
    constexpr bool kVWithK = !Tr::kFp8 && !Tr::kSplitKV;
#pragma unroll
    for (int c = 0; c < kBlocks; ++c) {
      tma::load_4d(kv + c * (BN * 128), maps + 1, full, CB * c, tma_k.row + n0, tma_k.head, tma_k.batch);
      if constexpr (kVWithK)
        tma::load_4d(kv + Tr::kKVBytes + c * (BN * 128), maps + 2, full, CB * c, tma_v.row + n0, tma_v.head,
                     tma_v.batch);
    }
    if constexpr (Tr::kSplitKV) load_mask_tma(st, n0, full);
    unsigned vfull = full;
    if constexpr (Tr::kSplitKV) {
      vfull = bar_vfull + 8 * st;
      pipe::wait(bar_vempty + 8 * st, (empty_bits >> (16 + st)) & 1u);
      empty_bits ^= 1u << (16 + st);
      tma::arrive_expect(vfull, Tr::kKVBytes);
    }
    if constexpr (Tr::kFp8) {  // V^T: one copy per 128 keys, all head_dim rows
#pragma unroll
      for (int c = 0; c < BN / 128; ++c)
        tma::load_4d(kv + Tr::kKVBytes + c * (D * 128), maps + 2, vfull, tma_v.row + n0 + 128 * c, 0, tma_v.head,
                     tma_v.batch);
    } else if constexpr (!kVWithK) {
#pragma unroll
      for (int c = 0; c < kBlocks; ++c)
        tma::load_4d(kv + Tr::kKVBytes + c * (BN * 128), maps + 2, vfull, CB * c, tma_v.row + n0, tma_v.head,
                     tma_v.batch);
    }
    if constexpr (!Tr::kSplitKV) load_mask_tma(st, n0, full);
    if (++st == STAGES) st = 0;
  }
}

// PAGED with TMA (attn_prefill_wgmma on TMA traits), the producer warpgroup: the query tile by
// its 128 threads' cp.async (its rows pack a GQA group's heads, which no box of q's map spans),
// each thread's copies fenced for the async proxy before its warp's first arrival; then per key
// tile one box chunk a lane, as the TMA decode reads the pools (attention_decode_tma.cuh): chunk c
// (keys [n0 + c box, n0 + (c + 1) box), box = min(page size, BN) slots of one page) is lane c / 4's
// of warp c % 4, copied for every 64-wide column block of K and V through maps 0 (K) and 1 (V)
// over (head dim, slot, kv head, page). Why four warps: a copy's coordinates go through uniform
// registers, so a warp issues its lanes' copies one lane at a time (an ELECT loop, ~7
// instructions a copy); at pages of 16 that is 32 copies a tile, and issued by one warp they took
// the issue slots of the two consumer warps on its scheduler (pages of 16 ran 6% slower than
// pages of 64, with more time at the consumers' turn barrier; BENCHMARKS.md, thirty-third
// session). Spread over the four warps, each scheduler takes a quarter. A lane's page lookup for
// a tile is issued before the wait for the stage. Each warp arrives once on the stage's "full"
// barrier (4 arrivals), its lane 0 with the warp's bytes, before its lanes' copies. A chunk wholly
// past the sequence reads page -1 (out of the map: TMA fills zeros and still counts the bytes); a
// table entry is clamped into the pool (copy_v_rows reads its page itself).
// The sequence's last, partly filled page holds stale slots past its end (the pool is never
// cleared): its K ones need nothing (their scores become -inf), but its V ones must be zeros, as
// 0 * inf is NaN in P V; so the warp holding that chunk copies its V itself (16-byte loads, zeros
// past the end, the swizzled layout the boxes would write) and fences it before arriving.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::produce_tma_paged(unsigned sQ, const T* q, long long q_stride) {
  static_assert(PAGED && !Tr::kSplitKV && !Tr::kFp8 && Tr::kMaskBytes == 0 && Tr::kWarpgroups == 2,
                "paged TMA: 16-bit K/V, one ring, two consumer warpgroups (Mainloop::kConsumerRegs' 224)");
  constexpr int kBlocks = D / CB;
  const int tid = threadIdx.x - Tr::kConsumerThreads, lane = tid % 32, chunk = lane * 4 + tid / 32;
  const int box = min(page_size, BN), chunks = BN / box;  // the host's pages: powers of two from 16
  if (tid == 0) {
    tma::prefetch(maps);
    tma::prefetch(maps + 1);
  }
  // This lane's chunk of tile i: its page (-1 past the sequence), first slot and keys in range.
  int page = -1, slot = 0, valid = 0;
  const auto look = [&](int i) {
    const int key = tiles.n0(i) + chunk * box;
    page = -1, slot = 0, valid = 0;
    if (chunk < chunks && key < sk) {
      const int pi = key >> page_shift;
      page = static_cast<int>(pool_page(__ldg(pages + pi), num_pages));
      slot = key - (pi << page_shift);
      valid = min(box, sk - key);
    }
  };
  look(0);
  load_q<128>(sQ, q, q_stride, tid);
  wg::cp_async_commit();
  wg::cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  __syncwarp();
  int st = 0;
  unsigned empty_parity = 1;  // a fresh barrier's "previous" phase counts as complete
  for (int i = 0; i < n_tiles; ++i) {
    const int pg = page, sl = slot, nv = valid;
    if (i + 1 < n_tiles) look(i + 1);
    pipe::wait(bar_empty + 8 * st, empty_parity);
    const unsigned stage = sKV + st * Tr::kStageBytes, full = bar_full + 8 * st;
    const bool part = nv > 0 && nv < box;  // at most one lane of one warp: the chunk holding the end
    const unsigned tail = __ballot_sync(kFullMask, part);
    if (tail) {
      const int c_lane = __ffs(tail) - 1;
      copy_v_rows(stage + Tr::kKVBytes + __shfl_sync(kFullMask, chunk, c_lane) * box * 128,
                  __shfl_sync(kFullMask, pg, c_lane), __shfl_sync(kFullMask, sl, c_lane),
                  __shfl_sync(kFullMask, nv, c_lane), box, lane);
    }
    const unsigned bytes = chunk < chunks ? (part ? 1u : 2u) * kBlocks * box * 128 : 0u;
    const unsigned warp_bytes = __reduce_add_sync(kFullMask, bytes);
    if (lane == 0) tma::arrive_expect(full, warp_bytes);
    __syncwarp();
    if (chunk < chunks) {
      const unsigned kv = stage + chunk * box * 128;
#pragma unroll
      for (int c = 0; c < kBlocks; ++c) {
        tma::load_4d(kv + c * (BN * 128), maps, full, CB * c, sl, tma_k.head, pg);
        if (!part) tma::load_4d(kv + Tr::kKVBytes + c * (BN * 128), maps + 1, full, CB * c, sl, tma_k.head, pg);
      }
    }
    if (++st == STAGES) st = 0, empty_parity ^= 1;
  }
}

// The warp's copy of `rows` slots of V from slot `slot` of page `page` into the stage's V tile at
// shared address `dst` (its first row; `box` rows), rows past `rows` and columns past head_dim
// zero, in the 128-byte swizzle the wgmma descriptors read; then fenced for the async proxy.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::copy_v_rows(unsigned dst, int page, int slot, int rows, int box,
                                                                 int lane) const {
  constexpr int kChunks = D / 8;  // 16-byte chunks a row
  const T* src = v + static_cast<long long>(page) * v_page + static_cast<long long>(slot) * v_stride;
  for (int e = lane; e < box * kChunks; e += 32) {
    const int r = e / kChunks, ch = e % kChunks;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows && ch * 8 < head_dim) x = __ldg(reinterpret_cast<const uint4*>(src + r * v_stride + ch * 8));
    const unsigned at = dst + (ch >> 3) * (BN * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
                 : "memory");
  }
  wg::fence_proxy_async_smem();
  __syncwarp();
}

// A mask tensor's tile for key tile n0 into stage st's mask slot: one copy per kMaskSwz-byte
// column block (MASK_BITS: one of the packed words), completing on `bar`.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::load_mask_tma(int st, int n0, unsigned bar) const {
  constexpr int MB = Tr::kMaskBytes, SWZ = Tr::kMaskSwz;
  if constexpr (Tr::kMaskBits)  // the packed words' box: BN / 32 words of BLOCK_M rows
    tma::load_4d(sMask + st * Tr::kMaskTileBytes, maps + 3, bar, n0 / 32, tma_m.row, tma_m.head, tma_m.batch);
  if constexpr (MB > 0)
#pragma unroll
    for (int c = 0; c < BN * MB / SWZ; ++c)
      tma::load_4d(sMask + st * Tr::kMaskTileBytes + c * kMaskBlockStride, maps + 3, bar, n0 + c * (SWZ / MB),
                   tma_m.row, tma_m.head, tma_m.batch);
}

// WS: the stages' barriers at `full` ("full" takes the 128 producer threads' arrivals, or with
// TMA one and then the bytes, PAGED with TMA one a producer warp; "empty" one per consumer warp,
// 8 * STAGES bytes later). Thread 0 initialises them and fences its inits (earlier ones too); the
// caller syncs the block.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::init_ring(unsigned full) {
  bar_full = full;
  bar_empty = full + 8 * STAGES;
  bar_vfull = full + 16 * STAGES;  // SPLIT_KV only
  bar_vempty = full + 24 * STAGES;
  v_bits = 0;
  if (threadIdx.x == 0) {
    for (int st = 0; st < STAGES; ++st) {
      pipe::init(bar_full + 8 * st, Tr::kTma ? (PAGED ? 4 : 1) : 128);
      pipe::init(bar_empty + 8 * st, Tr::kConsumerThreads / 32);
      if constexpr (Tr::kSplitKV) {
        pipe::init(bar_vfull + 8 * st, 1);
        pipe::init(bar_vempty + 8 * st, Tr::kConsumerThreads / 32);
      }
    }
    pipe::init_fence();
  }
}

// The mask tensor on key tile n0 in S's register layout, raw (FastMods::pair_at): an f32 mask's
// values in mt, a bool or 16-bit mask's pair words in mw (index 2 i + h); nothing past the ends
// is read.
// A packed bool mask (FastMods::kBits): row half h's word in mw[h], this thread's keys of the tile
// (mask_bits.cuh: word t of the tile's 128-key group holds lane t's keys, key 8 i + 2 t + e at bit
// 2 i + e; a 64-key tile is the group's low or high 16 bits, shifted down), from the stage
// (MASK_BITS) or else straight from global memory (L2: the packed mask of a 16k x 16k call is 32
// MiB; no ring space, the dense ring's stages stay as deep); zeros for rows past the ends.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::gather_mask(float (&mt)[S_REGS], unsigned (&mw)[BN / 4],
                                                                 int n0) const {
  if constexpr (FastMods<Mods>::kBits) {
    static_assert(BN == 64 || BN == 128, "packed mask: 64- or 128-key tiles (n0 a multiple of BN)");
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned x;
      if constexpr (Tr::kMaskBits) {
        // The stage's words (AttnFwdWgmmaTraits::kMaskBits): row r's group at r * 16. Rows before
        // 0 or past the end arrived as zeros (a mask broadcast over the rows: copies of its row).
        const char* tile = reinterpret_cast<const char*>(mask_smem) + stage * Tr::kMaskTileBytes;
        x = *reinterpret_cast<const unsigned*>(tile + (row_a - m0 + 8 * h) * 16 + 4 * t);
      } else {
        const int row = row_a + 8 * h;
        const unsigned* at = reinterpret_cast<const unsigned*>(mods.mask) + row * mods.m_sq + n0 / 128 * 4 + t;
        // past the end, or before 0 (kBottomAlign)
        x = static_cast<unsigned>(row) < static_cast<unsigned>(sq) ? __ldg(at) : 0u;
      }
      if constexpr (BN == 64) x = (n0 & 64 ? x >> 16 : x) & 0xffffu;
      mw[h] = x;
    }
  } else if constexpr (Tr::kTma && Tr::kMaskBytes > 0) {
    // The swizzled tile (AttnFwdWgmmaTraits): byte w of row r's column block sits in 16-byte
    // chunk (w / 16) ^ ((r * SWZ / 128) % (SWZ / 16)) of the row; a MASK_ROW row is row 0.
    constexpr int MB = Tr::kMaskBytes, SWZ = Tr::kMaskSwz, blk = kMaskBlockStride;
    const char* tile = reinterpret_cast<const char*>(mask_smem) + stage * Tr::kMaskTileBytes;
    if constexpr (MB == 2 && !Tr::kMaskRowOnly) {
      // 16-bit words: an 8 x 8 block of the tile (8 rows, keys 8 i .. 8 i + 7: one 16-byte chunk
      // a row) is what ldmatrix hands out in the accumulator's layout (lane 4 g + t: row g, keys
      // 2 t, 2 t + 1). So one ldmatrix.x4 gives four words (n8 blocks 2 q, 2 q + 1, row halves
      // 0, 1), where a word a load took four; lane l names row l % 8 of block l / 8.
      const int lane = threadIdx.x % 32, m = lane >> 3;
      const int r = row_a - m0 - lane / 4 + 8 * (m & 1) + (lane & 7);
      const char* row = tile + r * SWZ;
      const int x = (r * SWZ >> 7) & (SWZ / 16 - 1);
#pragma unroll
      for (int q = 0; q < BN / 16; ++q) {
        const int w = (2 * q + (m >> 1)) * 16;  // the block's chunk in the tile row
        unsigned quad[4];
        ldmatrix_x4(quad, row + (w / SWZ) * blk + ((((w % SWZ) >> 4) ^ x) << 4));
#pragma unroll
        for (int e = 0; e < 4; ++e) mw[4 * q + e] = quad[e];
      }
      return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = Tr::kMaskRowOnly ? 0 : row_a - m0 + 8 * h;
      const int x = (r * SWZ >> 7) & (SWZ / 16 - 1);
      const char* row = tile + r * SWZ;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        const int w = (i * 8 + 2 * t) * MB;  // the pair's byte in the tile row
        const int wb = w % SWZ;
        mods.pair_at(row + (w / SWZ) * blk + (((wb >> 4) ^ x) << 4) + (wb & 15), mt[4 * i + 2 * h],
                     mt[4 * i + 2 * h + 1], mw[2 * i + h]);
      }
    }
  } else if constexpr (Tr::kMaskBytes > 0) {
    if (!staged) {
      gather_in_place(mt, mw, n0);
      return;
    }
    const char* at = reinterpret_cast<const char*>(mask_smem) + stage * Tr::kMaskTileBytes +
                     (row_a - m0) * Tr::kMaskRow + 2 * t * Tr::kMaskBytes;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        mods.pair_at(at + h * 8 * Tr::kMaskRow + i * 8 * Tr::kMaskBytes, mt[4 * i + 2 * h], mt[4 * i + 2 * h + 1],
                     mw[2 * i + h]);
  } else {
    gather_in_place(mt, mw, n0);
  }
}

// gather_mask from the mask tensor itself (its tiles not staged).
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::gather_in_place(float (&mt)[S_REGS], unsigned (&mw)[BN / 4],
                                                                     int n0) const {
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = n0 + i * 8 + 2 * t, row = row_a + h * 8;
      mods.pair_in_place(row, key, row < sq && key < sk, row < sq && key + 1 < sk, mt[4 * i + 2 * h],
                         mt[4 * i + 2 * h + 1], mw[2 * i + h]);
    }
}

}  // namespace pyattn

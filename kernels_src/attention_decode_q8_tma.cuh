// Decode over a paged 8-bit cache (int8 / fp8 e4m3 codes, fp32 scales per token, or per page and
// channel for keys) with its ring filled by a producer warp (sm_90a, issue 12).
//
// attn_decode_q8's consumers (decode_q8_stage.cuh) plus producer warps, the last, as
// attn_decode16_tma does for 16-bit caches. The cp.async kernel's consumers issued their own
// copies: page lookups, addresses and 16-byte copies for every row, then a block-wide barrier per
// stage. That kept the 8-bit kernel at 57-62% of the copy rate, latency-bound with one chain of
// conversions and MMAs per warp. Here the consumers only wait on a stage's mbarrier.
//  * Codes: the K and V pools as tensor maps (head dim, slot, kv head, page; uint8), boxes of 128
//    columns (one 128-byte swizzle row) x min(page size, BLOCK_N) slots of one page, written as
//    [D / 128][BLOCK_N][128] per stage with the 128-byte swizzle. The consumers read that layout
//    through q8_chunk_at<Tr, true>; K's head-dim order is chosen so that the two rows a phase reads
//    hit 8 distinct bank groups (q8_kchunk<true>).
//  * Scales: fp32 per (slot, kv head), with the kv heads innermost in the cache (a box of one
//    head's slots would be 4 bytes wide, under TMA's 16). Each producer lane copies scales of
//    keys lane, lane + 32, ... with 4-byte cp.async (the page from the lane that looked it up, by a
//    shuffle) and has the stage's full barrier count one arrival when they land
//    (cp.async.mbarrier.arrive.noinc): the barrier expects 32 such arrivals and the 32 lanes'
//    expect-tx arrivals.
//  * Per-channel keys (Traits::kKeyChannel): no per-token K scales; each 16-key segment's page record
//    (SegRec: header, r[head_dim], the segment's kept values) comes by one bulk copy of lane 2 sg,
//    or two (lanes 2 sg and 2 sg + 1) where the segment's kept values do not follow r in the pool
//    (16-byte multiples), on the same barrier.
// Keys a box does not hold (past the block's range in its last tile, or slots of the last page past
// the sequence) may be stale pool memory: their scales are zero-filled, their scores masked to -inf,
// and each consumer warp zeroes its own V code rows there before P V (0 x a NaN code is NaN).
// Requires decode_q8_stage.cuh, decode_q8_swap.cuh, attention_decode_q8.cuh (cp_async_4), attention_decode_tma.cuh
// (ProducerChunks), tma.cuh and mbarrier.cuh.
#pragma once
#include "mbarrier.cuh"
#include "tma.cuh"

namespace pyattn {

// A producer warp: its tiles of the block's range (ProducerChunks::each_tile), S stages ahead of
// the consumers. Each lane looks its box chunk's page up (ProducerChunks, attention_decode_tma.cuh),
// copies the scales of its keys, then issues its chunk's boxes of K and V codes.
template <class Tr>
__device__ __forceinline__ void decode_produce_q8(unsigned char* sK, unsigned char* sV, float* sKs, float* sVs,
                                                  unsigned char* sSeg, const DecodeParams& p, const DecodeBlock<Tr>& blk,
                                                  unsigned full0, unsigned empty0) {
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, S = Tr::kStages, H = D / 128, SEGS = KB / 16;
  constexpr bool KC = Tr::kKeyChannel;
  const ProducerChunks<Tr> pc(p);
  const int lane = pc.lane, box = pc.box, box_shift = __ffs(box) - 1;  // box is a power of two
  const unsigned chunk_bytes = 2u * H * 128 * box;  // K and V codes, whole boxes
  const long long head_k = static_cast<long long>(blk.kv_head) * p.ks_stride_h;
  const long long head_v = static_cast<long long>(blk.kv_head) * p.vs_stride_h;
  pc.each_tile(p, blk, full0, empty0, [&](int st, int n0, unsigned full, bool mine, long long page, int slot) {
#pragma unroll
    for (int m = 0; m < (KB + 31) / 32; ++m) {
      const int i = lane + 32 * m;  // the stage's key
      const int c = (i >> box_shift) & 31;
      const long long pg = __shfl_sync(kFullMask, page, c);
      const int sl = __shfl_sync(kFullMask, slot, c) + (i & (box - 1));
      const bool ok = i < KB && n0 + i < blk.end;  // then chunk c is mine on lane c
      const long long at = pg * p.ks_stride_page + sl * p.ks_stride_slot;
      const long long av = pg * p.vs_stride_page + sl * p.vs_stride_slot;
      if (i < KB) {
        if (!KC) cp_async_4(sKs + st * KB + i, ok ? p.k_scale + at + head_k : p.k_scale, ok);
        cp_async_4(sVs + st * KB + i, ok ? p.v_scale + av + head_v : p.v_scale, ok);
      }
    }
    pipe::cp_async_arrive(full);  // one arrival when this lane's scales have landed
    // Per-channel keys: each 16-key segment's page record (SegRec, decode_q8_ring.cuh) in two bulk
    // copies, lanes 2 sg (header and r[head_dim]) and 2 sg + 1 (the segment's 16 slots of kept
    // values), or in one copy by lane 2 sg where the record's layout is the ring's (the segment
    // starts its page and head_dim fills the bucket: every segment at page 16, d = 128). A segment
    // without keys is not copied (its scores are masked). Why one copy where it can: each TMA
    // operation costs the stage; at page 16 one copy a segment instead of two took the per-channel
    // decode from 0.85-0.91x to 0.91-0.93x the per-token one, and no copies at all (a timing test)
    // gave 1.00-1.02x; 16-byte cp.async chunks in their place, 0.85-0.89x (H200, B1-B64 x 32k;
    // BENCHMARKS.md, forty-fourth session).
    unsigned seg_bytes = 0;
    const unsigned char* seg_src = nullptr;
    unsigned seg_dst = 0;
    if constexpr (KC) {
      const int sg = lane >> 1, key = 16 * sg, c = (key >> box_shift) & 31;
      const long long pg = __shfl_sync(kFullMask, page, c);
      const int sl0 = __shfl_sync(kFullMask, slot, c) + (key & (box - 1));
      if (sg < SEGS && n0 + key < blk.end) {
        const unsigned char* rec = reinterpret_cast<const unsigned char*>(p.k_scale) +
                                   (pg * p.ks_stride_page + blk.kv_head * p.ks_stride_h) * 4;
        const bool kept = lane & 1, whole = sl0 == 0 && p.head_dim == D;
        seg_bytes = whole ? (kept ? 0u : unsigned(SegRec<D>::kBytes))
                          : kept ? 16 * kKeptChannels * 2 : 16 + 2 * p.head_dim;
        seg_src = rec + (kept ? 16 + 2 * p.head_dim + sl0 * kKeptChannels * 2 : 0);
        seg_dst = smem_addr(sSeg + (st * SEGS + sg) * SegRec<D>::kBytes + (kept ? SegRec<D>::kKept : 0));
      }
    }
    tma::arrive_expect(full, (mine ? chunk_bytes : 0u) + seg_bytes);
    if (KC && seg_bytes) tma::load_bulk(seg_dst, seg_src, seg_bytes, full);
    if (mine) pc.load8(smem_addr(sK), smem_addr(sV), st, full, slot, blk.kv_head, page);
  });
}

// The producer warps' other mode (Traits::kGather), for pages that TMA boxes do not take (under 16
// slots or not a power of two; no tensor maps then): the stage's rows gathered with cp.async into
// the same ring layout, [D / 128][BLOCK_N][128] with the 128-byte swizzle (16-byte chunk c of ring
// row r at chunk c ^ (r % 8): the ring starts on a 1024-byte boundary, as TMA's swizzle assumes),
// completing on the stage's full barrier by each lane's cp.async arrival. Why producers and not the
// cp.async kernel (attn_decode), whose consumers copy their own rows: there a warp's copies, lookups
// and barrier wait in line with its MMAs, and the 8-bit kernel read pages of 1 and 8 slots at
// 2.4 TB/s against this ring's 4.1 at page 16. One producer warp issuing every row's copies was
// slower still (2.1 TB/s); the rows' producers (DecodeTile.gather: 4 warps of 16-key stages with
// swapped roles, 2 with m16 rows) reach 3.6 (H200, int8 B8 x 32k; sixty-second session). Lane l looks
// up the entries of the stage's rows l, l + 32, ... (in flight together, before the stage is free),
// copies their scales, then each warp-wide copy takes 4 rows x 8 chunks, whole 128-byte lines, each
// row's entry from the lane that looked it up. Per-token key scales only (per-channel ones need
// pages of 16 slots).
template <class Tr>
__device__ __forceinline__ void decode_gather_q8(unsigned char* sK, unsigned char* sV, float* sKs, float* sVs,
                                                 const DecodeParams& p, const DecodeBlock<Tr>& blk, unsigned full0,
                                                 unsigned empty0) {
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, S = Tr::kStages, H = D / 128, R = KB / 32;
  static_assert(!Tr::kKeyChannel && KB % 32 == 0, "gathered rows: per-token scales, whole rows a lane");
  const int lane = threadIdx.x % 32, first = Tr::kProducer > 1 ? threadIdx.x / 32 - Tr::kWarps : 0;
  const long long head_k = static_cast<long long>(blk.kv_head) * p.ks_stride_h;
  const long long head_v = static_cast<long long>(blk.kv_head) * p.vs_stride_h;
  const unsigned char* gk = static_cast<const unsigned char*>(p.k) + blk.kv_head * p.k_stride_h + (lane % 8) * 16;
  const unsigned char* gv = static_cast<const unsigned char*>(p.v) + blk.kv_head * p.v_stride_h + (lane % 8) * 16;
  for (int j = first; j < blk.n_tiles; j += Tr::kProducer) {
    const int st = j % S, n0 = blk.n_first + j * KB;
    int entry[R], slot[R];
    stage_entries(p, blk.pages, blk.end, [&](int m) { return n0 + lane + 32 * m; }, entry, slot);
    if (j >= S) pipe::wait(empty0 + 8 * st, ((j / S) - 1) & 1);  // the consumers are done with tile j - S
    const unsigned full = full0 + 8 * st;
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = lane + 32 * m;
      const bool ok = n0 + i < blk.end;
      const long long pg = pool_page(entry[m], p.num_pages);
      cp_async_4(sKs + st * KB + i, ok ? p.k_scale + pg * p.ks_stride_page + slot[m] * p.ks_stride_slot + head_k
                                       : p.k_scale, ok);
      cp_async_4(sVs + st * KB + i, ok ? p.v_scale + pg * p.vs_stride_page + slot[m] * p.vs_stride_slot + head_v
                                       : p.v_scale, ok);
    }
#pragma unroll
    for (int m = 0; m < R; ++m) {
      // Rows 32 m .. 32 m + 31, 4 a copy; not unrolled (unrolled, the stage's 32 copies added ~3000
      // instructions and ~0.8 s of compile time to every 8-bit TMA variant).
#pragma unroll 1
      for (int q = 0; q < 8; ++q) {
        const int from = 4 * q + lane / 8, r = 32 * m + from;  // the lane that looked ring row r up
        const int e = __shfl_sync(kFullMask, entry[m], from), sl = __shfl_sync(kFullMask, slot[m], from);
        const bool ok = n0 + r < blk.end;
        const long long pg = pool_page(e, p.num_pages);
        const long long ak = pg * p.k_stride_page + sl * p.k_stride_slot;
        const long long av = pg * p.v_stride_page + sl * p.v_stride_slot;
        const int dst = (st * H * KB + r) * 128 + (((lane % 8) ^ (r % 8)) << 4);
#pragma unroll
        for (int h = 0; h < H; ++h) {  // chunks past head_dim zero-filled (as the maps' bounds give them)
          const bool in = ok && h * 128 + (lane % 8) * 16 < p.head_dim;
          cp_async_16(sK + dst + h * KB * 128, in ? gk + ak + h * 128 : gk, in);
          cp_async_16(sV + dst + h * KB * 128, in ? gv + av + h * 128 : gv, in);
        }
      }
    }
    pipe::cp_async_arrive(full);  // one arrival when this lane's copies have landed
    pipe::arrive(full);           // and the one the TMA mode's expect-tx arrival makes
  }
}

template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void attn_decode_q8_tma(const DecodeParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles;
  constexpr int S = Tr::kStages, W = Tr::kWarps, NT = KW / 8, SEGB = SegRec<D>::kBytes;
  constexpr bool kMods = SOFTCAP || ALIBI, KC = Tr::kKeyChannel;
  // BLOCK_N a power of two (a box of min(page, BLOCK_N) slots then never straddles a page) of at
  // most 256 rows (a TMA box dimension's limit); 128-column boxes.
  static_assert(Tr::kProducer >= 1 && D % 128 == 0 && KB >= 16 && KB <= 256 && (KB & (KB - 1)) == 0,
                "producer warps, 128-column boxes, BLOCK_N a power of two in [16, 256]");
  static_assert(!KC || (KW % 16 == 0 && KB / 16 <= 16), "per-channel keys: whole segments per warp, a lane pair each");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * S];  // full[S], then empty[S]
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // the host's shared_bytes and this layout disagree
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [ROWS][kStride]
  // The ring from the first 1024-byte boundary past Q (the 128-byte swizzle repeats every 1024
  // bytes and TMA applies it by address; kSmemBytes holds the slack).
  const unsigned q_end = smem_addr(smem_raw) + Tr::kQBytes;
  unsigned char* sK = smem_raw + Tr::kQBytes + ((1024 - q_end % 1024) % 1024);  // [S][H][KB][128]
  unsigned char* sV = sK + S * KB * D;                                           // [S][H][KB][128]
  float* sKs = reinterpret_cast<float*>(sV + S * KB * D);                        // [S][KB]
  float* sVs = sKs + S * KB;                                                     // [S][KB]
  unsigned char* sSeg = reinterpret_cast<unsigned char*>(sVs + S * KB);  // [S][KB / 16] SegRec (per-channel keys)
  const unsigned full0 = smem_addr(bars), empty0 = full0 + 8 * S;

  const DecodeBlock<Tr> blk(p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < S; ++st) {
      pipe::init(full0 + 8 * st, 64);  // the producer's lanes: expect-tx arrivals and scale arrivals
      pipe::init(empty0 + 8 * st, W);  // one arrival per consumer warp
    }
    pipe::init_fence();
  }
  __syncthreads();  // the last block-wide barrier: a producer leaves when its copies are issued
  if (warp >= W) {
    if constexpr (Tr::kGather) {  // pages of 1-8 slots, or not a power of two: no boxes (no maps either)
      decode_gather_q8<Tr>(sK, sV, sKs, sVs, p, blk, full0, empty0);
    } else {
      decode_produce_q8<Tr>(sK, sV, sKs, sVs, sSeg, p, blk, full0, empty0);
    }
    return;
  }
  if constexpr (Tr::kSwap) {  // blocks of 8 rows: keys on the MMAs' M side (decode_q8_swap.cuh)
    q8s_consume<Tr, SOFTCAP, ALIBI>(p, blk, smem_raw, sK, sV, sKs, sVs, sSeg, full0, empty0);
    return;
  }

  load_q<Tr>(sQ, p, blk);
  cp_async_commit();
  const DecodeRows<MT, ALIBI> rows(p, blk.b, blk.kv_head, blk.r0, blk.n_rows, blk.kv_len);
  float acc[MT][D / 8][4];
  float row_max[MT][2], row_sum[MT][2];
  init_softmax_state<MT, D / 8>(acc, row_max, row_sum);
  const float sl2 = kMods ? 1.f : p.scale_log2;  // with modifiers s is final (log2 units) before the softmax
  if constexpr (KC) q8_zero_r_tails<Tr>(sSeg, p.head_dim);
  cp_async_wait<0>();
  decode_sync<Tr>();  // Q landed for every consumer warp
  unsigned qf[MT][D / 16][4];
  float row_inv[MT][2];
  q8_query_fragments<Tr, true>(sQ, qf, row_inv);
  float vref = 0.f;  // this warp's running V-scale reference (a power of two; 0: no key yet)
  __half* sQh = reinterpret_cast<__half*>(sQ);
  bool hi_rows[MT];  // whether row tile mi has real rows 8..15 (per-channel keys skip rescaling padding)
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) hi_rows[mi] = blk.r0 + mi * 16 + 8 < blk.n_rows;
  unsigned qs[KC ? MT : 1][KC ? D / 16 : 1][4];  // per-channel keys: Q fragments times a segment's r
  if constexpr (KC) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) qs[mi][ks][0] = qs[mi][ks][1] = qs[mi][ks][2] = qs[mi][ks][3] = 0u;
    decode_sync<Tr>();  // every warp has its fragments: the scaled query may replace Q
    if (warp == 0) q8_query_to_shared<Tr, true>(sQh, qf);
    decode_sync<Tr>();
  }

  for (int j = 0; j < blk.n_tiles; ++j) {
    const int wrow = warp * KW;  // this warp's first ring row
    const Q8TmaStage<Tr> ts(sK, sV, full0, blk, j, wrow);  // (decode_q8_swap.cuh)
    float s[MT][NT][4];
    if constexpr (KC) {
      q8_scores_channel<Tr, true>(ts.tK, sSeg + (ts.st * (KB / 16) + wrow / 16) * SEGB, wrow, qf, row_inv, hi_rows,
                                  sQh, qs, s);
    } else {
      q8_scores<Tr, true>(ts.tK, sKs + ts.st * KB, wrow, qf, row_inv, s);
    }
    if (kMods || !band_tile_full<KW>(blk.band, blk.qi_lo, blk.qi_hi, ts.n0, blk.kv_len))
      rows.template mask<NT, SOFTCAP>(s, p, blk.band, ts.n0 + 2 * t);
    q8_softmax_pv<Tr, true>(s, ts.tV, sVs + ts.st * KB, wrow, vref, acc, row_max, row_sum, sl2);
    ts.release(empty0, lane);
  }

  q8_unscale(acc, vref);
  decode_epilogue<Tr>(p, acc, row_max, row_sum, sl2, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, blk.n_rows);
}

}  // namespace pyattn

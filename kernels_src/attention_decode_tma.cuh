// Decode over a paged 16-bit cache with its ring filled by TMA (sm_90a, issue 12).
//
// The block of attn_decode16 (attention_decode.cuh) plus producer warps, the last. A stage of
// BLOCK_N keys is copied in chunks of box_rows = min(page size, BLOCK_N) slots of one page, a power
// of two >= 16 (smaller or odd pages: decode_gather16's rows, up to 8 query rows a KV head, else the
// cp.async kernel). Lane c of a producer
// looks up chunk c's page and copies it; the bytes complete on the stage's "full" mbarrier, and
// each consumer warp hands the stage back on its "empty" one. Shared memory: Q padded as in
// attn_decode16, then per stage K and V as [BLOCK_N / 16][head_dim / 64][16][64] elements (16 keys'
// column blocks side by side), 128-byte swizzled (16-byte chunk c of row r at c ^ r % 8), so the
// consumers' ldmatrix reads are conflict-free. The copies (pyattn.ops._decode.pool_maps puts the
// maps in device memory, p.tmaps; any NHD / HND strides):
//  * head_dim the bucket's (every column block whole): per kv head, K and V maps (64 columns, 16
//    slots, column block, slot / 16, page), so ONE box takes a chunk's rows whole. A 16-bit stage
//    at d = 128 and page 16 then takes 8 TMA operations instead of 16: H200, bf16, GQA 32 / 8, q_len 1
//    1-1.6% faster, two row tiles (one block an SM) 7% (BENCHMARKS.md, forty-fifth session; the
//    unit's per-operation cost paces the ring, forty-fourth).
//  * a narrower head_dim (e.g. 112 in the 128 bucket): the pools' maps (head dim, slot, kv head,
//    page), a box of 64 columns x 16 slots per column block and 16 keys, whose columns past head_dim
//    arrive as zeros (a whole-block map would read the next head's columns, or past the pool).
//
// Why not one bulk copy per key row (cp.async.bulk, no map, 256 bytes a row at d = 128): measured
// on an H200 at 1.8 TB/s, half the cp.async kernel's rate: TMA operations that small are paced by
// the unit's per-operation cost, so the rows must be gathered into page boxes (2 KiB at page 16).
//
// Rows a box does not hold (keys past the block's range in its last tile, or slots of the last
// page past the sequence) may be stale or never-written pool memory: the scores of those keys
// become -inf, and each consumer warp zeroes its own V rows there before P V (0 x NaN is NaN).
// Blocks of at most 8 query rows (Traits::kSwap, the attn_decode_swap family) run consumers with the
// MMA roles swapped, keys on M (decode16s_*, below; decode_swap.cuh); the producer is the same.
// Requires attention_decode.cuh (decode16_stage), tma.cuh and mbarrier.cuh.
#pragma once
#include "mbarrier.cuh"
#include "tma.cuh"
#include "decode_swap.cuh"

namespace pyattn {

// A producer lane's share of a ring stage, for both TMA-fed decodes (this file and
// attention_decode_q8_tma.cuh): lane c takes box chunk c of the tile, rows c * box .. of box = min(page
// size, BLOCK_N) slots, all in one page. Lane 0 prefetches the block's two tensor maps. With
// Tr::kProducer warps, producer i takes tiles i, i + kProducer, ...: one warp's serial page lookups
// and copy issues paced the bf16 ring (two: -1.3% at B8 x 32k, BENCHMARKS.md, forty-fifth session).
template <class Tr>
struct ProducerChunks {
  const TmaMap* maps;  // this block's K map, then its V map
  int lane, box, chunks, first;  // first: this producer's first tile
  __device__ __forceinline__ explicit ProducerChunks(const DecodeParams& p, int map0 = 0)
      : maps(static_cast<const TmaMap*>(p.tmaps) + map0), lane(threadIdx.x % 32), box(min(p.page_size, Tr::kBlockN)),
        chunks(Tr::kBlockN / box), first(Tr::kProducer > 1 ? threadIdx.x / 32 - Tr::kWarps : 0) {
    if (lane == 0) {
      tma::prefetch(maps);
      tma::prefetch(maps + 1);
    }
  }
  // Whether this lane's chunk of the tile whose first key is n0 holds keys of the block's range (a
  // lane past it never looks up a page-table entry past the sequence's pages), and then its page
  // and first slot (else 0, 0).
  __device__ __forceinline__ bool find(const DecodeParams& p, const DecodeBlock<Tr>& blk, int n0, long long& page,
                                       int& slot) const {
    const bool mine = lane < chunks && n0 + lane * box < blk.end;
    slot = 0;
    page = mine ? key_page(p, blk.pages, n0 + lane * box, slot) : 0;
    return mine;
  }
  // A producer's ring loop over its tiles of the block's range, S stages ahead of the consumers:
  // each tile's chunk is looked up before waiting for its stage to be free (the lookup's latency
  // then overlaps the wait), then body(st, n0, full, mine, page, slot) fills the stage.
  template <class F>
  __device__ __forceinline__ void each_tile(const DecodeParams& p, const DecodeBlock<Tr>& blk, unsigned full0,
                                            unsigned empty0, F&& body) const {
    constexpr int KB = Tr::kBlockN, S = Tr::kStages;
    for (int j = first; j < blk.n_tiles; j += Tr::kProducer) {
      const int st = j % S, n0 = blk.n_first + j * KB;
      long long page;
      int slot;
      const bool mine = find(p, blk, n0, page, slot);
      if (j >= S) pipe::wait(empty0 + 8 * st, ((j / S) - 1) & 1);  // the consumers are done with tile j - S
      body(st, n0, full0 + 8 * st, mine, page, slot);
    }
  }
  // Copy this lane's chunk (slots [slot, slot + box) of `page`) of 8-bit K and V codes into stage
  // st, laid out [stage][128-byte column block][BLOCK_N rows][128 bytes] from the shared addresses sK /
  // sV of stage 0: one box of 128 codes per column block.
  __device__ __forceinline__ void load8(unsigned sK, unsigned sV, int st, unsigned full, int slot, int kv_head,
                                        long long page) const {
    constexpr int KB = Tr::kBlockN, H = Tr::kHeadDim / 128;
    const unsigned off = (st * H * KB + lane * box) * 128;
    const int pg = static_cast<int>(page);
#pragma unroll
    for (int h = 0; h < H; ++h) {
      tma::load_4d(sK + off + h * KB * 128, maps, full, h * 128, slot, kv_head, pg);
      tma::load_4d(sV + off + h * KB * 128, maps + 1, full, h * 128, slot, kv_head, pg);
    }
  }
  // The same for 16-bit K and V, laid out [stage][BLOCK_N / 16][H][16 rows][128 bytes] (see the
  // file's head): `whole`, the kv head's maps, one box a chunk; else the pools' maps, a box per 16
  // rows and column block.
  __device__ __forceinline__ void load16(unsigned sK, unsigned sV, int st, unsigned full, int slot, int kv_head,
                                         long long page, bool whole) const {
    constexpr int KB = Tr::kBlockN, H = Tr::kHeadDim / 64;
    const unsigned off = (st * KB + lane * box) * H * 128;
    const int pg = static_cast<int>(page);
    if (whole) {
      tma::load_5d(sK + off, maps, full, 0, 0, 0, slot >> 4, pg);
      tma::load_5d(sV + off, maps + 1, full, 0, 0, 0, slot >> 4, pg);
      return;
    }
    for (int g = 0; g < box; g += 16)
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const unsigned at = off + (g * H + h * 16) * 128;
        tma::load_4d(sK + at, maps, full, h * 64, slot + g, kv_head, pg);
        tma::load_4d(sV + at, maps + 1, full, h * 64, slot + g, kv_head, pg);
      }
  }
};

// A producer warp (ProducerChunks::each_tile): each lane arrives on the full barrier with its
// chunk's bytes (the barrier counts 32 arrivals), then copies it.
template <class Tr>
__device__ __forceinline__ void decode_produce_tma(typename Tr::T* sK, typename Tr::T* sV, const DecodeParams& p,
                                                   const DecodeBlock<Tr>& blk, unsigned full0, unsigned empty0) {
  constexpr int H = Tr::kHeadDim / 64;
  const bool whole = p.head_dim == Tr::kHeadDim;  // the host gave each kv head its maps (load16)
  const ProducerChunks<Tr> pc(p, whole ? 2 * blk.kv_head : 0);
  const unsigned chunk_bytes = 2u * H * 64 * pc.box * sizeof(typename Tr::T);  // K and V, whole boxes
  pc.each_tile(p, blk, full0, empty0, [&](int st, int, unsigned full, bool mine, long long page, int slot) {
    tma::arrive_expect(full, mine ? chunk_bytes : 0u);
    if (mine) pc.load16(smem_addr(sK), smem_addr(sV), st, full, slot, blk.kv_head, page, whole);
  });
}

// The producer warps' other mode (Traits::kGather): the stage's rows gathered with cp.async into the
// same swizzled boxes, for pages TMA boxes do not take (as attention_decode_q8_tma.cuh's
// decode_gather_q8 does for 8-bit rows; no tensor maps). Lane l looks up rows l, l + 32, ...; each
// warp-wide copy takes 4 lines of 128 bytes (a row's column block: 8 lanes, a 16-byte chunk each),
// the row's entry from the lane that looked it up; columns past head_dim are zero-filled. Each lane's
// cp.async arrival is its one arrival on the stage's full barrier.
template <class Tr>
__device__ __forceinline__ void decode_gather16(typename Tr::T* sK, typename Tr::T* sV, const DecodeParams& p,
                                                const DecodeBlock<Tr>& blk, unsigned full0, unsigned empty0) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, S = Tr::kStages, H = D / 64, R = KB / 32;
  static_assert(KB % 32 == 0 && (32 * H) % 4 == 0, "gathered rows: whole rows a lane, 4 lines a copy");
  const int lane = threadIdx.x % 32, chunk = lane % 8, first = Tr::kProducer > 1 ? threadIdx.x / 32 - Tr::kWarps : 0;
  const T* gk = static_cast<const T*>(p.k) + blk.kv_head * p.k_stride_h + chunk * 8;
  const T* gv = static_cast<const T*>(p.v) + blk.kv_head * p.v_stride_h + chunk * 8;
  for (int j = first; j < blk.n_tiles; j += Tr::kProducer) {
    const int st = j % S, n0 = blk.n_first + j * KB;
    int entry[R], slot[R];
    stage_entries(p, blk.pages, blk.end, [&](int m) { return n0 + lane + 32 * m; }, entry, slot);
    if (j >= S) pipe::wait(empty0 + 8 * st, ((j / S) - 1) & 1);  // the consumers are done with tile j - S
#pragma unroll
    for (int m = 0; m < R; ++m) {
#pragma unroll 1
      for (int q = 0; q < 8 * H; ++q) {  // lines (row, column block) of rows 32 m .. 32 m + 31, 4 a copy
        const int line = 4 * q + lane / 8, from = line / H, h = line % H, r = 32 * m + from;
        const int e = __shfl_sync(kFullMask, entry[m], from), sl = __shfl_sync(kFullMask, slot[m], from);
        const bool ok = n0 + r < blk.end && h * 64 + chunk * 8 < p.head_dim;
        const long long pg = pool_page(e, p.num_pages);
        const long long ak = pg * p.k_stride_page + sl * p.k_stride_slot + h * 64;
        const long long av = pg * p.v_stride_page + sl * p.v_stride_slot + h * 64;
        // swizzled_box_at's element offset of (r, 64 h + 8 chunk) in stage st
        const int dst = st * KB * D + (r >> 4) * (D * 16) + h * 1024 + (r & 15) * 64 + ((chunk ^ (r & 7)) << 3);
        cp_async_16(sK + dst, ok ? gk + ak : gk, ok);
        cp_async_16(sV + dst, ok ? gv + av : gv, ok);
      }
    }
    pipe::cp_async_arrive(full0 + 8 * st);  // this lane's arrival, when its copies have landed
  }
}

// Swapped roles (Traits::kSwap, decode_swap.cuh), one ring stage of one warp: S^T = K Q^T over its
// KW keys (tK, tV: its first key row in the stage's swizzled boxes; n0: that key), the masks and
// modifiers, the softmax and O^T += V^T P^T. K's A fragments are the rows-on-M kernel's ldmatrix
// loads of K with the two middle matrices swapped; V^T's are ldmatrix.trans of V in the order that
// kernel reads K.
template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void decode16s_stage(const unsigned (&qb)[Tr::kHeadDim / 16][2], const typename Tr::T* tK,
                                                const typename Tr::T* tV, int n0, const DecodeParams& p,
                                                const DecodeCols<ALIBI>& cols, const DecodeBlock<Tr>& blk, float sl2,
                                                float (&acc)[Tr::kHeadDim / 16][4], float (&cmax)[2],
                                                float (&csum)[2]) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KW = Tr::kKeysPerWarp, MK = KW / 16, DM = D / 16;
  constexpr int KG = DM % 4 == 0 ? 4 : 2, VG = DM % 8 == 0 ? 8 : DM % 4 == 0 ? 4 : 2;  // loads a batch
  constexpr bool kMods = SOFTCAP || ALIBI;
  const int lane = threadIdx.x % 32, g = lane / 4;
  // This lane's ldmatrix address in the stage's swizzled boxes (r0 from the warp's first row, a
  // multiple of 16; c0 a multiple of 8): lanes 8i .. 8i + 7 address matrix i, rows (lane & 7) +
  // 8 (lane >> 4), column c0 + 8 ((lane >> 3) & 1).
  const auto at = [&](const T* base, int r0, int c0) {
    return swizzled_box_at<D>(base, r0 + (lane & 7) + ((lane >> 4) << 3), c0 + ((lane >> 3) & 1) * 8);
  };
  float s[MK][4];
#pragma unroll
  for (int mk = 0; mk < MK; ++mk) {
    s[mk][0] = s[mk][1] = s[mk][2] = s[mk][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < DM; k0 += KG) {
      unsigned ka[KG][4];
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) ldmatrix_x4(ka[kk], at(tK, mk * 16, (k0 + kk) * 16));
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        const unsigned a[4] = {ka[kk][0], ka[kk][2], ka[kk][1], ka[kk][3]};
        mma_16816<T>(s[mk], a, qb[k0 + kk][0], qb[k0 + kk][1]);
      }
    }
  }
  if (kMods || !band_tile_full<KW>(blk.band, blk.qi_lo, blk.qi_hi, n0, blk.kv_len))
    cols.template mask<MK, SOFTCAP>(s, p, blk.band, n0 + g);
  swap_online_softmax<MK, DM>(s, acc, cmax, csum, sl2);
#pragma unroll
  for (int mk = 0; mk < MK; ++mk) {
    const unsigned b0 = movmatrix_trans(pack2<T>(s[mk][0], s[mk][1]));  // keys 2t, 2t + 1 x row g
    const unsigned b1 = movmatrix_trans(pack2<T>(s[mk][2], s[mk][3]));  // keys 2t + 8, 2t + 9
#pragma unroll
    for (int d0 = 0; d0 < DM; d0 += VG) {
      unsigned va[VG][4];
#pragma unroll
      for (int dp = 0; dp < VG; ++dp) ldmatrix_x4_trans(va[dp], at(tV, mk * 16, (d0 + dp) * 16));
#pragma unroll
      for (int dp = 0; dp < VG; ++dp) mma_16816<T>(acc[d0 + dp], va[dp], b0, b1);
    }
  }
}

// The consumer warps of attn_decode16_tma with swapped roles: from Q's load to the stored rows.
template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void decode16s_consume(const DecodeParams& p, const DecodeBlock<Tr>& blk,
                                                  unsigned char* smem_raw, const typename Tr::T* sK,
                                                  typename Tr::T* sV, unsigned full0, unsigned empty0) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, S = Tr::kStages, H = D / 64;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  T* sQ = reinterpret_cast<T*>(smem_raw);
  SwapWarp<Tr, ALIBI> w(p, blk, sQ, SOFTCAP || ALIBI);
  cp_async_wait<0>();
  decode_sync<Tr>();  // Q landed for every consumer warp
  unsigned qb[D / 16][2];  // Q^T's B fragments: row g, columns 16 kk + 2t.. and + 8
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x2(qb[kk], sQ + (lane & 7) * Tr::kStride + kk * 16 + ((lane >> 3) & 1) * 8);
  for (int j = 0; j < blk.n_tiles; ++j) {
    const int st = j % S, n0 = blk.n_first + j * KB + warp * KW;  // this warp's first key
    pipe::wait(full0 + 8 * st, (j / S) & 1);
    const T* tK = sK + (st * KB + warp * KW) * H * 64;  // the warp's first 16-key group
    T* tV = sV + (st * KB + warp * KW) * H * 64;
    tma::zero_rows_from<KW, H, 16, 16>(reinterpret_cast<unsigned char*>(tV), blk.end - n0);  // V rows past the keys
    decode16s_stage<Tr, SOFTCAP, ALIBI>(qb, tK, tV, n0, p, w.cols, blk, w.sl2, w.acc, w.cmax, w.csum);
    __syncwarp();
    if (lane == 0) pipe::arrive(empty0 + 8 * st);  // this warp's reads of the stage are done
  }
  // O^T element (tile dm, e): channel 16 dm + g + 8 (e >> 1), row 2t + (e & 1)
  swap_epilogue<Tr>(p, w.cmax, w.csum, w.sl2, smem_raw, blk, [&](float* row0, float* row1) {
#pragma unroll
    for (int dm = 0; dm < D / 16; ++dm) {
      row0[16 * dm + g] = w.acc[dm][0], row1[16 * dm + g] = w.acc[dm][1];
      row0[16 * dm + g + 8] = w.acc[dm][2], row1[16 * dm + g + 8] = w.acc[dm][3];
    }
  });
}

template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void attn_decode16_tma(const DecodeParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles;
  constexpr int S = Tr::kStages, W = Tr::kWarps, DT = D / 8, H = D / 64;
  constexpr bool kMods = SOFTCAP || ALIBI, kQRegs = kDecodeQRegs<Tr>;
  // BLOCK_N a power of two (a box of min(page, BLOCK_N) slots then never straddles a page) of at
  // most 256 rows (a TMA box dimension's limit).
  static_assert(Tr::kProducer >= 1 && D % 64 == 0 && KB >= 16 && KB <= 256 && (KB & (KB - 1)) == 0,
                "producer warps, 64-column boxes, BLOCK_N a power of two in [16, 256]");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * S];  // full[S], then empty[S]
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // the host's shared_bytes and this layout disagree
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [ROWS][kStride]
  // The ring from the first 1024-byte boundary past Q (the 128-byte swizzle repeats every 1024
  // bytes and TMA applies it by address; kSmemBytes holds the slack).
  const unsigned q_end = smem_addr(smem_raw) + Tr::kQBytes;
  T* sK = reinterpret_cast<T*>(smem_raw + Tr::kQBytes + ((1024 - q_end % 1024) % 1024));  // [S][KB / 16][H][16][64]
  T* sV = sK + S * H * KB * 64;                                                             // [S][KB / 16][H][16][64]
  const unsigned full0 = smem_addr(bars), empty0 = full0 + 8 * S;

  const DecodeBlock<Tr> blk(p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < S; ++st) {
      pipe::init(full0 + 8 * st, 32);  // the producer's lanes
      pipe::init(empty0 + 8 * st, W);  // one arrival per consumer warp
    }
    pipe::init_fence();
  }
  __syncthreads();  // the last block-wide barrier: a producer leaves when its copies are issued
  if (warp >= W) {
    if constexpr (Tr::kGather) {  // pages TMA boxes do not take: no maps
      decode_gather16<Tr>(sK, sV, p, blk, full0, empty0);
    } else {
      decode_produce_tma<Tr>(sK, sV, p, blk, full0, empty0);
    }
    return;
  }
  if constexpr (Tr::kSwap) {  // blocks of 8 rows: keys on the MMAs' M side (decode_swap.cuh)
    decode16s_consume<Tr, SOFTCAP, ALIBI>(p, blk, smem_raw, sK, sV, full0, empty0);
    return;
  }

  load_q<Tr>(sQ, p, blk);
  cp_async_commit();
  const DecodeRows<MT, ALIBI> rows(p, blk.b, blk.kv_head, blk.r0, blk.n_rows, blk.kv_len);
  float acc[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
  init_softmax_state<MT, DT>(acc, row_max, row_sum);
  const float sl2 = kMods ? 1.f : p.scale_log2;  // with modifiers s is final (log2 units) before the softmax
  cp_async_wait<0>();
  decode_sync<Tr>();  // Q landed for every consumer warp
  unsigned qf[kQRegs ? D / 16 : 1][4];
  decode16_q_fragments<Tr>(sQ, qf);

  for (int j = 0; j < blk.n_tiles; ++j) {
    const int st = j % S, n0 = blk.n_first + j * KB + warp * KW;  // this warp's first key
    pipe::wait(full0 + 8 * st, (j / S) & 1);
    T* tK = sK + (st * KB + warp * KW) * H * 64;  // the warp's first 16-key group
    T* tV = sV + (st * KB + warp * KW) * H * 64;
    tma::zero_rows_from<KW, H, 16, 16>(reinterpret_cast<unsigned char*>(tV), blk.end - n0);  // V rows past the keys
    decode16_stage<Tr, SOFTCAP, ALIBI, kQRegs, true>(sQ, qf, tK, tV, n0, p, rows, blk.band, blk.qi_lo, blk.qi_hi,
                                                     blk.kv_len, sl2, acc, row_max, row_sum);
    __syncwarp();
    if (lane == 0) pipe::arrive(empty0 + 8 * st);  // this warp's reads of the stage are done
  }

  decode_epilogue<Tr>(p, acc, row_max, row_sum, sl2, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, blk.n_rows);
}

}  // namespace pyattn

// The wgmma forward kernel's main loop (attention_fwd_wgmma.cuh has the design, the traits and
// the entry point): per key tile the QK^T wgmma, the score modifiers, the online softmax and the
// P V wgmma of one consumer warpgroup, plus the producer's side of the ring when warp-specialized.
// PAGED (attention_prefill_wgmma.cuh): K/V rows come through a sequence's page list, and a row of
// the query tile packs (token, GQA group member) as token * row_group + member, so the band is
// tested on tokens; TREE adds an ancestor bit mask over the last sq keys. Both compile away in
// the dense kernel.
// Requires pyattn::AttnFwdParams, common.cuh, mma.cuh (pack2, fast_exp2).
#pragma once
#include "attention_mask.cuh"
#include "block_sparse.cuh"
#include "wgmma.cuh"
#include "wgmma_paged_load.cuh"
#include "wgmma_pipe.cuh"
#include "tma.cuh"

namespace pyattn {

// Four floats -> one register of four e4m3 codes (b0 the lowest byte), rounded to nearest and
// saturated at +-448 (cvt puts its first source in the upper byte of a pair). sm_89 and later.
__device__ __forceinline__ unsigned pack4_e4m3(float b0, float b1, float b2, float b3) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n" : "=h"(lo) : "f"(b0), "f"(b1));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n" : "=h"(hi) : "f"(b2), "f"(b3));
  return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}

template <class Tr, class Mods, bool SPARSE, bool PAGED = false, bool TREE = false>
struct AttnFwdWgmmaMainloop {
  static_assert(!TREE || PAGED, "tree masks are a paged-prefill mode");
  static_assert(!(SPARSE && PAGED), "block-sparse lists index dense keys");
  using T = typename Tr::T;
  static constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN;
  static constexpr int STAGES = Tr::kStages, AHEAD = Tr::kLookahead;
  static constexpr bool OVERLAP = Tr::kOverlap;
  static constexpr int S_REGS = BN / 2;  // f32 accumulator registers per thread of a m64 x BN tile
  static constexpr int O_REGS = D / 2;
  static constexpr int KS = BN / Tr::kK;  // k steps of P V (k16; FP8 k32)
  static constexpr int CB = Tr::kColElems;  // elements of a 128-byte column block
  // How far (log2 units) a row's max may outgrow its softmax reference. FP8: not at all. P enters
  // P V as e4m3 codes (3 mantissa bits), and referred to the exact max the dominant key's P is 1,
  // exact; referred to a stale one it is up to 256 and rounds by up to 6%: measured 2.5x the error
  // of a naive fp8 attention, against 1.0x with the exact max (the fp8 GPU tests' bool-mask case,
  // bit for bit in a NumPy emulation of the kernel).
  static constexpr float kLazyLog2 = Tr::kFp8 ? 0.f : 8.f;
  // A bounded soft-cap (ScoreMods' SOFTCAP 2: bf16, cap <= 51, nothing added after it) needs no
  // row max: the scores are t = tanh(.) in [-1, 1], c = cap log2 e, and against the fixed reference
  // cref = min(c, 124 - c) every P = exp2(t c - cref) lies in [2^-124, 2^(2c - 124)] (at most 2^24),
  // normal in bf16 (fp32's exponent range): no row underflows and the sums stay finite (O overflows
  // fp32 only where |v| times the keys exceeds 2^104). That drops the max's FMNMX a score, its
  // shuffles and every O rescale. O is then normalised by sums from the tensor cores, P (as packed
  // for P V) times a k16 x n8 block of ones, one m64n8k16 wgmma a k16 step beside P V's: against a
  // fixed reference no P is exactly 1, and a sum of unrounded P beside P V's rounded weights puts
  // P's rounding (2^-9) into the output in full (one query and key, cap 0.5: twice the naive error;
  // BENCHMARKS.md, twentieth session), while the sum of the same rounded P cancels it. The LSE
  // keeps the fp32 sum of unrounded P: from the rounded one it was off by up to 2^-9 (the GPU
  // tests' bound is 1e-3). (An mma.sync for the rounded sum waits for the tensor core that the
  // other warpgroups' wgmmas hold: the dense kernel ran 7-13% slower with one; BENCHMARKS.md,
  // twenty-first session.) FP16's exponent range has no room for a fixed reference.
  static constexpr bool FIXED_REF = FastMods<Mods>::kCapScale && Mods::kCapBounded;
  static_assert(!FIXED_REF || (kIsBf16<T> && !PAGED), "a bounded soft-cap: bf16, the dense kernels (FwdSmem::ones)");
  // Per-warpgroup tile bounds: a warpgroup computes the key tiles up to the last its own 64 rows
  // can see, [0, wg_j1) of the block's, and only waits for and frees the rest (skip). The block's
  // band covers all its rows, so causal, on three warpgroups' 192 rows and 128-key tiles one or two
  // of them would run a tile of -inf scores a row block, and so would the first of two on 64-key
  // tiles; so too bottom-right bands with Sq != Sk and windows' right edges. Rows where that is
  // measured (against the tree without, H200; BENCHMARKS.md): three warpgroups in persistent
  // blocks (d = 64 below 2k keys: 1k causal -8%, non-causal unchanged; a warpgroup that is done
  // early goes on to the epilogue) and two on 64-key tiles without mask tiles (d = 192 / 256: causal
  // -2 to -4%). Left out: three a block a tile (d = 64 from 2k: causal within 1%, non-causal 16k
  // +2%: the last warpgroup's chain still sets the block's time) and two on 128-key tiles (they never
  // differ on a square causal call; 1-2% slower with the code). A window's left edge is not skipped
  // so: a leading loop of skips made ptxas duplicate the softmax (+40% instructions) and spill
  // (NVRTC 13.0).
  static constexpr bool WG_BOUNDS =
      Tr::kTma && !SPARSE && !PAGED &&
      ((Tr::kWarpgroups == 3 && Tr::kPersist) || (Tr::kWarpgroups == 2 && BN < 128 && Tr::kMaskBytes == 0));

  // -- invariant
  const T* k;
  const T* v;
  long long k_stride, v_stride;
  Band band;
  KeyTiles<BM, BN, SPARSE> tiles;  // the band's key tiles, or this query tile's block-sparse list
  unsigned sKV;                    // shared address of stage 0 (K; V kKVBytes later)
  unsigned long long q_desc, k_desc0, v_desc0;
  FastMods<Mods> mods;             // score modifiers (unused without)
  unsigned sMask;                  // shared address of stage 0's mask tile (stage s: + s * kMaskTileBytes)
  const unsigned char* mask_smem;  // the same as a generic pointer
  bool staged;                     // the mask tensor's tiles ride in the ring (else read in place)
  int m0, n_tiles, sq, sk, head_dim;
  int wg_j1;                       // WG_BOUNDS: this warpgroup's key tiles are [0, wg_j1) of the block's
  int wg_row0, row_a, t;           // warpgroup's first row; this thread's rows row_a, row_a + 8; lane % 4
  int sub_row;                     // this thread's row of 16 x 16 sub-blocks within the query tile
  float sl2;
  float cref;                      // FIXED_REF: the softmax's fixed reference (log2 units)
  unsigned long long ones_desc;    // FIXED_REF: the tile of ones (B of the row sums' wgmma)
  // -- running state
  float acc[O_REGS];
  float row_max[2], row_sum[2];
  float rsum[4];                   // FIXED_REF: rounded P's row sums, an m64n8 accumulator (rows g, g + 8)
  unsigned pf[KS][4];              // P of the previous tile as wgmma A fragments (OVERLAP; pack_p)
  int stage, prev_stage, load_stage;
  unsigned bar_full, bar_empty;    // WS: shared addresses of the stages' barriers (8 bytes apart)
  unsigned full_parity;            // WS: parity of the "full" phase the consumers wait for at `stage`
                                   // (PERSIST: bit s that of stage s)
  unsigned bar_vfull, bar_vempty;  // SPLIT_KV: the stages' V barriers (K's and the mask's: bar_full / bar_empty)
  unsigned v_bits;                 // SPLIT_KV: bit s the parity of stage s's V "full" phase to wait for
  unsigned bar_q_empty;            // PERSIST: the query tile's "empty" barrier (its "full" one 8 bytes before)
  int wgi;                         // this thread's consumer warpgroup
  // -- PAGED: the sequence's page list, the pools' page strides (k_stride / v_stride: slot
  // strides), query rows as (token, group member), this thread's rows' tokens, tree masks
  const int* pages;
  long long k_page, v_page, q_head_stride;
  int page_size, page_shift, row_group;
  int rows_per_page;               // slot strides per page stride (K's = V's: validate/serving.py)
  int tok[2];                      // tokens of rows row_a, row_a + 8
  int wg_tok0, wg_tok1;            // tokens of the warpgroup's first and last rows
  int tree_k0;                     // TREE: the first key of the tree (sk - sq tokens)
  unsigned long long tree_bits[2]; // TREE: ancestor bits of rows row_a, row_a + 8 (0 past the end)
  // -- Tr::kTma: the tensor maps of q, k, v (consecutive) and the box coordinates of the block's
  // query tile and of key row 0 (row, head, batch; the column is the 64-wide block's first)
  struct TmaAt {
    int row, head, batch;
  };
  const TmaMap* maps;              // tm_q, tm_k, tm_v and (with a mask tensor) tm_mask
  TmaAt tma_q, tma_k, tma_v, tma_m;  // tma_m: (query row, head, batch) of the mask's box

  // The token (band position) of this thread's row half h.
  __device__ __forceinline__ int token(int h) const {
    if constexpr (PAGED) return tok[h];
    return row_a + 8 * h;
  }
  // Whether key `key` (>= tree_k0 or not) is an ancestor-or-self of row half h's token.
  __device__ __forceinline__ bool tree_allows(int h, int key) const {
    if constexpr (TREE) return key < tree_k0 || ((tree_bits[h] >> (key - tree_k0)) & 1ull);
    return true;
  }

  // The query tile (rows [m0, m0 + BM)) into sQ, by NT threads.
  template <int NT>
  __device__ __forceinline__ void load_q(unsigned sQ, const T* q, long long q_stride, int tid) const {
    if constexpr (PAGED)
      wgmma_load_q_rows<Tr, BM, NT>(sQ, q, q_stride, q_head_stride, row_group, m0, sq, head_dim, tid);
    else
      wgmma_load_tile<Tr, BM, NT>(sQ, q, q_stride, m0, sq, head_dim, tid);
  }

  // Key tile at n_load (K, V and a staged mask tile) into ring stage `st`, by NT threads.
  template <int NT>
  __device__ __forceinline__ void load(int st, int n_load, int tid) {
    const unsigned kv = sKV + st * Tr::kStageBytes;
    if constexpr (PAGED) {  // all threads load (no producer warpgroup): look up, then copy
      PagedKVLoad<Tr, BN, NT> pl = paged_load<NT>(tid);
      pl.fetch(n_load, sk);
      pl.copy(kv, kv + Tr::kKVBytes, pl.take(), n_load, sk);
      return;
    }
    wgmma_load_tile<Tr, BN, NT>(kv, k, k_stride, n_load, sk, head_dim, tid);
    wgmma_load_tile<Tr, BN, NT>(kv + Tr::kKVBytes, v, v_stride, n_load, sk, head_dim, tid);
    if constexpr (Tr::kMaskBytes > 0)
      if (staged)
        wgmma_load_mask<Tr, NT>(sMask + st * Tr::kMaskTileBytes, mods.mask, mods.m_sq, m0, sq, n_load, sk, tid);
  }

  // PAGED: the K/V loader of NT threads, this one `tid`.
  template <int NT>
  __device__ __forceinline__ PagedKVLoad<Tr, BN, NT> paged_load(int tid) const {
    PagedKVLoad<Tr, BN, NT> pl;
    pl.init(k, v, k_stride, v_stride, k_page, v_page, pages, page_size, page_shift, rows_per_page, head_dim, tid);
    return pl;
  }

  // WS producer: Q and every key tile through the ring. A stage is reused once all consumer warps
  // released it; it is handed over once this thread's copies into it landed and were fenced for
  // the async proxy (each of the 128 producer threads arrives on "full"). PAGED: tile i + 1's page
  // lookups are issued before the wait for tile i's stage, so its copies never wait on them.
  __device__ __forceinline__ void produce(unsigned sQ, const T* q, long long q_stride, int tid) {
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
  __device__ __forceinline__ void produce_tma(unsigned sQ) {
    prefetch_maps();
    // A fresh barrier's "previous" phase counts as complete (bits 16 + s: SPLIT_KV's V barriers).
    unsigned empty_bits = ((1u << STAGES) - 1) * (Tr::kSplitKV ? 0x10001u : 1u);
    produce_tma_tiles(empty_bits, sQ, true);
  }

  __device__ __forceinline__ void prefetch_maps() const {
    tma::prefetch(maps + 1);
    tma::prefetch(maps + 2);
    if constexpr (Tr::kMaskBytes > 0) tma::prefetch(maps + 3);
  }

  // The query tile's copies (one per 128-byte column block), completing on `bar`.
  __device__ __forceinline__ void load_q_tma(unsigned sQ, unsigned bar) const {
#pragma unroll
    for (int c = 0; c < D / CB; ++c)
      tma::load_4d(sQ + c * (BM * 128), maps, bar, CB * c, tma_q.row, tma_q.head, tma_q.batch);
  }

  // The block's key tiles through the ring from stage 0; bit s of `empty_bits` is the phase of
  // stage s's "empty" barrier to wait for, bit 16 + s that of its V barrier with SPLIT_KV (carried
  // on to the next query tile of a persistent block, whose tile may end at any stage).
  // `q_with_tile0`: the query tile rides on tile 0's "full" barrier (a persistent block's has
  // barriers of its own).
  __device__ __forceinline__ void produce_tma_tiles(unsigned& empty_bits, unsigned sQ, bool q_with_tile0) {
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

  // A mask tensor's tile for key tile n0 into stage st's mask slot: one copy per kMaskSwz-byte
  // column block, completing on `bar`.
  __device__ __forceinline__ void load_mask_tma(int st, int n0, unsigned bar) const {
    constexpr int MB = Tr::kMaskBytes, SWZ = Tr::kMaskSwz;
    if constexpr (MB > 0)
#pragma unroll
      for (int c = 0; c < BN * MB / SWZ; ++c)
        tma::load_4d(sMask + st * Tr::kMaskTileBytes + c * kMaskBlockStride, maps + 3, bar, n0 + c * (SWZ / MB),
                     tma_m.row, tma_m.head, tma_m.batch);
  }

  // The wgmma descriptors of this warpgroup's query rows at sQ and of stage 0's K and V (128-byte
  // swizzle; K-major operands step 32 B per k step inside a 128-byte column block, then jump to
  // the next block; V is read MN-major, 16 keys = 2048 B per k16 step, LBO the distance between
  // its 64-dim blocks; FP8's V^T is K-major like K, its rows the head dims).
  __device__ __forceinline__ void make_descs(unsigned sQ) {
    q_desc = wg::make_desc_sw128(sQ + wgi * 64 * 128, 16, 1024);
    k_desc0 = wg::make_desc_sw128(sKV, 16, 1024);
    v_desc0 = wg::make_desc_sw128(sKV + Tr::kKVBytes, Tr::kFp8 ? 16 : BN * 128, 1024);
  }

  // WS: the stages' barriers at `full` ("full" takes the 128 producer threads' arrivals, or with
  // TMA one and then the bytes; "empty" one per consumer warp, 8 * STAGES bytes later). Thread 0
  // initialises them and fences its inits (earlier ones too); the caller syncs the block.
  __device__ __forceinline__ void init_ring(unsigned full) {
    bar_full = full;
    bar_empty = full + 8 * STAGES;
    bar_vfull = full + 16 * STAGES;  // SPLIT_KV only
    bar_vempty = full + 24 * STAGES;
    v_bits = 0;
    if (threadIdx.x == 0) {
      for (int st = 0; st < STAGES; ++st) {
        pipe::init(bar_full + 8 * st, Tr::kTma ? 1 : 128);
        pipe::init(bar_empty + 8 * st, Tr::kConsumerThreads / 32);
        if constexpr (Tr::kSplitKV) {
          pipe::init(bar_vfull + 8 * st, 1);
          pipe::init(bar_vempty + 8 * st, Tr::kConsumerThreads / 32);
        }
      }
      pipe::init_fence();
    }
  }

  // This thread's place in the block: its consumer warpgroup, quad lane and warp (warp w owns rows
  // [16 w, 16 w + 16) of the tile: its row of 16 x 16 sub-blocks).
  __device__ __forceinline__ void set_thread() {
    wgi = threadIdx.x / 128;
    t = threadIdx.x % 4;
    sub_row = threadIdx.x / 32;
  }

  // The rows of the query tile at m0_ this thread holds (row_a, row_a + 8), and its warpgroup's first.
  __device__ __forceinline__ void set_rows(int m0_) {
    wg_row0 = m0_ + wgi * 64;
    row_a = wg_row0 + (threadIdx.x % 128) / 32 * 16 + (threadIdx.x % 32) / 4;
  }

  // The softmax's scale of the scores (after mods.init): modified scores are in log2 units already,
  // except a soft-cap's alone, whose factor softcap * log2(e) the softmax applies (FastMods::kCapScale).
  __device__ __forceinline__ void set_sl2(float scale_log2) {
    sl2 = FastMods<Mods>::kCapScale ? mods.post : FastMods<Mods>::kScoresFinal ? 1.f : scale_log2;
    if constexpr (FIXED_REF) cref = fminf(sl2, 124.f - sl2);
  }

  // A query tile's running state before its first key tile: O, row maxima and sums.
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) acc[i] = 0.f;
    row_max[0] = row_max[1] = -inf();
    row_sum[0] = row_sum[1] = 0.f;
    if constexpr (FIXED_REF) rsum[0] = rsum[1] = rsum[2] = rsum[3] = 0.f;
  }

  // FIXED_REF: fill the 256-byte tile of ones at shared address `ones` (FwdSmem::ones) and make its
  // descriptor; before the block's barrier that precedes the first wgmma.
  __device__ __forceinline__ void init_ones(unsigned ones) {
    if constexpr (FIXED_REF) {
      if (threadIdx.x < 64) {
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ones + 4 * threadIdx.x), "r"(ones2<T>()) : "memory");
        wg::fence_proxy_async_smem();
      }
      ones_desc = wg::make_desc_plain(ones, 128, 128);
    }
  }

  // Pin the wgmma accumulators (O, and FIXED_REF's row sums) at this point in program order.
  __device__ __forceinline__ void fence_acc() {
    wg::fence_operands(acc);
    if constexpr (FIXED_REF) wg::fence_operands(rsum);
  }

  // FIXED_REF's reference as a row max (the LSE is row_max * sl2 + log2(sum)).
  __device__ __forceinline__ void finish_max() {
    if constexpr (FIXED_REF) row_max[0] = row_max[1] = cref / sl2;
  }

  // What O's row half h is divided by, given its whole fp32 row sum `sum`: FIXED_REF's sum of the
  // rounded P that weighed V, else `sum` itself.
  __device__ __forceinline__ float normaliser(int h, float sum) const {
    if constexpr (FIXED_REF) return rsum[2 * h];
    return sum;
  }

  // One arrival per consumer warp on `bar`, once every lane is done with what it guards.
  __device__ __forceinline__ static void arrive_warp(unsigned bar) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) pipe::arrive(bar);
  }

  // WS consumer: the wgmmas that read stage `st` are complete; one arrival per warp frees it
  // (SPLIT_KV: its V; release_k frees its K and mask tile once S is done).
  __device__ __forceinline__ void release(int st) const {
    if constexpr (Tr::kSplitKV)
      arrive_warp(bar_vempty + 8 * st);
    else if constexpr (Tr::kWS)
      arrive_warp(bar_empty + 8 * st);
  }
  __device__ __forceinline__ void release_k(int st) const {
    if constexpr (Tr::kSplitKV) arrive_warp(bar_empty + 8 * st);
  }
  // SPLIT_KV: wait until stage st's V tile landed.
  __device__ __forceinline__ void wait_v(int st) {
    if constexpr (Tr::kSplitKV) {
      pipe::wait(bar_vfull + 8 * st, (v_bits >> st) & 1u);
      v_bits ^= 1u << st;
    }
  }

  // TMA: the distance between a mask tile's column blocks (MASK_ROW: one block, the whole row
  // unswizzled; a mask broadcast over the query rows always comes so, never as a whole tile).
  static constexpr int kMaskBlockStride = (Tr::kMaskRowOnly ? 1 : BM) * Tr::kMaskSwz;

  // The mask tensor on key tile n0 in S's register layout, raw (FastMods::pair_at): an f32 mask's
  // values in mt, a bool or 16-bit mask's pair words in mw (index 2 i + h); nothing past the ends
  // is read.
  // A packed bool mask (FastMods::kBits): row half h's BN / 32 words of the tile in mw[BN / 32 * h + w],
  // one vector load each, straight from global memory (L2: the packed mask of a 16k x 16k call
  // is 32 MiB); zeros for rows past the end. No ring space: the dense ring's stages stay as deep.
  __device__ __forceinline__ void gather_mask(float (&mt)[S_REGS], unsigned (&mw)[BN / 4], int n0) const {
    if constexpr (FastMods<Mods>::kBits) {
      constexpr int W = BN / 32;
      static_assert(W == 2 || W == 4, "packed mask: 64- or 128-key tiles");
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_a + 8 * h;
        const unsigned* at = reinterpret_cast<const unsigned*>(mods.mask) + row * mods.m_sq + n0 / 32;
        if (row >= sq) {
#pragma unroll
          for (int w = 0; w < W; ++w) mw[W * h + w] = 0u;
        } else if constexpr (W == 4) {
          const uint4 x = __ldg(reinterpret_cast<const uint4*>(at));
          mw[4 * h] = x.x, mw[4 * h + 1] = x.y, mw[4 * h + 2] = x.z, mw[4 * h + 3] = x.w;
        } else {
          const uint2 x = __ldg(reinterpret_cast<const uint2*>(at));
          mw[2 * h] = x.x, mw[2 * h + 1] = x.y;
        }
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
  __device__ __forceinline__ void gather_in_place(float (&mt)[S_REGS], unsigned (&mw)[BN / 4], int n0) const {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = n0 + i * 8 + 2 * t, row = row_a + h * 8;
        mods.pair_in_place(row, key, row < sq && key < sk, row < sq && key + 1 < sk, mt[4 * i + 2 * h],
                           mt[4 * i + 2 * h + 1], mw[2 * i + h]);
      }
  }

  // Whether key 2 t + e of n8 block i in row half h is visible by a bool mask as gather_mask gave
  // it (and a packed one's words were shifted by 2 t in `step`): a compile-time bit of a word.
  __device__ __forceinline__ static bool mask_visible(const unsigned (&mw)[BN / 4], int i, int h, int e) {
    if constexpr (FastMods<Mods>::kBits) return mw[BN / 32 * h + i / 4] & (1u << (8 * (i % 4) + e));
    return mw[2 * i + h] & (e ? 0xff00u : 0xffu);
  }

  // P_j (S after the softmax) as the A fragments of P V.
  // 16-bit: n8 blocks 2kk and 2kk+1 of S form k16 step kk (the mma.m16n8k16 A layout, wgmma.cuh).
  // FP8: a k32 A fragment holds row g's k 4t..4t+3 (register 0) and 16+4t..16+4t+3 (register 2),
  // row g+8's in registers 1 and 3, while the accumulator gives lane t keys 2t, 2t+1 of each n8
  // block. Packing keys (2t, 2t+1, 2t+8, 2t+9) of each 16-key half as k 4t..4t+3 needs no shuffle
  // when V's rows come in the same order: logical key 4t + j of a 16-key group is physical key
  // 2t + (j & 1) + 8 (j >> 1), the permutation the fp8_vt pass applies to V^T (kernels_src/fp8_vt.cuh).
  __device__ __forceinline__ void pack_p(const float (&s)[S_REGS]) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      if constexpr (Tr::kFp8) {
        const float* x = s + 16 * kk;  // n8 blocks 4kk .. 4kk + 3
        pf[kk][0] = pack4_e4m3(x[0], x[1], x[4], x[5]);
        pf[kk][1] = pack4_e4m3(x[2], x[3], x[6], x[7]);
        pf[kk][2] = pack4_e4m3(x[8], x[9], x[12], x[13]);
        pf[kk][3] = pack4_e4m3(x[10], x[11], x[14], x[15]);
      } else {
        pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
        pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
        pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
        pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    }
  }

  // Every key tile of the block's query tile (n_tiles > 0): tile 0 has no previous P V to overlap;
  // with OVERLAP the last P V follows the loop. A persistent block then releases the last stage
  // (its producer refills it for the next query tile; a per-tile block just ends).
  __device__ __forceinline__ void run_tiles() {
    if constexpr (WG_BOUNDS) {  // the same up to this warpgroup's last tile, then skips
      step<false>(0);
      int j = 1;
      for (; j < wg_j1; ++j) step<OVERLAP>(j);
      if constexpr (OVERLAP) {  // its stage freed even per tile: the producer may need it for a skipped tile
        wait_v(prev_stage);
        pv_now(prev_stage);
        release(prev_stage);
      }
      for (; j < n_tiles; ++j) skip(j);
      finish_max();
      return;
    }
    step<false>(0);
    for (int j = 1; j < n_tiles; ++j) step<OVERLAP>(j);
    if constexpr (OVERLAP) {  // -- O += P_last V_last
      wait_v(prev_stage);
      pv_now(prev_stage);
      if constexpr (Tr::kPersist) release(prev_stage);
    }
    finish_max();
  }

  // O += P V with V in `st`'s stage, issued and waited for (nothing else in flight).
  __device__ __forceinline__ void pv_now(int st) {
    fence_acc();
    wg::fence();
    pv(st);
    wg::commit();
    wg::wait<0>();
    fence_acc();
  }

  // O += P V with V in `st`'s stage.
  __device__ __forceinline__ void pv(int st) {
    const unsigned long long v_desc = wg::desc_add(v_desc0, st * Tr::kStageBytes);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      if constexpr (Tr::kFp8)  // k32 step kk: 32 B into 128-key block kk / 4 of V^T
        wg::Mma<T, D, 0>::rs(acc, pf[kk], wg::desc_add(v_desc, (kk / 4) * (D * 128) + (kk % 4) * 32), 1);
      else
        wg::Mma<T, D, 1>::rs(acc, pf[kk], wg::desc_add(v_desc, kk * 2048), 1);
    }
    if constexpr (FIXED_REF)
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) wg::Mma<T, 8, 0>::rs(rsum, pf[kk], ones_desc, 1);
  }

  // WG_BOUNDS: key tile j, which none of this warpgroup's rows can see. Its stage is waited for
  // before it is freed (an arrival before the producer refilled the slot would count toward the
  // slot's previous use), and the warpgroup takes and passes its GEMM turn, so the others' turns
  // and the ring's phases run as if it had computed the tile.
  __device__ __forceinline__ void skip(const int j) {
    wait_stage();
    if constexpr (Tr::kPingPong) {
      pipe::bar_sync(1 + wgi, 256);
      pass_turn(j);
    }
    release_k(stage);
    wait_v(stage);  // SPLIT_KV: V_j, outside the turn
    release(stage);
    if constexpr (Tr::kPersist)
      if (j + 1 == n_tiles) arrive_warp(bar_q_empty);
    advance();
  }

  // Row half h's scores to P = exp2(s sl2 - ref) in place; returns their sum over this thread's
  // keys (quad-partial, reduced in the epilogue), as four interleaved chains. Tr::kPolyExp of every
  // 8 key pairs take poly_exp2 (the FMA pipe) instead of the SFU: a loop of its own, because the
  // dead branch in the SFU-only kernels' loop changed their PTX (a masking block laid out anew,
  // d = 128 dense; NVRTC 13.0), and those kernels are measured as they are.
  __device__ __forceinline__ float exp_row(float (&s)[S_REGS], int h, float ref) const {
    float s4[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (Tr::kPolyExp == 0) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        s[4 * i + 2 * h] = fast_exp2(fmaf(s[4 * i + 2 * h], sl2, -ref));
        s[4 * i + 2 * h + 1] = fast_exp2(fmaf(s[4 * i + 2 * h + 1], sl2, -ref));
        s4[i % 4] += s[4 * i + 2 * h] + s[4 * i + 2 * h + 1];
      }
    } else {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        if (i % 8 < Tr::kPolyExp) {
          s[4 * i + 2 * h] = poly_exp2(fmaf(s[4 * i + 2 * h], sl2, -ref));
          s[4 * i + 2 * h + 1] = poly_exp2(fmaf(s[4 * i + 2 * h + 1], sl2, -ref));
        } else {
          s[4 * i + 2 * h] = fast_exp2(fmaf(s[4 * i + 2 * h], sl2, -ref));
          s[4 * i + 2 * h + 1] = fast_exp2(fmaf(s[4 * i + 2 * h + 1], sl2, -ref));
        }
        s4[i % 4] += s[4 * i + 2 * h] + s[4 * i + 2 * h + 1];
      }
    }
    return (s4[0] + s4[1]) + (s4[2] + s4[3]);
  }

  // The ring moves on from the tile at `stage` (step and skip end so).
  __device__ __forceinline__ void advance() {
    prev_stage = stage;
    if (++stage == STAGES) {
      stage = 0;
      if constexpr (!Tr::kPersist) full_parity ^= 1;
    }
  }

  // Wait until the tile at `stage` landed (this thread's copies), is visible to the async proxy, and
  // everyone's copies are done; every warpgroup also finished the wgmmas that read the stage
  // refilled below (tile j + AHEAD - STAGES: j - 1, or j - 2 with OVERLAP).
  __device__ __forceinline__ void wait_stage() {
    if constexpr (Tr::kPersist) {  // full_parity: a bit a stage (attention_fwd_tma.cuh says why)
      pipe::wait(bar_full + 8 * stage, (full_parity >> stage) & 1u);
      full_parity ^= 1u << stage;
    } else if constexpr (Tr::kWS) {
      pipe::wait(bar_full + 8 * stage, full_parity);  // the producer filled and fenced it
    } else {
      wg::cp_async_wait<AHEAD - 1>();
      wg::fence_proxy_async_smem();
      __syncthreads();
    }
  }

  // The next warpgroup's GEMM turn after this one's at tile j. A block a tile: the last one gave
  // warpgroup 0 its first turn before the loop, so it skips its last hand-over: every arrival then
  // meets a sync. (Two warpgroups: the same test and barrier spelled as before, so their code is
  // unchanged.) PERSIST: the turns run on from one query tile to the next, so the last warpgroup
  // hands over at every tile (attn_fwd_tma_persistent gives the first turn once and takes the last
  // hand-over at its end): warpgroup 0 starts the next tile's Q K^T while the others still finish
  // this one, their epilogues included, instead of waiting for the last one's.
  __device__ __forceinline__ void pass_turn(const int j) const {
    constexpr int NWG = Tr::kWarpgroups;
    if (Tr::kPersist || (NWG == 2 ? wgi == 0 : wgi != NWG - 1) || j + 1 < n_tiles)
      pipe::bar_arrive(1 + (NWG == 2 ? wgi ^ 1 : wgi == NWG - 1 ? 0 : wgi + 1), 256);
  }

  // Key tile j. WITH_PV: also O += P_{j-1} V_{j-1} behind S_j (OVERLAP, j > 0). A compile-time
  // switch, not `if (j > 0)`: with a run-time condition around the waits ptxas cannot prove the
  // accumulators idle and serialises every wgmma (C7514).
  template <bool WITH_PV>
  __device__ __forceinline__ void step(const int j) {
    const int n0 = tiles.n0(j);
    const unsigned long long sub = tiles.mask(j);
    wait_stage();  // tile j

    if constexpr (WITH_PV) wait_v(prev_stage);  // SPLIT_KV: V_{j-1}, before taking the turn
    // -- S = Q K_j^T (raw scores, fp32), and O += P_{j-1} V_{j-1} right behind it
    float s[S_REGS];
    if constexpr (Tr::kPingPong) pipe::bar_sync(1 + wgi, 256);  // our turn to issue GEMMs
    fence_acc();
    wg::fence();
    const unsigned long long k_desc = wg::desc_add(k_desc0, stage * Tr::kStageBytes);
#pragma unroll
    for (int kk = 0; kk < D / Tr::kK; ++kk) {
      const unsigned off = (kk % 4) * 32;  // k step inside the 128-byte column block kk / 4
      wg::Mma<T, BN, 0>::ss(s, wg::desc_add(q_desc, (kk / 4) * (BM * 128) + off),
                            wg::desc_add(k_desc, (kk / 4) * (BN * 128) + off), kk > 0);
    }
    wg::commit();
    if constexpr (WITH_PV) {
      pv(prev_stage);
      wg::commit();
    }
    if constexpr (Tr::kPingPong) pass_turn(j);
    if constexpr (!Tr::kWS) {
      // -- refill the stage freed at the barrier with tile j + AHEAD, while the tensor cores run
      if (j + AHEAD < n_tiles) load<Tr::kThreads>(load_stage, tiles.n0(j + AHEAD), threadIdx.x);
      wg::cp_async_commit();  // possibly empty: keeps one group per tile for wait<AHEAD-1>
      load_stage = load_stage + 1 == STAGES ? 0 : load_stage + 1;
    }
    // -- the mask's terms of tile j, gathered while the tensor cores run: all loads of a tile in
    // one batch (one per element pair, interleaved with the scores, they cost 2x the dense time)
    float mt[S_REGS];
    unsigned mw[BN / 4];
    // plain: the mask is absent from this warp's 16 rows of the tile (a bool mask all visible, a
    // float mask all +0), so its per-score work is skipped: padding masks, document masks and
    // the like are mostly such tiles.
    // Tested on the raw bytes, so such a tile converts nothing either.
    bool plain = false;
    if constexpr (Mods::kMask != kMaskNone) {
      constexpr bool kF32 = Mods::kMask == kMaskF32;
      constexpr bool kBits = FastMods<Mods>::kBits;
      gather_mask(mt, mw, n0);
      constexpr unsigned kAllVisible = kBits ? ~0u : 0x0101u;
      unsigned all = FastMods<Mods>::kBool ? kAllVisible : 0u;
#pragma unroll
      for (int i = 0; i < (kF32 ? S_REGS : kBits ? BN / 16 : BN / 4); ++i) {
        if constexpr (FastMods<Mods>::kBool) all &= mw[i];
        else all |= kF32 ? __float_as_uint(mt[i]) : mw[i];
      }
      plain = __all_sync(kFullMask, all == (FastMods<Mods>::kBool ? kAllVisible : 0u));
      if constexpr (kBits) {  // this thread's keys 2 t, 2 t + 1 of each n8 block at bits 8 (i % 4) + e
#pragma unroll
        for (int i = 0; i < BN / 16; ++i) mw[i] >>= 2 * t;
      }
    }
    if constexpr (WITH_PV) {
      wg::wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
    } else {
      wg::wait<0>();
    }
    wg::fence_operands(s);
    release_k(stage);  // SPLIT_KV: K_j (and its mask tile: read above) is done with
    if constexpr (Tr::kPersist)  // the last Q K^T read the query tile: the producer may load the next
      if (j + 1 == n_tiles) arrive_warp(bar_q_empty);

    bool full;
    if constexpr (PAGED)  // tokens, and no tile reaching into the tree is whole
      full = band_tile_full<BN>(band, wg_tok0, wg_tok1, n0, sk) && (!TREE || n0 + BN <= tree_k0);
    else
      full = band_tile_full<BN>(band, wg_row0, wg_row0 + 63, n0, sk);
    if constexpr (Mods::kAny) {
      // -- every score through the modifiers (FastMods::score: log2 units, or raw / tanh values
      // that the softmax's sl2 scales); masked -> -inf. Rows past the end get -inf and never read
      // the mask tensor.
      const bool rows_in = wg_row0 + 63 < sq;
      if constexpr (FastMods<Mods>::kFloatMask)  // the raw pairs as terms, where they are added
        if (!(full && rows_in && plain))
#pragma unroll
          for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              mods.terms(mw[2 * i + h], mt[4 * i + 2 * h], mt[4 * i + 2 * h + 1], s[4 * i + 2 * h],
                         s[4 * i + 2 * h + 1]);
      if (full && rows_in && plain) {  // as without the mask: raw scores, or the other modifiers'
        if constexpr (!FastMods<Mods>::kMaskOnly)
#pragma unroll
          for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[4 * i + e] = mods.score(s[4 * i + e], token(e >> 1), n0 + i * 8 + 2 * t + (e & 1), 0.f);
      } else if (full && rows_in) {  // every position visible: no per-element band or bounds tests
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& x = s[4 * i + e];
            const int row = token(e >> 1), key = n0 + i * 8 + 2 * t + (e & 1);
            if constexpr (FastMods<Mods>::kBool)
              x = mask_visible(mw, i, e >> 1, e & 1) ? mods.score(x, row, key, 0.f) : -inf();
            else
              x = mods.score(x, row, key, mt[4 * i + e]);
          }
      } else
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = n0 + i * 8 + 2 * t, row = token(h);
          const bool row_in = rows_in || row_a + h * 8 < sq;
          const bool in0 = row_in && key < sk, in1 = row_in && key + 1 < sk;
          bool ok0 = full ? row_in : in0 && band.allows(row, key) && tree_allows(h, key);
          bool ok1 = full ? row_in : in1 && band.allows(row, key + 1) && tree_allows(h, key + 1);
          if constexpr (FastMods<Mods>::kBool) {
            ok0 = ok0 && mask_visible(mw, i, h, 0);
            ok1 = ok1 && mask_visible(mw, i, h, 1);
          }
          float& s0 = s[4 * i + 2 * h];
          float& s1 = s[4 * i + 2 * h + 1];
          s0 = ok0 ? mods.score(s0, row, key, mt[4 * i + 2 * h]) : -inf();
          s1 = ok1 ? mods.score(s1, row, key + 1, mt[4 * i + 2 * h + 1]) : -inf();
        }
    } else if (!full) {  // -- mask keys past the end and outside the band (boundary tiles only)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + i * 8 + 2 * t + (e & 1), row = token(e >> 1);
          if (key >= sk || !band.allows(row, key) || !tree_allows(e >> 1, key)) s[4 * i + e] = -inf();
        }
    }
    if (SPARSE && sub != tiles.kAll) {  // -- block-sparse: keys of invisible 16 x 16 sub-blocks -> -inf
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        if (!tiles.visible(sub, sub_row, i * 8)) s[4 * i] = s[4 * i + 1] = s[4 * i + 2] = s[4 * i + 3] = -inf();
    }

    // -- online softmax: the 4 lanes of a quad share rows row_a and row_a + 8. Row max and sum run
    // as four interleaved chains: as one running chain they were BN / 4 dependent instructions per
    // row and tile, and the kernel is bound by its instruction latency (ncu: "wait" the top stall).
    // The reference max is lazy (as FlashAttention-4 does): a row's exponentials stay referred to
    // the max it had until a tile's max outgrows that by more than 2^kLazyLog2 (P up to 256 then,
    // exact in fp32 and within 16-bit range; the epilogue divides by the sum under the same
    // reference). So after a row's first tiles O is rarely rescaled: that multiply was one
    // instruction a score at d = 128 (D / BN of them) and four at d = 256, of ~8 (measured 1-3%
    // faster at d = 256, no change at d = 128: the softmax already fits under the other
    // warpgroup's GEMMs there; BENCHMARKS.md).
    float corr[2];
    bool moved = false;
    if constexpr (FIXED_REF) {  // P = exp2(t sl2 - cref); masked -inf -> 0
#pragma unroll
      for (int h = 0; h < 2; ++h) row_sum[h] += exp_row(s, h, cref);  // for the LSE
    } else
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Four independent running maxima / sums (4 x shorter dependency chains than one).
      float m4[4] = {row_max[h], -inf(), -inf(), -inf()};
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) m4[i % 4] = fmaxf(m4[i % 4], fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
      float mx = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      // A row's first visible key: +inf > kLazyLog2 (corr 0). No visible key yet: NaN, not moved,
      // max stays -inf and the row exponentiates against 0, never (-inf) - (-inf).
      const bool move = (mx - row_max[h]) * sl2 > kLazyLog2;
      corr[h] = move ? fast_exp2((row_max[h] - mx) * sl2) : 1.f;
      if (move) row_max[h] = mx;
      moved = moved || move;
      const float ref = row_max[h] == -inf() ? 0.f : row_max[h] * sl2;
      row_sum[h] = row_sum[h] * corr[h] + exp_row(s, h, ref);
    }

    // -- O (tiles < j, under the old reference) *= corr, once P_{j-1} V_{j-1} has landed; only
    // where a row of the warp moved its reference (a warp-uniform branch)
    if constexpr (WITH_PV) {
      wg::wait<0>();
      fence_acc();
      release(prev_stage);  // V_{j-1} read
    }
    if (!FIXED_REF && __any_sync(kFullMask, moved)) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        acc[4 * i] *= corr[0], acc[4 * i + 1] *= corr[0];
        acc[4 * i + 2] *= corr[1], acc[4 * i + 3] *= corr[1];
      }
    }
    pack_p(s);
    if constexpr (!OVERLAP) {  // -- O += P_j V_j now
      pv_now(stage);
      release(stage);
    }
    advance();
  }
};

}  // namespace pyattn

// The wgmma forward kernel's main loop (attention_fwd_wgmma.cuh has the design and the entry
// point, attention_fwd_wgmma_traits.cuh the traits): per key tile the QK^T wgmma, the score
// modifiers, the online softmax and the P V wgmma of one consumer warpgroup, plus the producer's
// side of the ring when warp-specialized.
// PAGED (attention_prefill_wgmma.cuh): K/V rows come through a sequence's page list, and a row of
// the query tile packs (token, GQA group member) as token * row_group + member, so the band is
// tested on tokens; TREE adds an ancestor bit mask over the last sq keys. Both compile away in
// the dense kernel.
// This header declares AttnFwdWgmmaMainloop with its short members; the long ones are defined out
// of class, included after the struct: the ring's fills and the mask gathers in
// attention_fwd_wgmma_loads.cuh, an f32 mask's terms as S's starting values in
// attention_fwd_wgmma_mask_init.cuh, the per-tile compute (step, the softmax's exponentials, P V)
// in attention_fwd_wgmma_step.cuh.
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
  static constexpr bool kPaged = PAGED;
  // setmaxnreg of the producer warpgroup / consumers. PAGED on TMA traits: the cp.async rows' 56 /
  // 224 (its producer spilled 140 bytes at TMA's 24, 28 at 40; its consumers none at 224; NVRTC 13.0).
  static constexpr int kProducerRegs = PAGED && Tr::kTma ? 56 : Tr::kProducerRegs;
  static constexpr int kConsumerRegs = PAGED && Tr::kTma ? 224 : Tr::kConsumerRegs;
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
  bool mask_plain = true;          // kMaskInit: this warp's last mask tile was all +0 (its guess)
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
  unsigned qf[Tr::kQRegs ? D / 16 : 1][4];  // Q_REGS: this warp's 16 query rows, a k16 step's A fragment each
  unsigned q_rows;                 // Q_REGS: shared address of this warpgroup's query rows
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
  int num_pages;                   // the pool's pages: page entries are clamped into it (paged_prefill's unchecked tables)
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
    pl.init(k, v, k_stride, v_stride, k_page, v_page, pages, page_size, page_shift, rows_per_page, num_pages,
            head_dim, tid);
    return pl;
  }

  // WS producer, cp.async (the 128 producer threads): Q and every key tile through the ring.
  __device__ __forceinline__ void produce(unsigned sQ, const T* q, long long q_stride, int tid);

  // WS producer with TMA (one thread): Q and the block's key tiles through the ring.
  __device__ __forceinline__ void produce_tma(unsigned sQ);

  __device__ __forceinline__ void produce_tma_paged(unsigned sQ, const T* q, long long q_stride);

  __device__ __forceinline__ void copy_v_rows(unsigned dst, int page, int slot, int rows, int box, int lane) const;

  __device__ __forceinline__ void prefetch_maps() const {
    tma::prefetch(maps + 1);
    tma::prefetch(maps + 2);
    if constexpr (Tr::kMaskBytes > 0 || Tr::kMaskBits) tma::prefetch(maps + 3);
  }

  // The query tile's copies (one per 128-byte column block), completing on `bar`.
  __device__ __forceinline__ void load_q_tma(unsigned sQ, unsigned bar) const {
#pragma unroll
    for (int c = 0; c < D / CB; ++c)
      tma::load_4d(sQ + c * (BM * 128), maps, bar, CB * c, tma_q.row, tma_q.head, tma_q.batch);
  }

  // TMA: the block's key tiles through the ring from stage 0 (`empty_bits`: the phases).
  __device__ __forceinline__ void produce_tma_tiles(unsigned& empty_bits, unsigned sQ, bool q_with_tile0);

  // TMA: a mask tensor's tile for key tile n0 into stage st's mask slot, completing on `bar`.
  __device__ __forceinline__ void load_mask_tma(int st, int n0, unsigned bar) const;

  // The wgmma descriptors of this warpgroup's query rows at sQ and of stage 0's K and V (128-byte
  // swizzle; K-major operands step 32 B per k step inside a 128-byte column block, then jump to
  // the next block; V is read MN-major, 16 keys = 2048 B per k16 step, LBO the distance between
  // its 64-dim blocks; FP8's V^T is K-major like K, its rows the head dims).
  __device__ __forceinline__ void make_descs(unsigned sQ) {
    q_desc = wg::make_desc_sw128(sQ + wgi * 64 * 128, 16, 1024);
    q_rows = sQ + wgi * 64 * 128;
    k_desc0 = wg::make_desc_sw128(sKV, 16, 1024);
    v_desc0 = wg::make_desc_sw128(sKV + Tr::kKVBytes, Tr::kFp8 ? 16 : BN * 128, 1024);
  }

  // WS: the stages' barriers at `full`, initialised by thread 0 (the caller syncs the block).
  __device__ __forceinline__ void init_ring(unsigned full);

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

  // The mask tensor on key tile n0 in S's register layout, raw (mt: f32 values, mw: words).
  __device__ __forceinline__ void gather_mask(float (&mt)[S_REGS], unsigned (&mw)[BN / 4], int n0) const;

  // gather_mask from the mask tensor itself (its tiles not staged).
  __device__ __forceinline__ void gather_in_place(float (&mt)[S_REGS], unsigned (&mw)[BN / 4], int n0) const;

  // A float mask alone, staged by TMA (f32, or 16-bit tiles of whole rows): its terms (m / scale)
  // start S (init_mask_scores returns whether the tile was all +0 for this warp, `plain_before`
  // whether its previous tile was). A 16-bit row broadcast over the rows stays after the GEMM: its
  // plain-tile skip won there (BENCHMARKS.md, sixty-fifth session).
  __device__ __forceinline__ bool init_mask_scores(float (&s)[S_REGS], bool plain_before) const;
  static constexpr bool kMaskInit = FastMods<Mods>::kFloatMask && FastMods<Mods>::kMaskOnly && Tr::kTma &&
                                    (Tr::kMaskBytes == 4 || (Tr::kMaskBytes == 2 && !Tr::kMaskRowOnly));

  // Whether key 2 t + e of n8 block i in row half h is visible by a bool mask as gather_mask gave
  // it: a compile-time bit of a word (packed: bit 2 i + e of row half h's word).
  __device__ __forceinline__ static bool mask_visible(const unsigned (&mw)[BN / 4], int i, int h, int e) {
    if constexpr (FastMods<Mods>::kBits) return mw[h] & (1u << (2 * i + e));
    return mw[2 * i + h] & (e ? 0xff00u : 0xffu);
  }

  // P_j (S after the softmax) as the A fragments of P V.
  __device__ __forceinline__ void pack_p(const float (&s)[S_REGS]);

  // Every key tile of the block's query tile (n_tiles > 0), the last P V included.
  __device__ __forceinline__ void run_tiles();

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
  __device__ __forceinline__ void pv(int st);

  // Q_REGS: this warp's 16 query rows of the landed query tile into qf (see load_q_frags).
  __device__ __forceinline__ void load_q_frags();

  // WG_BOUNDS: key tile j, which none of this warpgroup's rows can see (waited for, freed).
  __device__ __forceinline__ void skip(const int j);

  // Row half h's scores to P = exp2(s sl2 - ref) in place; returns their quad-partial sum.
  __device__ __forceinline__ float exp_row(float (&s)[S_REGS], int h, float ref) const;

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

  // Key tile j; WITH_PV: also O += P_{j-1} V_{j-1} behind S_j.
  template <bool WITH_PV>
  __device__ __forceinline__ void step(const int j);
};

}  // namespace pyattn

// The long member functions, defined out of class (the header comment says where).
#include "attention_fwd_wgmma_loads.cuh"
#include "attention_fwd_wgmma_mask_init.cuh"
#include "attention_fwd_wgmma_step.cuh"

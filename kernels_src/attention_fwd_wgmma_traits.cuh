// The wgmma forward kernel's compile-time configuration: AttnFwdWgmmaTraits (tile shape, ring
// depth, warp specialization, TMA, the register split, the shared-memory budget) and FwdSmem,
// where a block's shared memory puts each part. attention_fwd_wgmma.cuh has the design and the
// kernel. Apart from it because the traits are a header's worth on their own and are the one
// place the dense, TMA, fp8, paged-prefill and tree kernels take their layout from (the family
// records in pyattn/kernels/families render them; the rendered unit's static_assert checks
// kSmemBytes against the families' formula).
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPGROUPS_, int STAGES_ = 3,
          bool OVERLAP_ = true, int MASK_BYTES_ = 0, bool WS_ = false, bool TMA_ = false, bool PERSIST_ = false,
          bool MASK_ROW_ = false, bool SPLIT_KV_ = false, int POLY_EXP_ = 0, bool O_STAGE_ = false,
          bool MASK_BITS_ = false, bool Q_REGS_ = false, bool TAIL_SPLIT_ = false>
struct AttnFwdWgmmaTraits {
  using T = T_;
  using TO = typename OutOf<T_>::type;  // the output's element type
  // FP8 (fp8e4m3 inputs, attn_fwd_tma only): k32 wgmmas on 8-bit operands, which must both be
  // K-major, so P V reads V transposed: the host's fp8_vt pass writes V^T (head_dim rows of keys)
  // with each 16-key group's keys permuted so that S's accumulator registers, packed four to a
  // register, are P's A fragments as they stand (Mainloop::pack_p says how).
  static constexpr bool kFp8 = sizeof(T_) == 1;
  static constexpr int kColElems = 128 / sizeof(T_);  // elements of one 128-byte swizzle row
  static constexpr int kK = 32 / sizeof(T_);          // the k of one wgmma (32 bytes of a row)
  static constexpr int kHeadDim = HEAD_DIM_;  // compiled bucket; params.head_dim <= kHeadDim
  static constexpr int kBlockM = BLOCK_M_;
  static constexpr int kBlockN = BLOCK_N_;
  static constexpr int kWarpgroups = WARPGROUPS_;
  static constexpr bool kWS = WS_;
  static constexpr int kThreads = 128 * (WARPGROUPS_ + WS_);  // the producer is the last warpgroup
  static constexpr int kConsumerThreads = 128 * WARPGROUPS_;
  // WS register split (setmaxnreg): 128 * 56 + 256 * 224 = 64512, the file at 1 block/SM. The
  // cp.async producer needs addresses and bounds, not just a TMA issue: at 24 / 240 it spilled 232
  // bytes, at 40 / 232 48; the consumers, who issue no copies, fit in 224 (d = 128, ptxas -v).
  // TMA (attn_fwd_tma): one producer thread issues a few bulk tensor copies per tile and computes
  // no addresses, so the producer gives up all but 24 registers (128 * 24 + 256 * 240 = 64512).
  // One consumer warpgroup (TMA only): two blocks an SM, each 128 * 24 + 128 * 232 = 32768, half
  // the file; the blocks' tiles then start and end at different times, so one's prologue and
  // epilogue run under the other's GEMMs.
  // Three consumer warpgroups (TMA only; 512 threads): 128 * 24 + 384 * 160 = 64512. FlashAttention-3
  // runs d = 64 so: its GEMMs are half d = 128's per score while the softmax is not, so two
  // warpgroups taking turns leave the tensor core idle for the softmax's excess; with three, two
  // softmaxes run under each warpgroup's GEMMs.
  static constexpr bool kTma = TMA_;
  // Three warpgroups, causal: row blocks end at the last query row, so that the partial one (192
  // rows rarely divide a sequence) is the first, which sees the fewest keys, instead of the last,
  // which sees the most: at S = 4k the work computed past the band falls from 12.5% to 6.3%. Its
  // rows before 0 are computed and never stored. (These rows read no mask tensor and no ALiBi
  // slopes, which take two warpgroups: row indices before 0 would address them.)
  static constexpr bool kBottomAlign = WARPGROUPS_ == 3;
  static constexpr int kProducerRegs = TMA_ ? 24 : 56,
                       kConsumerRegs = !TMA_ ? 224 : WARPGROUPS_ == 1 ? 232 : WARPGROUPS_ == 2 ? 240 : 160;
  static_assert(!WS_ || WARPGROUPS_ == 2 || ((WARPGROUPS_ == 1 || WARPGROUPS_ == 3) && TMA_),
                "WS: the register split is for two consumer warpgroups, or one or three with TMA");
  static_assert(!TMA_ || WS_, "TMA: a producer warpgroup issues the copies");
  // PERSIST (attn_fwd_tma): one block per SM walks query tiles (attention_fwd_tma.cuh), so a
  // tile's Q and first K/V load under the previous tile's last steps and epilogue.
  static constexpr bool kPersist = PERSIST_;
  static_assert(!PERSIST_ || TMA_, "PERSIST: the TMA producer walks the tiles");
  // WS with OVERLAP: the consumer warpgroups take turns issuing their GEMMs (FA3's ping-pong; with
  // three, round robin), warpgroup w waiting on named barrier 1 + w, so one's softmax runs under
  // the others' tensor-core work.
  static constexpr bool kPingPong = WS_ && OVERLAP_ && WARPGROUPS_ >= 2;
  static constexpr int kStages = STAGES_;
  static constexpr bool kOverlap = OVERLAP_;
  // POLY_EXP (soft-capped calls, TileConfig.poly_exp): of every 8 key pairs of a row's exp2s, this
  // many run on the FMA pipe (poly_exp2) instead of the SFU, which a soft-cap loads twice a score.
  static constexpr int kPolyExp = POLY_EXP_;
  static_assert(POLY_EXP_ >= 0 && POLY_EXP_ <= 8, "POLY_EXP: 0-8 of every 8 key pairs");
  // SPLIT_KV (TMA): a stage's K and V tiles complete and are freed on barriers of their own, as
  // FlashAttention-3 does: K_j's slot is free once S_j = Q K_j^T is done, V_j's once P_j V_j is. With
  // OVERLAP, V_{j-1} stays in use through tile j's softmax while K_j's slot is already refilled, so
  // two stages suffice (one K / V stage ring otherwise needs three: d = 256 at 2 stages ran without
  // overlap, and so without ping-pong).
  static constexpr bool kSplitKV = SPLIT_KV_;
  static_assert(!SPLIT_KV_ || (TMA_ && OVERLAP_), "SPLIT_KV: TMA with OVERLAP");
  // How many tiles ahead of the one in use a tile is loaded (see the header comment).
  static constexpr int kLookahead = OVERLAP_ && !SPLIT_KV_ ? STAGES_ - 2 : STAGES_ - 1;
  static_assert(sizeof(T_) == 2 || (kFp8 && TMA_ && MASK_BYTES_ == 0 && BLOCK_N_ % 128 == 0),
                "wgmma kernel: 16-bit inputs, or fp8 through TMA (V^T tiles of whole 128-key rows, no mask tiles)");
  static_assert(BLOCK_M_ == 64 * WARPGROUPS_, "one m64 wgmma row block per warpgroup");
  static_assert(WARPGROUPS_ >= 1 && WARPGROUPS_ <= 3, "1-3 consumer warpgroups");
  static_assert(HEAD_DIM_ % kColElems == 0 && HEAD_DIM_ <= 256,
                "head dim: whole 128-byte swizzle rows, wgmma N <= 256");
  static_assert(BLOCK_N_ % kK == 0 && BLOCK_N_ >= 16 && BLOCK_N_ <= 256, "key tile: whole k steps of P V");
  static_assert(kLookahead >= 1, "STAGES too small for the pipeline (OVERLAP needs 3)");
  // Shared memory (bytes): tiles are [HEAD_DIM / kColElems][rows][128 bytes], 128-byte swizzled;
  // FP8's V^T tile is [BLOCK_N / 128][HEAD_DIM][128 keys].
  static constexpr int kQBytes = BLOCK_M_ * HEAD_DIM_ * sizeof(T_);
  static constexpr int kKVBytes = BLOCK_N_ * HEAD_DIM_ * sizeof(T_);  // one K or one V tile
  static constexpr int kStageBytes = 2 * kKVBytes;
  // A mask tensor's tile (BLOCK_M x BLOCK_N elements of MASK_BYTES each; 0 = no mask tensor) rides
  // in the ring with its K/V tile when the mask's rows are 16-byte aligned (else it is read from
  // global memory in place). cp.async pads rows by 16 bytes: the 8 rows a warp reads at once then
  // start in different banks. TMA cannot pad; it swizzles instead, as for K and V: the tile is
  // [BLOCK_N * MASK_BYTES / kMaskSwz][BLOCK_M][kMaskSwz bytes], each kMaskSwz-byte row's 16-byte
  // chunks permuted by its row (the 32/64/128-byte swizzle, whichever spans a row of the box),
  // so those 8 rows again read 8 different chunks.
  // MASK_ROW (TMA only): the mask is one row that every query row reads (query stride 0: a
  // key-padding mask), so a stage holds one unswizzled row of the tile's keys (256 bytes of bf16
  // at 128 keys): the dense ring still fits, where a whole mask tile forces a shallower one.
  // MASK_BITS (TMA only): a bool mask packed to bits (mask_bits.cuh) rides in the ring too, its
  // BLOCK_M rows of BLOCK_N / 8 bytes unswizzled (3 KiB a stage at 192 x 128), where the consumers
  // otherwise load their words from L2 right after issuing Q K^T and wait for them before the
  // softmax (d = 64, whose GEMMs are short, could not hide that wait). The words are in the order
  // of mask_bits.cuh, one word a row for each thread. A mask broadcast over the query rows (a
  // key-padding mask) comes packed as BLOCK_M copies of its row, read at box row 0 (its
  // mask_stride_q 0), so that a box is whole: a box of its one row and zeros measured 2.7% slower
  // than the row read from global memory (BENCHMARKS.md, fortieth session).
  static constexpr bool kMaskBits = MASK_BITS_;
  static constexpr int kMaskBytes = MASK_BYTES_;
  static constexpr bool kMaskRowOnly = MASK_ROW_;
  static constexpr int kMaskSwz = MASK_ROW_ || BLOCK_N_ * MASK_BYTES_ < 128 ? BLOCK_N_ * MASK_BYTES_ : 128;
  static constexpr int kMaskRow =
      MASK_BYTES_ ? BLOCK_N_ * MASK_BYTES_ + (TMA_ ? 0 : 16) : MASK_BITS_ ? BLOCK_N_ / 8 : 0;
  static constexpr int kMaskTileBytes = (MASK_ROW_ ? 1 : BLOCK_M_) * kMaskRow;
  static_assert(!MASK_BITS_ || (TMA_ && MASK_BYTES_ == 0 && !MASK_ROW_ && BLOCK_N_ == 128),
                "MASK_BITS: TMA, no byte mask, 128-key tiles (a 16-byte row of words a box row)");
  static_assert(MASK_BYTES_ == 0 || (BLOCK_N_ * MASK_BYTES_) % 16 == 0, "mask tile rows: whole 16-byte chunks");
  static_assert(MASK_BYTES_ == 0 || !TMA_ || MASK_ROW_ || (kMaskSwz >= 32 && kMaskTileBytes % 1024 == 0),
                "TMA mask tiles: a 32/64/128-byte swizzle, whole 1024-byte atoms");
  static_assert(!MASK_ROW_ || (TMA_ && MASK_BYTES_ > 0 && kMaskSwz <= 1024), "MASK_ROW: a TMA mask row");
  // WS: a "full" and an "empty" mbarrier (8 bytes each) per stage, after the mask tiles (SPLIT_KV:
  // those are K's and the mask tile's, V's follow); PERSIST: then a "full" and an "empty" one for
  // the query tile.
  static constexpr int kRingBarrierBytes = (WS_ ? 16 * STAGES_ : 0) * (SPLIT_KV_ ? 2 : 1);
  static constexpr int kBarrierBytes = kRingBarrierBytes + (PERSIST_ ? 16 : 0);
  // O_STAGE (TMA, 16-bit outputs): O leaves through a BLOCK_M x HEAD_DIM tile of its own, after
  // the mask tiles: stmatrix writes a warp's 16 rows, 16-byte loads read them back as whole row
  // chunks for 16-byte stores (wgmma_fwd_store), in place of quad_transpose4's shuffles.
  static constexpr bool kOStage = O_STAGE_;
  // Q_REGS (TMA, 16-bit inputs): each consumer thread loads its warp's 16 query rows once a query
  // tile as wgmma A fragments (ldmatrix, HEAD_DIM / 4 registers), and Q K^T reads only K from
  // shared memory (wgmma RS). With 64-key steps the query tile was re-read every step: at d = 64
  // with a 16-bit mask tile that was 1/4 of the shared-memory bytes a score (BENCHMARKS.md,
  // forty-third session). No persistent row sets it yet (that pairing is untested).
  static constexpr bool kQRegs = Q_REGS_;
  static_assert(!Q_REGS_ || (TMA_ && sizeof(T_) == 2), "Q_REGS: the TMA rows' 16-bit inputs");
  // TAIL_SPLIT (persistent TMA rows of two consumer warpgroups, 16-bit, HEAD_DIM <= 128): the
  // launch's last, partial round of query tiles is split by keys over every block
  // (fwd_tail_split.cuh). A variant of its own, which the host launches only for calls it splits:
  // compiled into the row's one variant, the tail's code cost every call ~20% more NVRTC time
  // and, in a first form, 2-5% of the unsplit calls' speed.
  static constexpr bool kTailSplit = TAIL_SPLIT_;
  static_assert(!TAIL_SPLIT_ || (PERSIST_ && WARPGROUPS_ == 2 && sizeof(T_) == 2 && HEAD_DIM_ <= 128),
                "TAIL_SPLIT: the persistent two-warpgroup 16-bit rows up to d = 128");
  static constexpr int kOStageBytes = O_STAGE_ ? BLOCK_M_ * HEAD_DIM_ * 2 : 0;
  static_assert(!O_STAGE_ || (TMA_ && sizeof(T_) == 2), "O_STAGE: the TMA rows' 16-bit outputs");
  // + 1024: the dynamic window is only guaranteed 16-byte aligned; swizzle atoms need 1024.
  static constexpr int kSmemBytes =
      kQBytes + STAGES_ * (kStageBytes + kMaskTileBytes) + kOStageBytes + kBarrierBytes + 1024;
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "tiles keep 1024-byte alignment");
};

// Where a block's shared memory puts things (AttnFwdWgmmaTraits::kSmemBytes): the query tile from
// the first 1024-byte boundary, the K/V stages (stage s: K at kv + s * kStageBytes, V kKVBytes
// later), the stages' mask tiles (stage s's at mask + s * kMaskTileBytes), O's staging tile
// (kOStageBytes, 0 without O_STAGE), then the barriers.
template <class Tr>
struct FwdSmem {
  unsigned q, kv, mask, o, bars;
  unsigned ones;  // 256 bytes for a constant operand (Mainloop::init_ones), in the alignment slack

  __device__ __forceinline__ explicit FwdSmem(const unsigned char* raw) {
    const unsigned base = wg::smem_u32(raw);
    q = (base + 1023u) & ~1023u;
    kv = q + Tr::kQBytes;
    mask = kv + Tr::kStages * Tr::kStageBytes;
    o = mask + Tr::kStages * Tr::kMaskTileBytes;
    bars = o + Tr::kOStageBytes;
    // The +1024 of kSmemBytes is split between the gap before q (q - base) and the bytes after the
    // barriers (1024 - that gap): one of the two holds 256 bytes.
    ones = q - base >= 256 ? (base + 15u) & ~15u : (bars + Tr::kBarrierBytes + 15u) & ~15u;
  }
};

}  // namespace pyattn

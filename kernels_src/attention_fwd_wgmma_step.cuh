// AttnFwdWgmmaMainloop's compute side, its member functions defined out of class: one key tile
// (`step`: Q K^T, the score modifiers and masks, the online softmax, P V), the walk over the
// block's key tiles (`run_tiles`, with WG_BOUNDS' `skip`), the exponentials of a row (`exp_row`),
// P packed as wgmma A fragments (`pack_p`) and P V (`pv`). The struct, its fields and its short
// members are in attention_fwd_wgmma_mainloop.cuh, which includes this header right after the
// struct; the bodies live here only to keep that header short (the code is as it was in the struct).
#pragma once
#include "attention_fwd_wgmma_mainloop.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "wgmma_pipe.cuh"

namespace pyattn {

// A 16-bit or f32 mask's terms added to a whole tile's scores s (FastMods::add_terms, a pair of
// keys a call; mw / mt as gather_mask leaves them): the mask-only loop and the second loop of a
// mask split from the other modifiers (kSplitMask in step) both take it.
template <int BN, class M>
__device__ __forceinline__ void add_tile_terms(const M& mods, const unsigned* mw, const float* mt, float* s) {
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      mods.add_terms(mw[2 * i + h], mt[4 * i + 2 * h], mt[4 * i + 2 * h + 1], s[4 * i + 2 * h], s[4 * i + 2 * h + 1]);
}

// P_j (S after the softmax) as the A fragments of P V.
// 16-bit: n8 blocks 2kk and 2kk+1 of S form k16 step kk (the mma.m16n8k16 A layout, wgmma.cuh).
// FP8: a k32 A fragment holds row g's k 4t..4t+3 (register 0) and 16+4t..16+4t+3 (register 2),
// row g+8's in registers 1 and 3, while the accumulator gives lane t keys 2t, 2t+1 of each n8
// block. Packing keys (2t, 2t+1, 2t+8, 2t+9) of each 16-key half as k 4t..4t+3 needs no shuffle
// when V's rows come in the same order: logical key 4t + j of a 16-key group is physical key
// 2t + (j & 1) + 8 (j >> 1), the permutation the fp8_vt pass applies to V^T (kernels_src/fp8_vt.cuh).
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::pack_p(const float (&s)[S_REGS]) {
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
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::run_tiles() {
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

// Q_REGS: this warp's 16 query rows (16 w .. 16 w + 15 of the warpgroup's 64) as wgmma A
// fragments, k16 step kk in qf[kk]: the m16n8k16 A layout, which ldmatrix.x4 hands out when lane l
// names row l % 16 at head dims 16 kk + 8 (l / 16). The tile is [D / 64][BM][128 bytes], each
// 128-byte row's 16-byte chunks swizzled by the row (chunk c at c ^ (row % 8)), as TMA wrote it.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::load_q_frags() {
  const int lane = threadIdx.x % 32, r = (threadIdx.x % 128) / 32 * 16 + lane % 16;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int chunk = (2 * kk + lane / 16) % 8;  // in the 128-byte column block kk / 4
    ldmatrix_x4_at(qf[kk], q_rows + (kk / 4) * (BM * 128) + r * 128 + ((chunk ^ (r % 8)) << 4));
  }
}

// O += P V with V in `st`'s stage.
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::pv(int st) {
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
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::skip(const int j) {
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
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ float
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::exp_row(float (&s)[S_REGS], int h, float ref) const {
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

// Key tile j. WITH_PV: also O += P_{j-1} V_{j-1} behind S_j (OVERLAP, j > 0). A compile-time
// switch, not `if (j > 0)`: with a run-time condition around the waits ptxas cannot prove the
// accumulators idle and serialises every wgmma (C7514).
template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
template <bool WITH_PV>
__device__ __forceinline__ void
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::step(const int j) {
  const int n0 = tiles.n0(j);
  const unsigned long long sub = tiles.mask(j);
  wait_stage();  // tile j

  if constexpr (WITH_PV) wait_v(prev_stage);  // SPLIT_KV: V_{j-1}, before taking the turn
  if constexpr (Tr::kQRegs)
    if (j == 0) load_q_frags();  // the query tile landed with tile 0 (or before the walk: PERSIST)
  // -- S = Q K_j^T (raw scores, fp32), and O += P_{j-1} V_{j-1} right behind it
  float s[S_REGS];
  // kMaskInit: the mask's terms start S, before the turn's barrier, whose wait hides their loads.
  if constexpr (kMaskInit) mask_plain = init_mask_scores(s, mask_plain);
  if constexpr (Tr::kPingPong) pipe::bar_sync(1 + wgi, 256);  // our turn to issue GEMMs
  fence_acc();
  wg::fence();
  const unsigned long long k_desc = wg::desc_add(k_desc0, stage * Tr::kStageBytes);
#pragma unroll
  for (int kk = 0; kk < D / Tr::kK; ++kk) {
    const unsigned off = (kk % 4) * 32;  // k step inside the 128-byte column block kk / 4
    if constexpr (Tr::kQRegs)
      wg::Mma<T, BN, 0>::rs(s, qf[kk], wg::desc_add(k_desc, (kk / 4) * (BN * 128) + off), kMaskInit || kk > 0);
    else
      wg::Mma<T, BN, 0>::ss(s, wg::desc_add(q_desc, (kk / 4) * (BM * 128) + off),
                            wg::desc_add(k_desc, (kk / 4) * (BN * 128) + off), kMaskInit || kk > 0);
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
  // An f32 mask with soft-cap or ALiBi (kF32Fused) takes no such test: its terms are ready to add
  // (one FMA a score), so the test's OR of 64 values and vote cost more than they skip; its tiles
  // all take the per-score path (d = 128 all-zero mask: 1.38-1.45x the time without the mask with
  // the test, 1.21-1.25x without: BENCHMARKS.md, sixty-sixth session).
  constexpr bool kF32Fused = Mods::kMask == kMaskF32 && !FastMods<Mods>::kMaskOnly;
  bool plain = false;
  if constexpr (Mods::kMask != kMaskNone && !kMaskInit) gather_mask(mt, mw, n0);
  if constexpr (Mods::kMask != kMaskNone && !kMaskInit && !kF32Fused) {
    constexpr bool kF32 = Mods::kMask == kMaskF32;
    constexpr bool kBits = FastMods<Mods>::kBits;
    // packed bits: this thread's BN / 4 keys of each row half (gather_mask), bits 2 i + e
    constexpr unsigned kAllVisible = kBits ? (BN == 128 ? ~0u : (1u << BN / 4) - 1u) : 0x0101u;
    unsigned all = FastMods<Mods>::kBool ? kAllVisible : 0u;
#pragma unroll
    for (int i = 0; i < (kF32 ? S_REGS : kBits ? 2 : BN / 4); ++i) {
      if constexpr (FastMods<Mods>::kBool) all &= mw[i];
      else all |= kF32 ? __float_as_uint(mt[i]) : mw[i];
    }
    plain = __all_sync(kFullMask, all == (FastMods<Mods>::kBool ? kAllVisible : 0u));
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
  if constexpr (Mods::kAny && !kMaskInit) {  // (kMaskInit: S holds the final raw scores, as dense)
    // -- every score through the modifiers (FastMods::score: log2 units, or raw / tanh values
    // that the softmax's sl2 scales); masked -> -inf. Rows past the end get -inf and never read
    // the mask tensor, where a warpgroup's rows are partly so (the last path tests each row). A
    // warpgroup whose rows all lie past the end (never stored; their mask words or tiles arrived
    // as zeros) takes the paths of rows inside: on the last path, the last row block at d = 64
    // (192 rows, 64 of them in at 16k keys) took 2.8x a whole block's time with a bool mask, and
    // the kernel's tail waited on it (BENCHMARKS.md, forty-second session).
    const bool rows_in = wg_row0 + 63 < sq || wg_row0 >= sq;
    // A bool or 16-bit mask with soft-cap or ALiBi (kSplitMask): a whole tile's scores go through
    // the other modifiers in one loop, and the mask follows in a second one that plain tiles skip
    // (a bool's -inf, a 16-bit term added last, as score() would: the same result; the pair
    // converted there, so that its terms are not live through the first loop). The loop with both
    // in each score, beside the plain tile's own copy, made these the largest variants (d = 128
    // bits: 7624 SASS instructions against 5320 for the bits alone) and the slowest to compile,
    // and cost up to 1.47x the time without the mask (d = 128 bf16; 1.14-1.17x split). A bool mask with
    // the soft-cap alone keeps the fused loop: split, it ran 5-7% slower on every tile kind
    // (BENCHMARKS.md, sixty-sixth session).
    constexpr bool kSplitMask = Mods::kMask != kMaskNone && !FastMods<Mods>::kMaskOnly && !kF32Fused &&
                                (FastMods<Mods>::kFloatMask || Mods::kAlibi);
    if constexpr (FastMods<Mods>::kFloatMask && FastMods<Mods>::kMaskOnly)  // the terms onto raw S
      if (!(full && rows_in && plain)) add_tile_terms<BN>(mods, mw, mt, s);
    if (full && rows_in && (kSplitMask || plain)) {  // plain: as without the mask
      if constexpr (!FastMods<Mods>::kMaskOnly)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[4 * i + e] = mods.score(s[4 * i + e], token(e >> 1), n0 + i * 8 + 2 * t + (e & 1), 0.f);
      if constexpr (kSplitMask) {
        if constexpr (FastMods<Mods>::kBool) {
          if (!plain)
#pragma unroll
            for (int i = 0; i < BN / 8; ++i)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                s[4 * i + 2 * h] = mask_visible(mw, i, h, 0) ? s[4 * i + 2 * h] : -inf();
                s[4 * i + 2 * h + 1] = mask_visible(mw, i, h, 1) ? s[4 * i + 2 * h + 1] : -inf();
              }
        } else {
          if (!plain) add_tile_terms<BN>(mods, mw, mt, s);
        }
      }
    } else if (!kSplitMask && full && rows_in) {  // every position visible: no per-element band or bounds tests
      // Packed bits alone: one row half's scores after the other (HO = 2), so that the word's bits
      // are tested in order and ptxas turns them into predicates a byte at a time (R2P of 7 bits,
      // where key blocks outermost gave 2): 86 instructions a masked d = 64 tile instead of 110.
      // (With ALiBi too that order spilled 52 bytes at d = 128, where the other had none.)
      constexpr int HO = FastMods<Mods>::kBits && FastMods<Mods>::kMaskOnly ? 2 : 1, EH = 4 / HO;
#pragma unroll
      for (int ho = 0; ho < HO; ++ho)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = EH * ho; e < EH * ho + EH; ++e) {
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
        float m0, m1;  // a float mask's terms (unused by score() with the mask alone: on S already)
        mods.pair_terms(mw[2 * i + h], mt[4 * i + 2 * h], mt[4 * i + 2 * h + 1], m0, m1);
        s0 = ok0 ? mods.score(s0, row, key, m0) : -inf();
        s1 = ok1 ? mods.score(s1, row, key + 1, m1) : -inf();
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
    mx = quad_max(mx);
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

}  // namespace pyattn

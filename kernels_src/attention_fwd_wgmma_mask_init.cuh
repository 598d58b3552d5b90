// AttnFwdWgmmaMainloop's float mask terms as the scores' starting values (kMaskInit), its member
// function defined out of class: attention_fwd_wgmma_mainloop.cuh includes this header after the
// struct. step() then issues Q K^T with scale_d 1 from its first k step, so the GEMM accumulates
// onto the terms, which are read before the warpgroup's GEMM turn (its wait hides the loads) and
// are off the path from S to the softmax.
#pragma once
#include "attention_fwd_wgmma_mainloop.cuh"
#include "mma.cuh"

namespace pyattn {

template <int KIND> struct MaskPairType { using type = __nv_bfloat16; };  // a 16-bit mask's element
template <> struct MaskPairType<kMaskF16> { using type = __half; };

template <class Tr, class Mods, bool SPARSE, bool PAGED, bool TREE>
__device__ __forceinline__ bool
AttnFwdWgmmaMainloop<Tr, Mods, SPARSE, PAGED, TREE>::init_mask_scores(float (&s)[S_REGS], bool plain_before) const {
  // gather_mask's TMA addressing, each pair scaled into S as it lands, so that no mask value stays
  // live beside S, P and O.
  // f32: whether the tile is plain for this warp (all +0: padding masks and the like, mostly) is
  // known only once every pair is read; the warp guesses the previous tile's answer (masks come in
  // runs). Guessed plain: a first pass only ORs the pairs (volatile loads, which the compiler can
  // neither merge with the second pass's nor hoist, keeping every value live across the vote), then
  // zeros, or a second pass scales. Guessed not: one pass scales and ORs. (A check-first pass on
  // every tile cost random masks a second round of load latency before the GEMM.)
  // 16-bit: one pass, no test. Timed in one call against the guess, d = 64 bf16: random 1.28 against
  // 1.39-1.42x dense, causal random 1.21 against 1.29-1.31x, zeros level with it (1.23-1.29x); the
  // guess's vote and its three ways into S cost a 16-bit tile more than its plain tiles save
  // (BENCHMARKS.md, sixty-fourth and sixty-fifth sessions).
  constexpr int MB = Tr::kMaskBytes, SWZ = Tr::kMaskSwz, blk = kMaskBlockStride;
  static_assert(MB == 4 || (MB == 2 && !Tr::kMaskRowOnly), "kMaskInit: f32 tiles, or 16-bit ones of whole rows");
  constexpr int HS = Tr::kMaskRowOnly ? 1 : 2;  // a mask row broadcast over the rows: both halves alike
  const char* tile = reinterpret_cast<const char*>(mask_smem) + stage * Tr::kMaskTileBytes;
  if constexpr (MB == 2) {
    // gather_mask's ldmatrix addressing: quad e of q holds n8 block 2 q + e / 2, row half e % 2
    using MaskT = typename MaskPairType<Mods::kMask>::type;
    const int lane = threadIdx.x % 32, m = lane >> 3;
    const int r = row_a - m0 - lane / 4 + 8 * (m & 1) + (lane & 7);
    const int x = (r * SWZ >> 7) & (SWZ / 16 - 1);
#pragma unroll
    for (int q = 0; q < BN / 16; ++q) {
      const int w = (2 * q + (m >> 1)) * 16;
      unsigned quad[4];
      ldmatrix_x4(quad, tile + r * SWZ + (w / SWZ) * blk + ((((w % SWZ) >> 4) ^ x) << 4));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = pair_to_float2<MaskT>(quad[e]);
        const int k = 8 * q + 4 * (e >> 1) + 2 * (e & 1);
        s[k] = f.x * mods.mscale, s[k + 1] = f.y * mods.mscale;
      }
    }
    return false;
  }
  const auto pair_addr = [&](int i, int h) {  // keys 8 i + 2 t, + 1 of row half h
    const int r = Tr::kMaskRowOnly ? 0 : row_a - m0 + 8 * h;
    const int x = (r * SWZ >> 7) & (SWZ / 16 - 1), w = (i * 8 + 2 * t) * 4, wb = w % SWZ;
    return tile + r * SWZ + (w / SWZ) * blk + (((wb >> 4) ^ x) << 4) + (wb & 15);
  };
  const auto scale = [&](unsigned& any) {  // the pass that scales (and ORs the raw pairs)
#pragma unroll
    for (int h = 0; h < HS; ++h)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        const float2 f = *reinterpret_cast<const float2*>(pair_addr(i, h));
        any |= __float_as_uint(f.x) | __float_as_uint(f.y);
        s[4 * i + 2 * h] = f.x * mods.mscale, s[4 * i + 2 * h + 1] = f.y * mods.mscale;
        if (HS == 1) s[4 * i + 2] = s[4 * i], s[4 * i + 3] = s[4 * i + 1];
      }
  };
  unsigned any = 0u;
  if (!plain_before) {
    scale(any);
    return __all_sync(kFullMask, any == 0u);
  }
#pragma unroll
  for (int h = 0; h < HS; ++h)
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) any |= lds_or_pair(pair_addr(i, h));
  if (__all_sync(kFullMask, any == 0u)) {
#pragma unroll
    for (int k = 0; k < S_REGS; ++k) s[k] = 0.f;
    return true;
  }
  scale(any);
  return false;
}

}  // namespace pyattn

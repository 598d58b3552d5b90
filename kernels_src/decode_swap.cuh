// What the decode consumers with the MMA roles swapped share (issue 12): blocks of at most 8 query
// rows a KV head (a GQA group of 4 or 8 at q_len 1, 4 x 2, ...), the keys on the M side of
// mma.m16n8k16 and the rows on N = 8, for 16-bit caches (attention_decode_tma.cuh) and 8-bit ones
// (decode_q8_swap.cuh):
//   S^T = K Q^T:     A = K (keys g, g + 8 of a 16-key tile), B = Q^T (row g);
//   O^T += V^T P^T:  A = V^T (head-dim channels of an m16 tile x keys), B = P^T, from S^T's C
//                    fragments by movmatrix (an 8 x 8 transpose in registers).
// Why: with the rows on M, a group of 4 left 75% of every MMA, of the accumulator and of the
// softmax as padding. Here each lane's C fragments (S^T and O^T alike) hold rows 2t and 2t + 1, so
// the softmax state is per row column, reduced over g (lanes xor 4, 8, 16), and the O rescale
// needs no shuffle: half the MMAs, half the accumulator, half the exponentials.
// Requires decode_common.cuh, common.cuh and mma.cuh.
#pragma once

namespace pyattn {

// An 8 x 8 matrix of 16-bit values transposed across the warp: lane (g, t) gives row g, columns
// 2t, 2t + 1 and gets row g of the transpose (columns g of rows 2t, 2t + 1).
__device__ __forceinline__ unsigned movmatrix_trans(unsigned a) {
  unsigned d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

// This lane's rows 2t and 2t + 1 (block rows r0 + 2t + j) and their score modifiers and masks.
template <bool ALIBI>
struct DecodeCols {
  int qi[2];
  bool ok[2];
  float slope[2];
  int diag, kv_len;

  __device__ __forceinline__ DecodeCols(const DecodeParams& p, int b, int kv_head, int r0, int n_rows, int len) {
    const int t = threadIdx.x % 4;
    diag = len - p.q_len;
    kv_len = len;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int gr = r0 + 2 * t + j;
      ok[j] = gr < n_rows;
      qi[j] = gr / p.group;
      slope[j] = 0.f;
      if constexpr (ALIBI)
        if (ok[j]) slope[j] = p.alibi[b * p.alibi_stride_b + kv_head * p.group + gr % p.group];
    }
  }

  // S^T element (key tile mk, e) is key key0 + 16 mk + 8 (e >> 1) (key0: the warp's first key plus
  // g), row 2t + (e & 1): past the end, outside the band, or a padding row -> -inf; with modifiers
  // kept scores become final, in log2 units (as DecodeRows::mask).
  template <int MK, bool SOFTCAP>
  __device__ __forceinline__ void mask(float (&s)[MK][4], const DecodeParams& p, const Band& band, int key0) const {
    constexpr bool kMods = SOFTCAP || ALIBI;
#pragma unroll
    for (int mk = 0; mk < MK; ++mk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 16 * mk + 8 * (e >> 1), j = e & 1;
        const bool keep = ok[j] && key < kv_len && band.allows(qi[j], key);
        float x = s[mk][e];
        if constexpr (kMods) {
          x *= p.scale;
          if constexpr (SOFTCAP) x = p.softcap * tanhf(x / p.softcap);
          if constexpr (ALIBI) x -= slope[j] * fabsf(static_cast<float>(qi[j] + diag - key));
          x *= kLog2e;
        }
        s[mk][e] = keep ? x : -inf();
      }
  }
};

// Online softmax over the warp's S^T (row columns 2t, 2t + 1; keys over g), O^T rescaled to the new
// max (skipped when no column's max moved, as online_softmax<.., true>). cmax: the running max of
// the unscaled scores; csum: this lane's partial sum (reduced over g in the epilogue).
template <int MK, int DM>
__device__ __forceinline__ void swap_online_softmax(float (&s)[MK][4], float (&acc)[DM][4], float (&cmax)[2],
                                                   float (&csum)[2], float sl2) {
  float corr[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float mx = cmax[j];
#pragma unroll
    for (int mk = 0; mk < MK; ++mk) mx = fmaxf(mx, fmaxf(s[mk][j], s[mk][j + 2]));
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
    const float ref = mx == -inf() ? 0.f : mx * sl2;  // no visible key yet: never (-inf) - (-inf)
    corr[j] = fast_exp2(fmaf(cmax[j], sl2, -ref));
    cmax[j] = mx;
    float sum = 0.f;
#pragma unroll
    for (int mk = 0; mk < MK; ++mk) {
      s[mk][j] = fast_exp2(fmaf(s[mk][j], sl2, -ref));
      s[mk][j + 2] = fast_exp2(fmaf(s[mk][j + 2], sl2, -ref));
      sum += s[mk][j] + s[mk][j + 2];
    }
    csum[j] = csum[j] * corr[j] + sum;
  }
  if (!__any_sync(kFullMask, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
  for (int dm = 0; dm < DM; ++dm) {
    acc[dm][0] *= corr[0], acc[dm][1] *= corr[1];
    acc[dm][2] *= corr[0], acc[dm][3] *= corr[1];
  }
}

// One consumer warp's start with swapped roles: Q's copy issued (its rows in sQ, [8][kStride]), the
// rows' modifiers, and an empty softmax state: O^T = 0 (m16 channel tiles x this lane's rows 2t,
// 2t + 1), the rows' running max -inf and partial sums 0; sl2 the softmax's log2 scale (1 with
// modifiers: their scores are final, in log2 units).
template <class Tr, bool ALIBI>
struct SwapWarp {
  DecodeCols<ALIBI> cols;
  float acc[Tr::kHeadDim / 16][4];
  float cmax[2], csum[2];
  float sl2;

  __device__ __forceinline__ SwapWarp(const DecodeParams& p, const DecodeBlock<Tr>& blk, typename Tr::T* sQ, bool mods)
      : cols(p, blk.b, blk.kv_head, blk.r0, blk.n_rows, blk.kv_len), sl2(mods ? 1.f : p.scale_log2) {
    static_assert(Tr::kRows == 8 && Tr::kMTiles == 1, "swapped roles: one n8 tile of rows");
    load_q<Tr>(sQ, p, blk);
    cp_async_commit();
#pragma unroll
    for (int dm = 0; dm < Tr::kHeadDim / 16; ++dm) acc[dm][0] = acc[dm][1] = acc[dm][2] = acc[dm][3] = 0.f;
    cmax[0] = cmax[1] = -inf();
    csum[0] = csum[1] = 0.f;
  }
};

// The warps' states into shared memory as decode_epilogue's first phase leaves them: this lane's
// rows 2t + j's maxima (log2 units) and sums reduced over g, and O^T's elements through
// store(row 2t, row 2t + 1) (each variant's channel order); then that epilogue's merge and stores.
template <class Tr, class Store>
__device__ __forceinline__ void swap_epilogue(const DecodeParams& p, const float (&cmax)[2], const float (&csum)[2],
                                              float sl2, unsigned char* smem_raw, const DecodeBlock<Tr>& blk,
                                              Store&& store) {
  constexpr int ROWS = Tr::kRows, AS = Tr::kAccStride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  decode_sync<Tr>();  // the ring is free to reuse
  float* sAcc = reinterpret_cast<float*>(smem_raw);  // [W][ROWS][AS]
  float* sM = sAcc + Tr::kWarps * ROWS * AS;          // [W][ROWS] max (log2 units), then weights
  float* sL = sM + Tr::kWarps * ROWS;                 // [W][ROWS] row sums
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float sum = csum[j];
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
    if (g == 0) {
      sM[warp * ROWS + 2 * t + j] = cmax[j] == -inf() ? -inf() : cmax[j] * sl2;
      sL[warp * ROWS + 2 * t + j] = sum;
    }
  }
  store(sAcc + (warp * ROWS + 2 * t) * AS, sAcc + (warp * ROWS + 2 * t + 1) * AS);
  decode_merge<Tr>(p, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, blk.n_rows);
}

}  // namespace pyattn

// The consumer side of the 8-bit decode kernels: where a ring stage keeps each 16-byte chunk of
// codes, Q's fp16 fragments in the permuted head-dim order, S = Q K^T on the codes, and the
// softmax plus O += P V with the V scales folded into P. Shared by the cp.async kernel
// (attention_decode_q8.cuh, every arch) and the TMA-fed one (attention_decode_q8_tma.cuh, sm_90a);
// the two differ in the ring's layout only (the TMA template argument below; decode_q8_ring.cuh).
// Requires decode_common.cuh, q8_codes.cuh, common.cuh and mma.cuh.
#pragma once
#include "decode_q8_ring.cuh"

namespace pyattn {

// D = A B + C on m16n8k8 (fp16 inputs, fp32 accumulate): the kept channels' rank-4 correction.
__device__ __forceinline__ void mma_1688_f16(float (&d)[4], const unsigned (&a)[2], unsigned b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(b));
}

__device__ __forceinline__ unsigned pack_half2_bits(__half lo, __half hi) {
  return static_cast<unsigned>(__half_as_ushort(lo)) | (static_cast<unsigned>(__half_as_ushort(hi)) << 16);
}

__device__ __forceinline__ unsigned hmul2_bits(unsigned a, unsigned b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const unsigned*>(&r);
}

// The smallest power of two >= x (x > 0 and finite; 0 stays 0).
__device__ __forceinline__ float pow2_ceil(float x) {
  return __uint_as_float((__float_as_uint(x) + 0x007fffffu) & 0xff800000u);
}

// A query row's power-of-two scale that puts its largest magnitude amax in [2^14, 2^15) (exact,
// inside fp16's range), and its inverse.
__device__ __forceinline__ void q8_row_scale(float amax, float& scale, float& inv) {
  int ex = 0;
  if (amax > 0.f) frexpf(amax, &ex);  // amax = m * 2^ex, m in [0.5, 1)
  const int e = min(max(15 - ex, -100), 100);
  scale = ldexpf(1.f, e);
  inv = ldexpf(1.f, -e);
}

// Q's A fragments in the permuted head-dim order, kept in registers: k16 step 4 gi + kk, quad lane
// t reads columns p0 = 16 q8_kchunk(gi, t) + 4 kk (pair a0/a1) and p0 + 2 (a2/a3) of rows g, g + 8.
// S = Q K^T runs in fp16 whatever T is: int8 / e4m3 codes become fp16 in 1-2 instructions per
// pair (bf16 needs ~5). Each query row is first scaled by a power of two that puts its largest
// element in [2^14, 2^15) (exact, and inside fp16's range); the score undoes it (row_inv).
template <class Tr, bool TMA>
__device__ __forceinline__ void q8_query_fragments(const typename Tr::T* sQ, unsigned (&qf)[Tr::kMTiles][Tr::kHeadDim / 16][4],
                                                   float (&row_inv)[Tr::kMTiles][2]) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, MT = Tr::kMTiles, LD = Tr::kStride;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // The 4 elements of row g + 8 h of row tile mi that k16 step ks's fragment takes (both passes).
  auto at = [&](int mi, int ks, int h) {
    return sQ + (mi * 16 + g + 8 * h) * LD + 16 * q8_kchunk<TMA>(ks / 4, t) + 4 * (ks % 4);
  };
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    float amax[2] = {0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const T* r = at(mi, ks, h);
#pragma unroll
        for (int e = 0; e < 4; ++e) amax[h] = fmaxf(amax[h], fabsf(to_float(r[e])));
      }
    }
    float row_scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      amax[h] = quad_max(amax[h]);
      q8_row_scale(amax[h], row_scale[h], row_inv[mi][h]);
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const T* r = at(mi, ks, h);
        qf[mi][ks][h] = pack2<__half>(to_float(r[0]) * row_scale[h], to_float(r[1]) * row_scale[h]);
        qf[mi][ks][2 + h] = pack2<__half>(to_float(r[2]) * row_scale[h], to_float(r[3]) * row_scale[h]);
      }
    }
  }
}

// Per-channel keys: the scaled fp16 query back into shared memory in the natural column order (same
// size and place as Q), where the kept channels' correction gathers its columns. One warp writes.
template <class Tr, bool TMA>
__device__ __forceinline__ void q8_query_to_shared(__half* sQh, const unsigned (&qf)[Tr::kMTiles][Tr::kHeadDim / 16][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int ks = 0; ks < Tr::kHeadDim / 16; ++ks) {
      const int p0 = 16 * q8_kchunk<TMA>(ks / 4, t) + 4 * (ks % 4);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned* r = reinterpret_cast<unsigned*>(sQh + (mi * 16 + g + 8 * h) * Tr::kStride + p0);
        r[0] = qf[mi][ks][h];
        r[1] = qf[mi][ks][2 + h];
      }
    }
}

// S = Q K^T over the warp's keys (ring rows wrow ..) of a stage with per-token key scales: one
// 16-byte read per key row and 64-column group feeds 4 k16 steps; then each score column times
// its key's scale (tKs: the stage's, key wrow + nt * 8 + 2t + (e & 1)) and each row by row_inv.
template <class Tr, bool TMA>
__device__ __forceinline__ void q8_scores(const unsigned char* tK, const float* tKs, int wrow,
                                          const unsigned (&qf)[Tr::kMTiles][Tr::kHeadDim / 16][4],
                                          const float (&row_inv)[Tr::kMTiles][2],
                                          float (&s)[Tr::kMTiles][Tr::kKeysPerWarp / 8][4]) {
  constexpr int MT = Tr::kMTiles, NT = Tr::kKeysPerWarp / 8, G64 = Tr::kHeadDim / 64;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  zero_tiles<MT, NT>(s);
#pragma unroll
  for (int gi = 0; gi < G64; ++gi) {
    uint4 kw[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r = wrow + nt * 8 + g;
      kw[nt] = *reinterpret_cast<const uint4*>(tK + q8_chunk_at<Tr, TMA>(r, q8_kchunk<TMA>(gi, t)));
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const unsigned words[4] = {kw[nt].x, kw[nt].y, kw[nt].z, kw[nt].w};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        unsigned b0, b1;
        codes_to_half2<Tr::kCode>(words[kk], b0, b1);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) mma_16816<__half>(s[mi][nt], qf[mi][4 * gi + kk], b0, b1);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float2 ksc = *reinterpret_cast<const float2*>(tKs + wrow + nt * 8 + 2 * t);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      s[mi][nt][0] *= ksc.x * row_inv[mi][0], s[mi][nt][1] *= ksc.y * row_inv[mi][0];
      s[mi][nt][2] *= ksc.x * row_inv[mi][1], s[mi][nt][3] *= ksc.y * row_inv[mi][1];
    }
  }
}

// S = Q K^T over the warp's keys with per-channel key scales (Traits::kKeyChannel): a key's value is
// code * S[page] * r[page][c]. Per 16-key segment (one page; tSeg: the warp's first segment record in
// the stage, SegRec): Q's fragments times the page's r (qs; r <= 1 keeps the power-of-two scaled query
// in fp16's range), the segment's 2 n8 tiles of codes, the page's kKeptChannels largest channels
// (r = 0, codes 0) as a rank-4 correction (one m16n8k8 MMA per n8 tile of the scaled query's kept
// columns, gathered from sQh, times their fp16 values over S), then S and the rows' row_inv.
// hi_rows: whether row tile mi has real rows 8..15; qs lives in the caller (rows 8..15 of padding
// tiles stay 0 there across stages).
template <class Tr, bool TMA>
__device__ __forceinline__ void q8_scores_channel(const unsigned char* tK, const unsigned char* tSeg, int wrow,
                                                  const unsigned (&qf)[Tr::kMTiles][Tr::kHeadDim / 16][4],
                                                  const float (&row_inv)[Tr::kMTiles][2],
                                                  const bool (&hi_rows)[Tr::kMTiles], const __half* sQh,
                                                  unsigned (&qs)[Tr::kMTiles][Tr::kHeadDim / 16][4],
                                                  float (&s)[Tr::kMTiles][Tr::kKeysPerWarp / 8][4]) {
  constexpr int D = Tr::kHeadDim, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles, NT = KW / 8, G64 = D / 64;
  constexpr int LD = Tr::kStride, KV = Tr::kCode;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  zero_tiles<MT, NT>(s);
  // per 16-key segment (one page): Q fragments times the page's channel scales, then its 2 n8 tiles
#pragma unroll
  for (int sg = 0; sg < KW / 16; ++sg) {
    const unsigned char* seg = tSeg + sg * SegRec<D>::kBytes;
    const __half* rseg = reinterpret_cast<const __half*>(seg + SegRec<D>::kR);
    uint2 rr[D / 16];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      rr[ks] = *reinterpret_cast<const uint2*>(rseg + 16 * q8_kchunk<TMA>(ks / 4, t) + 4 * (ks % 4));
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        qs[mi][ks][0] = hmul2_bits(qf[mi][ks][0], rr[ks].x);
        qs[mi][ks][2] = hmul2_bits(qf[mi][ks][2], rr[ks].y);
      }
      // Rows 8..15 only where real (warp-uniform; else they stay 0, set before the key loop). At
      // D = 256 that would keep 64 more registers live across segments: there they are always
      // computed (padding rows are 0 in qf, so they come out 0).
      if (D > 128 || hi_rows[mi]) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          qs[mi][ks][1] = hmul2_bits(qf[mi][ks][1], rr[ks].x);
          qs[mi][ks][3] = hmul2_bits(qf[mi][ks][3], rr[ks].y);
        }
      }
    }
#pragma unroll
    for (int gi = 0; gi < G64; ++gi) {
      uint4 kw[2];
#pragma unroll
      for (int q2 = 0; q2 < 2; ++q2) {
        const int r = wrow + (2 * sg + q2) * 8 + g;
        kw[q2] = *reinterpret_cast<const uint4*>(tK + q8_chunk_at<Tr, TMA>(r, q8_kchunk<TMA>(gi, t)));
      }
#pragma unroll
      for (int q2 = 0; q2 < 2; ++q2) {
        const unsigned words[4] = {kw[q2].x, kw[q2].y, kw[q2].z, kw[q2].w};
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          unsigned b0, b1;
          codes_to_half2<KV>(words[kk], b0, b1);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) mma_16816<__half>(s[mi][2 * sg + q2], qs[mi][4 * gi + kk], b0, b1);
        }
      }
    }
    // -- the kept channels: k step 2t, 2t + 1 of an m16n8k8 is kept channel (rank) 2t, 2t + 1 for
    // quad lanes t = 0, 1; lanes t = 2, 3 feed zeros. A: the scaled query's kept columns (sQh), B:
    // the keys' kept values over S (key g of each n8 tile: slot 8 q2 + g of the segment).
    const uint2 hdr = *reinterpret_cast<const uint2*>(seg);  // S, the kept channels' indices
    const unsigned idxw = hdr.y >> (16 * (t & 1));
    const int c0 = idxw & 0xffu, c1 = (idxw >> 8) & 0xffu;
    unsigned ka[MT][2];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      const __half* q0 = sQh + (mi * 16 + g) * LD;
      ka[mi][0] = t < 2 ? pack_half2_bits(q0[c0], q0[c1]) : 0u;
      ka[mi][1] = t < 2 && hi_rows[mi] ? pack_half2_bits(q0[8 * LD + c0], q0[8 * LD + c1]) : 0u;
    }
    const unsigned* kept = reinterpret_cast<const unsigned*>(seg + SegRec<D>::kKept);
#pragma unroll
    for (int q2 = 0; q2 < 2; ++q2) {
      // lanes t = 2, 3 repeat lanes 0, 1's values (finite): their A columns are 0
      const unsigned kb = kept[(q2 * 8 + g) * (kKeptChannels / 2) + (t & 1)];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) mma_1688_f16(s[mi][2 * sg + q2], ka[mi], kb);
    }
    // -- the page's S and the query rows' scales (rows 8..15 that are padding score 0 already)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      const float a0 = __uint_as_float(hdr.x) * row_inv[mi][0], a1 = __uint_as_float(hdr.x) * row_inv[mi][1];
#pragma unroll
      for (int q2 = 0; q2 < 2; ++q2) {
        s[mi][2 * sg + q2][0] *= a0, s[mi][2 * sg + q2][1] *= a0;
        if (hi_rows[mi]) s[mi][2 * sg + q2][2] *= a1, s[mi][2 * sg + q2][3] *= a1;
      }
    }
  }
}

// NG codes (Traits::kVGroup) of each of a 16-key step's 4 V rows of this lane, keys r0 + 2t, + 1,
// + 8, + 9, at logical byte vg NG 8 + NG g of the row: the lane owns NG head-dim columns of them.
template <class Tr, bool TMA>
__device__ __forceinline__ void q8_v_rows(const unsigned char* tV, int r0, int vg, unsigned (&vw)[4][Tr::kVGroup / 4]) {
  constexpr int NG = Tr::kVGroup;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int rk = r0 + 2 * t, rr[4] = {rk, rk + 1, rk + 8, rk + 9};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int byte = vg * NG * 8 + NG * g;  // logical byte in the row
    const unsigned char* src = tV + q8_chunk_at<Tr, TMA>(rr[i], byte >> 4) + (byte & 15);
    if constexpr (NG == 16) {
      const uint4 x = *reinterpret_cast<const uint4*>(src);
      vw[i][0] = x.x, vw[i][1] = x.y, vw[i][2] = x.z, vw[i][3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(src);
      vw[i][0] = x.x, vw[i][1] = x.y;
    }
  }
}

// Word w4 of those rows interleaved byte by byte: lo[c] holds channel c's codes of keys (2t, 2t+1)
// as an fp16 pair, hi[c] those of (2t+8, 2t+9).
template <int KV, int N>
__device__ __forceinline__ void q8_v_pairs(const unsigned (&vw)[4][N], int w4, unsigned (&lo)[4], unsigned (&hi)[4]) {
  codes_to_half2<KV>(__byte_perm(vw[0][w4], vw[1][w4], 0x5140), lo[0], lo[1]);
  codes_to_half2<KV>(__byte_perm(vw[0][w4], vw[1][w4], 0x7362), lo[2], lo[3]);
  codes_to_half2<KV>(__byte_perm(vw[2][w4], vw[3][w4], 0x5140), hi[0], hi[1]);
  codes_to_half2<KV>(__byte_perm(vw[2][w4], vw[3][w4], 0x7362), hi[2], hi[3]);
}

// The online softmax of the stage's (masked) scores, then O += P V over the warp's keys. P is
// multiplied by each key's V scale over vref, a per-warp running power of two (so that P * scale
// / vref stays in [0, 1], fp16's range); O is kept in units of vref and rescaled when vref grows,
// like the online softmax's max. The 4 lanes of a quad hold all the warp's columns, so their max
// is the warp's (vref is warp-uniform).
template <class Tr, bool TMA>
__device__ __forceinline__ void q8_softmax_pv(float (&s)[Tr::kMTiles][Tr::kKeysPerWarp / 8][4], const unsigned char* tV,
                                              const float* tVs, int wrow, float& vref,
                                              float (&acc)[Tr::kMTiles][Tr::kHeadDim / 8][4],
                                              float (&row_max)[Tr::kMTiles][2], float (&row_sum)[Tr::kMTiles][2],
                                              float sl2) {
  constexpr int D = Tr::kHeadDim, KW = Tr::kKeysPerWarp, MT = Tr::kMTiles, NT = KW / 8, DT = D / 8;
  constexpr int NG = Tr::kVGroup, KV = Tr::kCode;
  const int t = threadIdx.x % 4;
  online_softmax<MT, NT, DT, true>(s, acc, row_max, row_sum, sl2);
  // -- P *= V scale / vref (after the row sums, which must not see it)
  float2 vsc[NT];
  float vmax = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    vsc[nt] = *reinterpret_cast<const float2*>(tVs + wrow + nt * 8 + 2 * t);
    vmax = fmaxf(vmax, fmaxf(vsc[nt].x, vsc[nt].y));
  }
  vmax = quad_max(vmax);
  const float vref_new = fmaxf(vref, pow2_ceil(vmax));
  if (vref_new != vref) {  // O was accumulated in units of the old vref (0 before any key: O is 0)
    const float r = vref > 0.f ? vref / vref_new : 0.f;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int i = 0; i < DT; ++i) acc[mi][i][0] *= r, acc[mi][i][1] *= r, acc[mi][i][2] *= r, acc[mi][i][3] *= r;
    vref = vref_new;
  }
  const float vinv = vref > 0.f ? 1.f / vref : 0.f;  // exact: a power of two
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      s[mi][nt][0] *= vsc[nt].x * vinv, s[mi][nt][1] *= vsc[nt].y * vinv;
      s[mi][nt][2] *= vsc[nt].x * vinv, s[mi][nt][3] *= vsc[nt].y * vinv;
    }

  // -- O += P V: per k16 step, 4 key rows (2t, 2t+1, 2t+8, 2t+9) x NG bytes per lane. A lane reads
  // NG consecutive bytes of a row and so owns output column g of NG n8 tiles: the output columns
  // are permuted (Traits::acc_col maps them back in the merge).
#pragma unroll
  for (int kk = 0; kk < KW / 16; ++kk) {
    unsigned a[MT][4];
    p_fragments<__half, MT, NT>(s, kk, a);
#pragma unroll
    for (int vg = 0; vg < D / (8 * NG); ++vg) {
      unsigned vw[4][NG / 4];
      q8_v_rows<Tr, TMA>(tV, wrow + kk * 16, vg, vw);
#pragma unroll
      for (int w4 = 0; w4 < NG / 4; ++w4) {
        unsigned b0[4], b1[4];  // one code pair per B register
        q8_v_pairs<KV>(vw, w4, b0, b1);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int dt = vg * NG + w4 * 4 + e;
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) mma_16816<__half>(acc[mi][dt], a[mi], b0[e], b1[e]);
        }
      }
    }
  }
}

// O back from units of vref (0 when the warp saw no key: its O is 0 then).
template <int MT, int DT>
__device__ __forceinline__ void q8_unscale(float (&acc)[MT][DT][4], float vref) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int i = 0; i < DT; ++i)
      acc[mi][i][0] *= vref, acc[mi][i][1] *= vref, acc[mi][i][2] *= vref, acc[mi][i][3] *= vref;
}

}  // namespace pyattn

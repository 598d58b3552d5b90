// The TMA-fed 8-bit decode's consumer warps with the MMA roles swapped (issue 12): blocks of at
// most 8 query rows (a GQA group of 4 or 8 at q_len 1, 4 x 2, ...), the keys on the M side of
// mma.m16n8k16 and the rows on N = 8.
//   S^T = K Q^T:     A = K codes, keys g and g + 8 of a 16-key tile (the same 16-byte reads and
//                    code conversions as decode_q8_stage.cuh's B fragments), B = Q^T (row g).
//   O^T += V^T P^T:  A = V codes, head-dim channels of an m16 tile x keys 2t.., 2t + 8..; B = P^T,
//                    from S^T's C fragments by movmatrix (an 8 x 8 transpose in registers).
// Why: with 16 query rows on M a group of 4 left 75% of every MMA, of the accumulator and of the
// softmax as padding. Here each lane's C fragments (S^T and O^T alike) hold rows 2t and 2t + 1,
// so the softmax state is per row column, reduced over g (lanes xor 4, 8, 16), and the O rescale
// needs no shuffle: half the MMAs, half the accumulator (32 registers at d = 128, which is what
// lets the per-channel variant run without spills), half the exponentials.
// Output channel of O^T element (m16 tile dm, row g + 8 h): the V read's byte order, swap_col.
// Requires decode_q8_stage.cuh (and through it decode_common.cuh, q8_codes.cuh, mma.cuh).
#pragma once
#include "mbarrier.cuh"
#include "tma.cuh"
#include "pdl.cuh"

namespace pyattn {

// An 8 x 8 matrix of 16-bit values transposed across the warp: lane (g, t) gives row g, columns
// 2t, 2t + 1 and gets row g of the transpose (columns g of rows 2t, 2t + 1).
__device__ __forceinline__ unsigned movmatrix_trans(unsigned a) {
  unsigned d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

// Head-dim channel of O^T's m16 tile dm, row g + 8 h (the lane reads kVGroup consecutive bytes of
// a V row at NG g: channel pair 2 (dm % (NG / 2)) of them, the pair's first on row g).
template <class Tr>
__device__ __forceinline__ int swap_col(int dm, int g, int h) {
  constexpr int NG = Tr::kVGroup;
  return (dm / (NG / 2)) * NG * 8 + NG * g + 2 * (dm % (NG / 2)) + h;
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

  // S^T element (key tile mk, e) is key key0 + 16 mk + g + 8 (e >> 1), row 2t + (e & 1): past the
  // end, outside the band, or a padding row -> -inf; with modifiers kept scores become final, in
  // log2 units (as DecodeRows::mask).
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

// Q^T's B fragments (row g; permuted head-dim order as q8_query_fragments) and the inverse row
// scales of this lane's columns 2t, 2t + 1.
template <class Tr>
__device__ __forceinline__ void q8s_query(const typename Tr::T* sQ, unsigned (&qb)[Tr::kHeadDim / 16][2],
                                          float (&cinv)[2]) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* row = sQ + g * Tr::kStride;
  auto at = [&](int ks) { return row + 16 * q8_kchunk<true>(ks / 4, t) + 4 * (ks % 4); };
  float amax = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(to_float(at(ks)[e])));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));  // the row's 4 lanes: one scale a row
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
  float scale, inv;
  q8_row_scale(amax, scale, inv);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const T* r = at(ks);
    qb[ks][0] = pack2<__half>(to_float(r[0]) * scale, to_float(r[1]) * scale);
    qb[ks][1] = pack2<__half>(to_float(r[2]) * scale, to_float(r[3]) * scale);
  }
  cinv[0] = __shfl_sync(kFullMask, inv, 8 * t);  // row 2t's lanes: g = 2t
  cinv[1] = __shfl_sync(kFullMask, inv, 8 * t + 4);
}

// K's A fragments for k16 step kk of a 16-key tile: 16-byte chunk words of keys g (lo) and g + 8 (hi).
template <int KV>
__device__ __forceinline__ void q8s_key_frag(unsigned lo, unsigned hi, unsigned (&a)[4]) {
  codes_to_half2<KV>(lo, a[0], a[2]);
  codes_to_half2<KV>(hi, a[1], a[3]);
}

// S^T += K Q^T over one 16-key tile (ring rows r0 ..) for B fragments qb.
template <class Tr>
__device__ __forceinline__ void q8s_tile_scores(const unsigned char* tK, int r0, const unsigned (&qb)[Tr::kHeadDim / 16][2],
                                                float (&s)[4]) {
  constexpr int G64 = Tr::kHeadDim / 64;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int gi = 0; gi < G64; ++gi) {
    const int c = q8_kchunk<true>(gi, t);
    const uint4 lo = *reinterpret_cast<const uint4*>(tK + q8_chunk_at<Tr, true>(r0 + g, c));
    const uint4 hi = *reinterpret_cast<const uint4*>(tK + q8_chunk_at<Tr, true>(r0 + g + 8, c));
    const unsigned wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned a[4];
      q8s_key_frag<Tr::kCode>(wl[kk], wh[kk], a);
      mma_16816<__half>(s, a, qb[4 * gi + kk][0], qb[4 * gi + kk][1]);
    }
  }
}

// S^T over the warp's keys (ring rows wrow ..) with per-token key scales (tKs: the stage's), then
// each row column by its inverse scale.
template <class Tr>
__device__ __forceinline__ void q8s_scores(const unsigned char* tK, const float* tKs, int wrow,
                                           const unsigned (&qb)[Tr::kHeadDim / 16][2], const float (&cinv)[2],
                                           float (&s)[Tr::kKeysPerWarp / 16][4]) {
  constexpr int MK = Tr::kKeysPerWarp / 16;
  const int g = (threadIdx.x % 32) / 4;
#pragma unroll
  for (int mk = 0; mk < MK; ++mk) {
    s[mk][0] = s[mk][1] = s[mk][2] = s[mk][3] = 0.f;
    q8s_tile_scores<Tr>(tK, wrow + 16 * mk, qb, s[mk]);
  }
#pragma unroll
  for (int mk = 0; mk < MK; ++mk) {
    const float k0 = tKs[wrow + 16 * mk + g], k1 = tKs[wrow + 16 * mk + g + 8];
    s[mk][0] *= k0 * cinv[0], s[mk][1] *= k0 * cinv[1];
    s[mk][2] *= k1 * cinv[0], s[mk][3] *= k1 * cinv[1];
  }
}

// S^T with per-channel key scales (q8_scores_channel's arithmetic, one segment a 16-key tile):
// Q^T's fragments times the page's r, the codes, the kept channels' rank-4 correction (m16n8k8:
// A = the keys' kept values over S, ranks 2t, 2t + 1 for t < 2; B = the scaled query's kept
// columns, zeros on lanes t >= 2), then the page's S and the columns' inverse scales.
template <class Tr>
__device__ __forceinline__ void q8s_scores_channel(const unsigned char* tK, const unsigned char* tSeg, int wrow,
                                                   const unsigned (&qb)[Tr::kHeadDim / 16][2], const float (&cinv)[2],
                                                   const __half* sQh, float (&s)[Tr::kKeysPerWarp / 16][4]) {
  constexpr int D = Tr::kHeadDim, MK = Tr::kKeysPerWarp / 16;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mk = 0; mk < MK; ++mk) {
    const unsigned char* seg = tSeg + mk * SegRec<D>::kBytes;
    const __half* rseg = reinterpret_cast<const __half*>(seg + SegRec<D>::kR);
    unsigned qs[D / 16][2];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint2 rr = *reinterpret_cast<const uint2*>(rseg + 16 * q8_kchunk<true>(ks / 4, t) + 4 * (ks % 4));
      qs[ks][0] = hmul2_bits(qb[ks][0], rr.x);
      qs[ks][1] = hmul2_bits(qb[ks][1], rr.y);
    }
    s[mk][0] = s[mk][1] = s[mk][2] = s[mk][3] = 0.f;
    q8s_tile_scores<Tr>(tK, wrow + 16 * mk, qs, s[mk]);
    const uint2 hdr = *reinterpret_cast<const uint2*>(seg);  // S, the kept channels' indices
    const unsigned idxw = hdr.y >> (16 * (t & 1));
    const int c0 = idxw & 0xffu, c1 = (idxw >> 8) & 0xffu;
    const __half* q0 = sQh + g * Tr::kStride;
    const unsigned kb = t < 2 ? pack_half2_bits(q0[c0], q0[c1]) : 0u;
    const unsigned* kept = reinterpret_cast<const unsigned*>(seg + SegRec<D>::kKept);
    // lanes t = 2, 3 repeat lanes 0, 1's values (finite): their B rows are 0
    const unsigned ka[2] = {kept[g * (kKeptChannels / 2) + (t & 1)], kept[(g + 8) * (kKeptChannels / 2) + (t & 1)]};
    mma_1688_f16(s[mk], ka, kb);
    const float S = __uint_as_float(hdr.x);
    s[mk][0] *= S * cinv[0], s[mk][1] *= S * cinv[1];
    s[mk][2] *= S * cinv[0], s[mk][3] *= S * cinv[1];
  }
}

// Online softmax over the warp's S^T (row columns 2t, 2t + 1; keys over g), O^T rescaled to the new
// max (skipped when no column's max moved, as online_softmax<.., true>). cmax: the running max of
// the unscaled scores; csum: this lane's partial sum (reduced over g in the epilogue).
template <int MK, int DM>
__device__ __forceinline__ void q8s_online_softmax(float (&s)[MK][4], float (&acc)[DM][4], float (&cmax)[2],
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

// The softmax of the stage's (masked) S^T, then O^T += V^T P^T over the warp's keys, P times each
// key's V scale over vref (q8_softmax_pv's running power of two; keys g, g + 8 of a tile are this
// lane's, the max over them reduced over g).
template <class Tr>
__device__ __forceinline__ void q8s_softmax_pv(float (&s)[Tr::kKeysPerWarp / 16][4], const unsigned char* tV,
                                               const float* tVs, int wrow, float& vref,
                                               float (&acc)[Tr::kHeadDim / 16][4], float (&cmax)[2],
                                               float (&csum)[2], float sl2) {
  constexpr int D = Tr::kHeadDim, MK = Tr::kKeysPerWarp / 16, DM = D / 16, NG = Tr::kVGroup, KV = Tr::kCode;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  q8s_online_softmax<MK, DM>(s, acc, cmax, csum, sl2);
  float2 vsc[MK];
  float vmax = 0.f;
#pragma unroll
  for (int mk = 0; mk < MK; ++mk) {
    vsc[mk] = make_float2(tVs[wrow + 16 * mk + g], tVs[wrow + 16 * mk + g + 8]);
    vmax = fmaxf(vmax, fmaxf(vsc[mk].x, vsc[mk].y));
  }
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) vmax = fmaxf(vmax, __shfl_xor_sync(kFullMask, vmax, o));
  const float vref_new = fmaxf(vref, pow2_ceil(vmax));
  if (vref_new != vref) {  // O was accumulated in units of the old vref (0 before any key: O is 0)
    const float r = vref > 0.f ? vref / vref_new : 0.f;
#pragma unroll
    for (int dm = 0; dm < DM; ++dm) acc[dm][0] *= r, acc[dm][1] *= r, acc[dm][2] *= r, acc[dm][3] *= r;
    vref = vref_new;
  }
  const float vinv = vref > 0.f ? 1.f / vref : 0.f;  // exact: a power of two
#pragma unroll
  for (int mk = 0; mk < MK; ++mk) {
    const float v0 = vsc[mk].x * vinv, v1 = vsc[mk].y * vinv;
    // P^T's B fragments: S^T's keys g (and g + 8) x rows 2t, 2t + 1, transposed to keys 2t, 2t + 1
    // (and 2t + 8, 2t + 9) x row g
    const unsigned b0 = movmatrix_trans(pack2<__half>(s[mk][0] * v0, s[mk][1] * v0));
    const unsigned b1 = movmatrix_trans(pack2<__half>(s[mk][2] * v1, s[mk][3] * v1));
    const int rk = wrow + 16 * mk + 2 * t;
    const int rr[4] = {rk, rk + 1, rk + 8, rk + 9};
#pragma unroll
    for (int vg = 0; vg < D / (8 * NG); ++vg) {
      unsigned vw[4][NG / 4];  // NG codes of each of the 4 rows
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int byte = vg * NG * 8 + NG * g;  // logical byte in the row
        const unsigned char* src = tV + q8_chunk_at<Tr, true>(rr[i], byte >> 4) + (byte & 15);
        if constexpr (NG == 16) {
          const uint4 x = *reinterpret_cast<const uint4*>(src);
          vw[i][0] = x.x, vw[i][1] = x.y, vw[i][2] = x.z, vw[i][3] = x.w;
        } else {
          const uint2 x = *reinterpret_cast<const uint2*>(src);
          vw[i][0] = x.x, vw[i][1] = x.y;
        }
      }
#pragma unroll
      for (int w4 = 0; w4 < NG / 4; ++w4) {
        // Rows (2t, 2t+1) and (2t+8, 2t+9) interleaved byte by byte: lo[c] / hi[c] hold channel c's
        // key pairs, the A fragment rows of a channel tile.
        unsigned lo[4], hi[4];
        codes_to_half2<KV>(__byte_perm(vw[0][w4], vw[1][w4], 0x5140), lo[0], lo[1]);
        codes_to_half2<KV>(__byte_perm(vw[0][w4], vw[1][w4], 0x7362), lo[2], lo[3]);
        codes_to_half2<KV>(__byte_perm(vw[2][w4], vw[3][w4], 0x5140), hi[0], hi[1]);
        codes_to_half2<KV>(__byte_perm(vw[2][w4], vw[3][w4], 0x7362), hi[2], hi[3]);
#pragma unroll
        for (int pr = 0; pr < 2; ++pr) {
          const unsigned a[4] = {lo[2 * pr], lo[2 * pr + 1], hi[2 * pr], hi[2 * pr + 1]};
          mma_16816<__half>(acc[vg * (NG / 2) + w4 * 2 + pr], a, b0, b1);
        }
      }
    }
  }
}

// The warps' states into shared memory as decode_epilogue's first phase leaves them (rows 2t + j of
// this lane; O back from units of vref), then that epilogue's merge and stores.
template <class Tr>
__device__ __forceinline__ void q8s_epilogue(const DecodeParams& p, const float (&acc)[Tr::kHeadDim / 16][4],
                                             const float (&cmax)[2], const float (&csum)[2], float vref, float sl2,
                                             unsigned char* smem_raw, const DecodeBlock<Tr>& blk) {
  constexpr int DM = Tr::kHeadDim / 16, ROWS = Tr::kRows, AS = Tr::kAccStride;
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
#pragma unroll
  for (int dm = 0; dm < DM; ++dm)  // rows g and g + 8 of an O^T tile: adjacent channels (swap_col)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      *reinterpret_cast<float2*>(sAcc + (warp * ROWS + 2 * t + j) * AS + swap_col<Tr>(dm, g, 0)) =
          make_float2(acc[dm][j] * vref, acc[dm][j + 2] * vref);
  decode_merge<Tr>(p, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, blk.n_rows);
}

// The consumer warps of attn_decode_q8_tma with swapped roles (Traits::kSwap): from Q's load to the
// stored rows. The producer warp, the ring and its barriers are the kernel's.
template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void q8s_consume(const DecodeParams& p, const DecodeBlock<Tr>& blk, unsigned char* smem_raw,
                                            const unsigned char* sK, unsigned char* sV, const float* sKs,
                                            const float* sVs, const unsigned char* sSeg, unsigned full0,
                                            unsigned empty0) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, MK = KW / 16;
  constexpr int S = Tr::kStages, W = Tr::kWarps, H = D / 128, SEGB = SegRec<D>::kBytes;
  constexpr bool kMods = SOFTCAP || ALIBI, KC = Tr::kKeyChannel;
  static_assert(Tr::kRows == 8 && Tr::kMTiles == 1, "swapped roles: one n8 tile of rows");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [8][kStride]
  load_q<Tr>(sQ, p, blk);
  cp_async_commit();
  const DecodeCols<ALIBI> cols(p, blk.b, blk.kv_head, blk.r0, blk.n_rows, blk.kv_len);
  float acc[D / 16][4];
#pragma unroll
  for (int dm = 0; dm < D / 16; ++dm) acc[dm][0] = acc[dm][1] = acc[dm][2] = acc[dm][3] = 0.f;
  float cmax[2] = {-inf(), -inf()}, csum[2] = {0.f, 0.f};
  const float sl2 = kMods ? 1.f : p.scale_log2;  // with modifiers s is final (log2 units) before the softmax
  if (KC && p.head_dim < D) {  // r past head_dim in every record: zeros (the copies bring head_dim entries)
    for (int rec = warp; rec < S * (KB / 16); rec += W)
      for (int i = 16 + 2 * p.head_dim + 2 * lane; i < SegRec<D>::kKept; i += 64)
        *reinterpret_cast<__half*>(const_cast<unsigned char*>(sSeg) + rec * SEGB + i) = __ushort_as_half(0);
  }
  cp_async_wait<0>();
  decode_sync<Tr>();  // Q landed for every consumer warp
  unsigned qb[D / 16][2];
  float cinv[2];
  q8s_query<Tr>(sQ, qb, cinv);
  __half* sQh = reinterpret_cast<__half*>(sQ);
  if constexpr (KC) {  // the scaled query in natural column order, where the kept channels gather
    decode_sync<Tr>();  // every warp has its fragments: the scaled query may replace Q
    if (warp == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        unsigned* r = reinterpret_cast<unsigned*>(sQh + g * Tr::kStride + 16 * q8_kchunk<true>(ks / 4, t) + 4 * (ks % 4));
        r[0] = qb[ks][0];
        r[1] = qb[ks][1];
      }
    }
    decode_sync<Tr>();
  }
  float vref = 0.f;  // this warp's running V-scale reference (a power of two; 0: no key yet)
  for (int j = 0; j < blk.n_tiles; ++j) {
    const int st = j % S, wrow = warp * KW;      // this warp's first ring row
    const int n0 = blk.n_first + j * KB + wrow;  // this warp's first key
    pipe::wait(full0 + 8 * st, (j / S) & 1);
    const unsigned char* tK = sK + st * KB * D;
    unsigned char* tV = sV + st * KB * D;
    const int valid = blk.end - n0;  // this warp's rows from `valid` on hold no key of the range
    if (valid < KW) {  // the warp's 16-byte chunks of those V rows, a lane each in turn
      const int r0 = max(valid, 0);
      for (int i = lane; i < (KW - r0) * H * 8; i += 32)
        reinterpret_cast<uint4*>(tV + (i / 8 % H) * KB * 128 + (wrow + r0 + i / (8 * H)) * 128)[i % 8] =
            make_uint4(0, 0, 0, 0);
      tma::fence_shared();  // these generic writes before the stage's next TMA writes
      __syncwarp();
    }
    float s[MK][4];
    if constexpr (KC) {
      q8s_scores_channel<Tr>(tK, sSeg + (st * (KB / 16) + wrow / 16) * SEGB, wrow, qb, cinv, sQh, s);
    } else {
      q8s_scores<Tr>(tK, sKs + st * KB, wrow, qb, cinv, s);
    }
    if (kMods || !band_tile_full<KW>(blk.band, blk.qi_lo, blk.qi_hi, n0, blk.kv_len))
      cols.template mask<MK, SOFTCAP>(s, p, blk.band, n0 + g);
    q8s_softmax_pv<Tr>(s, tV, sVs + st * KB, wrow, vref, acc, cmax, csum, sl2);
    __syncwarp();
    if (lane == 0) pipe::arrive(empty0 + 8 * st);  // this warp's reads of the stage are done
  }
  pdl::launch_dependents();  // the next decode's blocks may start once every block is past its keys
  q8s_epilogue<Tr>(p, acc, cmax, csum, vref, sl2, smem_raw, blk);
}

}  // namespace pyattn

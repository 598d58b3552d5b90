// The TMA-fed 8-bit decode's consumer warps with the MMA roles swapped (issue 12; the scheme and
// what it shares with the 16-bit one: decode_swap.cuh). K's A fragments come from the same 16-byte
// reads and code conversions as decode_q8_stage.cuh's B fragments (keys g, g + 8 of a 16-key tile),
// V^T's from the same 4-row byte interleave (a channel pair an m16 tile); against the rows on M
// the accumulator halves to 32 registers at d = 128, which is what lets the per-channel variant
// run without spills. Output channel of O^T element (m16 tile dm, row g + 8 h): the V read's byte
// order, swap_col.
// Requires decode_q8_stage.cuh (and through it decode_common.cuh, q8_codes.cuh, mma.cuh).
#pragma once
#include "mbarrier.cuh"
#include "decode_swap.cuh"

namespace pyattn {

// Head-dim channel of O^T's m16 tile dm, row g + 8 h (the lane reads kVGroup consecutive bytes of
// a V row at NG g: channel pair 2 (dm % (NG / 2)) of them, the pair's first on row g).
template <class Tr>
__device__ __forceinline__ int swap_col(int dm, int g, int h) {
  constexpr int NG = Tr::kVGroup;
  return (dm / (NG / 2)) * NG * 8 + NG * g + 2 * (dm % (NG / 2)) + h;
}

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
  amax = quad_max(amax);  // the row's 4 lanes: one scale a row
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
__device__ __forceinline__ void q8s_tile_scores(const unsigned char* tK, int r0,
                                                const unsigned (&qb)[Tr::kHeadDim / 16][2],
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

// The softmax of the stage's (masked) S^T, then O^T += V^T P^T over the warp's keys, P times each
// key's V scale over vref (q8_softmax_pv's running power of two; keys g, g + 8 of a tile are this
// lane's, the max over them reduced over g).
template <class Tr>
__device__ __forceinline__ void q8s_softmax_pv(float (&s)[Tr::kKeysPerWarp / 16][4], const unsigned char* tV,
                                               const float* tVs, int wrow, float& vref,
                                               float (&acc)[Tr::kHeadDim / 16][4], float (&cmax)[2],
                                               float (&csum)[2], float sl2) {
  constexpr int D = Tr::kHeadDim, MK = Tr::kKeysPerWarp / 16, DM = D / 16, NG = Tr::kVGroup, KV = Tr::kCode;
  const int g = (threadIdx.x % 32) / 4;
  swap_online_softmax<MK, DM>(s, acc, cmax, csum, sl2);
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
#pragma unroll
    for (int vg = 0; vg < D / (8 * NG); ++vg) {
      unsigned vw[4][NG / 4];
      q8_v_rows<Tr, true>(tV, wrow + 16 * mk, vg, vw);
#pragma unroll
      for (int w4 = 0; w4 < NG / 4; ++w4) {
        unsigned lo[4], hi[4];  // channel c's key pairs: the A fragment rows of a channel tile
        q8_v_pairs<KV>(vw, w4, lo, hi);
#pragma unroll
        for (int pr = 0; pr < 2; ++pr) {
          const unsigned a[4] = {lo[2 * pr], lo[2 * pr + 1], hi[2 * pr], hi[2 * pr + 1]};
          mma_16816<__half>(acc[vg * (NG / 2) + w4 * 2 + pr], a, b0, b1);
        }
      }
    }
  }
}

// The warps' states into shared memory as decode_epilogue's first phase leaves them (O^T's rows
// 2t + j as float2 pairs of channels, back from units of vref), then that epilogue's merge.
template <class Tr>
__device__ __forceinline__ void q8s_epilogue(const DecodeParams& p, const float (&acc)[Tr::kHeadDim / 16][4],
                                             const float (&cmax)[2], const float (&csum)[2], float vref, float sl2,
                                             unsigned char* smem_raw, const DecodeBlock<Tr>& blk) {
  const int g = (threadIdx.x % 32) / 4;
  swap_epilogue<Tr>(p, cmax, csum, sl2, smem_raw, blk, [&](float* row0, float* row1) {
#pragma unroll
    for (int dm = 0; dm < Tr::kHeadDim / 16; ++dm) {  // rows g and g + 8 of an O^T tile: adjacent channels
      *reinterpret_cast<float2*>(row0 + swap_col<Tr>(dm, g, 0)) = make_float2(acc[dm][0] * vref, acc[dm][2] * vref);
      *reinterpret_cast<float2*>(row1 + swap_col<Tr>(dm, g, 0)) = make_float2(acc[dm][1] * vref, acc[dm][3] * vref);
    }
  });
}

// A consumer warp's turn at TMA ring stage j of the 8-bit decodes (q8s_consume below and
// attention_decode_q8_tma.cuh's rows-on-M consumers): the stage waited full, this warp's V rows
// past the range's keys zeroed (0 x NaN is NaN), its stage, first key (wrow: its first ring row)
// and the stage's K / V boxes; release() hands the stage back once the warp's reads are done.
template <class Tr>
struct Q8TmaStage {
  int st, n0;
  const unsigned char* tK;
  unsigned char* tV;
  __device__ __forceinline__ Q8TmaStage(const unsigned char* sK, unsigned char* sV, unsigned full0,
                                        const DecodeBlock<Tr>& blk, int j, int wrow) {
    constexpr int S = Tr::kStages, KB = Tr::kBlockN, D = Tr::kHeadDim;
    st = j % S;
    n0 = blk.n_first + j * KB + wrow;
    pipe::wait(full0 + 8 * st, (j / S) & 1);
    tK = sK + st * KB * D;
    tV = sV + st * KB * D;
    tma::zero_rows_from<Tr::kKeysPerWarp, D / 128, KB>(tV + wrow * 128, blk.end - n0);
  }
  __device__ __forceinline__ void release(unsigned empty0, int lane) const {
    __syncwarp();
    if (lane == 0) pipe::arrive(empty0 + 8 * st);  // this warp's reads of the stage are done
  }
};

// The consumer warps of attn_decode_q8_tma with swapped roles (Traits::kSwap): from Q's load to the
// stored rows. The producer warp, the ring and its barriers are the kernel's.
template <class Tr, bool SOFTCAP, bool ALIBI>
__device__ __forceinline__ void q8s_consume(const DecodeParams& p, const DecodeBlock<Tr>& blk, unsigned char* smem_raw,
                                            const unsigned char* sK, unsigned char* sV, const float* sKs,
                                            const float* sVs, unsigned char* sSeg, unsigned full0,
                                            unsigned empty0) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, KB = Tr::kBlockN, KW = Tr::kKeysPerWarp, MK = KW / 16;
  constexpr int SEGB = SegRec<D>::kBytes;
  constexpr bool kMods = SOFTCAP || ALIBI, KC = Tr::kKeyChannel;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  T* sQ = reinterpret_cast<T*>(smem_raw);
  SwapWarp<Tr, ALIBI> w(p, blk, sQ, kMods);
  if constexpr (KC) q8_zero_r_tails<Tr>(sSeg, p.head_dim);
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
        const int col = 16 * q8_kchunk<true>(ks / 4, t) + 4 * (ks % 4);
        unsigned* r = reinterpret_cast<unsigned*>(sQh + g * Tr::kStride + col);
        r[0] = qb[ks][0];
        r[1] = qb[ks][1];
      }
    }
    decode_sync<Tr>();
  }
  float vref = 0.f;  // this warp's running V-scale reference (a power of two; 0: no key yet)
  for (int j = 0; j < blk.n_tiles; ++j) {
    const int wrow = warp * KW;  // this warp's first ring row
    const Q8TmaStage<Tr> ts(sK, sV, full0, blk, j, wrow);
    float s[MK][4];
    if constexpr (KC) {
      q8s_scores_channel<Tr>(ts.tK, sSeg + (ts.st * (KB / 16) + wrow / 16) * SEGB, wrow, qb, cinv, sQh, s);
    } else {
      q8s_scores<Tr>(ts.tK, sKs + ts.st * KB, wrow, qb, cinv, s);
    }
    if (kMods || !band_tile_full<KW>(blk.band, blk.qi_lo, blk.qi_hi, ts.n0, blk.kv_len))
      w.cols.template mask<MK, SOFTCAP>(s, p, blk.band, ts.n0 + g);
    q8s_softmax_pv<Tr>(s, ts.tV, sVs + ts.st * KB, wrow, vref, w.acc, w.cmax, w.csum, w.sl2);
    ts.release(empty0, lane);
  }
  q8s_epilogue<Tr>(p, w.acc, w.cmax, w.csum, vref, w.sl2, smem_raw, blk);
}

}  // namespace pyattn

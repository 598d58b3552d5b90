// What every forward kernel shares about which keys a query sees and how a score is formed:
// per-sequence geometry (dense or varlen), the causal/window band, and the optional score
// modifiers (soft-cap, ALiBi, a mask tensor), which are compile-time switches so that the plain
// kernel carries none of their cost. Semantics are those of pyattn.reference.attention_ref.
// Requires pyattn::AttnFwdParams and common.cuh.
#pragma once
#include "band.cuh"

namespace pyattn {

// Where batch entry (or varlen sequence) b lives in the (packed) arrays.
struct SeqInfo {
  long long q_row0, k_row0;  // first row in the packed arrays (0 for dense batches)
  int sq, sk;                // its query and key lengths
};

__device__ __forceinline__ SeqInfo seq_info(const AttnFwdParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    const int q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    s.q_row0 = q0;
    s.k_row0 = k0;
    s.sq = p.cu_seqlens_q[b + 1] - q0;
    s.sk = p.cu_seqlens_k[b + 1] - k0;
  } else {
    s.q_row0 = s.k_row0 = 0;
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
  }
  return s;
}

enum MaskKind { kMaskNone = 0, kMaskBool = 1, kMaskF16 = 2, kMaskBF16 = 3, kMaskF32 = 4 };

// Compile-time score modifiers. kAny: scores go through score_mod() instead of the fused
// scale-and-exp2 path.
template <int MASK_, bool SOFTCAP_, bool ALIBI_>
struct ScoreMods {
  static constexpr int kMask = MASK_;
  static constexpr bool kSoftcap = SOFTCAP_;
  static constexpr bool kAlibi = ALIBI_;
  static constexpr bool kAny = MASK_ != kMaskNone || SOFTCAP_ || ALIBI_;
};

// Additive mask value at element index `idx`: 0 / -inf for bool masks (True = may attend).
template <int KIND>
__device__ __forceinline__ float mask_value(const void* mask, long long idx) {
  if constexpr (KIND == kMaskBool) return static_cast<const unsigned char*>(mask)[idx] ? 0.f : -inf();
  if constexpr (KIND == kMaskF16) return __half2float(static_cast<const __half*>(mask)[idx]);
  if constexpr (KIND == kMaskBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[idx]);
  if constexpr (KIND == kMaskF32) return static_cast<const float*>(mask)[idx];
  return 0.f;
}

// Per-(batch, head) state the modifiers need, fetched once per block.
struct ModState {
  const void* mask;   // at (batch, head); rows and keys still to add
  float alibi_slope;  // 0 when ALiBi is off
  int diag;           // sk - sq: ALiBi distance is |i + diag - j|
};

template <class Mods>
__device__ __forceinline__ ModState make_mod_state(const AttnFwdParams& p, int batch, int head, int sq, int sk) {
  ModState m;
  m.mask = nullptr;
  if constexpr (Mods::kMask != kMaskNone) {
    const int esize = Mods::kMask == kMaskBool ? 1 : Mods::kMask == kMaskF32 ? 4 : 2;
    m.mask = static_cast<const char*>(p.mask) + (batch * p.mask_stride_b + head * p.mask_stride_h) * esize;
  }
  m.alibi_slope = 0.f;
  if constexpr (Mods::kAlibi) m.alibi_slope = p.alibi[batch * p.alibi_stride_b + head];
  m.diag = sk - sq;
  return m;
}

// Final score in log2 units from a raw dot product q.k of (row, key), both inside the sequence:
// scale, soft-cap, ALiBi, mask, in the reference's order.
template <class Mods>
__device__ __forceinline__ float score_mod(const AttnFwdParams& p, const ModState& m, float raw, int row, int key) {
  float x = raw * p.scale;
  if constexpr (Mods::kSoftcap) x = p.softcap * tanhf(x / p.softcap);
  if constexpr (Mods::kAlibi) x -= m.alibi_slope * fabsf(static_cast<float>(row + m.diag - key));
  if constexpr (Mods::kMask != kMaskNone)
    x += mask_value<Mods::kMask>(m.mask, row * p.mask_stride_q + key * p.mask_stride_k);
  return x * kLog2e;
}

// Masks (and, with modifiers, forms) the S accumulators of one warp: MT m16 row tiles x NT n8
// key tiles in the mma.sync C layout (this lane: rows row0 and row0 + 8 of each row tile, keys
// key0 and key0 + 1 of each key tile). Modifiers apply to every tile; without them only tiles
// that cross the band or the sequence end (`full` false) are touched. Rows past the end never
// read the mask tensor.
template <class Mods, int MT, int NT>
__device__ __forceinline__ void mask_scores(float (&s)[MT][NT][4], const AttnFwdParams& p, const ModState& mods,
                                            const Band& band, int row0, int key0, int sq, int sk, bool full) {
  if (!Mods::kAny && full) return;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nt * 8 + (e & 1), row = row0 + mi * 16 + (e >> 1) * 8;
        const bool ok = key < sk && band.allows(row, key);
        if constexpr (Mods::kAny) s[mi][nt][e] = ok && row < sq ? score_mod<Mods>(p, mods, s[mi][nt][e], row, key) : -inf();
        else if (!ok) s[mi][nt][e] = -inf();
      }
}

}  // namespace pyattn

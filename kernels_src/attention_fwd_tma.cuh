// attn_fwd_tma (sm_90a): the wgmma forward kernel (attention_fwd_wgmma.cuh) fed by TMA. A producer
// warpgroup hands the consumers their stages as in the warp-specialized wgmma rows, but only one
// of its threads works: per key tile it issues one bulk tensor copy per 64-wide column block of K
// and of V (and, with tile 0, of the query tile), 128-byte swizzled by the copy engine into the
// layout the wgmma descriptors read, with zeros past the tensor's ends (rows past the sequence,
// columns past head_dim). Against the cp.async producer (about 2 instructions per 16 bytes over
// 128 threads) that frees the SM's issue slots and the producer's registers for the consumers.
// Varlen: a tile that reaches past its sequence's end reads the next sequence's rows (TMA clips at
// the packed tensor's end only); the kernel masks those keys as before (P = 0 there, and query
// rows past the end are never stored).
// A mask tensor's tiles come the same way (map tm_mask; its swizzle is the one that spans a tile
// row's bytes, up to 128), so a masked call runs this kernel too; the host maps only masks whose
// keys are consecutive and whose address and strides are whole 16 bytes.
// Requires pyattn::AttnFwdTmaParams (rendered: AttnFwdParams `fwd`, then the maps tm_q, tm_k,
// tm_v, tm_mask); launch as attn_fwd_wgmma.
#pragma once
#include "attention_fwd_wgmma.cuh"

namespace pyattn {

template <class Tr, class Mods>
__device__ __forceinline__ void attn_fwd_tma(const AttnFwdTmaParams& p) {
  static_assert(Tr::kTma, "attn_fwd_tma: traits with TMA on");
  attn_fwd_wgmma<Tr, Mods, false>(p.fwd, &p.tm_q);  // tm_q, tm_k, tm_v, tm_mask: consecutive 128-byte maps
}

}  // namespace pyattn

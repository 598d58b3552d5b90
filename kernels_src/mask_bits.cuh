// A bool mask packed to bits for attn_fwd_tma (MaskKind kMaskBits): bit j of word w of a packed row
// is key 32 w + j of that (batch, head, query row), 1 = may attend, any nonzero byte counting as
// True; rows are `words` words (whole 16-byte groups, the main loop's vector loads) with zeros
// past the keys. Broadcast axes of the mask stay broadcast (packed size 1), so a key-padding mask
// packs to one row a batch entry. One thread a word, grid-stride; threads of a row read
// consecutive 32-byte pieces of it (coalesced).
// Why pack per call rather than stage bytes: a bool tile in the ring took a stage's worth of
// shared memory from K/V (2 stages and no overlap at d = 128: 1.17x the dense time before any
// mask work); 128 x 128 bits are 2 KiB, read by each thread as two 16-byte loads from L2.
// Requires pyattn::MaskBitsParams and common.cuh.
#pragma once
#include "common.cuh"

namespace pyattn {

// Bits 0..3 = bytes 0..3 of `x` nonzero.
__device__ __forceinline__ unsigned mask_nibble(unsigned x) {
  return ((__vcmpne4(x, 0u) & 0x01010101u) * 0x01020408u) >> 24;
}

__device__ __forceinline__ void mask_bits(const MaskBitsParams& p) {
  const long long total = static_cast<long long>(p.rows) * p.words;
  const unsigned char* src = static_cast<const unsigned char*>(p.src);
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int w = static_cast<int>(idx % p.words);
    long long r = idx / p.words;  // packed row: (batch, head, query row), each of its packed size
    const long long q = r % p.rows_q;
    r /= p.rows_q;
    const long long h = r % p.rows_h, b = r / p.rows_h;
    const long long key0 = 32ll * w;
    const unsigned char* row = src + b * p.stride_b + h * p.stride_h + q * p.stride_q;
    unsigned word = 0;
    if (key0 + 32 <= p.keys && p.stride_k == 1 && reinterpret_cast<unsigned long long>(row + key0) % 16 == 0) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(row + key0));
      const uint4 c = __ldg(reinterpret_cast<const uint4*>(row + key0 + 16));
      word = mask_nibble(a.x) | mask_nibble(a.y) << 4 | mask_nibble(a.z) << 8 | mask_nibble(a.w) << 12 |
             mask_nibble(c.x) << 16 | mask_nibble(c.y) << 20 | mask_nibble(c.z) << 24 | mask_nibble(c.w) << 28;
    } else {  // row ends, strided or unaligned masks: a byte at a time
      for (int j = 0; j < 32 && key0 + j < p.keys; ++j)
        if (__ldg(row + (key0 + j) * p.stride_k)) word |= 1u << j;
    }
    static_cast<unsigned*>(p.dst)[idx] = word;
  }
}

}  // namespace pyattn

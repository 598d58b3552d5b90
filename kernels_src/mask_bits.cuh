// A bool mask packed to bits for attn_fwd_tma (MaskKind kMaskBits), any nonzero byte counting as
// True (1 = may attend). A packed row (batch, head, query row) is 128-key groups of four u32
// words, zeros past the keys; broadcast axes of the mask stay broadcast (packed size 1), so a
// key-padding mask packs to one row a batch entry.
// Word order, "thread-major": word t of group g holds, at bit 2 i + e, key 128 g + 8 i + 2 t + e
// (i = 0..15, e = 0..1): exactly the keys that lane t of a quad holds in a wgmma accumulator row
// of a 128-key tile (n8 block i, column 2 t + e). A consumer thread then reads one word a row
// and tests bit 2 i + e, where a key-ordered word needed four words a row, shifted by 2 t
// (BENCHMARKS.md, fortieth session).
// One thread a 128-key group (reads 128 bytes, writes 16), grid-stride; the threads of a row read
// consecutive 128-byte pieces of it.
// A group whose keys all lie outside row q's causal / window band (band_lo <= key - q <= hi) is
// written as zeros without reading the mask: the kernel masks those keys by the band anyway, and a
// causal call then reads half the mask (a 16k x 16k bool mask: ~45 us of a ~90 us pack on H200).
// A mask broadcast over the query rows gets an unbounded band (its one row serves every query).
// Why pack per call rather than stage bytes: a bool tile in the ring took a stage's worth of
// shared memory from K/V (2 stages and no overlap at d = 128: 1.17x the dense time before any
// mask work); 128 x 128 bits are 2 KiB.
// Requires pyattn::MaskBitsParams and common.cuh.
#pragma once
#include "common.cuh"

namespace pyattn {

// Bits 0..3 = bytes 0..3 of `x` nonzero.
__device__ __forceinline__ unsigned mask_nibble(unsigned x) {
  return ((__vcmpne4(x, 0u) & 0x01010101u) * 0x01020408u) >> 24;
}

__device__ __forceinline__ void mask_bits(const MaskBitsParams& p) {
  const int groups = p.words / 4;
  const long long total = static_cast<long long>(p.rows) * groups;
  const unsigned char* src = static_cast<const unsigned char*>(p.src);
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int g = static_cast<int>(idx % groups);
    long long r = idx / groups;  // packed row: (batch, head, query row), each of its packed size
    const long long q = r % p.rows_q;
    r /= p.rows_q;
    const long long h = r % p.rows_h, b = r / p.rows_h;
    const long long key0 = 128ll * g;
    const unsigned char* row = src + b * p.stride_b + h * p.stride_h + q * p.stride_q;
    unsigned w[4] = {0u, 0u, 0u, 0u};
    if (key0 - q > p.band_hi || key0 + 127 - q < p.band_lo) {
      // outside the band: zeros, unread
    } else if (key0 + 128 <= p.keys && p.stride_k == 1 && reinterpret_cast<unsigned long long>(row + key0) % 16 == 0) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {  // keys 16 c .. 16 c + 15: n8 blocks 2 c (bytes 0-7), 2 c + 1 (8-15)
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(row + key0 + 16 * c));
        const unsigned lo01 = mask_nibble(a.x), lo23 = mask_nibble(a.y);  // block 2 c: lanes 0, 1 / 2, 3
        const unsigned hi01 = mask_nibble(a.z), hi23 = mask_nibble(a.w);  // block 2 c + 1
        w[0] |= ((lo01 & 3u) | (hi01 & 3u) << 2) << (4 * c);
        w[1] |= ((lo01 >> 2) | (hi01 >> 2) << 2) << (4 * c);
        w[2] |= ((lo23 & 3u) | (hi23 & 3u) << 2) << (4 * c);
        w[3] |= ((lo23 >> 2) | (hi23 >> 2) << 2) << (4 * c);
      }
    } else {  // row ends, strided or unaligned masks: a byte at a time
      for (int j = 0; j < 128 && key0 + j < p.keys; ++j)
        if (__ldg(row + (key0 + j) * p.stride_k)) w[(j & 7) >> 1] |= 1u << (2 * (j >> 3) + (j & 1));
    }
    reinterpret_cast<uint4*>(p.dst)[idx] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace pyattn

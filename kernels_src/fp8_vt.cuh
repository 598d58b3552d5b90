// fp8 V transposed for attn_fwd_fp8: 8-bit wgmma reads both operands K-major, so P V needs V with
// its keys contiguous. vt[batch][kv head][d][key] (rows of keys_pad keys, a multiple of 16, zeros
// past seqlen_k: P is 0 there, and 0 * NaN garbage would not be), keys permuted within each 16-key
// group: logical key 4t + j holds physical key 2t + (j & 1) + 8 (j >> 1), the order in which the
// main loop packs S's accumulator registers into P's A fragments (Mainloop::pack_p).
// One block of 256 threads moves 64 keys x 64 head dims of one (batch, kv head) through shared
// memory, in 4-byte loads and stores. Grid: (key_tiles * batch * heads_kv, ceil(head_dim / 64)).
// Requires pyattn::Fp8VtParams and common.cuh.
#pragma once
#include "common.cuh"

namespace pyattn {

__device__ __forceinline__ void fp8_vt(const Fp8VtParams& p) {
  // [key][dim]; rows of 68 bytes: a warp's 4 reads of a column land in distinct banks
  __shared__ __align__(16) unsigned char tile[64][68];
  const int kt = blockIdx.x % p.key_tiles, bh = blockIdx.x / p.key_tiles;
  const int b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int k0 = 64 * kt, d0 = 64 * blockIdx.y;
  const unsigned char* v = static_cast<const unsigned char*>(p.v) + b * p.v_stride_b + h * p.v_stride_h;
  for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) {
    const int r = i / 16, d = d0 + 4 * (i % 16), key = k0 + r;
    unsigned x = 0u;  // head_dim is a multiple of 8: a word is whole or past the end
    if (key < p.seqlen_k && d < p.head_dim) x = *reinterpret_cast<const unsigned*>(v + key * p.v_stride_s + d);
    *reinterpret_cast<unsigned*>(&tile[r][4 * (i % 16)]) = x;
  }
  __syncthreads();
  unsigned char* vt = static_cast<unsigned char*>(p.vt) + static_cast<long long>(bh) * p.head_dim * p.keys_pad;
  for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) {
    const int dr = i / 16, d = d0 + dr, l0 = 4 * (i % 16);  // logical keys l0 .. l0 + 3 of the tile
    if (d >= p.head_dim || k0 + l0 >= p.keys_pad) continue;  // keys_pad: a multiple of 16, so all 4
    const int base = (l0 & ~15) + 2 * ((l0 & 15) / 4);      // physical keys base, +1, +8, +9
    const unsigned x = tile[base][dr] | (tile[base + 1][dr] << 8) | (tile[base + 8][dr] << 16) |
                       (static_cast<unsigned>(tile[base + 9][dr]) << 24);
    *reinterpret_cast<unsigned*>(vt + static_cast<long long>(d) * p.keys_pad + k0 + l0) = x;
  }
}

}  // namespace pyattn

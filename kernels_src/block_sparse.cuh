// Block-sparse key-tile lists for the tensor-core prefill kernels (attention_fwd_mma.cuh and
// attention_fwd_wgmma.cuh). The host (pyattn/ops/_sparse_layout.py) turns the user's BSR layout
// into, per (query head, query tile), the ascending list of key tiles holding at least one visible
// 16 x 16 sub-block, plus a bit mask of those sub-blocks. A kernel then walks only the listed
// tiles (work proportional to the non-zero blocks) and masks per element only in tiles whose mask
// is not all ones. Dense launches (SPARSE = false) walk [n_begin, n_end) in steps of BN as before.
// Requires pyattn::AttnFwdParams.
#pragma once

namespace pyattn {

template <int BM, int BN, bool SPARSE>
struct KeyTiles {
  static constexpr int kColBits = BN / 16;  // sub-blocks per row of sub-blocks
  static constexpr int kBits = (BM / 16) * kColBits;
  // Dense tiles may be larger (192 query rows): their mask is all ones and never indexed.
  static constexpr unsigned long long kAll = kBits >= 64 ? ~0ull : ((1ull << kBits) - 1ull);
  static_assert(BM % 16 == 0 && BN % 16 == 0 && (kBits <= 64 || !SPARSE),
                "one 64-bit mask of 16 x 16 sub-blocks per tile");

  const int* idx;                  // SPARSE: this row's key-tile ids
  const unsigned long long* bits;  // SPARSE: their sub-block masks
  int n_begin;                     // dense: first key of the band
  int count;                       // tiles to visit

  // Dense: the band's tiles [n_begin, n_end). Sparse: row head * tile_stride_h + m_block of the list.
  __device__ __forceinline__ void init(const AttnFwdParams& p, int head, int m_block, int begin, int end) {
    if constexpr (SPARSE) {
      const int r = head * p.tile_stride_h + m_block, t0 = p.tile_ptr[r];
      idx = p.tile_idx + t0;
      bits = p.tile_bits + t0;
      count = p.tile_ptr[r + 1] - t0;
      n_begin = 0;
    } else {
      idx = nullptr;
      bits = nullptr;
      n_begin = begin;
      count = end > begin ? (end - begin + BN - 1) / BN : 0;
    }
  }

  __device__ __forceinline__ int n0(int j) const {
    if constexpr (SPARSE) return __ldg(idx + j) * BN;
    return n_begin + j * BN;
  }

  // Sub-block mask of tile j; kAll (nothing to mask) for dense launches.
  __device__ __forceinline__ unsigned long long mask(int j) const {
    if constexpr (SPARSE) return __ldg(bits + j);
    return kAll;
  }

  // Whether key offset `col` (within the tile) of sub-block row `rb` is in a visible sub-block.
  __device__ __forceinline__ static bool visible(unsigned long long m, int rb, int col) {
    return (m >> (rb * kColBits + col / 16)) & 1ull;
  }
};

}  // namespace pyattn

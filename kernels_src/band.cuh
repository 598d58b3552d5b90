// The causal / sliding-window band: which keys a query row may see, shared by the prefill and
// decode kernels. Parameter-struct agnostic: make_band reads causal and window_left/right from
// any params struct that has them.
#pragma once

namespace pyattn {

constexpr int kNoBound = 1 << 30;  // "unbounded" side of the band; compared as key - row, never summed

// Row i may see key j iff lo <= j - i <= hi (and 0 <= j < sk). Causal and window combine by AND.
struct Band {
  int lo, hi;
  __device__ __forceinline__ bool allows(int row, int key) const {
    const int d = key - row;  // both < 2^31 and >= 0: the difference cannot overflow
    return d >= lo && d <= hi;
  }
};

template <class Params>  // AttnFwdParams or DecodeParams: both carry causal and window_left/right
__device__ __forceinline__ Band make_band(const Params& p, int sq, int sk) {
  const int diag = sk - sq;  // bottom-right alignment
  Band b{-kNoBound, kNoBound};
  if (p.causal == 1) b.hi = diag;
  if (p.causal == 2) b.hi = 0;  // top-left (torch SDPA's is_causal)
  if (p.window_right >= 0) b.hi = min(b.hi, diag + p.window_right);
  if (p.window_left >= 0) b.lo = diag - p.window_left;
  return b;
}

// Key tiles [begin, end) that rows [r0, r1] can see at all; begin is a multiple of BN.
template <int BN>
__device__ __forceinline__ void band_key_range(const Band& b, int r0, int r1, int sk, int& begin, int& end) {
  const long long lo = static_cast<long long>(r0) + b.lo, hi = static_cast<long long>(r1) + b.hi + 1;
  begin = static_cast<int>(max(0LL, lo)) / BN * BN;
  end = static_cast<int>(min(static_cast<long long>(sk), hi));
}

// True when every key of [n0, n0 + BN) is visible to every row of [r0, r1] (no per-element masking).
template <int BN>
__device__ __forceinline__ bool band_tile_full(const Band& b, int r0, int r1, int n0, int sk) {
  return n0 + BN <= sk && n0 + BN - 1 - r0 <= b.hi && n0 - r1 >= b.lo;
}

}  // namespace pyattn

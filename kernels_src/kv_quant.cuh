// The 8-bit encoders the paged-cache writers share (kv_append.cuh: per-token scales; kv_pages.cuh:
// per-channel key scales): fp32 constants, a NaN-propagating max, and int8 / fp8 e4m3 encoding
// exactly as pyattn/quant.py documents.
#pragma once
#include <cuda_fp8.h>

namespace pyattn {

// fp32 constants without <cfloat> (NVRTC has no host headers).
__device__ __forceinline__ float kv_flt_max() { return __int_as_float(0x7f7fffff); }
__device__ __forceinline__ float kv_qnan() { return __int_as_float(0x7fffffff); }

// max that propagates NaN (fmaxf drops it): a NaN anywhere in a row must reach every lane.
__device__ __forceinline__ float max_keep_nan(float a, float b) { return (a > b || a != a) ? a : b; }

template <int KV> struct KvQuant;

// int8: symmetric codes in [-127, 127] (-128 unused, so negating a code never overflows).
template <> struct KvQuant<1> {
  static constexpr float kMax = 127.0f;
  __device__ static __forceinline__ unsigned pack4(float a, float b, float c, float d) {
    return byte(a) | (byte(b) << 8) | (byte(c) << 16) | (byte(d) << 24);
  }
  // __float2int_rn: round half to even (np.rint); |y| <= 127 * (1 + 2^-23) here, the clamp is exact.
  __device__ static __forceinline__ unsigned byte(float y) {
    return static_cast<unsigned>(min(max(__float2int_rn(y), -127), 127)) & 0xffu;
  }
};

// fp8 e4m3 ("fn": no inf, max normal 448): round to nearest even, saturating to +-448. sm_89+ run
// one cvt.rn.satfinite.e4m3x2.f32 per pair; older archs the header's exact software conversion.
template <> struct KvQuant<2> {
  static constexpr float kMax = 448.0f;
  __device__ static __forceinline__ unsigned pack4(float a, float b, float c, float d) {
    const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return (lo & 0xffffu) | (hi << 16);  // x.x in the low byte: element order = byte order
  }
};

// One code from one scaled value y (|y| <= kMax up to float32 rounding), as its byte.
template <int KV>
__device__ __forceinline__ unsigned kv_encode1(float y) {
  if constexpr (KV == 1) {
    return KvQuant<1>::byte(y);
  } else {
    return static_cast<unsigned>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3)) & 0xffu;
  }
}

// The float value of one stored code (exact: int8 and e4m3 values are float32 values).
template <int KV>
__device__ __forceinline__ float kv_decode1(unsigned char c) {
  if constexpr (KV == 1) {
    return static_cast<float>(static_cast<signed char>(c));
  } else {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3)));
  }
}

}  // namespace pyattn

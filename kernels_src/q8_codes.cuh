// 8-bit KV codes to fp16 pairs, for the 8-bit decode kernels (attention_decode_q8.cuh) and the
// GPU test of the conversion (tests/test_gpu_quant_decode.py). Requires common.cuh and cuda_fp8.h.
#pragma once

namespace pyattn {

// Four codes of one word -> two packed fp16 pairs (codes 0, 1) and (2, 3), exactly.
template <int KV>
__device__ __forceinline__ void codes_to_half2(unsigned w, unsigned& lo, unsigned& hi) {
  if constexpr (KV == 1) {  // int8: (x + 128) in the low mantissa of 1024 (0x64xx), minus 1152
    const unsigned u = w ^ 0x80808080u;
    const unsigned x = __byte_perm(u, 0x64646464u, 0x4140), y = __byte_perm(u, 0x64646464u, 0x4342);
    const __half2 bias = __half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
    const __half2 a = __hsub2(*reinterpret_cast<const __half2*>(&x), bias);
    const __half2 b = __hsub2(*reinterpret_cast<const __half2*>(&y), bias);
    lo = *reinterpret_cast<const unsigned*>(&a);
    hi = *reinterpret_cast<const unsigned*>(&b);
  } else {  // e4m3 -> f16 is exact
#if __CUDA_ARCH__ >= 890  // one cvt per pair
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    lo = *reinterpret_cast<const unsigned*>(&a);  // {x, y}: x in the low half, as mma expects
    hi = *reinterpret_cast<const unsigned*>(&b);
#else
    // No fp8 cvt before sm_89, and cuda_fp8.h's software conversion (a branchy routine per code)
    // cost 2-4.5 s of ptxas per d=256 decode variant. Instead: a code's sign and 7 magnitude bits
    // placed at fp16 bits 15 and 13..7 are a half of value code * 2^-8, normal and subnormal codes
    // alike (fp16's 5 exponent bits to e4m3's 4, the same 3 mantissa bits), and one HMUL2 by 256
    // scales it back exactly. The NaN code (0x7F) would read 480: the cache never writes it (its
    // codes saturate at 448).
    const __half2 k256 = __half2(__ushort_as_half(0x5C00), __ushort_as_half(0x5C00));
    const unsigned t0 = __byte_perm(w, 0u, 0x4140);  // codes 0, 1 -> the low bytes of two halves
    const unsigned t1 = __byte_perm(w, 0u, 0x4342);  // codes 2, 3
    const unsigned x = ((t0 & 0x00800080u) << 8) | ((t0 & 0x007F007Fu) << 7);
    const unsigned y = ((t1 & 0x00800080u) << 8) | ((t1 & 0x007F007Fu) << 7);
    const __half2 a = __hmul2(*reinterpret_cast<const __half2*>(&x), k256);
    const __half2 b = __hmul2(*reinterpret_cast<const __half2*>(&y), k256);
    lo = *reinterpret_cast<const unsigned*>(&a);
    hi = *reinterpret_cast<const unsigned*>(&b);
#endif
  }
}

}  // namespace pyattn

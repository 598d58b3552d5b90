// Thin wrappers over the sm_80+ warp-level tensor-core and async-copy instructions.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4), which the kernels rely on:
//   A 16x16 (row):  a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B 16x8  (col):  b0 = (k 2t..2t+1, n g)  b1 = (k 2t+8.., n g)
//   C 16x8  (f32):  c0,c1 = (g, 2t..2t+1)   c2,c3 = (g+8, 2t..2t+1)
// The C layout of two adjacent n8 tiles equals the A layout of one k16 step, which is what lets
// the softmax probabilities P stay in registers between S = Q K^T and O += P V.
#pragma once

namespace pyattn {

// Two 1.0s of T, packed as pack2 would (a tile of ones: row sums on the tensor cores; bf16 only
// so far, the bounded soft-cap's).
template <typename T> __device__ __forceinline__ constexpr unsigned ones2();
template <> __device__ __forceinline__ constexpr unsigned ones2<__nv_bfloat16>() { return 0x3F803F80u; }
template <typename T> constexpr bool kIsBf16 = false;
template <> constexpr bool kIsBf16<__nv_bfloat16> = true;

// Two floats -> one register of two 16-bit values (low half = first).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// D = A B + C, fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the special-function unit, denormals flushed: softmax terms that small are zero anyway,
// and exp2f would add range handling around the same instruction.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x without the special-function unit (FlashAttention-4's trick for Blackwell, where that unit
// did not grow with the tensor cores): x = n + f, n = round(x) by the 1.5 * 2^23 addition (add.rn:
// the compiler may not fold it away), 2^f on [-0.5, 0.5] by a cubic (relative error 7.5e-5, below
// bf16 P's rounding of 2^-9), 2^n built in the exponent bits. ~9 FMA / integer instructions
// against one MUFU op that the SFU (16 lanes an SM a clock) serves at 1/8 of the FMA rate. A
// soft-capped softmax loads the SFU twice a score (tanh and exp2), and there 1 or 2 of every 8
// exp2s taken so measured 3-8% faster; more was slower, as the softmax is bound by its issue and
// latency too (the tile rows' poly_exp; BENCHMARKS.md, twenty-sixth session).
// x is clamped at -127, where 2^n's bits are 0: -inf (a masked score) gives 0 exactly.
__device__ __forceinline__ float poly_exp2(float x) {
  x = fmaxf(x, -127.f);
  float t, n;
  asm("add.rn.f32 %0, %1, 0f4B400000;\n" : "=f"(t) : "f"(x));  // round(x) in t's low mantissa bits
  asm("sub.rn.f32 %0, %1, 0f4B400000;\n" : "=f"(n) : "f"(t));
  const float f = x - n;
  const float p = fmaf(fmaf(fmaf(0x1.c3f6a6p-5f, f, 0x1.f0ddccp-3f), f, 0x1.62f31ap-1f), f, 0x1.fff694p-1f);
  return p * __int_as_float((__float_as_int(t) << 23) + (127 << 23));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit values; lane l supplies the shared-window address of one matrix
// row (a TMA-filled tile's, which the wgmma kernels keep as such).
__device__ __forceinline__ void ldmatrix_x4_at(unsigned (&r)[4], unsigned saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr));
}
// The same at a generic pointer into shared memory.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) { ldmatrix_x4_at(r, smem_addr(row)); }

// The OR of the two 32-bit words at shared-memory pointer p (8-byte aligned), by a volatile load,
// which the compiler neither merges with another load of the same bytes nor hoists (a test pass
// before a second pass that reads the same words for their values).
__device__ __forceinline__ unsigned lds_or_pair(const void* p) {
  unsigned a, b;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(a), "=r"(b) : "r"(smem_addr(p)));
  return a | b;
}

// Two 8x8 matrices; lanes 0-15 supply the row addresses.
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

// 16-byte global -> shared copy that bypasses registers and L1; zero-fills when !valid
// (a src-size of 0 reads nothing, so `src` only has to be some valid address).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Zero MT x N accumulator tiles in the mma C layout (score tiles before Q K^T).
template <int MT, int N>
__device__ __forceinline__ void zero_tiles(float (&x)[MT][N][4]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int i = 0; i < N; ++i) x[mi][i][0] = x[mi][i][1] = x[mi][i][2] = x[mi][i][3] = 0.f;
}

// An empty online-softmax state: O = 0, running max -inf, sum 0 (rows g and g + 8 of each tile).
template <int MT, int DT>
__device__ __forceinline__ void init_softmax_state(float (&acc)[MT][DT][4], float (&row_max)[MT][2],
                                                   float (&row_sum)[MT][2]) {
  zero_tiles<MT, DT>(acc);
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    row_max[mi][0] = row_max[mi][1] = -inf();
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }
}

// Online-softmax step over one warp's score tile in the C layout above: MT m16 row tiles x NT n8
// key tiles, this lane holding rows g and g + 8 of each row tile (the 4 lanes of a quad share
// them). Scores s are scaled by sl2 into log2 units; row_max keeps the running max of the
// unscaled scores, row_sum this lane's partial sum (quad-reduced once, in the epilogue), and acc
// (MT x DT n8 output tiles) is rescaled to the new max. s becomes the unnormalised P.
// SKIP_SAME: skip the rescale of acc when no row of the warp's tile got a new max (a warp vote
// instead of DT x 4 multiplies; decode's long rows keep their max after the first tiles).
template <int MT, int NT, int DT, bool SKIP_SAME = false>
__device__ __forceinline__ void online_softmax(float (&s)[MT][NT][4], float (&acc)[MT][DT][4],
                                               float (&row_max)[MT][2], float (&row_sum)[MT][2], float sl2) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[mi][h];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mi][nt][2 * h], s[mi][nt][2 * h + 1]));
      mx = quad_max(mx);
      // A row with no visible key yet keeps max -inf: exponentiate against 0, never (-inf) - (-inf).
      const float ref = mx == -inf() ? 0.f : mx * sl2;
      corr[h] = fast_exp2(fmaf(row_max[mi][h], sl2, -ref));
      row_max[mi][h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[mi][nt][2 * h] = fast_exp2(fmaf(s[mi][nt][2 * h], sl2, -ref));
        s[mi][nt][2 * h + 1] = fast_exp2(fmaf(s[mi][nt][2 * h + 1], sl2, -ref));
        sum += s[mi][nt][2 * h] + s[mi][nt][2 * h + 1];
      }
      row_sum[mi][h] = row_sum[mi][h] * corr[h] + sum;
    }
    if constexpr (SKIP_SAME)
      if (!__any_sync(kFullMask, corr[0] != 1.f || corr[1] != 1.f)) continue;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      acc[mi][dt][0] *= corr[0]; acc[mi][dt][1] *= corr[0];
      acc[mi][dt][2] *= corr[1]; acc[mi][dt][3] *= corr[1];
    }
  }
}

// The A fragments of P for k16 step kk (key tiles 2kk and 2kk + 1), from S's C fragments.
template <typename T, int MT, int NT>
__device__ __forceinline__ void p_fragments(const float (&s)[MT][NT][4], int kk, unsigned (&a)[MT][4]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    a[mi][0] = pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
    a[mi][1] = pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
    a[mi][2] = pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
    a[mi][3] = pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
  }
}

}  // namespace pyattn

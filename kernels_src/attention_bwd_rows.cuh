// The backward's row-parallel kernels around the main one (attention_bwd_mma.cuh / _simt.cuh /
// _wgmma.cuh):
//
//   attn_bwd_pre:     per query row, dsum = rowsum(dout * o) (fp32), the LSE in log2 units
//                     (+inf for a row that saw no key, so its recomputed P is exp2(-inf) = 0, never
//                     NaN), dq_acc zeroed, and the deterministic counters of its query tiles zeroed.
//                     Rows past the sequence up to the next multiple of block_m (which the main
//                     kernel reads as part of its last query tile) get dsum 0 and LSE +inf.
//   attn_bwd_convert: dq = scale * dq_acc, rounded to T, into the caller's strided dq.
//
// Both are bound by memory bandwidth (at B * S = 16k rows of 2048 elements: 256 MB moved by the
// pre pass, 192 MB by convert), so they move 16-byte chunks: a row's chunks lie on W lanes (W the
// power of two >= the row's chunks, at most 32) and a warp takes 32 / W rows. One warp per row with
// 2-byte loads ran at 0.9 TB/s (BENCHMARKS.md, issue 14, fifth session): a d=64 row's 128 bytes
// were 2 bytes per lane per load. Arrays that are not 16-byte aligned (`out` is read with plain
// loads by contract, fp32 dq may have any stride) take the same lanes element by element; the
// alignment test reads only launch parameters, so every thread takes the same path.
// Grid: (row tiles of WARPS * 32 / W rows, heads_q, batch); row_pass_rows_per_warp in
// pyattn/kernels/families/backward.py computes 32 / W for the host. Requires AttnBwdParams,
// common.cuh and attention_bwd_common.cuh.
#pragma once
#include "attention_bwd_common.cuh"

namespace pyattn {

// Where this thread works in a row pass (see the top): chunk lane c of W, row r of the warp's rows.
struct RowLanes {
  int width, rows, c, r;
};

template <typename T>
__device__ __forceinline__ RowLanes row_lanes(int head_dim) {
  const int chunks = head_dim * static_cast<int>(sizeof(T)) / 16;  // head_dim % 8 == 0: whole chunks
  int w = 1;
  while (w < chunks && w < 32) w <<= 1;
  const int lane = threadIdx.x % 32;
  return {w, 32 / w, lane % w, lane / w};
}

__device__ __forceinline__ bool aligned16(const void* base, long long sb, long long sh, long long ss, int elem) {
  return ((reinterpret_cast<unsigned long long>(base) | static_cast<unsigned long long>((sb | sh | ss) * elem)) & 15) == 0;
}

// Sum over the W lanes of a row (W a power of two, the same for the whole warp).
__device__ __forceinline__ float row_sum(float x, int width) {
  for (int offset = width / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// The dot product of two 16-byte chunks of T, added to acc in fp32.
template <typename T>
__device__ __forceinline__ float chunk_dot(const uint4& a, const uint4& b, float acc) {
  const T* x = reinterpret_cast<const T*>(&a);
  const T* y = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) acc = fmaf(to_float(x[i]), to_float(y[i]), acc);
  return acc;
}

template <typename T, int WARPS>
__device__ __forceinline__ void attn_bwd_pre(const AttnBwdParams& p) {
  constexpr int E = 16 / sizeof(T);  // elements per chunk
  const RowLanes rl = row_lanes<T>(p.head_dim);
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row = (blockIdx.x * WARPS + threadIdx.x / 32) * rl.rows + rl.r;
  const BwdSeq seq = bwd_seq(p, batch);
  const int padded = (seq.sq + p.block_m - 1) / p.block_m * p.block_m;
  if ((row - rl.r) >= padded) return;  // the warp's first row: the whole warp, before any shuffle
  const long long r = acc_row(p, seq, batch, head) + row;
  const long long qi = seq.q_row0 + row;
  const T* o = static_cast<const T*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + qi * p.o_stride_s;
  const T* dout = static_cast<const T*>(p.dout) + batch * p.dout_stride_b + head * p.dout_stride_h + qi * p.dout_stride_s;
  float* acc = p.dq_acc + r * p.head_dim;
  float sum = 0.f;
  if (row < seq.sq) {
    if constexpr (sizeof(T) == 4) {
      // fp32, the exact CUDA-core path: one lane sums the row in d order with fmaf, the order in which
      // attn_bwd_simt forms dP. With one visible key (o = v) dP - dsum is then exactly 0, so dS = 0
      // as in the reference, not a rounding difference that the 2x rule against an exact 0 refuses.
      if (rl.c == 0)
        for (int d = 0; d < p.head_dim; ++d) sum = fmaf(to_float(dout[d]), to_float(o[d]), sum);
    } else if (aligned16(p.o, p.o_stride_b, p.o_stride_h, p.o_stride_s, sizeof(T)) &&
        aligned16(p.dout, p.dout_stride_b, p.dout_stride_h, p.dout_stride_s, sizeof(T))) {
      for (int c = rl.c; c < p.head_dim / E; c += rl.width)
        sum = chunk_dot<T>(*reinterpret_cast<const uint4*>(dout + c * E), *reinterpret_cast<const uint4*>(o + c * E), sum);
    } else {
      for (int d = rl.c; d < p.head_dim; d += rl.width) sum = fmaf(to_float(dout[d]), to_float(o[d]), sum);
    }
    for (int c = rl.c; c < p.head_dim / 4; c += rl.width)  // dq_acc rows: 256-byte aligned scratch
      reinterpret_cast<float4*>(acc)[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  sum = row_sum(sum, rl.width);
  if (rl.c != 0 || row >= padded) return;
  if (p.deterministic && row % p.block_m == 0)
    p.sem[(static_cast<long long>(batch) * p.heads_q + head) * p.m_blocks + row / p.block_m] = 0;
  if (row >= seq.sq) {  // padding of the last query tile
    p.dsum[r] = 0.f;
    p.lse_log2[r] = inf();
    return;
  }
  const float lse = p.lse[batch * p.lse_stride_b + head * p.lse_stride_h + qi * p.lse_stride_s];
  p.dsum[r] = sum;
  p.lse_log2[r] = lse == -inf() ? inf() : lse * kLog2e;
}

template <typename T, int WARPS>
__device__ __forceinline__ void attn_bwd_convert(const AttnBwdParams& p) {
  constexpr int E = 16 / sizeof(T);
  const RowLanes rl = row_lanes<T>(p.head_dim);
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row = (blockIdx.x * WARPS + threadIdx.x / 32) * rl.rows + rl.r;
  const BwdSeq seq = bwd_seq(p, batch);
  if (row >= seq.sq) return;  // no shuffles here: lanes leave on their own
  const long long qi = seq.q_row0 + row;
  const float* acc = p.dq_acc + (acc_row(p, seq, batch, head) + row) * p.head_dim;
  T* dq = static_cast<T*>(p.dq) + batch * p.dq_stride_b + head * p.dq_stride_h + qi * p.dq_stride_s;
  if (aligned16(p.dq, p.dq_stride_b, p.dq_stride_h, p.dq_stride_s, sizeof(T))) {
    for (int c = rl.c; c < p.head_dim / E; c += rl.width) {
      uint4 out;
      T* x = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int i = 0; i < E; i += 4) {
        const float4 a = reinterpret_cast<const float4*>(acc + c * E)[i / 4];
        x[i] = from_float<T>(a.x * p.scale);
        x[i + 1] = from_float<T>(a.y * p.scale);
        x[i + 2] = from_float<T>(a.z * p.scale);
        x[i + 3] = from_float<T>(a.w * p.scale);
      }
      *reinterpret_cast<uint4*>(dq + c * E) = out;
    }
  } else {
    for (int d = rl.c; d < p.head_dim; d += rl.width) dq[d] = from_float<T>(acc[d] * p.scale);
  }
}

}  // namespace pyattn

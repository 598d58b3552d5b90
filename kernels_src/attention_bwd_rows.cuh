// The backward's row-parallel kernels around the main one (attention_bwd_mma.cuh / _simt.cuh):
//
//   attn_bwd_pre:     per query row, dsum = rowsum(dout * o) (fp32), the LSE in log2 units
//                     (+inf for a row that saw no key, so its recomputed P is exp2(-inf) = 0, never
//                     NaN), dq_acc zeroed, and the deterministic counters of its query tiles zeroed.
//                     Rows past the sequence up to the next multiple of block_m (which the main
//                     kernel reads as part of its last query tile) get dsum 0 and LSE +inf.
//   attn_bwd_convert: dq = scale * dq_acc, rounded to T, into the caller's strided dq.
//
// One warp per row, lane l on elements l, l + 32, ...: rows are head_dim <= 256 elements, the
// loads of a warp are contiguous, and the head dim is a launch parameter (one variant per dtype).
// Grid: (row tiles of WARPS rows, heads_q, batch). Requires AttnBwdParams, common.cuh and
// attention_bwd_common.cuh.
#pragma once
#include "attention_bwd_common.cuh"

namespace pyattn {

template <typename T, int WARPS>
__device__ __forceinline__ void attn_bwd_pre(const AttnBwdParams& p) {
  const int head = blockIdx.y, batch = blockIdx.z, lane = threadIdx.x % 32;
  const int row = blockIdx.x * WARPS + threadIdx.x / 32;
  const BwdSeq seq = bwd_seq(p, batch);
  const int padded = (seq.sq + p.block_m - 1) / p.block_m * p.block_m;
  if (row >= padded) return;
  const long long r = acc_row(p, seq, batch, head) + row;
  if (p.deterministic && lane == 0 && row % p.block_m == 0)
    p.sem[(static_cast<long long>(batch) * p.heads_q + head) * p.m_blocks + row / p.block_m] = 0;
  if (row >= seq.sq) {  // padding of the last query tile
    if (lane == 0) {
      p.dsum[r] = 0.f;
      p.lse_log2[r] = inf();
    }
    return;
  }
  const long long qi = seq.q_row0 + row;
  const T* o = static_cast<const T*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + qi * p.o_stride_s;
  const T* dout = static_cast<const T*>(p.dout) + batch * p.dout_stride_b + head * p.dout_stride_h + qi * p.dout_stride_s;
  float* acc = p.dq_acc + r * p.head_dim;
  float sum = 0.f;
  for (int d = lane; d < p.head_dim; d += 32) {
    sum = fmaf(to_float(dout[d]), to_float(o[d]), sum);
    acc[d] = 0.f;
  }
  sum = warp_sum(sum);
  if (lane == 0) {
    const float lse = p.lse[batch * p.lse_stride_b + head * p.lse_stride_h + qi * p.lse_stride_s];
    p.dsum[r] = sum;
    p.lse_log2[r] = lse == -inf() ? inf() : lse * kLog2e;
  }
}

template <typename T, int WARPS>
__device__ __forceinline__ void attn_bwd_convert(const AttnBwdParams& p) {
  const int head = blockIdx.y, batch = blockIdx.z, lane = threadIdx.x % 32;
  const int row = blockIdx.x * WARPS + threadIdx.x / 32;
  const BwdSeq seq = bwd_seq(p, batch);
  if (row >= seq.sq) return;
  const long long qi = seq.q_row0 + row;
  const float* acc = p.dq_acc + (acc_row(p, seq, batch, head) + row) * p.head_dim;
  T* dq = static_cast<T*>(p.dq) + batch * p.dq_stride_b + head * p.dq_stride_h + qi * p.dq_stride_s;
  for (int d = lane; d < p.head_dim; d += 32) dq[d] = from_float<T>(acc[d] * p.scale);
}

}  // namespace pyattn

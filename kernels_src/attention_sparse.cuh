// CSR sparse attention: every query row attends to its own list of keys.
//
// Query row i of (batch b, query head h) attends to the keys indices[offsets[o + i] ..
// offsets[o + i + 1]) with o = b * off_stride_b + h * off_stride_h (see SparseParams); the softmax
// runs over exactly those keys, in any order. Rows own different key lists, so there is no K/V
// tile to share and no tensor-core shape: one warp per query row gathers its keys' K and V rows
// straight from global memory, each row read being one coalesced access across the 32 lanes.
//
// Lane l owns the EPL = HEAD_DIM / 32 consecutive head-dim elements d = l * EPL + e (valid for
// d < head_dim; HEAD_DIM is the compiled bucket). Keys go 8 at a time: every lane forms its partial
// dot products with all 8 keys, a transpose-reduce butterfly finishes the 8 sums with 9 shuffles
// (lane l then holds the score of key l / 4), and an online softmax in base 2 folds them into the
// running max m and sum. Indices, offsets and alignment were checked on the host (pyattn/ops/sparse.py):
// every listed index is in [0, seqlen_k), no row lists a key twice, and q/k/v/o base pointers are
// 16-byte aligned with (batch, seq, head) strides that are multiples of 16 bytes.
// Requires pyattn::SparseParams (rendered by pyattn.jit.source), common.cuh and mma.cuh (fast_exp2).
#pragma once

namespace pyattn {

namespace sparse_detail {

template <int BYTES> struct Raw;  // the register type of one 16-, 8-, 4- or 2-byte access
template <> struct Raw<16> { using type = uint4; };
template <> struct Raw<8> { using type = uint2; };
template <> struct Raw<4> { using type = unsigned; };
template <> struct Raw<2> { using type = unsigned short; };

// A lane's EPL elements of one row, in the widest accesses (16, 8 or 4 bytes) that divide them.
// Access j covers elements d0 + j * kElems ..: its byte offset from the 16-byte aligned row start
// is a multiple of its size, so it is aligned. kElems is a power of two dividing 8 and head_dim is
// a multiple of 8, so an access lies wholly inside or wholly past head_dim (checked per access).
template <typename T, int EPL>
struct LaneRow {
  static constexpr int kBytes = EPL * static_cast<int>(sizeof(T));
  static constexpr int kAccessBytes = kBytes % 16 == 0 ? 16 : kBytes % 8 == 0 ? 8 : kBytes % 4 == 0 ? 4
                                                                                                   : sizeof(T);
  static constexpr int kElems = kAccessBytes / static_cast<int>(sizeof(T));
  static constexpr int kAccesses = EPL / kElems;
  using R = typename Raw<kAccessBytes>::type;
  static_assert(kElems * kAccesses == EPL && 8 % kElems == 0, "accesses tile the lane's elements");

  R raw[kAccesses];

  // Load (zeros where !valid or past head_dim: nothing is read there).
  __device__ __forceinline__ void load(const T* row, int d0, int head_dim, bool valid) {
#pragma unroll
    for (int j = 0; j < kAccesses; ++j) {
      R r;
      if (valid && d0 + j * kElems < head_dim) {
        r = *reinterpret_cast<const R*>(row + d0 + j * kElems);
      } else {
        r = R();
      }
      raw[j] = r;
    }
  }

  // Element e as float (e is a compile-time constant once the callers' loops are unrolled).
  __device__ __forceinline__ float at(int e) const {
    return to_float(reinterpret_cast<const T*>(&raw[e / kElems])[e % kElems]);
  }
};

// Store this lane's EPL values, rounded to T, where d < head_dim.
template <typename T, int EPL>
__device__ __forceinline__ void store_lane(T* row, int d0, int head_dim, const float (&x)[EPL]) {
  using L = LaneRow<T, EPL>;
#pragma unroll
  for (int j = 0; j < L::kAccesses; ++j) {
    if (d0 + j * L::kElems < head_dim) {
      typename L::R r;
      T* e = reinterpret_cast<T*>(&r);
#pragma unroll
      for (int i = 0; i < L::kElems; ++i) e[i] = from_float<T>(x[j * L::kElems + i]);
      *reinterpret_cast<typename L::R*>(row + d0 + j * L::kElems) = r;
    }
  }
}

// Sum each of x[0..8) over the warp with 9 shuffles instead of 8 x 5 = 40: at each of the xor 16 /
// 8 / 4 steps a lane keeps the half of its values that its lane bit selects and sends the other
// half to its partner, which adds it to the same values. Afterwards lane l holds the (so far
// 8-lane) sum of x[l >> 2]; xor 2 and xor 1 add up the 4 lanes that hold the same value.
__device__ __forceinline__ float transpose_reduce8(const float (&x)[8], int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float y[4];  // lane holds values b4 * 4 + i
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = b4 ? x[i] : x[i + 4];
    y[i] = (b4 ? x[i + 4] : x[i]) + __shfl_xor_sync(kFullMask, send, 16);
  }
  float z[2];  // values b4 * 4 + b3 * 2 + i
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = b3 ? y[i] : y[i + 2];
    z[i] = (b3 ? y[i + 2] : y[i]) + __shfl_xor_sync(kFullMask, send, 8);
  }
  float w = (b2 ? z[1] : z[0]) + __shfl_xor_sync(kFullMask, b2 ? z[0] : z[1], 4);  // value lane >> 2
  w += __shfl_xor_sync(kFullMask, w, 2);
  w += __shfl_xor_sync(kFullMask, w, 1);
  return w;
}

// Reduce over the 8 key slots (lanes that differ in bits 4, 3, 2; a quad holds one slot).
__device__ __forceinline__ float slot_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullMask, x, 4));
  x = fmaxf(x, __shfl_xor_sync(kFullMask, x, 8));
  return fmaxf(x, __shfl_xor_sync(kFullMask, x, 16));
}
__device__ __forceinline__ float slot_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 4);
  x += __shfl_xor_sync(kFullMask, x, 8);
  return x + __shfl_xor_sync(kFullMask, x, 16);
}

}  // namespace sparse_detail

template <typename T, int HEAD_DIM, int WARPS>
__device__ __forceinline__ void attn_sparse(const SparseParams& p) {
  constexpr int EPL = HEAD_DIM / 32;  // head-dim elements per lane
  constexpr int KEYS = 8;             // keys per step: the butterfly reduces 8 dot products at once
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM >= 32 && HEAD_DIM <= 256, "head-dim bucket: 32..256, whole lanes");
  static_assert(WARPS >= 1 && WARPS <= 32, "one warp per query row, at most 32 warps per block");
  static_assert(32 % KEYS == 0, "a 32-index batch splits into whole steps");
  using Row = sparse_detail::LaneRow<T, EPL>;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * WARPS + warp, head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.seqlen_q) return;  // the whole warp leaves together: no shuffle is left waiting
  const int kv_head = head / p.group;  // GQA/MQA: `group` query heads share one KV head
  const int* off = p.offsets + batch * p.off_stride_b + head * p.off_stride_h + row;
  const int begin = off[0], n = off[1] - begin;  // the same address in every lane: one broadcast

  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride_b + head * p.q_stride_h + row * p.q_stride_s;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h;
  T* o = static_cast<T*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + row * p.o_stride_s;
  const int d0 = lane * EPL;  // this lane's first head-dim element

  // -- q row in registers, pre-scaled by scale * log2(e) so scores come out in log2 units
  float qf[EPL];
  {
    Row qr;
    qr.load(q, d0, p.head_dim, true);
#pragma unroll
    for (int e = 0; e < EPL; ++e) qf[e] = qr.at(e) * p.scale_log2;  // padding was loaded as 0
  }

  float acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = 0.f;
  float m = -inf();  // running max of the scores (log2 units), warp-uniform
  float l = 0.f;     // running sum of exp2(s - m) over this lane's key slot (lane >> 2) of every step
  const int slot = lane >> 2;

  for (int base = 0; base < n; base += 32) {
    // -- 32 list entries in one coalesced load: lane j holds key index base + j of the row's list
    const int count = min(32, n - base);
    const int my_index = lane < count ? p.indices[begin + base + lane] : 0;

#pragma unroll 1
    for (int t = 0; t < count; t += KEYS) {  // warp-uniform: every lane runs the same steps
      // -- gather K and V rows of keys t .. t + 7 (loads issued together; keys past the list end
      // are not read)
      Row kr[KEYS], vr[KEYS];
#pragma unroll
      for (int j = 0; j < KEYS; ++j) {
        const int key = __shfl_sync(kFullMask, my_index, t + j);
        const bool valid = t + j < count;
        kr[j].load(k + key * p.k_stride_s, d0, p.head_dim, valid);
        vr[j].load(v + key * p.v_stride_s, d0, p.head_dim, valid);
      }

      // -- S = q K^T for 8 keys: partial dot products over this lane's elements, then the butterfly
      float part[KEYS];
#pragma unroll
      for (int j = 0; j < KEYS; ++j) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) s = fmaf(qf[e], kr[j].at(e), s);
        part[j] = s;
      }
      float s = sparse_detail::transpose_reduce8(part, lane);  // score of key t + slot
      if (t + slot >= count) s = -inf();                      // past the list end: p = 0

      // -- online softmax update (base 2): rescale what was accumulated under the old max
      const float m_new = fmaxf(m, sparse_detail::slot_max(s));
      // A row with no finite score yet keeps max -inf: exponentiate against 0 so that
      // (-inf) - (-inf) never produces NaN.
      const float ref = m_new == -inf() ? 0.f : m_new;
      const float pk = fast_exp2(s - ref);
      const float corr = fast_exp2(m - ref);
      l = l * corr + pk;
      m = m_new;

      // -- O += P V: key j's probability lives in lanes 4j .. 4j + 3
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[e] *= corr;
#pragma unroll
      for (int j = 0; j < KEYS; ++j) {
        const float pj = __shfl_sync(kFullMask, pk, 4 * j);
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[e] = fmaf(pj, vr[j].at(e), acc[e]);
      }
    }
  }

  // -- epilogue: normalise, store O and the natural-log LSE; a row with no key gets 0 / -inf
  l = sparse_detail::slot_sum(l);
  const bool empty = l == 0.f;
  const float inv = empty ? 0.f : 1.f / l;
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] *= inv;
  sparse_detail::store_lane<T, EPL>(o, d0, p.head_dim, acc);
  if (lane == 0 && p.lse != nullptr)
    p.lse[batch * p.lse_stride_b + head * p.lse_stride_h + row] = empty ? -inf() : (m + log2f(l)) * kLn2;
}

}  // namespace pyattn

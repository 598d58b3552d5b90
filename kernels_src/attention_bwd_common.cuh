// What the backward kernels share: per-sequence geometry, the scratch rows, which (query tile,
// key tile) pairs the causal/window band leaves visible, the score modifiers' recomputation, and
// the counters of the deterministic dQ accumulation.
//
// The tile pair (m, n) is visited iff some (row, key) of it lies in the band:
//   n1 - m0 >= band.lo  and  n0 - m1 <= band.hi   (m0..m1 its rows, n0..n1 its keys, clipped to the sequence)
// Key block n walks its visible query tiles in increasing m; the key blocks that visit tile m are
// a contiguous run n_first(m) .. n_last(m), so with `deterministic` block n adds its dQ part of
// tile m after exactly n - n_first(m) others did (a counter per tile), always in the order of n.
// Requires pyattn::AttnBwdParams and common.cuh.
#pragma once
#include "band.cuh"

namespace pyattn {

constexpr int kBwdRowPad = 128;  // varlen scratch rows per sequence are padded by this (>= every BLOCK_M)

// Where batch entry (or varlen sequence) b lives in the packed arrays and in the scratch rows.
struct BwdSeq {
  long long q_row0, k_row0, acc_row0;
  int sq, sk;
};

__device__ __forceinline__ BwdSeq bwd_seq(const AttnBwdParams& p, int b) {
  BwdSeq s;
  if (p.cu_seqlens_q != nullptr) {  // clamped as the forward's (common.cuh clamp_rows says why)
    int q0, k0;
    clamp_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, q0, s.sq);
    clamp_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k, k0, s.sk);
    s.q_row0 = q0;
    s.k_row0 = k0;
    s.acc_row0 = q0 + static_cast<long long>(b) * kBwdRowPad;
  } else {
    s.q_row0 = s.k_row0 = s.acc_row0 = 0;
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
  }
  return s;
}

// The scratch row of query 0 of (batch b, query head h).
__device__ __forceinline__ long long acc_row(const AttnBwdParams& p, const BwdSeq& s, int b, int h) {
  return b * p.acc_stride_b + h * p.acc_stride_h + s.acc_row0;
}

// Query 0 of (batch b, query head h) in q and in dout; rows step by q_stride_s / dout_stride_s.
template <typename T>
__device__ __forceinline__ void bwd_query_rows(const AttnBwdParams& p, const BwdSeq& s, int b, int h, const T*& q,
                                               const T*& dout) {
  q = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + s.q_row0 * p.q_stride_s;
  dout = static_cast<const T*>(p.dout) + b * p.dout_stride_b + h * p.dout_stride_h + s.q_row0 * p.dout_stride_s;
}

__device__ __forceinline__ long long floor_div(long long a, long long b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Query tiles [m_begin, m_end) of BM rows that see some key of [n0, n1] (see the top).
template <int BM>
__device__ __forceinline__ void band_query_tiles(const Band& b, int n0, int n1, int sq, int& m_begin, int& m_end) {
  const long long first_row = static_cast<long long>(n0) - b.hi, last_row = static_cast<long long>(n1) - b.lo;
  const int tiles = (sq + BM - 1) / BM;
  if (sq == 0 || first_row > sq - 1 || last_row < 0) {
    m_begin = m_end = 0;
    return;
  }
  m_begin = static_cast<int>(max(0LL, floor_div(first_row, BM)));
  m_end = static_cast<int>(min(static_cast<long long>(tiles), last_row / BM + 1));
}

// What a key block [n0, n0 + BN) of the main kernels walks: the band, its query tiles [m_begin,
// m_end) of BM rows, and `iters` = tiles x the GQA group (query head, query tile), head-major.
template <int BM, int BN>
struct BwdWalk {
  Band band;
  int m_begin, m_end, iters;
  __device__ __forceinline__ BwdWalk(const AttnBwdParams& p, int sq, int sk, int n0) : band(make_band(p, sq, sk)) {
    band_query_tiles<BM>(band, n0, min(n0 + BN, sk) - 1, sq, m_begin, m_end);
    iters = (m_end - m_begin) * p.group;
  }
};

// The first key tile of BN keys that visits query tile m (rows from m0): the base of the ranks.
template <int BN>
__device__ __forceinline__ int band_first_key_tile(const Band& b, int m0) {
  const long long first_key = static_cast<long long>(m0) + b.lo;
  return first_key <= 0 ? 0 : static_cast<int>(first_key / BN);
}

// True when every (row, key) of rows [r0, r0 + BM) and keys [n0, n0 + BN) is inside the sequence and the band.
template <int BM, int BN>
__device__ __forceinline__ bool band_pair_full(const Band& b, int r0, int n0, int sq, int sk) {
  return r0 + BM <= sq && n0 + BN <= sk && n0 + BN - 1 - r0 <= b.hi && n0 - (r0 + BM - 1) >= b.lo;
}

// Compile-time score modifiers of the backward: soft-cap and ALiBi (the op takes no mask tensor).
template <bool SOFTCAP_, bool ALIBI_>
struct BwdMods {
  static constexpr bool kSoftcap = SOFTCAP_;
  static constexpr bool kAlibi = ALIBI_;
  static constexpr bool kAny = SOFTCAP_ || ALIBI_;
};

// The forward's final score in log2 units from the raw dot product (scale, soft-cap, ALiBi, as
// pyattn.reference orders them); `dcap` gets d(score)/d(scaled dot product) of the soft-cap,
// 1 - tanh^2 (1 without it).
template <class Mods>
__device__ __forceinline__ float bwd_score(const AttnBwdParams& p, float raw, float slope, int row, int key, int diag,
                                           float& dcap) {
  float x = raw * p.scale;
  dcap = 1.f;
  if constexpr (Mods::kSoftcap) {
    const float th = tanhf(x / p.softcap);
    x = p.softcap * th;
    dcap = 1.f - th * th;
  }
  if constexpr (Mods::kAlibi) x -= slope * fabsf(static_cast<float>(row + diag - key));
  return x * kLog2e;
}

// dq_acc[i] += a, dq_acc[i + 1] += b (i even): one vector reduction on sm_90+ (half the L2 atomic
// requests of two scalar ones: a warp's pairs then cover whole 32-byte sectors), two before.
__device__ __forceinline__ void red_add_pair(float* at, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(at), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(at, a);
  atomicAdd(at + 1, b);
#endif
}

// red_add_pair when `pred` holds, as one predicated instruction (no branch: attn_bwd_wgmma issues
// these while a wgmma is in flight, where ptxas serialises the wgmmas around any divergent path).
__device__ __forceinline__ void red_add_pair_if(bool pred, float* at, float a, float b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(at),
               "f"(a), "f"(b), "r"(static_cast<int>(pred))
               : "memory");
}

// Key block n of (kv head, batch): the default grid has n fastest (blockIdx.x), so the key blocks of
// one head run together and share its Q/dO tiles in L2. With `deterministic` n is slowest
// (blockIdx.z): blocks that take turns on a query tile's dQ are then mostly in different waves, so
// a block rarely waits (with n fastest, the blocks of a head in one wave form a chain of waits
// per tile). Blocks are dispatched in linear order, so the blocks a block waits for started first.
__device__ __forceinline__ void bwd_block(const AttnBwdParams& p, int& n_block, int& kv_head, int& batch) {
  if (p.deterministic) {
    n_block = blockIdx.z, kv_head = blockIdx.x, batch = blockIdx.y;
  } else {
    n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
  }
}

// A 4-byte global -> shared copy (cp.async; mma.cuh's cp_async_16 for 16-byte chunks): a tile's LSE
// and dsum travel with its Q and dO (same commit group), so no thread waits on a global load
// to store them (measured: 0.80 stall cycles per issued instruction on long scoreboard before).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}

// -- the deterministic mode's ordered accumulation ------------------------------------------------
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every thread of the block returns once the counter holds `value` (earlier key blocks are done).
__device__ __forceinline__ void sem_wait(const int* sem, int value) {
  if (threadIdx.x == 0)
    while (ld_acquire(sem) != value) __nanosleep(64);
  __syncthreads();
}

// After every thread's adds: one release increment (the fence makes the block's adds, ordered
// before it by the barrier, visible to whoever acquires the new value).
__device__ __forceinline__ void sem_arrive(int* sem) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
  }
}

}  // namespace pyattn

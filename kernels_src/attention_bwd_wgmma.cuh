// FlashAttention-2-structured backward pass on Hopper warpgroup tensor cores (sm_90a, wgmma):
// fp16/bf16 in, fp32 accumulate. The same algorithm and semantics as attention_bwd_mma.cuh (read
// its header first); what differs is who does the products.
//
// One block owns BLOCK_N = 64 * WARPGROUPS keys of one (batch, KV head); warpgroup w owns keys
// [64w, 64w + 64), the M of its wgmmas, so its dK and dV (64 x HEAD_DIM each) live in its registers
// for the whole block. K and V stay in shared memory; Q/dO tiles of BLOCK_M queries (and their
// LSE, dsum) stream through a STAGES-deep cp.async ring filled by all threads. All tiles use the
// 128-byte swizzle of wgmma.cuh ([cols / 64][rows][64 elements]). Per query tile:
//   S^T  = K_w Q^T     m64 n{BLOCK_M} k16, A = K and B = Q from shared memory, both K-major
//   dP^T = V_w dO^T    the same shape, A = V, B = dO
//   P^T  = exp2(S^T * scale_log2 - LSE), dS^T = P^T (dP^T - dsum)   in registers (fp32)
//   dV  += P^T dO      m64 n{HEAD_DIM} k16, A = P^T from registers (the accumulator's C layout,
//                      packed to 16 bits, is the A layout, as for the forward's P V), B = dO read
//                      MN-major (transpose bit): dO needs no transposed copy
//   dK  += dS^T Q      the same, A = dS^T from registers, B = Q read MN-major
//   dQ   = dS K        A = dS: every warpgroup's dS^T goes to shared memory ([queries / 64][keys][64]),
//                      read M-major (the A transpose bit), B = K read MN-major. The warpgroups split
//                      dQ by query rows when BLOCK_M = BLOCK_N (each 64 rows x HEAD_DIM), else by
//                      64-wide head-dim blocks (BLOCK_M = 64); either way one wgmma row block each.
//                      dQ is added to the fp32 dq_acc (red.global.add.v2, while dK's wgmma runs, or
//                      in key-block order under `deterministic`, see attention_bwd_common.cuh),
//                      scaled by attn_bwd_convert.
// Why not the mma.sync kernel's layout on Hopper: there 8 warps of m16 tiles reload their B
// fragments from shared memory for every product and the kernel is latency-bound at 8 warps and
// shared-memory-bound at 16 (BENCHMARKS.md, issue 14); a wgmma reads each operand tile once per
// warpgroup, asynchronously.
// A block per key block, not a persistent grid: blocks that walked key blocks from a counter,
// loading the next one's K/V and first tile under the current one, measured up to 8% slower at
// causal shapes and no faster elsewhere (BENCHMARKS.md, issue 14, fifth session).
// Requires pyattn::AttnBwdParams, common.cuh, mma.cuh; wgmma.cuh and wgmma_pipe.cuh (tile loads).
#pragma once
#include "attention_bwd_common.cuh"
#include "wgmma.cuh"
#include "wgmma_pipe.cuh"

namespace pyattn {

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int WARPGROUPS_, int STAGES_>
struct AttnBwdWgmmaTraits {
  using T = T_;
  static constexpr int kHeadDim = HEAD_DIM_, kBlockM = BLOCK_M_, kBlockN = 64 * WARPGROUPS_;
  static constexpr int kWarpgroups = WARPGROUPS_, kThreads = 128 * WARPGROUPS_, kStages = STAGES_;
  // dQ: split by query rows (each warpgroup 64 rows, N = HEAD_DIM) or by 64-wide head-dim blocks.
  static constexpr bool kDqByRows = BLOCK_M_ == 64 * WARPGROUPS_;
  static constexpr int kDqN = kDqByRows ? HEAD_DIM_ : HEAD_DIM_ / WARPGROUPS_;
  static constexpr int kKVBytes = kBlockN * HEAD_DIM_ * 2;  // one of K, V
  static constexpr int kQBytes = BLOCK_M_ * HEAD_DIM_ * 2;  // one of Q, dO (per stage)
  static constexpr int kDSBytes = kBlockN * BLOCK_M_ * 2;   // dS^T
  static constexpr int kStatBytes = STAGES_ * 2 * BLOCK_M_ * 4;  // LSE (log2) and dsum per stage
  // + 1024: the dynamic window is only guaranteed 16-byte aligned; swizzle atoms need 1024.
  static constexpr int kSmemBytes = 2 * kKVBytes + 2 * STAGES_ * kQBytes + kDSBytes + kStatBytes + 1024;
  static_assert(sizeof(T_) == 2, "wgmma backward: 16-bit inputs");
  static_assert(HEAD_DIM_ % 64 == 0 && HEAD_DIM_ <= 128, "head dim: whole swizzle rows; dK + dV in registers");
  static_assert(BLOCK_M_ % 64 == 0 && BLOCK_M_ <= 128, "query tile: whole swizzle rows of dS^T");
  static_assert(kDqByRows || (BLOCK_M_ == 64 && kDqN % 64 == 0), "dQ: 64 rows or 64-wide head-dim blocks per warpgroup");
  static_assert(BLOCK_M_ <= kBwdRowPad, "the varlen scratch padding covers one query tile");
  static_assert(STAGES_ == 2, "two Q/dO stages: the next tile loads during this one");
};

template <class Tr, class Mods>
__device__ __forceinline__ void attn_bwd_wgmma(const AttnBwdParams& p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim, BM = Tr::kBlockM, BN = Tr::kBlockN, NT = Tr::kThreads;
  constexpr int SR = BM / 2;          // f32 registers per thread of an m64 x BM accumulator (S^T, dP^T)
  constexpr int GR = D / 2;           // ... of dK, dV (m64 x D)
  constexpr int QR = Tr::kDqN / 2;    // ... of dQ
  constexpr int KQ = BM / 16;         // k16 steps over a query tile (dK, dV)

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = wg::smem_u32(smem_raw);
  const unsigned sK = (raw + 1023u) & ~1023u, sV = sK + Tr::kKVBytes;
  const unsigned sQ = sV + Tr::kKVBytes;                  // stage s at + s * kQBytes
  const unsigned sdO = sQ + Tr::kStages * Tr::kQBytes;    // stage s at + s * kQBytes
  const unsigned sDS = sdO + Tr::kStages * Tr::kQBytes;   // dS^T: [BM / 64][BN keys][64 queries]
  float* stats = reinterpret_cast<float*>(smem_raw + (sDS + Tr::kDSBytes - raw));  // [stage][lse | dsum][BM]

  const int wgi = threadIdx.x / 128, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int key_row = 64 * wgi + 16 * ((threadIdx.x % 128) / 32) + g;  // (+ 8) in the block: this thread's keys

  int n_block, kv_head, batch;
  bwd_block(p, n_block, kv_head, batch);
  const BwdSeq seq = bwd_seq(p, batch);
  const int sq = seq.sq, sk = seq.sk, n0 = n_block * BN;
  const BwdWalk<BM, BN> walk(p, sq, sk, n0);
  const Band band = walk.band;
  const int m_begin = walk.m_begin, m_end = walk.m_end, iters = walk.iters;

  // One query tile's operands: Q and dO rows (zero past the sequence), LSE and dsum (the pre
  // kernel padded them to whole tiles: +inf and 0, so padded rows give P = dS = 0).
  auto load_tile = [&](int hq, int m, int stage) {
    const int m0 = m * BM;
    const T *q, *dout;
    bwd_query_rows(p, seq, batch, hq, q, dout);
    wgmma_load_tile<Tr, BM, NT>(sQ + stage * Tr::kQBytes, q, p.q_stride_s, m0, sq, p.head_dim, threadIdx.x);
    wgmma_load_tile<Tr, BM, NT>(sdO + stage * Tr::kQBytes, dout, p.dout_stride_s, m0, sq, p.head_dim, threadIdx.x);
    const long long r = acc_row(p, seq, batch, hq) + m0;
    for (int i = threadIdx.x; i < 2 * BM; i += NT)
      cp_async_4(stats + (stage * 2 + i / BM) * BM + i % BM, (i < BM ? p.lse_log2 : p.dsum) + r + i % BM);
  };
  float dk[GR], dv[GR];
#pragma unroll
  for (int i = 0; i < GR; ++i) dk[i] = dv[i] = 0.f;
  // The block's dK and dV rows, this thread's pairs (dK scaled), rounded to T.
  auto store_dkdv = [&]() {
    T* dkp = static_cast<T*>(p.dk) + batch * p.dk_stride_b + kv_head * p.dk_stride_h + seq.k_row0 * p.dk_stride_s;
    T* dvp = static_cast<T*>(p.dv) + batch * p.dv_stride_b + kv_head * p.dv_stride_h + seq.k_row0 * p.dv_stride_s;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = n0 + key_row + 8 * h;
      if (key >= sk) continue;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const int d = i * 8 + 2 * t;
        if (d < p.head_dim) {
          *reinterpret_cast<unsigned*>(dkp + key * p.dk_stride_s + d) =
              pack2<T>(dk[4 * i + 2 * h] * p.scale, dk[4 * i + 2 * h + 1] * p.scale);
          *reinterpret_cast<unsigned*>(dvp + key * p.dv_stride_s + d) = pack2<T>(dv[4 * i + 2 * h], dv[4 * i + 2 * h + 1]);
        }
      }
    }
  };
  if (n0 >= sk || iters == 0) {  // no keys here (varlen) or no query tile sees them: dK = dV = 0
    store_dkdv();
    return;
  }

  // -- prologue: K, V and the first query tile in flight (one cp.async group)
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  wgmma_load_tile<Tr, BN, NT>(sK, k, p.k_stride_s, n0, sk, p.head_dim, threadIdx.x);
  wgmma_load_tile<Tr, BN, NT>(sV, v, p.v_stride_s, n0, sk, p.head_dim, threadIdx.x);
  load_tile(kv_head * p.group, m_begin, 0);
  wg::cp_async_commit();
  // The ring stage, toggled per tile. (`it & 1` is the same value, but ptxas then emits 144 more
  // instructions at d=64 than for the kernel measured in BENCHMARKS.md: checked on the SASS.)
  int stage = 0;
  // Descriptors (wgmma.cuh): K-major operands step 32 B per k16 inside a 64-column block, then
  // jump a block; MN-major ones step 16 rows (2048 B) per k16, LBO = the distance of 64-wide blocks.
  const unsigned long long k_a = wg::make_desc_sw128(sK + wgi * 64 * 128, 16, 1024);
  const unsigned long long v_a = wg::make_desc_sw128(sV + wgi * 64 * 128, 16, 1024);
  const unsigned long long q_b = wg::make_desc_sw128(sQ, 16, 1024);         // + stage
  const unsigned long long do_b = wg::make_desc_sw128(sdO, 16, 1024);       // + stage
  const unsigned long long q_bt = wg::make_desc_sw128(sQ, BM * 128, 1024);  // Q as (queries x dims), MN-major
  const unsigned long long do_bt = wg::make_desc_sw128(sdO, BM * 128, 1024);
  // dQ: A = dS (queries x keys) read from dS^T M-major; B = K (keys x dims) MN-major.
  const unsigned long long ds_at = wg::make_desc_sw128(sDS + (Tr::kDqByRows ? wgi * BN * 128 : 0), BN * 128, 1024);
  const unsigned long long k_bt = wg::make_desc_sw128(sK + (Tr::kDqByRows ? 0 : wgi * BN * 128), BN * 128, 1024);
  const int dq_row0 = Tr::kDqByRows ? 64 * wgi : 0, dq_col0 = Tr::kDqByRows ? 0 : wgi * Tr::kDqN;
  const int diag = sk - sq;

  // Add a finished tile's dQ (query tile m of head hq) to dq_acc, unscaled (attn_bwd_convert scales).
  // It runs while the tile's dK wgmma is in flight, so it is branch-free (predicated reductions):
  // code that reads registers while wgmmas are in flight must have no divergent path and leave
  // registers to spare, or ptxas serialises every wgmma of the kernel (C7518 / C7512; holding dQ
  // for a tile longer, beside dK + dV, ran out of registers). `deterministic`: after the tile's
  // wgmmas, in key-block order.
  float dq[QR];
  auto flush_dq = [&](int hq, int m) {
    const int m0 = m * BM;
    float* acc = p.dq_acc + (acc_row(p, seq, batch, hq) + m0) * p.head_dim;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = dq_row0 + 16 * ((threadIdx.x % 128) / 32) + g + 8 * h;
#pragma unroll
      for (int i = 0; i < Tr::kDqN / 8; ++i) {
        const int d = dq_col0 + i * 8 + 2 * t;  // head_dim is a multiple of 8: d + 1 is in range too
        red_add_pair_if(m0 + row < sq && d < p.head_dim, acc + row * p.head_dim + d, dq[4 * i + 2 * h],
                        dq[4 * i + 2 * h + 1]);
      }
    }
  };
  auto flush_dq_ordered = [&](int hq, int m) {
    int* sem = p.sem + (static_cast<long long>(batch) * p.heads_q + hq) * p.m_blocks + m;
    sem_wait(sem, n_block - band_first_key_tile<BN>(band, m * BM));
    flush_dq(hq, m);
    sem_arrive(sem);
  };
  int hq = kv_head * p.group, m = m_begin;  // this iteration's query head and tile
  for (int it = 0; it < iters; ++it) {
    const int m0 = m * BM;
    const bool last_m = m + 1 == m_end;
    const int hq_next = last_m ? hq + 1 : hq, m_next = last_m ? m_begin : m + 1;
    // Tile `it` landed for everyone and is visible to the async proxy; every warpgroup finished
    // tile it - 1 (its wgmmas, its reads of dS^T), so its stage and dS^T may be overwritten.
    wg::cp_async_wait<0>();
    wg::fence_proxy_async_smem();
    __syncthreads();
    if (it + 1 < iters) load_tile(hq_next, m_next, stage ^ 1);
    wg::cp_async_commit();
    const unsigned qoff = stage * Tr::kQBytes;
    const float* lse_s = stats + stage * 2 * BM;
    const float* dsum_s = lse_s + BM;

    // -- S^T = K Q^T and dP^T = V dO^T (fp32), one commit group each: A (keys) and B (queries) both
    // K-major over the head dim
    float s[SR], dp[SR];
    auto keys_x_queries = [&](float (&acc)[SR], unsigned long long a, unsigned long long b) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned off = (kk % 4) * 32;
        wg::Mma<T, BM, 0>::ss(acc, wg::desc_add(a, (kk / 4) * (BN * 128) + off),
                              wg::desc_add(b, qoff + (kk / 4) * (BM * 128) + off), kk > 0);
      }
      wg::commit();
    };
    wg::fence();
    keys_x_queries(s, k_a, q_b);
    keys_x_queries(dp, v_a, do_b);
    // With a soft-cap, dS needs each score's 1 - tanh^2: it is made with P, in dP^T's registers
    // (keeping the factors for a second pass would take another accumulator's worth of registers).
    if constexpr (Mods::kSoftcap) {
      wg::wait<0>();
      wg::fence_operands(dp);
    } else {
      wg::wait<1>();
    }
    wg::fence_operands(s);

    // -- P^T = exp2(S^T * scale_log2 - LSE) (kept in s), packed to T as the A fragments of dV
    // (k16 step kk = query columns [16 kk, 16 kk + 16): n8 blocks 2 kk and 2 kk + 1). Two copies
    // of the pass, one of them masked (masked scores -> exp2(-inf) = 0, branch-free): a tile
    // wholly inside the sequence and the band, most of them, tests nothing per score. With one
    // copy and the test behind a `full` flag, ptxas re-derived part of the flag for each of the
    // 64 scores (12% of the d=64 kernel's instructions: BENCHMARKS.md, issue 14, fifth session).
    float slope = 0.f;
    if constexpr (Mods::kAlibi) slope = p.alibi[batch * p.alibi_stride_b + hq];
    unsigned pf[KQ][4], df[KQ][4];
    auto p_pass = [&](const bool masked) {  // called with a constant: inlined, `masked` folds away
#pragma unroll
      for (int i = 0; i < BM / 8; ++i) {
        const int qc = i * 8 + 2 * t;  // this thread's two query columns qc, qc + 1
        const float2 lse = *reinterpret_cast<const float2*>(lse_s + qc);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float l = (e & 1) ? lse.y : lse.x;
          const int key = n0 + key_row + 8 * (e >> 1), row = m0 + qc + (e & 1);
          float x, cap;
          if constexpr (Mods::kAny) x = bwd_score<Mods>(p, s[4 * i + e], slope, row, key, diag, cap) - l;
          else x = fmaf(s[4 * i + e], p.scale_log2, -l);
          if (masked) x = key < sk && row < sq && band.allows(row, key) ? x : -inf();
          s[4 * i + e] = fast_exp2(x);
          if constexpr (Mods::kSoftcap)  // dS^T, in place of dP^T
            dp[4 * i + e] = s[4 * i + e] * (dp[4 * i + e] - dsum_s[qc + (e & 1)]) * cap;
        }
        // n8 block i is half (i & 1) of k16 step i / 2: registers {0, 1} or {2, 3} (rows g, g + 8)
        pf[i / 2][2 * (i & 1)] = pack2<T>(s[4 * i], s[4 * i + 1]);
        pf[i / 2][2 * (i & 1) + 1] = pack2<T>(s[4 * i + 2], s[4 * i + 3]);
      }
    };
    if (band_pair_full<BM, BN>(band, m0, n0, sq, sk)) p_pass(false);
    else p_pass(true);

    // -- dV += P^T dO over the tile's queries, while dP^T finishes and dS is computed
    wg::fence_operands(dv);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) wg::Mma<T, D, 1>::rs(dv, pf[kk], wg::desc_add(do_bt, qoff + kk * 2048), 1);
    wg::commit();
    if constexpr (!Mods::kSoftcap) {
      wg::wait<1>();  // dP^T done (dV may still run)
      wg::fence_operands(dp);
    }

    // -- dS^T = P^T (dP^T - dsum) (with a soft-cap: made above): the A fragments of dK, and shared
    // memory for dQ
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
      const int qc = i * 8 + 2 * t;
      float ds[4];
      if constexpr (Mods::kSoftcap) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[e] = dp[4 * i + e];
      } else {
        const float2 dsum = *reinterpret_cast<const float2*>(dsum_s + qc);
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[e] = s[4 * i + e] * (dp[4 * i + e] - ((e & 1) ? dsum.y : dsum.x));
      }
      df[i / 2][2 * (i & 1)] = pack2<T>(ds[0], ds[1]);
      df[i / 2][2 * (i & 1) + 1] = pack2<T>(ds[2], ds[3]);
      // (key, queries qc, qc + 1) in 64-query block i / 8, chunk i % 8 swizzled by the row (key_row % 8 = g)
      const unsigned at = sDS + (i / 8) * (BN * 128) + key_row * 128 + (((i & 7) ^ g) << 4) + 4 * t;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(df[i / 2][2 * (i & 1)]) : "memory");
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + 8 * 128), "r"(df[i / 2][2 * (i & 1) + 1]) : "memory");
    }

    // -- dQ = dS K over the block's keys, once every warpgroup's dS^T is in shared memory; then
    // dK += dS^T Q, which runs while this tile's dQ is added to dq_acc
    wg::fence_proxy_async_smem();
    pipe::bar_sync(1, NT);
    wg::fence_operands(dk);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wg::Mma<T, Tr::kDqN, 1>::template ss<1>(dq, wg::desc_add(ds_at, kk * 2048), wg::desc_add(k_bt, kk * 2048),
                                              kk > 0);
    wg::commit();
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) wg::Mma<T, D, 1>::rs(dk, df[kk], wg::desc_add(q_bt, qoff + kk * 2048), 1);
    wg::commit();
    wg::wait<1>();  // dV and dQ done; dK may still run
    wg::fence_operands(dq);
    wg::fence_operands(dv);
    if (p.deterministic) {
      wg::wait<0>();
      wg::fence_operands(dk);
      flush_dq_ordered(hq, m);
    } else {
      flush_dq(hq, m);
      wg::wait<0>();
      wg::fence_operands(dk);
    }
    hq = hq_next, m = m_next, stage ^= 1;
  }
  store_dkdv();
}

}  // namespace pyattn

// FlashAttention-3-style fused forward pass on Hopper warpgroup tensor cores (sm_90a only):
// fp16/bf16 in, fp32 accumulate, wgmma.mma_async.
//
// One block owns BLOCK_M = 64 * WARPGROUPS query rows of one (batch, query head); warpgroup w
// owns rows [64w, 64w + 64) (the M of one wgmma). Q, K and V tiles sit in shared memory with the
// 128-byte swizzle (wgmma.cuh), K/V tiles of BLOCK_N keys in a STAGES-deep cp.async ring. Without
// WS all threads fill the ring and meet at a __syncthreads per tile; with WS (warp-specialized) a
// producer warpgroup fills it alone (its registers cut to 56 by setmaxnreg, the consumers' raised
// to 224) and hands stages over through "full" / "empty" mbarriers (wgmma_pipe.cuh), so the
// consumer warpgroups never wait for each other and issue no copies.
// Per key tile j and warpgroup:
//   S_j = Q K_j^T        wgmma m64 n{BLOCK_N} k16, A = Q and B = K from shared memory (K-major)
//   online softmax on S_j in registers (fp32, base 2), P_j packed to 16 bits in registers
//   O += P_j V_j         wgmma m64 n{HEAD_DIM} k16, A = P from registers, B = V from shared
//                        memory read MN-major (transpose bit), so V needs no transposed copy
// OVERLAP (FA3's intra-warpgroup pipelining): O += P_{j-1} V_{j-1} is issued right behind
// S_j = Q K_j^T, so the tensor cores run it while the warpgroup does the softmax of tile j.
// That keeps tiles j-1 (V) and j (K) resident, so a tile loads STAGES - 2 tiles ahead
// (STAGES - 1 without OVERLAP, or with SPLIT_KV: K and V freed on barriers of their own).
//
// Semantics are attention_fwd_mma.cuh's: GQA, bshd/bhsd strides, causal and sliding window (whole
// tiles skipped, per-element masks only on boundary tiles), varlen, natural-log LSE, empty rows
// -> 0 / -inf, head_dim padding, sequence tails, and the score modifiers (Mods: mask tensor,
// soft-cap, ALiBi), applied to S in registers by FastMods (attention_mask.cuh) between the QK^T
// wgmma and the softmax; without modifiers none of that code is compiled in.
// Requires pyattn::AttnFwdParams, common.cuh and mma.cuh; the traits and the shared-memory layout
// are in attention_fwd_wgmma_traits.cuh, the main loop in attention_fwd_wgmma_mainloop.cuh (its
// long members in attention_fwd_wgmma_loads.cuh and attention_fwd_wgmma_step.cuh), the loads and
// the pipeline in wgmma_pipe.cuh.
//
// Launch: Traits::kThreads = 128 * (WARPGROUPS + WS) threads, Traits::kSmemBytes dynamic shared memory
// (opt in above 48 KiB), grid (ceil(max seqlen_q / BLOCK_M), heads_q, batch or varlen sequences);
// causal launches walk blockIdx.x from the last query tile down (most work first). The caller
// guarantees 16-byte aligned q/k/v/o and row strides that are multiples of 8 elements (cp.async
// and 4-byte output stores), and a HEAD_DIM bucket that is a multiple of 64 (64 / 128 / 192 / 256;
// smaller head dims run in the next bucket, zero-padded).
#pragma once
#include "attention_fwd_wgmma_mainloop.cuh"
#include "attention_fwd_wgmma_traits.cuh"

namespace pyattn {

// What a wgmma attention block does once its Mainloop is set up (ml.sKV and ml.wgi included),
// shared by the dense kernel below and the paged one (attention_prefill_wgmma.cuh): the wgmma
// descriptors (Mainloop::make_descs); when warp-specialized, the stages' barriers at `bar_full`
// (Mainloop::init_ring) and the producer warpgroup's whole run; the accumulators; when all
// threads load, the prologue (Q by `load_q` with tile 0, then tiles 1 .. AHEAD-1, one cp.async
// group per tile); and the main loop to the last P V.
// Returns false in the producer warpgroup (done), true in the consumers, whose epilogue follows.
template <class Tr, class Mainloop, class LoadQ>
__device__ __forceinline__ bool wgmma_block_run(Mainloop& ml, unsigned sQ, unsigned bar_full,
                                                const typename Tr::T* q, long long q_stride_s, LoadQ&& load_q) {
  constexpr int STAGES = Tr::kStages, AHEAD = Tr::kLookahead;
  ml.make_descs(sQ);
  ml.stage = ml.prev_stage = 0;
  ml.load_stage = AHEAD % STAGES;
  ml.full_parity = 0;

  if constexpr (Tr::kWS) {
    ml.init_ring(bar_full);
    __syncthreads();
    if (threadIdx.x >= Tr::kConsumerThreads) {  // -- the producer warpgroup
      pipe::regs_dec<Mainloop::kProducerRegs>();
      if constexpr (Tr::kTma && Mainloop::kPaged) {
        if (ml.n_tiles > 0) ml.produce_tma_paged(sQ, q, q_stride_s);
      } else if constexpr (Tr::kTma) {
        if (threadIdx.x == Tr::kConsumerThreads && ml.n_tiles > 0) ml.produce_tma(sQ);
      } else if (ml.n_tiles > 0) {
        ml.produce(sQ, q, q_stride_s, threadIdx.x - Tr::kConsumerThreads);
      }
      return false;
    }
    pipe::regs_inc<Mainloop::kConsumerRegs>();
    if constexpr (Tr::kPingPong)
      if (ml.wgi == Tr::kWarpgroups - 1 && ml.n_tiles > 0) pipe::bar_arrive(1, 256);  // warpgroup 0 issues first
  }
  ml.clear();

  if (ml.n_tiles > 0) {  // CTA-uniform
    if constexpr (!Tr::kWS) {
      load_q();
#pragma unroll
      for (int i = 0; i < AHEAD; ++i) {
        if (i < ml.n_tiles) ml.template load<Tr::kThreads>(i, ml.tiles.n0(i), threadIdx.x);
        wg::cp_async_commit();
      }
    }
    ml.run_tiles();
  }
  return true;
}

// Where a block's query tile lives: its sequence, (batch, query head), and its rows of q and o.
template <class Tr>
struct FwdTileAt {
  SeqInfo seq;
  int head, batch;
  const typename Tr::T* q;
  typename Tr::TO* o;  // the output's type (bf16 for fp8 inputs)
};

// Set up `ml` for query tile (m_block, head, batch): every field that depends on the tile (the
// block-invariant ones are the caller's). Returns false when the tile starts past its sequence's
// end (varlen: the grid covers the longest), where the block has nothing to do for it. [j0, j1):
// only those of the tile's key tiles (a tail split's piece; fwd_tail_split.cuh).
template <class Tr, class Mainloop>
__device__ __forceinline__ bool wgmma_fwd_tile(Mainloop& ml, const AttnFwdParams& p, int m_block, int head, int batch,
                                               FwdTileAt<Tr>& at, int j0 = 0, int j1 = 0x7fffffff) {
  using T = typename Tr::T;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN;
  int m0 = m_block * BM;
  const SeqInfo seq = seq_info(p, batch);
  const int sq = seq.sq, sk = seq.sk;
  if (m0 >= sq) return false;
  if constexpr (Tr::kBottomAlign)
    if (p.causal) m0 -= (sq + BM - 1) / BM * BM - sq;  // the traits say why; m0 may be < 0
  const int kv_head = head / p.group;  // GQA/MQA: `group` query heads share one KV head
  at.seq = seq;
  at.head = head;
  at.batch = batch;
  at.q = static_cast<const T*>(p.q) + batch * p.q_stride_b + head * p.q_stride_h + seq.q_row0 * p.q_stride_s;
  at.o = static_cast<typename Tr::TO*>(p.o) + batch * p.o_stride_b + head * p.o_stride_h + seq.q_row0 * p.o_stride_s;
  ml.k = static_cast<const T*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h + seq.k_row0 * p.k_stride_s;
  ml.v = static_cast<const T*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h + seq.k_row0 * p.v_stride_s;
  ml.band = make_band(p, sq, sk);
  int n_begin, n_end;  // key tiles outside every row's band are skipped
  band_key_range<BN>(ml.band, Tr::kBottomAlign ? max(m0, 0) : m0, min(m0 + BM, sq) - 1, sk, n_begin, n_end);
  if (j0 > 0 || j1 != 0x7fffffff) {  // a piece of the tile's key tiles (fwd_tail_split.cuh)
    n_end = min(n_end, n_begin + j1 * BN);
    n_begin += j0 * BN;
  }
  ml.tiles.init(p, head, m_block, n_begin, n_end);
  ml.n_tiles = ml.tiles.count;
  ml.sq = sq;
  ml.sk = sk;
  ml.mods.init(p, batch, head, sq, sk);
  ml.m0 = m0;
  ml.staged = false;
  if constexpr (Tr::kMaskBytes > 0)  // 16-byte aligned rows of consecutive keys: copy tiles by cp.async
    ml.staged = Tr::kTma || (ml.mods.m_sk == 1 && (ml.mods.m_sq * Tr::kMaskBytes) % 16 == 0 &&
                             reinterpret_cast<unsigned long long>(ml.mods.mask) % 16 == 0);  // TMA: the host mapped it
  if constexpr (Tr::kTma) {
    // Box coordinates (column, row, head, batch) of the maps (pyattn.runtime.tensormap): a
    // zero stride (varlen's batch axis, a broadcast) is a map axis of size 1.
    // (Packed rows fit an int: the host maps tensors of < 2^31 rows.)
    ml.tma_q = {m0 + static_cast<int>(seq.q_row0), p.q_stride_h ? head : 0, p.q_stride_b ? batch : 0};
    ml.tma_k = {static_cast<int>(seq.k_row0), p.k_stride_h ? kv_head : 0, p.k_stride_b ? batch : 0};
    // FP8: the map is over the host's V^T buffer (keys, head_dim, kv heads, batch), never broadcast.
    if constexpr (Tr::kFp8)
      ml.tma_v = {static_cast<int>(seq.k_row0), kv_head, batch};
    else
      ml.tma_v = {static_cast<int>(seq.k_row0), p.v_stride_h ? kv_head : 0, p.v_stride_b ? batch : 0};
    // The mask's map (keys, query rows, heads, batch): a key-padding mask (query stride 0, MASK_ROW)
    // is one row, copied once per tile and read by every row.
    ml.tma_m = {p.mask_stride_q ? m0 : 0, p.mask_stride_h ? head : 0, p.mask_stride_b ? batch : 0};
  }
  ml.set_rows(m0);
  if constexpr (Mainloop::WG_BOUNDS) {
    // The tiles up to the last that this warpgroup's own rows see: at least one (rows before 0 or
    // past the end, or a band that sees no key, compute tile 0 as before: every score -inf). The
    // broadcast tells ptxas the bound is warp-uniform: a loop bound it cannot prove so made it
    // compile every shuffle of the softmax twice, for converged and diverged warps.
    const int r0 = max(ml.wg_row0, 0), r1 = min(ml.wg_row0 + 63, sq - 1);
    int b = 0, e = 0;
    if (r0 <= r1) band_key_range<BN>(ml.band, r0, r1, sk, b, e);
    ml.wg_j1 = __shfl_sync(kFullMask, e > b ? min((e - n_begin + BN - 1) / BN, ml.n_tiles) : 1, 0);
  }
  ml.set_sl2(p.scale_log2);
  return true;
}

// The block-invariant fields of `ml`: shared-memory addresses, maps, this thread's place.
template <class Tr, class Mainloop>
__device__ __forceinline__ void wgmma_fwd_block(Mainloop& ml, const AttnFwdParams& p, const TmaMap* maps,
                                                const unsigned char* smem_raw, unsigned sKV, unsigned sMask) {
  ml.k_stride = p.k_stride_s;
  ml.v_stride = p.v_stride_s;
  ml.sMask = sMask;
  ml.mask_smem = smem_raw + (sMask - wg::smem_u32(smem_raw));
  ml.head_dim = p.head_dim;
  ml.sKV = sKV;
  if constexpr (Tr::kTma) ml.maps = maps;
  ml.set_thread();
}

// A row's 32 consecutive output columns lie across a quad as 4-byte pairs: lane t holds columns
// 8g + 2t, 8g + 2t + 1 of each 8-column group g = 4j + k (a[k]). A 4x4 transpose over the quad (a
// shuffle round over lane bit 0 within 2x2 blocks, one over bit 1 across them) leaves lane t group
// 4j + t whole: a[k] = lane k's pair of it, 16 consecutive bytes.
__device__ __forceinline__ void quad_transpose4(unsigned (&a)[4], int t) {
  const bool b0 = t & 1, b1 = t & 2;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const unsigned r = __shfl_xor_sync(kFullMask, b0 ? a[2 * c] : a[2 * c + 1], 1);
    if (b0) {
      a[2 * c] = r;
    } else {
      a[2 * c + 1] = r;
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const unsigned r = __shfl_xor_sync(kFullMask, b1 ? a[e] : a[2 + e], 2);
    if (b1) {
      a[e] = r;
    } else {
      a[2 + e] = r;
    }
  }
}

// stmatrix .x4: four 8 x 8 matrices of 16-bit pairs from the mma fragment layout (lane l holds
// row l / 4, columns 2 (l % 4) and + 1 of each, in r[0..3]) to shared memory, row by row; lane l
// gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// O_STAGE: a consumer warp's 16 rows of O (normalised by inv[h] for its rows row_a + 8 h) leave
// through its 16 rows of the staging tile at sO: one stmatrix.x4 per 16 columns (matrices: rows
// 0-7 and 8-15 of two 8-column groups), then each lane loads whole 16-byte chunks of a row and
// stores them, 8 lanes a 128-byte row segment. A row's chunk c sits at c ^ (row % 8) (the 8 rows
// of one matrix then fill 8 distinct 16-byte bank groups). Against the quad transpose this trades
// per warp and 16 columns 8 shuffles and 24 selects for one stmatrix, and the loads are per row.
template <class Tr, class Mainloop>
__device__ __forceinline__ void store_o_staged(const Mainloop& ml, const AttnFwdParams& p, typename Tr::TO* o,
                                               unsigned sO, const float (&inv)[2]) {
  using T = typename Tr::TO;
  constexpr int D = Tr::kHeadDim, ROW_BYTES = D * 2, CHUNKS = D / 8, RPI = 32 / CHUNKS;  // rows a load
  static_assert(D % 16 == 0 && 32 % CHUNKS == 0, "O_STAGE: whole 16-column stmatrix blocks, rows of <= 32 chunks");
  const int lane = threadIdx.x % 32;
  const unsigned warp_tile = sO + (threadIdx.x / 32) * 16 * ROW_BYTES;
  // stmatrix: lane l addresses row l % 8 + 8 (l / 8 % 2) (matrix l / 8: row halves, then column
  // groups) of column group 2 b + l / 16, at chunk (2 b + l / 16) ^ (l % 8) = (l / 16 ^ l % 8) ^ 2 b
  const unsigned st_row = warp_tile + (lane % 8 + 8 * (lane / 8 % 2)) * ROW_BYTES;
  const int st_swz = lane / 16 ^ lane % 8;
  __syncwarp();  // the warp's loads of its previous tile's rows are done
#pragma unroll
  for (int b = 0; b < D / 16; ++b) {
    unsigned r[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = 2 * b + m / 2, h = m % 2;
      r[m] = pack2<T>(ml.acc[4 * i + 2 * h] * inv[h], ml.acc[4 * i + 2 * h + 1] * inv[h]);
    }
    stmatrix_x4(st_row + ((st_swz ^ 2 * b) << 4), r);
  }
  __syncwarp();
  // The loads: lane l takes chunk c = l % CHUNKS of rows l / CHUNKS + RPI k, at c ^ (row % 8), where
  // row % 8 = (l / CHUNKS) ^ (RPI k % 8) (the two have no bit in common)
  const int chunk = lane % CHUNKS, r0 = lane / CHUNKS, at0 = ml.row_a - lane / 4 + r0;
  const unsigned ld_row = warp_tile + r0 * ROW_BYTES;
  const int ld_swz = chunk ^ r0 % 8;
  // the global row addresses step by RPI rows from the first; predicated stores, no branches
  unsigned long long g =
      reinterpret_cast<unsigned long long>(o + static_cast<long long>(at0) * p.o_stride_s + chunk * 8);
  const unsigned long long step =
      static_cast<unsigned long long>(RPI * p.o_stride_s * static_cast<long long>(sizeof(T)));
  const bool col_in = chunk * 8 < p.head_dim;  // head_dim is a multiple of 8: a chunk is whole
#pragma unroll
  for (int k = 0; k < 16 / RPI; ++k, g += step) {
    unsigned a[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(ld_row + k * RPI * ROW_BYTES + ((ld_swz ^ (RPI * k % 8)) << 4)));
    const int at_row = at0 + RPI * k;
    const int ok = col_in && at_row < ml.sq && (!Tr::kBottomAlign || at_row >= 0);
    // (a uint4 store under `if` compiled to a branch around four 4-byte stores: NVRTC 13.0 split it
    // after the asm load; st.global takes the generic address, which for global memory is the same)
    asm volatile("{\n .reg .pred p;\n setp.ne.s32 p, %5, 0;\n @p st.global.v4.u32 [%0], {%1, %2, %3, %4};\n}\n"
                 :: "l"(g), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(ok) : "memory");
  }
}

// The epilogue of a consumer thread: full row sums, normalise, store O and the natural-log LSE.
// O leaves in 16-byte stores (quad_transpose4) when the output's rows are 16-byte aligned (always
// for pyattn's own outputs; an `out=` view may be 4-byte aligned only): a warp's 4-byte store
// writes 16 bytes in each of 8 rows, so the L1 handled 8 lines for 128 bytes, 4 times a 16-byte
// store's work for the same data, on the consumers' way to their next query tile. Warp-specialized
// rows only: the others run two blocks an SM at 128 registers a thread, where the shuffles spilled
// (d = 64: 20 / 64 bytes) and d = 64 at 1k keys ran slower.
// `sO`: O_STAGE's staging tile (FwdSmem::o), unused without it.
template <class Tr, class Mainloop>
__device__ __forceinline__ void wgmma_fwd_store(const Mainloop& ml, const AttnFwdParams& p,
                                                const FwdTileAt<Tr>& at, unsigned sO = 0) {
  using T = typename Tr::TO;  // what is stored
  constexpr int D = Tr::kHeadDim;
  static_assert(D % 32 == 0, "wgmma_fwd_store: head-dim buckets are multiples of 32");
  const bool wide = Tr::kWS && ((reinterpret_cast<unsigned long long>(at.o) |
                      static_cast<unsigned long long>(p.o_stride_s) * sizeof(T)) & 15) == 0;
  float invs[2];  // O_STAGE: both rows' factors, for the staged store after the loop
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(ml.row_sum[h]);
    const int row = ml.row_a + 8 * h;
    // the quad's rows: the shuffles below run on every lane (kBottomAlign: rows before 0 are not stored)
    const bool row_in = row < ml.sq && (!Tr::kBottomAlign || row >= 0);
    const bool empty = sum == 0.f;
    // FP8: V's per-tensor descale folds into the normalisation (the scores' is in scale_log2).
    const float inv = empty ? 0.f : (Tr::kFp8 ? p.o_scale : 1.f) / ml.normaliser(h, sum);
    if constexpr (Tr::kOStage) invs[h] = inv;
    T* orow = at.o + static_cast<long long>(row) * p.o_stride_s;
    if (wide) {
      if constexpr (!Tr::kOStage) {
#pragma unroll
        for (int j = 0; j < D / 32; ++j) {
          unsigned a[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int i = 4 * j + k;
            a[k] = pack2<T>(ml.acc[4 * i + 2 * h] * inv, ml.acc[4 * i + 2 * h + 1] * inv);
          }
          quad_transpose4(a, ml.t);
          const int d = 8 * (4 * j + ml.t);
          if (row_in && d < p.head_dim)  // head_dim is a multiple of 8: the group is whole
            *reinterpret_cast<uint4*>(orow + d) = make_uint4(a[0], a[1], a[2], a[3]);
        }
      }
    } else if (row_in) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const int d = i * 8 + 2 * ml.t;
        if (d < p.head_dim)  // head_dim is a multiple of 8, so d + 1 is in range too
          *reinterpret_cast<unsigned*>(orow + d) =
              pack2<T>(ml.acc[4 * i + 2 * h] * inv, ml.acc[4 * i + 2 * h + 1] * inv);
      }
    }
    if (row_in && p.lse != nullptr && ml.t == 0) {
      const long long idx = at.batch * p.lse_stride_b + at.head * p.lse_stride_h + at.seq.q_row0 + row;
      p.lse[idx] = empty ? -inf() : (ml.row_max[h] * ml.sl2 + log2f(sum)) * kLn2;
    }
  }
  if constexpr (Tr::kOStage)
    if (wide) store_o_staged<Tr>(ml, p, at.o, sO, invs);
}

// `maps`: with Tr::kTma, the tensor maps of q, k, v and the mask, consecutive (AttnFwdTmaParams::tm_q ...).
template <class Tr, class Mods, bool SPARSE = false>
__device__ __forceinline__ void attn_fwd_wgmma(const AttnFwdParams& p, const TmaMap* maps = nullptr) {
  using Mainloop = AttnFwdWgmmaMainloop<Tr, Mods, SPARSE>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const FwdSmem<Tr> sm(smem_raw);

  Mainloop ml;
  wgmma_fwd_block<Tr>(ml, p, maps, smem_raw, sm.kv, sm.mask);
  // Blocks start in the order of x, then y. A full float mask shared by the heads (head stride 0)
  // is read heads-fastest: the heads of a query tile then run side by side, and its mask tiles come
  // from DRAM once and from L2 for the other heads (x fastest, each head swept the whole mask: 2
  // bytes a score from DRAM, 8 GiB at (1, 16k, 16) bf16), at the price of each head's K / V read
  // once per set of query tiles in flight instead of once.
  int m_block = blockIdx.x, head = blockIdx.y;
  if constexpr (FastMods<Mods>::kFloatMask && !Tr::kMaskRowOnly)
    if (p.mask_stride_h == 0) {
      const int lin = blockIdx.y * gridDim.x + blockIdx.x;
      m_block = lin / gridDim.y, head = lin % gridDim.y;
    }
  // Causal blocks near the end of the sequence do the most work: start them first.
  if (p.causal) m_block = gridDim.x - 1 - m_block;
  FwdTileAt<Tr> at;
  if (!wgmma_fwd_tile<Tr>(ml, p, m_block, head, blockIdx.z, at)) return;  // whole block exits

  // -- descriptors, barriers, the main loop; the producer warpgroup's work ends there
  ml.init_ones(sm.ones);
  if (!wgmma_block_run<Tr>(ml, sm.q, sm.bars, at.q, p.q_stride_s, [&] {
        wgmma_load_tile<Tr, Tr::kBlockM, Tr::kThreads>(sm.q, at.q, p.q_stride_s, ml.m0, ml.sq, p.head_dim, threadIdx.x);
      }))
    return;
  wgmma_fwd_store<Tr>(ml, p, at, sm.o);
}

}  // namespace pyattn

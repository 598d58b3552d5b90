// attn_fwd_tma (sm_90a): the wgmma forward kernel (attention_fwd_wgmma.cuh) fed by TMA. A producer
// warpgroup hands the consumers their stages as in the warp-specialized wgmma rows, but only one
// of its threads works: per key tile it issues one bulk tensor copy per 64-wide column block of K
// and of V (and, with tile 0, of the query tile), 128-byte swizzled by the copy engine into the
// layout the wgmma descriptors read, with zeros past the tensor's ends (rows past the sequence,
// columns past head_dim). Against the cp.async producer (about 2 instructions per 16 bytes over
// 128 threads) that frees the SM's issue slots and the producer's registers for the consumers.
// Varlen: a tile that reaches past its sequence's end reads the next sequence's rows (TMA clips at
// the packed tensor's end only); the kernel masks those keys as before (P = 0 there, and query
// rows past the end are never stored).
// A float mask tensor's tiles come the same way (map tm_mask; its swizzle is the one that spans a
// tile row's bytes, up to 128; a key-padding mask with MASK_ROW: one unswizzled row a stage), so a
// masked call runs this kernel too; the host maps only masks whose keys are consecutive and whose
// address and strides are whole 16 bytes. A bool mask comes packed to bits (mask_bits.cuh), which
// the consumers load themselves: no map, no ring space.
// Traits with PERSIST (attn_fwd_tma_persistent below) launch one block an SM that walks the query
// tiles; the others launch as attn_fwd_wgmma.
// Requires pyattn::AttnFwdTmaParams (rendered: AttnFwdParams `fwd`, then the maps tm_q, tm_k,
// tm_v, tm_mask).
#pragma once
#include "attention_fwd_wgmma.cuh"
#include "fwd_tail_split.cuh"

namespace pyattn {

// x / d for 0 <= x < 2^31 and a divisor d >= 1 fixed for the block, by a multiply-high
// (Granlund-Montgomery, round-up form): with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1
// (< 2^32), x / d = (umulhi(x, m) + x) >> l, the sum below 2^32 for such x. The unit walk divides
// twice per query tile on every consumer thread (the unit by its group's units, the (batch, head)
// by the heads); an int division compiles to ~35 dependent instructions of the uniform datapath,
// this to 3, and the per-tile set-up is instructions the ping-pong does not hide
// (BENCHMARKS.md, twenty-seventh and twenty-ninth sessions).
struct FastDiv {
  unsigned m, l;

  FastDiv() = default;
  __device__ __forceinline__ explicit FastDiv(int divisor) {
    const unsigned d = static_cast<unsigned>(divisor);
    l = 32 - __clz(d - 1);  // d = 1: __clz(0) = 32, l = 0, m = 1, x / 1 = (0 + x) >> 0
    // floor(2^32 r / d), r = 2^l - d < d, bit by bit, once a block (a 64-bit `/` compiles to a
    // CALL into the runtime's u64 division); 2 r < 2^32 as d <= 2^31.
    unsigned r = static_cast<unsigned>((1ull << l) - d), q = 0;
#pragma unroll 1
    for (int i = 0; i < 32; ++i) {
      r <<= 1;
      q <<= 1;
      if (r >= d) {
        r -= d;
        q |= 1;
      }
    }
    m = q + 1;
  }
  __device__ __forceinline__ int div(int x) const {
    return static_cast<int>((__umulhi(static_cast<unsigned>(x), m) + static_cast<unsigned>(x)) >> l);
  }
};

// A persistent launch's work units, in order, and which block takes which: unit u goes to block
// u % gridDim.x (round u / gridDim.x), or with three consumer warpgroups to the block that its
// round's rotation picks (below). Without causality a unit is one query tile, and the row
// blocks of one (batch, head) are consecutive, so the blocks running at once share their K/V in
// L2. Causal units pair row block n_mb - 1 - i (the most keys) with row block i (the fewest):
// every unit then costs about n_mb + 1 key tiles, so a plain stride over units is balanced (a
// stride over single causal tiles was 23-34% slower at 16k, longest-first across all heads 7-12%
// slower at 1k, where the blocks running at once read as many heads' K/V from DRAM).
// An odd n_mb leaves each (batch, head) a middle row block of half a unit's cost. Alone in its unit
// it made every (n_mb + 1) / 2-th unit half as long, and a stride that is a multiple of that count
// (132 SMs, n_mb = 11 or 43: d = 64 at 2k / 8k) gave some blocks only half units and the rest only
// whole ones (causal 2k 5% slower than a block a tile). So with an odd n_mb two (batch, head)s form
// a group of n_mb units: the first one's pairs, the second one's, then one unit of both middle
// blocks; a last group of one (batch, head) is its pairs and its middle block.
// Rotated rounds (three consumer warpgroups: the short row at d = 64). Round r still holds units
// [r G, r G + G) (G = gridDim.x), so the blocks running at once still share their heads' K/V in
// L2, but its blocks rotate by r * shift, which moves a block's unit on by one place (mod `per`,
// the units of a (batch, head) or of a group of two) from round to round. With the plain stride, a
// multiple of `per` puts a block on the same place in every round: at d = 64 and 1024 query rows
// (six row blocks of 192, the last of 64 rows, where one warpgroup of three works; it measured 0.71
// of a whole block) on 132 SMs, 22 blocks took only those tails, and the kernel lasted as long as
// the other 110 blocks' 24 whole ones, where 19.4 and 3.9 tails each would do. Rotated: 6% faster.
// Units of one cost (no causality, window or varlen; whole row blocks) need no rotation (shift 0).
// The two-warpgroup rows keep the plain stride, in a loop of its own: with the rounds' loop in
// their code, even unrotated, d = 128 and 256 at 1k keys ran 1.3-2.7% slower (H200, 3-4
// alternating rounds; ptxas moved their spills), and no last row block of theirs leaves two
// warpgroups of three idle.
struct PersistentUnits {
  int n_mb, pairs, n_bh, total;  // row blocks, causal pairs a (batch, head), (batch, head)s, units
  int shift;                     // rotated rounds: the rotation a round adds, in [0, gridDim.x)

  __device__ __forceinline__ PersistentUnits(const AttnFwdParams& p, int block_m) {
    n_mb = (p.seqlen_q + block_m - 1) / block_m;
    pairs = n_mb / 2;
    n_bh = p.heads_q * p.batch;
    total = !p.causal ? n_mb * n_bh : !(n_mb & 1) ? pairs * n_bh : (n_bh / 2) * n_mb + (n_bh & 1) * (pairs + 1);
    const int G = gridDim.x, per = per_units(p);
    const bool even = !p.causal && p.window_left < 0 && p.window_right < 0 && p.cu_seqlens_q == nullptr &&
                      p.seqlen_q % block_m == 0;
    shift = even ? 0 : (1 - G % per + per) % per % G;  // (G + shift) % per == 1 where shift < G allows
  }
  // The consumers' divisors (FastDiv): by the units of a (batch, head) or group, by the query
  // heads. Their 4 registers stay live across the walk, so only rows with the room take them
  // (attn_fwd_tma_persistent's kFastUnits); the producer thread, at 24 registers, divides plainly.
  // (A member for that divisor, live in every role, alone raised the d = 256 row's spills from
  // 56 to 120 bytes: it is recomputed where needed.)
  struct Divs {
    FastDiv per, heads;
  };
  __device__ __forceinline__ Divs divs(const AttnFwdParams& p) const {
    return {FastDiv(per_units(p)), FastDiv(p.heads_q)};
  }
  // The units of a (batch, head) (n_mb; causal: its pairs), or of a group of two with an odd n_mb.
  __device__ __forceinline__ int per_units(const AttnFwdParams& p) const {
    return !p.causal || (n_mb & 1) ? n_mb : pairs;
  }
  // The rotation of the round after one rotated by `rot` (the loops below start at rot =
  // blockIdx.x, base 0, and take unit base + rot of each round when it is below `total`).
  __device__ __forceinline__ int next_rot(int rot) const {
    rot += shift;
    return rot >= static_cast<int>(gridDim.x) ? rot - static_cast<int>(gridDim.x) : rot;
  }
  // Query tile `side` (0, 1: causal) of unit u as (m_block, head, batch); false when the unit has
  // no such tile (side 1 without causality, or a middle-block unit of a last lone (batch, head)).
  // `fast`: the divisors as FastDivs (the consumers), or null (plain division).
  __device__ __forceinline__ bool tile(const AttnFwdParams& p, int u, int side, int& m_block, int& head,
                                       int& batch, const Divs* fast = nullptr) const {
    // x / d, d = per_units(p) in each branch below (the consumers' FastDiv holds that same divisor;
    // d is passed, not recomputed, so the producer's plain division stays as cheap as it was)
    const auto per_div = [fast](int x, int d) { return fast ? fast->per.div(x) : x / d; };
    int bh, i;
    if (!p.causal) {
      bh = per_div(u, n_mb);
      m_block = u - bh * n_mb;
    } else if (!(n_mb & 1)) {
      bh = per_div(u, pairs);
      i = u - bh * pairs;
      m_block = side == 0 ? n_mb - 1 - i : i;
    } else {  // a group of two (batch, head)s: n_mb units
      const int g = per_div(u, n_mb);
      bh = 2 * g;
      i = u - g * n_mb;
      if (bh + 1 == n_bh && i >= pairs) i = 2 * pairs;  // a lone last (batch, head): its middle unit
      if (i == 2 * pairs) {  // both middle blocks, one a side
        bh += side;
        m_block = pairs;
      } else {
        if (i >= pairs) {
          ++bh;
          i -= pairs;
        }
        m_block = side == 0 ? n_mb - 1 - i : i;
      }
    }
    batch = fast ? fast->heads.div(bh) : bh / p.heads_q;
    head = bh - batch * p.heads_q;
    return p.causal ? bh < n_bh : side == 0;
  }
};

// Persistent attn_fwd_tma (Tr::kPersist): gridDim.x blocks (one an SM) walk the query tiles
// (PersistentUnits). Each role's walk is written twice, the rotated rounds and the plain stride:
// one loop with a compile-time condition in it changed the two-warpgroup rows' PTX (compared with
// NVRTC 13.0), whose speed the plain stride's code is kept for. The producer thread runs ahead
// through the units, so the next tile's query and K/V stream in under this one's last steps and
// epilogue. The query tile has its own "full" / "empty" barriers; the consumers' last Q K^T of a
// tile releases it.
// Every query tile starts the ring at stage 0, with each stage's phase kept in a bit of its own
// (full_parity / empty_bits), so a tile may leave stages unvisited. Why not carry the stage on:
// past the tile loop's branches ptxas then keeps the stage and every wgmma descriptor formed
// from it in per-thread registers and moves each to a uniform register before its wgmma (+8% of
// the main loop's instructions at d = 64, measured slower); a tile loop per starting stage
// (constant within it) costs a main loop per stage, and over 2 s of NVRTC time for some variants.
// Tiles past a varlen sequence's end are skipped by every role; tiles without key tiles (a
// band that sees no key) store zeros / -inf without touching the query tile.
template <class Tr, class Mods>
__device__ __forceinline__ void attn_fwd_tma_persistent(const AttnFwdTmaParams& tp) {
  const AttnFwdParams& p = tp.fwd;
  const TmaMap* maps = &tp.tm_q;
  using Mainloop = AttnFwdWgmmaMainloop<Tr, Mods, false>;
  // The last round's key split (fwd_tail_split.cuh; the traits' TAIL_SPLIT): without a mask tensor
  // or a bounded soft-cap (whose O is normalised by other sums than its LSE's); ALiBi compiles
  // without spills but was not measured, so the host leaves it out (pyattn/ops/_fwd_tail.py)
  constexpr bool kTail = Tr::kTailSplit;
  static_assert(!kTail || (Mods::kMask == kMaskNone && !Mods::kAlibi && !Mainloop::FIXED_REF),
                "a tail split: no mask tensor, ALiBi or bounded soft-cap");
  constexpr int STAGES = Tr::kStages, BM = Tr::kBlockM;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const FwdSmem<Tr> sm(smem_raw);
  const unsigned sQ = sm.q, bar_full = sm.bars;
  const unsigned bar_q_full = bar_full + Tr::kRingBarrierBytes;  // after the stages' full / empty barriers

  Mainloop ml;
  wgmma_fwd_block<Tr>(ml, p, maps, smem_raw, sm.kv, sm.mask);
  ml.bar_q_empty = bar_q_full + 8;
  if (threadIdx.x == 0) {
    pipe::init(bar_q_full, 1);
    pipe::init(ml.bar_q_empty, Tr::kConsumerThreads / 32);
  }
  ml.init_ones(sm.ones);
  ml.init_ring(bar_full);  // fences the query tile's barriers too
  __syncthreads();
  const PersistentUnits units(p, BM);
  FwdTileAt<Tr> at;
  int m_block, head, batch;

  if (threadIdx.x >= Tr::kConsumerThreads) {  // -- the producer warpgroup: one thread works
    pipe::regs_dec<Tr::kProducerRegs>();
    if (threadIdx.x != Tr::kConsumerThreads) return;
    tma::prefetch(maps);
    ml.prefetch_maps();
    // A fresh barrier's "previous" phase counts as complete (bits 16 + s: SPLIT_KV's V barriers).
    unsigned empty_bits = ((1u << STAGES) - 1) * (Tr::kSplitKV ? 0x10001u : 1u), q_parity = 1;
    if constexpr (Tr::kWarpgroups == 3) {  // rotated rounds; else the plain stride (PersistentUnits)
      for (int base = 0, rot = blockIdx.x; base < units.total; base += gridDim.x, rot = units.next_rot(rot)) {
        const int u = base + rot;
#pragma unroll 1
        for (int side = 0; side < 2; ++side) {
          if (u >= units.total || !units.tile(p, u, side, m_block, head, batch)) continue;
          if (!wgmma_fwd_tile<Tr>(ml, p, m_block, head, batch, at) || ml.n_tiles == 0) continue;
          pipe::wait(ml.bar_q_empty, q_parity);
          q_parity ^= 1;
          tma::arrive_expect(bar_q_full, Tr::kQBytes);
          ml.load_q_tma(sQ, bar_q_full);
          ml.produce_tma_tiles(empty_bits, sQ, false);
        }
      }
    } else {
      // the whole units, then (kTail) the pieces of the tail (fwd_tail_split.cuh). `whole`, `end` and
      // a tile's key-tile count are spelled again in the consumers' walk: helpers shared by the two
      // moved the split variant's SASS and cost it 0.7-1.5% (BENCHMARKS.md, sixtieth session)
      const int whole = kTail && tp.sk_iters > 0 ? tp.sk_first : units.total;
      const int end = kTail ? tail_walk_end(tp, units.total) : units.total;
      for (int u = blockIdx.x; u < end; u += gridDim.x) {
        int unit = u, j0 = 0, j1 = 0x7fffffff;
        if (kTail && u >= whole && !tail_piece_of(tp, u, unit, j0, j1)) continue;
#pragma unroll 1
        for (int side = 0; side < 2; ++side) {
          if (!units.tile(p, unit, side, m_block, head, batch)) continue;
          int a = 0, b = 0x7fffffff;  // a tail item's key tiles of this query tile
          if (kTail && u >= whole &&
              !tail_side(side, p.causal ? (side ? units.n_mb - m_block : m_block + 1) : tp.sk_tiles, j0, j1, a, b))
            continue;
          if (!(kTail ? wgmma_fwd_tile<Tr>(ml, p, m_block, head, batch, at, a, b)
                      : wgmma_fwd_tile<Tr>(ml, p, m_block, head, batch, at)) ||
              ml.n_tiles == 0)
            continue;
          pipe::wait(ml.bar_q_empty, q_parity);
          q_parity ^= 1;
          tma::arrive_expect(bar_q_full, Tr::kQBytes);
          ml.load_q_tma(sQ, bar_q_full);
          ml.produce_tma_tiles(empty_bits, sQ, false);
        }
      }
    }
    return;
  }

  // -- the consumer warpgroups
  pipe::regs_inc<Tr::kConsumerRegs>();
  ml.make_descs(sQ);
  ml.full_parity = 0;  // PERSIST: a bit a stage
  unsigned q_parity = 0;
  // The unit walk's divisions by FastDiv where the consumers have the registers: at d = 256
  // (spilling 56 bytes already) ptxas (NVRTC 13.0) spilled 4-8 more with them; every d <= 128 row
  // kept 0.
  constexpr bool kFastUnits = Tr::kHeadDim <= 128;
  typename PersistentUnits::Divs divs;
  if constexpr (kFastUnits) divs = units.divs(p);
  const typename PersistentUnits::Divs* fast = kFastUnits ? &divs : nullptr;
  // GEMM turns run on across the block's query tiles (Mainloop::pass_turn): warpgroup 0 gets its
  // first turn here, once, and takes the last warpgroup's final hand-over after the loop.
  if constexpr (Tr::kPingPong)
    if (ml.wgi == Tr::kWarpgroups - 1) pipe::bar_arrive(1, 256);  // warpgroup 0 issues first
  if constexpr (Tr::kWarpgroups == 3) {  // the producer's walk, unit for unit
    for (int base = 0, rot = blockIdx.x; base < units.total; base += gridDim.x, rot = units.next_rot(rot)) {
      const int u = base + rot;
#pragma unroll 1
      for (int side = 0; side < 2; ++side) {
        if (u >= units.total || !units.tile(p, u, side, m_block, head, batch, fast)) continue;
        if (!wgmma_fwd_tile<Tr>(ml, p, m_block, head, batch, at)) continue;
        ml.clear();
        ml.stage = ml.prev_stage = 0;
        if (ml.n_tiles > 0) {  // CTA-uniform
          pipe::wait(bar_q_full, q_parity);
          q_parity ^= 1;
          ml.run_tiles();
        }
        wgmma_fwd_store<Tr>(ml, p, at, sm.o);
      }
    }
  } else {
    const int whole = kTail && tp.sk_iters > 0 ? tp.sk_first : units.total;
    const int end = kTail ? tail_walk_end(tp, units.total) : units.total;
    for (int u = blockIdx.x; u < end; u += gridDim.x) {
      int unit = u, j0 = 0, j1 = 0x7fffffff;
      if (kTail && u >= whole && !tail_piece_of(tp, u, unit, j0, j1)) continue;
#pragma unroll 1
      for (int side = 0; side < 2; ++side) {
        if (!units.tile(p, unit, side, m_block, head, batch, fast)) continue;
        // a tail item's key tiles of this query tile, [a, b) of its own c of them, the tail's x0 on
        int a = 0, b = 0x7fffffff, c0 = 0;
        if (kTail && u >= whole) {
          c0 = p.causal ? (side ? units.n_mb - m_block : m_block + 1) : tp.sk_tiles;
          if (!tail_side(side, c0, j0, j1, a, b)) continue;
        }
        if (!(kTail ? wgmma_fwd_tile<Tr>(ml, p, m_block, head, batch, at, a, b)
                    : wgmma_fwd_tile<Tr>(ml, p, m_block, head, batch, at)))
          continue;
        ml.clear();
        ml.stage = ml.prev_stage = 0;
        if (ml.n_tiles > 0) {  // CTA-uniform
          pipe::wait(bar_q_full, q_parity);
          q_parity ^= 1;
          ml.run_tiles();
        }
        if constexpr (kTail) {
          // a piece of the query tile: stored for the merge; the warp that completes the tile goes
          // on to store it merged
          if (u >= whole) {
            const int t = unit - tp.sk_first, c = side ? tp.sk_tiles - c0 : c0;  // (causal: side 1's i + 1)
            if ((a > 0 || b < c) &&
                !tail_piece(ml, tp, p.causal ? 2 * t + side : t, t * tp.sk_tiles + (side ? c0 : 0), c, b - a))
              continue;
          }
        }
        wgmma_fwd_store<Tr>(ml, p, at, sm.o);
      }
    }
  }
  // The last warpgroup's final hand-over (or the first turn, where no tile ran): every arrival
  // meets a sync.
  if constexpr (Tr::kPingPong)
    if (ml.wgi == 0) pipe::bar_sync(1, 256);
}

template <class Tr, class Mods>
__device__ __forceinline__ void attn_fwd_tma(const AttnFwdTmaParams& p) {
  static_assert(Tr::kTma, "attn_fwd_tma: traits with TMA on");
  // tm_q, tm_k, tm_v, tm_mask: consecutive 128-byte maps
  if constexpr (Tr::kPersist)
    attn_fwd_tma_persistent<Tr, Mods>(p);
  else
    attn_fwd_wgmma<Tr, Mods, false>(p.fwd, &p.tm_q);
}

}  // namespace pyattn

// What every forward kernel shares about which keys a query sees and how a score is formed:
// per-sequence geometry (dense or varlen), the causal/window band, and the optional score
// modifiers (soft-cap, ALiBi, a mask tensor), which are compile-time switches so that the plain
// kernel carries none of their cost. Semantics are those of pyattn.reference.attention_ref.
// Requires pyattn::AttnFwdParams and common.cuh.
#pragma once
#include "band.cuh"

namespace pyattn {

// A paged prefill's sequence b (PagedFwdParams pp, its member fwd p): its first packed query row
// and new tokens, clamped as varlen's offsets (common.cuh clamp_rows, into fwd.total_q and max_q),
// and its cached keys clamped into [0, max_k]. Tables no host check has seen (paged_prefill's
// max_seqlen_q / max_seqlen_k) then address wrong rows and pages, never memory outside q, out, the
// LSE, the partials or the pools.
template <class PP>
__device__ __forceinline__ void paged_seq(const AttnFwdParams& p, const PP& pp, int b, int& q_row0, int& sq, int& sk) {
  clamp_rows(p.cu_seqlens_q, b, p.total_q, pp.max_q, q_row0, sq);
  sk = min(max(pp.kv_len[b], 0), pp.max_k);
}

// The paged prefill kernels' compact grid, one-dimensional: block x / splits is unit t of the
// whole batch, sequence by sequence, and in a sequence row group (kv head) by row group, query tile
// by query tile (the order of the (query tiles, row groups, sequences) grid before, whose
// neighbouring blocks share a sequence's pages and, for a long sequence, a kv head's keys in L2).
// Sequence b owns groups x ceil(rows_b / BM) units (groups = heads_q / row_group; rows_b its new
// tokens, clamped by paged_seq, times row_group). The grid is sized by a bound on that sum that
// needs no offsets on the host (total rows / BM + one part tile a sequence, for each group) instead
// of the longest sequence's tiles for every sequence: a mixed step of 63 one-token rows and one
// 2048-token chunk had 63 empty blocks for each real one, and passing them cost it 80 us
// (BENCHMARKS.md, the fifty-sixth session). Causal launches take the units backwards: each
// sequence's last rows (most keys) first.
__device__ __forceinline__ int paged_unit(const AttnFwdParams& p, int splits, int& split) {
  const int t_raw = blockIdx.x / splits;
  split = blockIdx.x - t_raw * splits;
  return p.causal ? gridDim.x / splits - 1 - t_raw : t_raw;
}

struct PagedTile {
  int seq, group, tile;  // the sequence, its row group and query tile; seq < 0: past the batch's units
  int q_row0, sq, sk;    // as paged_seq gives them for the sequence
};

// Unit t's sequence, found by every warp itself from a scan of the sequences, 128 a round (one
// round for a batch of up to 128). A lane's loads of a round (its sequences' offsets and lengths)
// are independent, and the unit's geometry comes from the lane that read it: one round trip of
// loads a round, as paged_seq alone took.
template <int BM, class PP>
__device__ __forceinline__ PagedTile paged_tile_scan(const AttnFwdParams& p, const PP& pp, int t) {
  constexpr int K = 4;  // sequences a lane
  const int lane = threadIdx.x % 32, rg = pp.row_group, groups = p.heads_q / rg;
  int before = 0;  // the units of the earlier rounds' sequences
  for (int base = 0; base < p.batch; base += 32 * K) {
    int n[K], lo[K], len[K], keys[K], mine = 0;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int j = base + lane * K + i;
      lo[i] = len[i] = keys[i] = 0;
      if (j < p.batch) paged_seq(p, pp, j, lo[i], len[i], keys[i]);
      n[i] = (len[i] * rg + BM - 1) / BM * groups;
      mine += n[i];
    }
    int incl = mine;  // inclusive scan of the lanes' units
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += up;
    }
    const unsigned hit = __ballot_sync(kFullMask, t < before + incl);
    if (hit != 0u) {  // the first lane whose sequences reach unit t holds it
      PagedTile at{0, 0, 0, 0, 0, 0};
      int first = before + incl - mine;
      bool found = false;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        if (!found && t < first + n[i]) {
          const int u = t - first, tiles = n[i] / groups, g = u / tiles;
          at = {base + lane * K + i, g, u - g * tiles, lo[i], len[i], keys[i]};
          found = true;
        }
        first += n[i];
      }
      const int f = __ffs(hit) - 1;
      return {__shfl_sync(kFullMask, at.seq, f), __shfl_sync(kFullMask, at.group, f),
              __shfl_sync(kFullMask, at.tile, f), __shfl_sync(kFullMask, at.q_row0, f),
              __shfl_sync(kFullMask, at.sq, f), __shfl_sync(kFullMask, at.sk, f)};
    }
    before += __shfl_sync(kFullMask, incl, 31);
  }
  return {-1, 0, 0, 0, 0, 0};
}

// The same out of line, for the wgmma kernels: inlined there, the scan's loop and shuffles cost
// their main loops spills (ptxas, NVRTC 13.0: 36-64 bytes at d = 128 with a soft-cap or ALiBi,
// against 8-16 before); the call costs a few instructions at the entry. The mma.sync kernel
// (attention_prefill_mma.cuh) spills less with it inlined (20 bytes at d = 128 against 28 out of
// line and 36 before; with a soft-cap and ALiBi 68 against 236), so it takes paged_tile_scan.
template <int BM, class PP>
__device__ __noinline__ PagedTile paged_tile(const AttnFwdParams& p, const PP& pp, int t) {
  return paged_tile_scan<BM>(p, pp, t);
}

// Its page list: a CSR row (page_indptr) or, page_indptr null, a block table's row.
template <class PP>
__device__ __forceinline__ const int* paged_pages(const PP& pp, int b) {
  return pp.page_indices + (pp.page_indptr != nullptr ? pp.page_indptr[b] : b * pp.table_stride);
}

// Where batch entry (or varlen sequence) b lives in the (packed) arrays.
struct SeqInfo {
  long long q_row0, k_row0;  // first row in the packed arrays (0 for dense batches)
  int sq, sk;                // its query and key lengths
};

__device__ __forceinline__ SeqInfo seq_info(const AttnFwdParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    int q0, k0;
    clamp_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, q0, s.sq);
    clamp_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k, k0, s.sk);
    s.q_row0 = q0;
    s.k_row0 = k0;
  } else {
    s.q_row0 = s.k_row0 = 0;
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
  }
  return s;
}

// kMaskBits: a bool mask packed by mask_bits.cuh (a row: 128-key groups of four words, word t
// holding quad lane t's keys of the group; zero past the keys), read by attn_fwd_tma only.
enum MaskKind { kMaskNone = 0, kMaskBool = 1, kMaskF16 = 2, kMaskBF16 = 3, kMaskF32 = 4, kMaskBits = 5 };

// Compile-time score modifiers. kAny: scores go through score_mod() instead of the fused
// scale-and-exp2 path.
// SOFTCAP_: 0 none, 1 a soft-cap, 2 a bounded one (bf16 inputs, cap <= 51, no ALiBi or float mask
// after it: the wgmma forward's softmax then needs no row max; AttnFwdWgmmaMainloop::FIXED_REF).
template <int MASK_, int SOFTCAP_, bool ALIBI_>
struct ScoreMods {
  static constexpr int kMask = MASK_;
  static constexpr bool kSoftcap = SOFTCAP_ != 0;
  static constexpr bool kCapBounded = SOFTCAP_ == 2;
  static constexpr bool kAlibi = ALIBI_;
  static constexpr bool kAny = MASK_ != kMaskNone || SOFTCAP_ != 0 || ALIBI_;
};

// Additive mask value at element index `idx`: 0 / -inf for bool masks (True = may attend).
template <int KIND>
__device__ __forceinline__ float mask_value(const void* mask, long long idx) {
  if constexpr (KIND == kMaskBool) return static_cast<const unsigned char*>(mask)[idx] ? 0.f : -inf();
  if constexpr (KIND == kMaskF16) return __half2float(static_cast<const __half*>(mask)[idx]);
  if constexpr (KIND == kMaskBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[idx]);
  if constexpr (KIND == kMaskF32) return static_cast<const float*>(mask)[idx];
  return 0.f;
}

// Per-(batch, head) state the modifiers need, fetched once per block.
struct ModState {
  const void* mask;   // at (batch, head); rows and keys still to add
  float alibi_slope;  // 0 when ALiBi is off
  int diag;           // sk - sq: ALiBi distance is |i + diag - j|
};

template <class Mods>
__device__ __forceinline__ ModState make_mod_state(const AttnFwdParams& p, int batch, int head, int sq, int sk) {
  ModState m;
  m.mask = nullptr;
  if constexpr (Mods::kMask != kMaskNone) {
    const int esize = Mods::kMask == kMaskBool ? 1 : Mods::kMask == kMaskF32 ? 4 : 2;
    m.mask = static_cast<const char*>(p.mask) + (batch * p.mask_stride_b + head * p.mask_stride_h) * esize;
  }
  m.alibi_slope = 0.f;
  if constexpr (Mods::kAlibi) m.alibi_slope = p.alibi[batch * p.alibi_stride_b + head];
  m.diag = sk - sq;
  return m;
}

// Final score in log2 units from a raw dot product q.k of (row, key), both inside the sequence:
// scale, soft-cap, ALiBi, mask, in the reference's order.
template <class Mods>
__device__ __forceinline__ float score_mod(const AttnFwdParams& p, const ModState& m, float raw, int row, int key) {
  float x = raw * p.scale;
  if constexpr (Mods::kSoftcap) x = p.softcap * tanhf(x / p.softcap);
  if constexpr (Mods::kAlibi) x -= m.alibi_slope * fabsf(static_cast<float>(row + m.diag - key));
  if constexpr (Mods::kMask != kMaskNone)
    x += mask_value<Mods::kMask>(m.mask, row * p.mask_stride_q + key * p.mask_stride_k);
  return x * kLog2e;
}

// The score modifiers as the wgmma kernel's inner loop applies them: the final score in log2
// units straight from a raw dot product, with scale and log2(e) folded into two constants and the
// soft-cap through tanh.approx.f32 (one MUFU op, like the softmax's exp2; its relative error of
// 2^-11 is below what a 16-bit score carries, see the GPU tests' 2x rule). The mma.sync kernel's
// score_mod keeps the accurate tanhf. Order as the reference: scale, soft-cap, ALiBi, mask.
// A bool mask is a visibility predicate, not a term: its key pairs are gathered as 16-bit words
// (byte e nonzero = key 2u + e visible) and folded into the band test, so with a bool mask alone
// the scores stay raw and the softmax scales them as without modifiers (kScoresFinal false).
// A float mask alone keeps them raw too: its terms divided by the scale (times `mscale`) are added
// to the raw dot products, one fma a score, and a tile whose terms are all 0 needs no
// work at all. (A term whose quotient exceeds float32, |m| > 3.4e38 * scale, becomes -inf; so did
// the log2 form's |m| > 2.4e38, such as finfo(float32).min.)
// A packed bool mask (kBits) is a predicate too; its words are read straight from global memory
// (L2) by the wgmma main loop, not staged (AttnFwdWgmmaMainloop::gather_mask).
template <class Mods>
struct FastMods {
  static constexpr bool kBits = Mods::kMask == kMaskBits;
  static constexpr bool kBool = Mods::kMask == kMaskBool || kBits;
  static constexpr bool kFloatMask = Mods::kMask != kMaskNone && !kBool;
  static constexpr bool kScoresFinal = Mods::kSoftcap || Mods::kAlibi;  // else raw scores (+ mask terms)
  static constexpr bool kMaskOnly = Mods::kMask != kMaskNone && !kScoresFinal;
  // A soft-cap with nothing added after it: score() returns tanh(raw * pre) and the softmax's
  // scale (post = softcap * log2 e) finishes it, one multiply per score fewer.
  static constexpr bool kCapScale = Mods::kSoftcap && !Mods::kAlibi && !kFloatMask;
  static constexpr int kSize = kBits ? 4 : kBool ? 1 : Mods::kMask == kMaskF32 ? 4 : 2;  // bits: a word
  const char* mask;         // at (batch, head)
  long long m_sq, m_sk;     // mask strides (elements; kBits: words, m_sk unused)
  bool pairs;               // keys (2u, 2u + 1) of a row are one aligned pair load
  float pre, post;          // y = raw * pre, or tanh(raw * pre) * post with the soft-cap
  float mscale;             // a float mask's terms: m * log2(e) in final scores, m / scale in raw ones
  float slope;              // ALiBi slope in log2 units
  int diag;                 // sk - sq

  __device__ __forceinline__ void init(const AttnFwdParams& p, int batch, int head, int sq, int sk) {
    mask = nullptr;
    m_sq = p.mask_stride_q;
    m_sk = p.mask_stride_k;
    pairs = false;
    if constexpr (Mods::kMask != kMaskNone) {
      mask = static_cast<const char*>(p.mask) + (batch * p.mask_stride_b + head * p.mask_stride_h) * kSize;
      // A pair load needs consecutive keys (stride 1) and every row's even key 2 * kSize aligned.
      pairs = m_sk == 1 && m_sq % 2 == 0 && reinterpret_cast<unsigned long long>(mask) % (2 * kSize) == 0;
    }
    if constexpr (Mods::kSoftcap) {
      pre = p.scale / p.softcap;
      post = p.softcap * kLog2e;
    } else {
      pre = p.scale * kLog2e;
      post = 1.f;
    }
    mscale = kScoresFinal ? kLog2e : 1.f / p.scale;
    slope = 0.f;
    if constexpr (Mods::kAlibi) slope = p.alibi[batch * p.alibi_stride_b + head] * kLog2e;
    diag = sk - sq;
  }

  __device__ __forceinline__ static float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }

  // The mask at keys (key, key + 1) of `row`, read in place, raw as pair_at gives it. `in0` /
  // `in1` say which keys lie inside the sequence; the others are never read (bytes 0).
  __device__ __forceinline__ void pair_in_place(int row, int key, bool in0, bool in1, float& a, float& b,
                                                unsigned& word) const {
    a = b = 0.f;
    word = 0;
    if constexpr (Mods::kMask != kMaskNone) {
      const long long idx = row * m_sq + key * m_sk;
      if (pairs && in1) {  // in1 implies in0 (key + 1 in range)
        pair_at(mask + idx * kSize, a, b, word);
      } else if constexpr (kBool) {
        const unsigned char* m = reinterpret_cast<const unsigned char*>(mask);
        word = (in0 && __ldg(m + idx) ? 0x01u : 0u) | (in1 && __ldg(m + idx + m_sk) ? 0x100u : 0u);
      } else if constexpr (kSize == 2) {
        const unsigned short* m = reinterpret_cast<const unsigned short*>(mask);
        word = (in0 ? __ldg(m + idx) : 0u) | (in1 ? static_cast<unsigned>(__ldg(m + idx + m_sk)) << 16 : 0u);
      } else {
        const float* m = reinterpret_cast<const float*>(mask);
        if (in0) a = __ldg(m + idx);
        if (in1) b = __ldg(m + idx + m_sk);
      }
    }
  }

  // The raw pair at `at` (global or shared memory, aligned to two elements): a bool mask's bytes
  // or a 16-bit mask's two elements in `word`, an f32 mask's in a / b. Raw, so that a tile with
  // nothing to add (all bytes 1, all bits 0) is found before any conversion; terms() converts.
  __device__ __forceinline__ static void pair_at(const char* at, float& a, float& b, unsigned& word) {
    if constexpr (kBool) {
      word = *reinterpret_cast<const unsigned short*>(at);
    } else if constexpr (kSize == 2) {
      word = *reinterpret_cast<const unsigned*>(at);
    } else if constexpr (Mods::kMask == kMaskF32) {
      const float2 f = *reinterpret_cast<const float2*>(at);
      a = f.x, b = f.y;
    }
  }

  // A float mask's raw pair (a 16-bit pair's `word`, or an f32 pair's f0, f1) onto the scores s0,
  // s1, times mscale. With the mask alone (kMaskOnly) on the raw scores, in place, before the main
  // loop's branches on the tile (an fma in score(), inside them, cost a register move a score to
  // merge them: SASS); with ALiBi or soft-cap on the final scores of a tile that went through
  // score() without it (kSplitMask in the wgmma step). Otherwise score() adds the term itself.
  // A 16-bit pair by pair_to_float2 (common.cuh: a bf16 by its bits, one instruction a term).
  __device__ __forceinline__ void add_terms(unsigned word, float f0, float f1, float& s0, float& s1) const {
    float a, b;
    pair_terms(word, f0, f1, a, b);
    s0 = fmaf(a, mscale, s0), s1 = fmaf(b, mscale, s1);
  }

  // A float mask's pair of terms (a, b) as gathered: a 16-bit pair's `word` converted, an f32
  // pair's raw values (f0, f1) as they are.
  __device__ __forceinline__ static void pair_terms(unsigned word, float f0, float f1, float& a, float& b) {
    if constexpr (Mods::kMask == kMaskF16) {
      const float2 f = pair_to_float2<__half>(word);
      a = f.x, b = f.y;
    } else if constexpr (Mods::kMask == kMaskBF16) {
      const float2 f = pair_to_float2<__nv_bfloat16>(word);
      a = f.x, b = f.y;
    } else {
      a = f0, b = f1;
    }
  }

  // The score of a visible (row, key) from its raw dot product and a float mask's term `m`: final
  // (log2 units), or, when !kScoresFinal, raw (a float mask's term is on it already: terms(); the
  // softmax scales it), or tanh(raw * pre) when kCapScale (the softmax scales that too).
  __device__ __forceinline__ float score(float raw, int row, int key, float m) const {
    if constexpr (!kScoresFinal) return raw;
    if constexpr (kCapScale) return tanh_approx(raw * pre);
    float y = Mods::kSoftcap ? tanh_approx(raw * pre) * post : raw * pre;
    if constexpr (Mods::kAlibi) y -= slope * fabsf(static_cast<float>(row + diag - key));
    if constexpr (kFloatMask) y = fmaf(m, mscale, y);  // -inf for a -inf float mask
    return y;
  }
};

// Masks (and, with modifiers, forms) the S accumulators of one warp: MT m16 row tiles x NT n8
// key tiles in the mma.sync C layout (this lane: rows row0 and row0 + 8 of each row tile, keys
// key0 and key0 + 1 of each key tile). Modifiers apply to every tile; without them only tiles
// that cross the band or the sequence end (`full` false) are touched. Rows past the end never
// read the mask tensor.
template <class Mods, int MT, int NT>
__device__ __forceinline__ void mask_scores(float (&s)[MT][NT][4], const AttnFwdParams& p, const ModState& mods,
                                            const Band& band, int row0, int key0, int sq, int sk, bool full) {
  if (!Mods::kAny && full) return;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nt * 8 + (e & 1), row = row0 + mi * 16 + (e >> 1) * 8;
        const bool ok = key < sk && band.allows(row, key);
        if constexpr (Mods::kAny) s[mi][nt][e] = ok && row < sq ? score_mod<Mods>(p, mods, s[mi][nt][e], row, key) : -inf();
        else if (!ok) s[mi][nt][e] = -inf();
      }
}

}  // namespace pyattn

// Paged K/V tile loads of the wgmma prefill (attention_prefill_wgmma.cuh, sm_90a): rows
// [row0, row0 + ROWS) of one sequence's keys into the 128-byte-swizzled K and V tiles of a ring
// stage (the layout of wgmma_load_tile). Key r sits at slot r % page_size of page
// pages[r / page_size]; one lookup per row serves both K and V. Rows at or past `row_end` and
// columns at or past `head_dim` are zero-filled.
//
// Why this shape (issue 13, BENCHMARKS.md "Paged prefill loader"): the previous loader shuffled
// two 64-bit element offsets per pass and formed two 64-bit addresses from them (~25 instructions
// per pass of a K and a V copy, ~296 per 64-key tile, against ~3.5 per copy in the dense loader),
// and looked its page up only after the stage was free. Nsight Compute on the 4k chunk over 16k
// (H200): 2.24 M instructions per scheduler against the dense kernel's 1.38 M, 4.49 M cycles
// against 3.95 M, no scheduler saturated (0.50 issued per cycle): the producer's serial per-tile
// chain (wait, lookup round trip, offset math, copies) held the consumers up. This loader: 1.84 M
// instructions and 3.90 M cycles on the same 64-key tiles, and the dense kernel's 128-key row
// became usable (the chunk at 1.02-1.03x the dense kernel's speed).
//
// Here, per tile, lane l of each warp looks up one row the warp copies (as before) but keeps it
// as one 32-bit number: the row's index in units of the pool's slot stride (page *
// rows_per_page + slot; rows_per_page = page stride / slot stride, the same for K and V: the
// caller checks both, and that the pool's rows number under 2^32). A pass then costs one shuffle
// and, per pool, one IMAD.WIDE.U32 (row * slot bytes + this thread's column pointer) and one
// cp.async. `fetch` issues the page load of the next tile before the producer waits for a free
// stage, so the copies never wait for it.
// Requires wgmma.cuh (cp_async_16).
#pragma once

namespace pyattn {

// base + row * bytes: one IMAD.WIDE.U32 (the product as mul.wide.u32, the add left to ptxas,
// which fuses them). As 64-bit C++ products ptxas kept an add of a zero high half per address
// (59 instructions for a 64-key tile's 16 copies instead of 42), and a whole mad.wide.u32 in PTX
// became three instructions (73).
__device__ __forceinline__ const char* paged_row_addr(const char* base, unsigned row, unsigned bytes) {
  unsigned long long off;
  asm("mul.wide.u32 %0, %1, %2;\n" : "=l"(off) : "r"(row), "r"(bytes));
  return base + off;
}

template <class Tr, int ROWS, int NT>
struct PagedKVLoad {
  using T = typename Tr::T;
  static constexpr int CPR = Tr::kHeadDim / 8;  // 16-byte chunks per row
  static constexpr bool kRowWise = NT % CPR == 0;
  static constexpr int kRowsPerPass = kRowWise ? NT / CPR : 1;
  static constexpr int kPasses = (ROWS + kRowsPerPass - 1) / kRowsPerPass;
  static constexpr int R = CPR <= 32 && 32 % CPR == 0 ? 32 / CPR : 0;  // rows of one warp per pass
  // A warp touches kPasses * R rows per tile: one lane each. Else (HEAD_DIM 192: 24 chunks a row)
  // every chunk looks its page up itself (flat chunk walk, 64-bit offsets; no measured row uses it).
  static constexpr bool kShuffle = kRowWise && R > 0 && kPasses * R <= 32;

  const char* kc;     // K pool at this kv head's slot 0 + this thread's column (bytes)
  const char* vc;     // the same in the V pool
  const T* k;         // (flat walk) the pools' kv-head bases
  const T* v;
  unsigned k_row, v_row;  // bytes between slots of the K / V pool
  long long k_slot, v_slot, k_page, v_page;  // (flat walk) element strides
  const int* pages;
  int page_size, page_shift, rows_per_page, num_pages, head_dim;
  int me, cc, r0, look;  // this thread (0..NT-1); its chunk column and first row; the tile row its lane looks up
  bool col_ok;
  int page, slot;     // fetched: the page and slot of row `look` of the next tile (0, 0 past the end)

  __device__ __forceinline__ void init(const T* k_, const T* v_, long long k_slot_, long long v_slot_,
                                       long long k_page_, long long v_page_, const int* pages_, int page_size_,
                                       int page_shift_, int rows_per_page_, int num_pages_, int head_dim_,
                                       int tid) {
    k = k_, v = v_, k_slot = k_slot_, v_slot = v_slot_, k_page = k_page_, v_page = v_page_;
    pages = pages_, page_size = page_size_, page_shift = page_shift_, rows_per_page = rows_per_page_;
    num_pages = num_pages_;
    head_dim = head_dim_;
    page = slot = 0;
    me = tid;
    if constexpr (kShuffle) {
      const int lane = tid % 32;
      cc = tid % CPR, r0 = tid / CPR;
      col_ok = cc * 8 < head_dim;
      // Padded columns read nothing (size 0); their address stays at column 0 of a real row.
      kc = reinterpret_cast<const char*>(k + (col_ok ? cc * 8 : 0));
      vc = reinterpret_cast<const char*>(v + (col_ok ? cc * 8 : 0));
      k_row = static_cast<unsigned>(k_slot * sizeof(T));
      v_row = static_cast<unsigned>(v_slot * sizeof(T));
      const int row = (lane / R) * kRowsPerPass + (tid - lane) / CPR + lane % R;
      look = lane / R < kPasses && row < ROWS ? row : -1;
    }
  }

  __device__ __forceinline__ int page_of(int key) const {
    return page_shift >= 0 ? key >> page_shift : key / page_size;
  }

  // Page list entry `pi`, clamped into the pool (common.cuh pool_page).
  __device__ __forceinline__ int page_at(int pi) const {
    return static_cast<int>(pool_page(__ldg(pages + pi), num_pages));
  }

  // Issue this lane's page lookup for the tile at row0 (its result is read by `take`).
  __device__ __forceinline__ void fetch(int row0, int row_end) {
    if constexpr (kShuffle) {
      const int key = row0 + look;
      page = slot = 0;
      if (look >= 0 && key < row_end) {
        const int pi = page_of(key);
        page = page_at(pi);
        slot = key - pi * page_size;
      }
    }
  }

  // The fetched row as a slot-stride index (waits for the lookup).
  __device__ __forceinline__ unsigned take() const {
    return static_cast<unsigned>(page) * static_cast<unsigned>(rows_per_page) + static_cast<unsigned>(slot);
  }

  // Copy the tile at row0 into dk / dv; `row` is `take()` of that tile's fetch. All NT threads call it.
  __device__ __forceinline__ void copy(unsigned dk, unsigned dv, unsigned row, int row0, int row_end) const {
    if constexpr (kShuffle) {
      if (row0 + ROWS <= row_end)
        passes<true>(dk, dv, row, row0, row_end);
      else
        passes<false>(dk, dv, row, row0, row_end);
    } else {
      flat(dk, dv, row0, row_end);
    }
  }

  template <bool WHOLE>
  __device__ __forceinline__ void passes(unsigned dk, unsigned dv, unsigned row, int row0, int row_end) const {
    const int lane = me % 32;
    const unsigned d = (cc >> 3) * (ROWS * 128) + r0 * 128;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const unsigned g = __shfl_sync(0xffffffffu, row, pass * R + lane / CPR);  // every lane, every pass
      const int r = pass * kRowsPerPass + r0;
      if (ROWS % kRowsPerPass == 0 || r < ROWS) {
        const bool ok = WHOLE ? col_ok : col_ok && row0 + r < row_end;
        const unsigned sw = d + pass * kRowsPerPass * 128 + (((cc & 7) ^ ((kRowsPerPass % 8 == 0 ? r0 : r) & 7)) << 4);
        wg::cp_async_16(dk + sw, paged_row_addr(kc, g, k_row), ok);
        wg::cp_async_16(dv + sw, paged_row_addr(vc, g, v_row), ok);
      }
    }
  }

  __device__ __forceinline__ void flat(unsigned dk, unsigned dv, int row0, int row_end) const {
    constexpr int kChunks = ROWS * CPR;
#pragma unroll
    for (int c0 = 0; c0 < kChunks; c0 += NT) {
      const int c = c0 + me;
      if (kChunks % NT == 0 || c < kChunks) {
        const int r = c / CPR, ch = c % CPR, key = row0 + r, col = ch * 8;
        const bool ok = col < head_dim && key < row_end;
        long long ko = 0, vo = 0;
        if (ok) {
          const int pi = page_of(key);
          const long long pg = page_at(pi), sl = key - pi * page_size;
          ko = pg * k_page + sl * k_slot + col;
          vo = pg * v_page + sl * v_slot + col;
        }
        const unsigned sw = (ch >> 3) * (ROWS * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
        wg::cp_async_16(dk + sw, k + ko, ok);
        wg::cp_async_16(dv + sw, v + vo, ok);
      }
    }
  }
};

}  // namespace pyattn

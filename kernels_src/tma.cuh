// TMA (the Tensor Memory Accelerator, sm_90a): one thread copies a whole 2-D box of a tensor
// (cp.async.bulk.tensor) into shared memory, 128-byte swizzled on the way, and the bytes' arrival
// completes a transaction count on an mbarrier. The tensor maps are encoded on the host
// (pyattn.runtime.tensormap) and live in the kernel's __grid_constant__ parameter struct, so
// their generic addresses point into parameter space, where the copy instruction may read them.
// Requires common.cuh (TmaMap).
#pragma once

namespace pyattn {
namespace tma {

// Fetch a tensor map into the descriptor cache before its first copy.
__device__ __forceinline__ void prefetch(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Arrive on the barrier at shared address `bar` and add `bytes` to the transaction count its
// current phase waits for (the copies issued against it complete them).
__device__ __forceinline__ void arrive_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Copy the box at coordinates (c0 innermost, c1, c2, c3) of a rank-4 map to shared address
// `dst`, completing its bytes on `bar`. Elements outside the tensor arrive as zeros (and count).
__device__ __forceinline__ void load_4d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// The same for a rank-5 map (coordinates c0 innermost .. c4).
__device__ __forceinline__ void load_5d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2, int c3,
                                        int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
      "%7}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Copy `bytes` (a multiple of 16) contiguous bytes from global `src` (16-byte aligned) to shared
// address `dst` (16-byte aligned), completing them on `bar`: the non-tensor bulk copy (the 8-bit
// decode's per-channel page records, attention_decode_q8_tma.cuh).
__device__ __forceinline__ void load_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Order this thread's earlier generic-proxy writes to shared memory before later async-proxy
// (bulk copy) accesses of it.
__device__ __forceinline__ void fence_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Zero rows [valid, ROWS) of a warp's share of a ring stage held as groups of GROUP rows, each
// BOXES boxes of BOX_ROWS rows of 128 bytes (rows: the warp's first row in the first box; GROUP =
// ROWS: one group), a lane a 16-byte chunk in turn, fenced before the stage's next TMA writes. The
// decodes' TMA rings: keys past a block's range or its sequence are stale pool memory there, and
// 0 x NaN is NaN in P V.
template <int ROWS, int BOXES, int BOX_ROWS, int GROUP = ROWS>
__device__ __forceinline__ void zero_rows_from(unsigned char* rows, int valid) {
  if (valid >= ROWS) return;
  const int lane = threadIdx.x % 32, r0 = max(valid, 0);
  for (int i = lane; i < (ROWS - r0) * BOXES * 8; i += 32) {
    unsigned char* row = rows + (i / 8 % BOXES) * BOX_ROWS * 128;
    const int r = r0 + i / (8 * BOXES);
    if constexpr (GROUP < ROWS) {
      row += (r / GROUP) * BOXES * BOX_ROWS * 128 + (r % GROUP) * 128;
    } else {
      row += r * 128;
    }
    reinterpret_cast<uint4*>(row)[i % 8] = make_uint4(0, 0, 0, 0);
  }
  fence_shared();
  __syncwarp();
}

}  // namespace tma
}  // namespace pyattn

// Paged KV-cache append: one launch writes the new tokens of several sequences into their pool
// slots and performs the copy-on-write page copies of the same call (see KvAppendParams). The
// host guarantees that no slot is both read and written, or written twice, by one launch, so
// items are independent. One thread per 16-byte chunk of one (item, kv head) row.
// Requires pyattn::KvAppendParams and common.cuh.
#pragma once

namespace pyattn {

template <typename T>
__device__ __forceinline__ void kv_append(const KvAppendParams& p) {
  const int chunks = p.head_dim / 8;  // head_dim is a multiple of 8: rows are whole 16-byte chunks
  const long long total = static_cast<long long>(p.n_items) * p.heads_kv * chunks;
  for (long long c = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; c < total;
       c += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(c % chunks) * 8;
    const int h = static_cast<int>((c / chunks) % p.heads_kv);
    const int item = static_cast<int>(c / (static_cast<long long>(chunks) * p.heads_kv));
    const int dst = p.dst[item], src = p.src[item];
    const long long dpage = dst / p.page_size, dslot = dst % p.page_size;
    T* k_out = static_cast<T*>(p.k) + dpage * p.k_stride_page + dslot * p.k_stride_slot + h * p.k_stride_h + col;
    T* v_out = static_cast<T*>(p.v) + dpage * p.v_stride_page + dslot * p.v_stride_slot + h * p.v_stride_h + col;
    const T *k_in, *v_in;
    if (src >= 0) {
      k_in = static_cast<const T*>(p.k_src) + src * p.k_src_stride_t + h * p.k_src_stride_h + col;
      v_in = static_cast<const T*>(p.v_src) + src * p.v_src_stride_t + h * p.v_src_stride_h + col;
    } else {
      const int slot = -1 - src;
      const long long spage = slot / p.page_size, sslot = slot % p.page_size;
      k_in = static_cast<const T*>(p.k) + spage * p.k_stride_page + sslot * p.k_stride_slot + h * p.k_stride_h + col;
      v_in = static_cast<const T*>(p.v) + spage * p.v_stride_page + sslot * p.v_stride_slot + h * p.v_stride_h + col;
    }
    *reinterpret_cast<uint4*>(k_out) = *reinterpret_cast<const uint4*>(k_in);
    *reinterpret_cast<uint4*>(v_out) = *reinterpret_cast<const uint4*>(v_in);
  }
}

}  // namespace pyattn

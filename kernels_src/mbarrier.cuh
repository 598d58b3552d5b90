// mbarriers and named barriers (sm_90a): how a producer hands ring stages to consumers. Shared by
// the wgmma prefill's producer warpgroup (wgmma_pipe.cuh), the TMA prefill (attention_fwd_tma.cuh)
// and the decode's producer warps (attention_decode_tma.cuh, attention_decode_q8_tma.cuh). No dependencies.
#pragma once

namespace pyattn {
namespace pipe {

__device__ __forceinline__ void init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Make initialised barriers visible to the other threads (with a __syncthreads after it).
__device__ __forceinline__ void init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival on the barrier, made when every cp.async copy this thread issued before has landed
// (.noinc: the barrier's expected count includes it). For a producer whose stage mixes TMA boxes
// and small cp.async copies (attention_decode_q8_tma.cuh's scales).
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Wait until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Named barriers (id 0 is __syncthreads): wait for / signal `count` threads.
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Registers per thread of the calling warpgroup (all of its warps execute it).
template <int N> __device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace pipe
}  // namespace pyattn

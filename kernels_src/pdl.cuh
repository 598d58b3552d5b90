// Programmatic dependent launch (sm_90 and later). Every pyattn kernel's entry point (rendered by
// pyattn.jit.source.render) calls wait() as its first statement, and on sm_90+ every launch
// (pyattn.runtime.launch) sets the programmatic stream serialization attribute: a kernel's blocks
// may then start while the kernel before it in the stream is still finishing, so that its launch
// and block start overlap that kernel's tail (back-to-back decodes spent 1.2-3.9 us between kernels
// on an H200: BENCHMARKS.md, thirty-second session). wait() returns once every prerequisite grid
// has completed and its memory is visible (at once when there is none, e.g. after a memset, a
// copy or a plain launch); nothing global may be read or written before it, since the kernel before
// may still be writing (or reading) it, which is why the entry point, not each kernel, calls it:
// no kernel can touch memory first. Below sm_90 it compiles to nothing and the host launches plainly
// (KernelSpec.dependent_launch).
//
// No pyattn kernel calls griddepcontrol.launch_dependents: without it a block counts as
// triggered when it exits, so the next kernel is launched when this grid's last block exits, and
// that launch still overlaps the grid's completion and memory flush (no programmatic launch at
// all cost 2.1-2.5 us a call at B8 x 4k and B1 x 32k). Triggered after the key loop instead, the next
// decode's blocks took the SM slots this grid's blocks left while the last ones still merged and
// combined their splits, and the call took longer: H200, bf16, GQA 32 / 8, page 16, B8 x 32k
// 249.0 -> 245.2-245.9 us without the early trigger, int8 B64 x 32k -1%, the other points within
// +0.3% (BENCHMARKS.md, forty-sixth session).
#pragma once

namespace pyattn {
namespace pdl {

__device__ __forceinline__ void wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace pdl
}  // namespace pyattn

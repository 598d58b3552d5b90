// Programmatic dependent launch (sm_90a): a kernel launched with the programmatic stream
// serialization attribute (pyattn.runtime.launch, pdl=True) may have its blocks start while the
// kernel before it in the stream is still running, so that the launch and the blocks' start
// overlap that kernel's tail (the TMA decode spent 1.2-3.9 us a call between back-to-back kernels
// on an H200: BENCHMARKS.md, thirty-second session). wait() returns once every prerequisite grid
// has completed and its memory is visible (at once when there is none, e.g. a plain launch);
// nothing global may be read or written before it, since the kernel before may still be writing
// (or reading) it. launch_dependents() lets the next such kernel start its blocks once every block
// of this grid has called it or exited.
#pragma once

namespace pyattn {
namespace pdl {

__device__ __forceinline__ void wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

}  // namespace pdl
}  // namespace pyattn

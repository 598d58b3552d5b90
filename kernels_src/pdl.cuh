// Programmatic dependent launch (sm_90a): a kernel launched with the programmatic stream
// serialization attribute (pyattn.runtime.launch, pdl=True) may have its blocks start while the
// kernel before it in the stream is still running, so that the launch and the blocks' start
// overlap that kernel's tail (the TMA decode spent 1.2-3.9 us a call between back-to-back kernels
// on an H200: BENCHMARKS.md, thirty-second session). wait() returns once every prerequisite grid
// has completed and its memory is visible (at once when there is none, e.g. a plain launch);
// nothing global may be read or written before it, since the kernel before may still be writing
// (or reading) it.
//
// The decode kernels never call griddepcontrol.launch_dependents: without it a block counts as
// triggered when it exits, so the next kernel's blocks take SM slots as this grid's blocks leave.
// Triggered after the key loop instead, the next decode's blocks were let in while this grid's
// blocks still merged and combined their splits, and the call took longer: H200, bf16, GQA 32 / 8,
// page 16, B8 x 32k 248.9 -> 245.1-246.2 us with the trigger moved to the block's end, the other
// points level or faster (BENCHMARKS.md, forty-sixth session).
#pragma once

namespace pyattn {
namespace pdl {

__device__ __forceinline__ void wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

}  // namespace pdl
}  // namespace pyattn

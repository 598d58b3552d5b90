"""Dev probe (GPU): backward calls to run under Nsight Compute, and the stall metrics to read.

Usage (the third call of the main kernel is the profiled one; the first two compile and warm up):
  /opt/nvidia/nsight-compute/2025.3.1/ncu -k regex:'attn_bwd_(w?g?mma)' --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \\
      --section MemoryWorkloadAnalysis --page raw python dev/profile_backward.py [--d 128] [--seqlen 4096] \\
      | grep -E "$(python dev/profile_backward.py --metrics)"

bf16, B = 16384 // S, H = 2048 // d (the benchmark's shapes), pyattn arrays from NumPy (no torch).
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import pyattn

# Per-warp stall reasons (cycles per issued instruction), the tensor pipe's use, shared-memory
# wavefronts and conflicts, L2 reduction sectors (the dQ atomics), issue activity.
METRICS = [f"smsp__average_warps_issue_stalled_{r}_per_issue_active" for r in (
    "barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "math_pipe_throttle", "wait", "not_selected",
    "lg_throttle", "dispatch_stall", "membar", "selected", "no_instruction", "drain", "branch_resolving")] + [
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    # wgmma (attn_bwd_wgmma): instructions issued to the gmma pipe, and the tensor pipe's busy cycles
    # counted over every tensor instruction kind (the hmma metric above counted them too on ncu 2025.3)
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_type_hmma_hgmma_qgmma_imma_igmma_bmma_bgmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "smsp__average_warps_issue_stalled_gmma_per_issue_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "lts__t_sectors_op_red.sum", "lts__t_sectors_op_atom.sum", "dram__bytes.sum", "gpu__time_duration.sum",
    "launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_sustained_active"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", action="store_true", help="print a grep pattern of the metrics to read, and exit")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    if args.metrics:
        print("|".join(m.replace(".", "[.]") for m in METRICS))
        return
    S, d = args.seqlen, args.d
    B, H = 16384 // S, 2048 // d
    rng = np.random.default_rng(0)
    q, k, v, do = (pyattn.asarray(rng.standard_normal((B, S, H, d), np.float32).astype(ml_dtypes.bfloat16))
                   for _ in range(4))
    out, lse = pyattn.attention(q, k, v, causal=args.causal, return_lse=True)
    for _ in range(3):
        grads = pyattn.attention_backward(do, q, k, v, out, lse, causal=args.causal, deterministic=args.deterministic)
    pyattn.get_device().synchronize()
    print("done", [g.shape for g in grads])


if __name__ == "__main__":
    main()

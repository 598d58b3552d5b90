#!/bin/bash
# The device calls of the decode work (issue 12, BENCHMARKS.md "Decode on sm_90a: TMA page loads"):
# each PART fits one 10-minute device call. Usage (repository root, on the GPU machine):
#   PARTS=warm,tests bash dev/gpu_decode.sh         compile the decode / serving variants, decode GPU tests
#   PARTS=bench bash dev/gpu_decode.sh              bench_decode (GQA grid, MHA), bench_ragged
#   PARTS=warm8,q8 bash dev/gpu_decode.sh           the 8-bit kernels' GPU tests and tile rows (tune_decode.py --kv:
#                                                   the TMA-fed kernel's rows and the cp.async kernel's, same run)
#   PARTS=fixed bash dev/gpu_decode.sh              a call's fixed cost: probe_decode_fixed (--between: behind a
#                                                   plain kernel too), probe_decode_timeline, probe_decode_step
#   PARTS=quant,boundary,probe,ncu bash dev/gpu_decode.sh
#       bench_quant speed, bench_boundary, probe_decode_bw (cp.async row vs the TMA row, same run),
#       Nsight Compute of the table's kernel at B 64 / 8 x 32k (DRAM throughput, warp stall reasons)
# Writes *.log, *.json and ncu_*.txt under $OUT.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYATTN_CACHE_DIR=${PYATTN_CACHE_DIR:-/tmp/pc}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NCU=/opt/nvidia/nsight-compute/2025.3.1/ncu
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
has() { [[ ",${PARTS:-warm,tests}," == *",$1,"* ]]; }
tables='^\||^==|MISS|PASS|targets|WARNING|FAILED|^\('

if has warm; then
  stamp warm
  python -m pyattn warmup --quiet > "$OUT/warm.log" 2>&1 &
  python dev/warm_issue13.py >> "$OUT/warm.log" 2>&1 &
  python dev/warm_serving.py >> "$OUT/warm.log" 2>&1 &
  wait
  tail -2 "$OUT/warm.log"
fi
if has warm8; then  # only the 8-bit / serving kernels of dev/warm_issue13.py (for the q8 and quant parts)
  stamp warm8
  python dev/warm_issue13.py > "$OUT/warm8.log" 2>&1
  tail -2 "$OUT/warm8.log"
fi
if has tests; then
  stamp tests
  timeout 300 python -m pytest -q -p no:cacheprovider -ra tests/test_gpu_decode.py tests/test_gpu_quant_decode.py \
    tests/test_gpu_quant_cache.py tests/test_gpu_serving.py tests/test_gpu_sparq.py tests/test_gpu_boundary.py \
    tests/test_gpu_contiguous.py \
    2>&1 | tee "$OUT/tests.log" | tail -8
fi
if has bench; then
  stamp bench_decode
  timeout 330 python scripts/bench_decode.py --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log" \
    | grep -E "$tables" | tail -40
  stamp "bench_decode MHA"
  timeout 120 python scripts/bench_decode.py --kv-heads 32 --layouts p16 --configs 8x32768,64x4096 \
    --json "$OUT/mha_decode.json" 2>&1 | tee "$OUT/mha_decode.log" | grep -E "$tables" | tail -12
  stamp bench_ragged
  timeout 120 python scripts/bench_ragged.py --json "$OUT/bench_ragged.json" 2>&1 | tee "$OUT/bench_ragged.log" \
    | grep -E "$tables" | tail -12
fi
if has fixed; then  # where a decode call's fixed ~10-14 us go (BENCHMARKS.md, thirty-second session)
  stamp probe_decode_fixed
  timeout 120 python dev/probe_decode_fixed.py --splits "" --between 2>&1 | tee "$OUT/fixed.log" | tail -12
  stamp probe_decode_timeline
  timeout 90 python dev/probe_decode_timeline.py 2>&1 | tee "$OUT/timeline.log" | tail -12
  stamp probe_decode_step
  timeout 120 python dev/probe_decode_step.py 2>&1 | tee "$OUT/step.log" | tail -20
fi
if has quant; then
  stamp bench_quant
  timeout 240 python scripts/bench_quant.py --sections speed --budget 200 --json "$OUT/bench_quant.json" 2>&1 \
    | tee "$OUT/bench_quant.log" | grep -E "$tables" | tail -30
fi
if has boundary; then
  stamp bench_boundary
  timeout 150 python scripts/bench_boundary.py --json "$OUT/bench_boundary.json" 2>&1 \
    | tee "$OUT/bench_boundary.log" | grep -E "$tables" | tail -30
fi
if has probe; then
  stamp probe_decode_bw
  timeout 150 python dev/probe_decode_bw.py --points 64x32768,8x32768,8x4096,1x32768,1x4096 --tiles cp \
    2>&1 | tee "$OUT/probe.log"
fi
if has q8; then  # the 8-bit kernel: its GPU tests, its tile rows, the benchmark
  stamp "q8 tests"
  timeout 200 python -m pytest -q -p no:cacheprovider -x tests/test_gpu_quant_decode.py tests/test_gpu_quant_cache.py \
    2>&1 | tee "$OUT/q8_tests.log" | tail -3
  for kv in int8 fp8e4m3; do
    stamp "tune_decode --kv $kv"
    timeout 150 python dev/tune_decode.py --kv $kv 2>&1 | tee "$OUT/tune_$kv.log" | tail -10
  done
fi
if has ncu; then
  for pt in 64x32768 8x32768; do
    stamp "ncu $pt"
    timeout 90 $NCU --clock-control none --nvtx --nvtx-include "probe/" --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
      --page raw python dev/probe_decode_bw.py --points $pt --only nhd_p16 --once > "$OUT/ncu_$pt.txt" 2>&1
    # the kernel, its time, DRAM throughput, and the per-warp stall reasons (cycles per issued instruction)
    # (ncu 2025.3 names: the metrics below; the older `_per_warp_active.pct` stall names matched nothing)
    grep -E "attn_decode|gpu__time_duration.sum|gpu__dram_throughput.avg.pct|dram__bytes.sum.per_second|issue_stalled_[a-z_]+_per_issue_active.ratio" \
      "$OUT/ncu_$pt.txt" | awk '$NF != "0" && $NF != "0.00"' | head -30
  done
fi
stamp done

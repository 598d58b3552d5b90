#!/bin/bash
# One device call for the paged prefill's loader (issue 13, BENCHMARKS.md "Paged prefill loader"):
# compile, the serving GPU tests, Nsight Compute on the chunk (dense kernel, paged kernel, and the
# paged kernel of a baseline tree when BASE names one), the probe's tile rows, the benchmark.
# Usage (repository root, on the GPU machine):
#   [BASE=dir] [PARTS=chunk,batch] [TESTS="tests/..."] [PROBE=0] bash dev/gpu_chunk_loader.sh
# Writes tests.log, ncu_*.txt, probe.log, bench.log, bench.json (and base_bench.log) under $OUT.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYATTN_CACHE_DIR=${PYATTN_CACHE_DIR:-/tmp/pc}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NCU=/opt/nvidia/nsight-compute/2025.3.1/ncu
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
ncu_one() {  # kernel regex, output name, profile_chunk arguments
  local k=$1 name=$2
  shift 2
  timeout 45 $NCU --clock-control none -k "regex:$k" --launch-skip 2 --launch-count 1 $SECTIONS \
    python dev/profile_chunk.py "$@" > "$OUT/$name" 2>&1
  grep -E "Duration|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Compute \(SM\) Throughput|Memory Throughput|Registers" "$OUT/$name" | head -12
}

T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
python dev/warm_serving.py 2>&1 | tee "$OUT/tests.log"
stamp tests
timeout 60 python -m pytest -q -p no:cacheprovider -x ${TESTS:-tests/test_gpu_serving.py} 2>&1 | tee -a "$OUT/tests.log" | tail -3
stamp "ncu dense"; ncu_one attn_fwd_wgmma ncu_dense.txt dense
stamp "ncu paged"; ncu_one attn_prefill_wgmma ncu_paged.txt paged 16
if [ -n "$BASE" ]; then
  stamp "ncu paged, baseline loader"
  (cd "$BASE" && export PYTHONPATH=$PWD && ncu_one attn_prefill_wgmma ncu_paged_base.txt paged 16)
fi
if [ "${PROBE:-1}" = 1 ]; then
  stamp probe
  timeout 60 python dev/probe_serving.py --quick --chunk-only 2>&1 | tee "$OUT/probe.log"
fi
stamp bench
timeout 120 python scripts/bench_serving.py --parts "${PARTS:-chunk,batch}" --budget 60 --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.log" | tail -25
if [ -n "$BASE" ]; then
  stamp "baseline bench (chunk)"
  (cd "$BASE" && PYTHONPATH=$PWD timeout 60 python scripts/bench_serving.py --parts chunk --pages 16 2>&1 \
    | tee "$OUT/base_bench.log" | grep -E "chunk p|dense")
fi
stamp done

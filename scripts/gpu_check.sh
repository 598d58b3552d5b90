#!/usr/bin/env bash
# The one command for a GPU machine: environment, `pyattn info`, the whole test suite (GPU tests
# included), then the benchmarks (all on scripts/harness.py) and the headline plot; the short
# tables come last. Usage:
#   scripts/gpu_check.sh [all|tests|bench]      (run from anywhere; output goes to $OUT or /tmp/pyattn-out)
# $OUT receives pytest.log, one bench_*.json and bench_*.log per benchmark, and benchmarks.png.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/pyattn-out}
mkdir -p "$out"
export PYATTN_CACHE_DIR=${PYATTN_CACHE_DIR:-/tmp/pyattn-cache}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true
python3 -c 'import sys; sys.path.insert(0, "scripts"); import harness; print(harness.env_line(harness.environment()))'
python3 -m pyattn info

rc=0
# bench NAME FILTER TAIL [ARGS...]: run scripts/NAME.py with --json into $out, keep its log, show
# the lines matching FILTER (the tables and targets), at most TAIL of them.
bench() {
  local name=$1 filter=$2 tail=$3
  shift 3
  echo "== $name"
  python3 "scripts/$name.py" --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.log" | grep -E "$filter" | tail -"$tail"
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
}
tables='^\||^==|MISS|PASS|targets|WARNING|FAILED'

if [[ $what == all || $what == tests ]]; then
  echo "== tests (pytest, GPU tests included)"
  python3 -m pytest -q -p no:cacheprovider -ra tests 2>&1 | tee "$out/pytest.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
if [[ $what == all || $what == bench ]]; then
  bench bench_startup '.' 30 --importtime   # fresh processes, a warm kernel cache: the start-up breakdown
  bench bench_foundation '.' 20
  bench bench_prefill '.' 65                # pyattn vs torch SDPA FA2 / cuDNN, small grids, ceilings, NumPy end to end
  bench bench_fp8 '.' 20                    # fp8 e4m3 inputs vs pyattn bf16 and SDPA FA2 / cuDNN (bf16), fp8 matmul ceiling
  bench bench_decode "$tables|^\(" 50       # paged / contiguous KV vs SDPA, copy bandwidth
  echo "== bench_decode, MHA 32/32"          # (not bench_*.json: the plot takes the GQA run's)
  python3 scripts/bench_decode.py --json "$out/mha_decode.json" --kv-heads 32 --layouts p16 --configs 8x32768,64x4096 \
    2>&1 | tee "$out/mha_decode.log" | grep -E "$tables|^\(" | tail -20
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
  bench bench_ragged "$tables|^\(" 20       # a ragged batch (128..64k tokens): split choice, copy bandwidth
  bench bench_sparse "$tables" 50           # block-sparse vs dense pyattn / SDPA, patterns, CSR
  bench bench_quant "$tables" 60            # bf16 / int8 / fp8 KV caches: speed and accuracy
  bench bench_sparq "$tables" 40            # SparQ vs exact decode at L = 32k / 128k, accuracy on structured data
  bench bench_boundary "$tables" 45         # host time per input kind, NumPy vs its floor, torch after a compile
  bench bench_serving "$tables" 40          # paged chunked prefill vs dense, 64 x 512 batch, tree verify vs decode
  bench bench_varlen "$tables" 20           # attention_varlen vs FA2's varlen kernel (torch jagged SDPA), host time
  bench bench_engine "^  (decode|mixed)|^==|WARNING|FAILED" 12  # an engine's pools: paged_decode vs paged_prefill rows, a mixed step
  bench bench_backward "$tables" 45         # backward vs SDPA FA2 / cuDNN backward (issue 14)
  # Examples: each examples/*.py must run to completion on the GPU (they print their own checks).
  for ex in examples/*.py; do
    [[ -f $ex ]] || continue
    echo "== example $ex"
    python3 "$ex" > "$out/example_$(basename "$ex" .py).log" 2>&1 || { echo "FAILED: $ex"; rc=1; }
    tail -3 "$out/example_$(basename "$ex" .py).log"
  done
  echo "== headline plot"
  python3 scripts/plot_benchmarks.py -o "$out/benchmarks.png" "$out"/bench_*.json || rc=1
fi
exit $rc

#!/bin/bash
# The device call of the array-boundary work (issue 11): the GPU tests of every op's repeat-call
# path (attention, decode, a serving loop's append and decode, the boundary), bench_boundary on
# this tree and on the A/B base tree (.ab/base, a `git archive` of the tree before, when present)
# in alternating rounds, the transformers decode-step probe, the DLPack / CuPy probes and every
# example. Usage (repository root, on the GPU machine):
#   bash dev/gpu_boundary.sh            writes 8 logs under $OUT (the most the device tool returns)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYATTN_CACHE_DIR=${PYATTN_CACHE_DIR:-/tmp/pc}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
stamp warm
python -m pyattn warmup --quiet > "$OUT/warm.log" 2>&1 &
python dev/warm_serving.py >> "$OUT/warm.log" 2>&1 &
python dev/warm_issue13.py >> "$OUT/warm.log" 2>&1 &
wait
stamp tests
python -m pytest -q -p no:cacheprovider tests/test_gpu_boundary.py tests/test_host_path_attention.py \
  tests/test_host_path_decode.py tests/test_host_path_numpy.py tests/test_gpu_decode_step.py \
  tests/test_gpu_attention.py tests/test_gpu_decode.py \
  2>&1 | tee "$OUT/tests.log" | tail -4
for round in 1 2; do
  stamp "bench_boundary, this tree, round $round"
  python scripts/bench_boundary.py --quick 2>&1 | tee "$OUT/boundary_new_$round.log" | grep -E '^\|' | head -24
  if [[ -d .ab/base ]]; then
    stamp "bench_boundary, base tree, round $round"
    (cd .ab/base && PYTHONPATH=$PWD python scripts/bench_boundary.py --quick 2>&1) | tee "$OUT/boundary_base_$round.log" \
      | grep -E '^\|' | head -24
  fi
done
stamp probes
python dev/probe_hf_out.py 2>&1 | tee "$OUT/probes.log" | tail -4
python dev/probe_dlpack_cost.py >> "$OUT/probes.log" 2>&1
python dev/probe_cupy_import.py 2>&1 | tee -a "$OUT/probes.log" | tail -3
for ex in examples/*.py; do
  stamp "$ex"
  python "$ex" > /tmp/example.log 2>&1 || echo "FAILED: $ex"
  { echo "== $ex"; cat /tmp/example.log; } >> "$OUT/examples.log"
  tail -3 /tmp/example.log
done
stamp done

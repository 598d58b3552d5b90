#!/bin/bash
# Every benchmark's --quick run and its targets, in two device calls of under 10 minutes each, so
# that a speed regression in a path no session is working on shows up within a few sessions.
# (Per-channel key decode ran 1.46x slower from 2026-11-25 on, launch bounds fitted to the wrong
# ring, because no session ran bench_quant: BENCHMARKS.md, thirty-first session.)
#   PART=1 bash dev/gpu_sentinel.sh    prefill, fp8, sparse, backward, startup, foundation
#   PART=2 bash dev/gpu_sentinel.sh    decode, ragged, 8-bit caches, SparQ, serving, boundary
# Each benchmark's log goes to $OUT/<name>.log; printed: its PASS / MISS lines and its time. Run one
# part a session, the other the next, beside the session's own work; compare with the figures in
# BENCHMARKS.md and scripts/gpu_check.sh's full runs (these are smoke runs: fewer shapes, repeats).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYATTN_CACHE_DIR=${PYATTN_CACHE_DIR:-/tmp/pc}
OUT=${OUT:-/tmp/out}
PART=${PART:-1}
mkdir -p "$OUT"
case $PART in
  1) names=(bench_prefill bench_fp8 bench_sparse bench_backward bench_startup bench_foundation) ;;
  2) names=(bench_decode bench_ragged bench_quant bench_sparq bench_serving bench_boundary) ;;
  *) echo "PART: 1 or 2, got $PART"; exit 2 ;;
esac
rc=0
for name in "${names[@]}"; do
  t0=$SECONDS
  timeout "${BENCH_S:-150}" python "scripts/$name.py" --quick > "$OUT/$name.log" 2>&1
  code=$?
  [[ $code == 0 ]] || rc=1
  echo "== $name: rc=$code, $((SECONDS - t0)) s"
  grep -E "^\s*(PASS|MISS)|WARNING|FAILED|Traceback" "$OUT/$name.log" | head -30
done
exit $rc

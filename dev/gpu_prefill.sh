#!/bin/bash
# The sm_90a prefill work's device call (issue 15), a part list a call:
#   PARTS=ab,tail,tests,bench bash dev/gpu_prefill.sh
#   warm   `pyattn warmup` and dev/warm_issue13.py into /tmp/pc (a fresh machine: the tests' kernels)
#   ab     dev/time_prefill.py on the A/B base tree (.ab/base, from `git archive`) and on this tree in
#          ROUNDS (default 3) alternating processes (which tree goes first flips each round), each
#          tree with its own kernel cache, then SDPA cuDNN on the same shapes (SHAPES: time_prefill's
#          --shapes, default its own list)
#   tail   dev/probe_tail.py (what the d = 64 short row's 64-row tail block costs)
#   tests  the TMA prefill's GPU tests (test_gpu_tma_views, test_gpu_tma_masks, test_gpu_tma_persistent,
#          test_gpu_three_warpgroups, test_gpu_wgmma_ws, test_gpu_softcap_poly, test_gpu_masks; TESTS_K:
#          a pytest -k filter; TESTS_S: their time limit, default 400 s)
#   bench  scripts/bench_prefill.py --only configs (x FA2 and x cuDNN in the same run)
#   repro  the pytest node ids in REPRO, REPEAT (default 3) times, each test's threads' stacks dumped
#          when it runs past 60 s (a hang named instead of a silent timeout), REPRO_S (100) s a time
# Logs under $OUT (at most 8 files come back): ab.log, tail.log, tests.log, bench.log.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-ab,tests}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
here=$PWD
has() { [[ ",$PARTS," == *",$1,"* ]]; }
shapes=()
[[ -n $SHAPES ]] && shapes=(--shapes "$SHAPES")

if has warm; then
  (PYTHONPATH=$here PYATTN_CACHE_DIR=/tmp/pc python -m pyattn warmup --quiet &
   PYTHONPATH=$here PYATTN_CACHE_DIR=/tmp/pc python dev/warm_issue13.py & wait) > "$OUT/warm.log" 2>&1
  echo "warm: $(tail -2 "$OUT/warm.log" | tr '\n' ' ')"
fi
if has repro; then
  for i in $(seq "${REPEAT:-3}"); do
    PYTHONPATH=$here PYATTN_CACHE_DIR=/tmp/pc timeout "${REPRO_S:-100}" python -X faulthandler -m pytest -v -p no:cacheprovider \
      -o faulthandler_timeout=60 $REPRO
    echo "repro $i rc=$?"
  done > "$OUT/repro.log" 2>&1
  grep -E 'rc=|PASSED|FAILED|Timeout|File ' "$OUT/repro.log" | head -60
fi
if has ab && [[ ! -d .ab/base ]]; then
  echo "ab: no .ab/base here (the run tool carries it only when asked: carry [\".ab\"])"
elif has ab; then
  {
    # the trees' order flips every round: the tree timed second read ~1% apart from the first on
    # code neither changed (BENCHMARKS.md, sixtieth session)
    base() { (cd .ab/base && PYTHONPATH=$PWD PYATTN_CACHE_DIR=/tmp/pc_base python "$here/dev/time_prefill.py" "base$1" "${shapes[@]}"); }
    new() { PYTHONPATH=$here PYATTN_CACHE_DIR=/tmp/pc python dev/time_prefill.py "new$1" "${shapes[@]}"; }
    for r in $(seq "$ROUNDS"); do
      if (( r % 2 )); then base "$r"; new "$r"; else new "$r"; base "$r"; fi
    done
    PYTHONPATH=$here python dev/time_prefill.py cudnn --cudnn "${shapes[@]}"
  } > "$OUT/ab.log" 2>&1
  echo "ab rc=$?"
  grep RESULT "$OUT/ab.log"
fi
if has tail; then
  PYTHONPATH=$here PYATTN_CACHE_DIR=/tmp/pc python dev/probe_tail.py > "$OUT/tail.log" 2>&1
  echo "tail rc=$?"
  tail -4 "$OUT/tail.log"
fi
if has tests; then
  PYTHONPATH=$here PYATTN_CACHE_DIR=/tmp/pc timeout "${TESTS_S:-400}" python -m pytest -q -p no:cacheprovider -ra -m gpu \
    ${TESTS_K:+-k "$TESTS_K"} tests/test_gpu_tma_views.py tests/test_gpu_tma_masks.py tests/test_gpu_tma_persistent.py \
    tests/test_gpu_three_warpgroups.py tests/test_gpu_wgmma_ws.py tests/test_gpu_softcap_poly.py tests/test_gpu_masks.py \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/tests.log" | tail -15
fi
if has bench; then
  PYTHONPATH=$here PYATTN_CACHE_DIR=/tmp/pc python scripts/bench_prefill.py --only configs > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  tail -40 "$OUT/bench.log"
fi

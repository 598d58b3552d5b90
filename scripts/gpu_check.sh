#!/usr/bin/env bash
# The one command for a GPU machine: environment, `pyattn info`, the whole test suite (GPU tests
# included), then the benchmarks; the short tables come last. Usage:
#   scripts/gpu_check.sh [all|tests|bench]      (run from anywhere; logs go to $OUT or /tmp/pyattn-out)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/pyattn-out}
mkdir -p "$out"
export PYATTN_CACHE_DIR=${PYATTN_CACHE_DIR:-/tmp/pyattn-cache}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true
python3 - <<'PY'
import importlib.metadata as md, sys
names = ["cuda-bindings", "cuda-core", "cuda-pathfinder", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy",
         "ml_dtypes", "torch", "hypothesis"]
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print("python", sys.version.split()[0], "|", ", ".join(f"{n} {v(n)}" for n in names))
PY
python3 -m pyattn info

rc=0
if [[ $what == all || $what == tests ]]; then
  echo "== tests (pytest, GPU tests included)"
  python3 -m pytest -q -p no:cacheprovider -ra tests 2>&1 | tee "$out/pytest.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
if [[ $what == all || $what == bench ]]; then
  echo "== benchmarks"
  python3 scripts/bench_foundation.py --json "$out/bench_foundation.json" 2>&1 | tee "$out/bench.log" | tail -20
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
  echo "== prefill benchmark (pyattn vs torch SDPA FA2/cuDNN, ceilings, NumPy end to end)"
  python3 scripts/bench_prefill.py --json "$out/bench_prefill.json" --png "$out/bench_prefill.png" 2>&1 \
    | tee "$out/bench_prefill.log" | tail -40
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
  echo "== decode benchmark (paged / contiguous KV vs torch SDPA FA2/cuDNN, copy bandwidth)"
  python3 scripts/bench_decode.py --json "$out/bench_decode.json" 2>&1 | tee "$out/bench_decode.log" \
    | grep -E '^\||^==|MISS|PASS|targets' | tail -45
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
  echo "== sparse benchmark (block-sparse vs dense pyattn / SDPA, patterns, CSR sparse_attention)"
  python3 scripts/bench_sparse.py --json "$out/bench_sparse.json" 2>&1 | tee "$out/bench_sparse.log" \
    | grep -E '^\||^==|MISS|PASS|targets|WARNING' | tail -50
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
  echo "== 8-bit KV cache benchmark (decode over bf16 / int8 / fp8 caches, accuracy)"
  python3 scripts/bench_quant.py --json "$out/bench_quant.json" 2>&1 | tee "$out/bench_quant.log" \
    | grep -E '^\||^==|MISS|PASS|targets|WARNING' | tail -60
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
fi
exit $rc

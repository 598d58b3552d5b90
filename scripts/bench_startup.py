"""Start-up benchmark: what a fresh process pays before its first attention result, with a warm kernel cache.

Usage: PYTHONPATH=. python scripts/bench_startup.py [--json out.json] [--runs 7] [--cache-dir DIR] [--importtime]

Each figure is the median over ``--runs`` fresh processes (``python -c``), run after one process
that fills the kernel cache (its first call compiles: reported as the cold first call):

- ``import numpy``;
- ``import pyattn`` (numpy already imported);
- CUDA context: the first ``pyattn.get_device().activate()`` (driver initialisation);
- first call: ``pyattn.attention`` on small device arrays (1, 128, 4, 64) fp16, uploaded and
  synchronised beforehand, until its result is ready: the kernel's load from the warm disk cache,
  planning and the launch.

The cache is a new temporary directory unless ``--cache-dir`` names one. Without a GPU only the
import figures are measured. ``--importtime`` adds the slowest modules under ``import pyattn``
(``python -X importtime``, one fresh process). Targets (issue 16): ``import pyattn`` <= 30 ms,
first call with a warm cache <= 15 ms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("import_numpy_ms", "import_pyattn_ms", "context_ms", "first_call_ms")
TARGETS = {"import_pyattn_ms": 30.0, "first_call_ms": 15.0}

CHILD = r"""
import json, time
t0 = time.perf_counter()
import numpy as np
t1 = time.perf_counter()
import pyattn
t2 = time.perf_counter()
res = {"import_numpy_ms": (t1 - t0) * 1e3, "import_pyattn_ms": (t2 - t1) * 1e3}
try:
    dev = pyattn.get_device()
    dev.activate()
    t3 = time.perf_counter()
    res["context_ms"] = (t3 - t2) * 1e3
    q = pyattn.asarray(np.ones((1, 128, 4, 64), np.float16))
    dev.synchronize()
    t4 = time.perf_counter()
    pyattn.attention(q, q, q)
    dev.synchronize()
    res["first_call_ms"] = (time.perf_counter() - t4) * 1e3
except pyattn.NoDeviceError as exc:
    res["no_gpu"] = str(exc)
print("PYATTN_STARTUP " + json.dumps(res))
"""


def child_env(cache_dir: str) -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYATTN_CACHE_DIR=cache_dir, PYTHONPATH=path)


def run_child(cache_dir: str, code: str = CHILD) -> dict:
    """One fresh process running ``code``; the dict it prints on its ``PYATTN_STARTUP`` line."""
    p = subprocess.run([sys.executable, "-c", code], env=child_env(cache_dir), capture_output=True, text=True,
                       timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PYATTN_STARTUP ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"start-up child failed (exit {p.returncode}): {(p.stderr or p.stdout)[-800:]}")
    return json.loads(line.split(" ", 1)[1])


def measure(runs: int, cache_dir: str) -> dict:
    """The cold process, then ``runs`` warm ones: {"cold": {...}, "runs": [...], "median": {...}}."""
    cold = run_child(cache_dir)
    warm = [run_child(cache_dir) for _ in range(runs)]
    med = {k: float(np.median([r[k] for r in warm])) for k in STEPS if all(k in r for r in warm)}
    return {"cold": cold, "runs": warm, "median": med, "no_gpu": cold.get("no_gpu")}


def import_profile(cache_dir: str, top: int = 12) -> list:
    """The ``top`` modules by own import time under ``import pyattn`` (numpy imported first):
    [(module, own ms, cumulative ms)]."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", "import numpy; import pyattn"],
                       env=child_env(cache_dir), capture_output=True, text=True, timeout=120)
    rows, after_numpy = [], False
    for line in p.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not parts[0].startswith("import time:") or "self" in parts[0]:
            continue
        name = parts[2].rstrip()
        if after_numpy:
            rows.append((name.strip(), int(parts[0].split(":")[1]) / 1e3, int(parts[1]) / 1e3))
        after_numpy |= name == " numpy"
    return sorted(rows, key=lambda r: -r[1])[:top]


def targets(med: dict) -> list:
    names = {"import_pyattn_ms": "import pyattn", "first_call_ms": "first call with a warm cache"}
    return [{"pass": None if k not in med else med[k] <= lim,
             "text": f"{names[k]}: {harness.fmt(med.get(k), '.1f')} ms (target <= {lim:.0f} ms)"}
            for k, lim in TARGETS.items()]


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--runs", type=int, default=7, help="fresh processes with a warm cache (default 7)")
    p.add_argument("--cache-dir", help="kernel cache to use (default: a new temporary directory)")
    p.add_argument("--importtime", action="store_true", help="also list the slowest modules under import pyattn")
    args = p.parse_args(argv)
    runs = 3 if args.quick else max(1, args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or os.path.join(tmp, "cache")
        result = {"environment": harness.environment(), "cache_dir": "temporary" if not args.cache_dir else cache}
        result.update(measure(runs, cache))
        if args.importtime:
            result["importtime_top"] = import_profile(cache)
    med, cold = result["median"], result["cold"]
    print(f"== start-up of a fresh process (median of {runs}, warm kernel cache); {harness.env_line(result['environment'])}")
    for k in STEPS:
        print(f"  {k[:-3].replace('_', ' '):14} {harness.fmt(med.get(k), '.1f'):>8} ms   (cold cache: "
              f"{harness.fmt(cold.get(k), '.1f')} ms)")
    print(f"  {'total':14} {sum(med.values()):8.1f} ms")
    if result["no_gpu"]:
        print(f"  no GPU ({result['no_gpu']}): import figures only")
    for name, own, cum in result.get("importtime_top", []):
        print(f"    {name:40} own {own:6.2f} ms  cumulative {cum:7.2f} ms")
    result["targets"] = targets(med)
    harness.print_targets(result["targets"])
    harness.save_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

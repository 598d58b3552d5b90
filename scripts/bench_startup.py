"""Start-up benchmark: what a fresh process pays before its first attention result, with a warm kernel cache.

Usage: PYTHONPATH=. python scripts/bench_startup.py [--json out.json] [--runs 7] [--cache-dir DIR] [--importtime]
       [--no-bytecode-cache]

Each figure is the median over ``--runs`` fresh processes (``python -c``), run after one process
that fills the kernel cache (its first call compiles: reported as the cold first call):

- ``import numpy``;
- ``import pyattn`` (numpy already imported);
- CUDA context: the first ``pyattn.get_device().activate()`` (driver initialisation);
- first call: ``pyattn.attention`` on small device arrays (1, 128, 4, 64) fp16, uploaded and
  synchronised beforehand, until its result is ready. It is split into the op's import (the first
  access of ``pyattn.attention`` imports the op, validation, pipeline, kernel-family and launch
  modules) and the call (the kernel's load from the warm disk cache, planning, the launch).

Then ``--runs`` more processes make the same first call in steps through pyattn.jit's public
functions: importing ``pyattn.jit``, ``toolchain_fingerprint()`` (NVRTC identity, header version,
kernel-source digest), ``build(spec)`` (cache key, entry read and checksum), then the call (module
load, plan, launch, synchronisation; it reads the entry again, ~0.3 ms). Without a GPU only the
import figures and these JIT steps are measured (for sm_90a, whose kernel the first process
compiles with NVRTC).

The processes use a private bytecode cache (``PYTHONPYCACHEPREFIX`` in a temporary directory,
``PYTHONDONTWRITEBYTECODE`` cleared), written by the first process (whose figures are therefore
cold for both caches): an installed wheel has its
``.pyc`` files, while a process that compiles every module from source pays about twice the import
time. ``--no-bytecode-cache`` measures with the environment as it is (the JSON and the report say
which). The cache is a new temporary directory unless ``--cache-dir`` names one. ``--importtime``
adds the slowest modules the first call imports (``python -X importtime``, one fresh process).
Targets (issue 16): ``import pyattn`` <= 30 ms, first call with a warm cache <= 15 ms.
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
SPLIT = ("op_import_ms", "call_ms")  # first_call_ms = op_import_ms + call_ms
JIT_STEPS = ("op_import_ms", "jit_import_ms", "fingerprint_ms", "cache_read_ms", "load_launch_ms")
NAMES = {"op_import_ms": "import of the op's modules", "call_ms": "the call", "jit_import_ms": "import pyattn.jit",
         "fingerprint_ms": "toolchain fingerprint", "cache_read_ms": "key + cache read (jit.build)",
         "load_launch_ms": "module load, plan, launch, sync"}
TARGETS = {"import_pyattn_ms": 30.0, "first_call_ms": 15.0}
NO_GPU_ARCH = "sm_90a"  # the JIT steps' arch without a GPU (what the GPU machines have)

# argv[1] == "steps": the JIT steps before the call (always without a GPU).
CHILD = r"""
import json, sys, time
T = time.perf_counter
t0 = T()
import numpy as np
t1 = T()
import pyattn
t2 = T()
res = {"import_numpy_ms": (t1 - t0) * 1e3, "import_pyattn_ms": (t2 - t1) * 1e3}
try:
    dev = pyattn.get_device()
    dev.activate()
    t3 = T()
    res["context_ms"] = (t3 - t2) * 1e3
    arch = dev.arch
    q = pyattn.asarray(np.ones((1, 128, 4, 64), np.float16))
    dev.synchronize()
except pyattn.NoDeviceError as exc:
    res["no_gpu"] = str(exc)
    dev, arch = None, sys.argv[2]
    pyattn.asarray  # what the upload imports with a GPU
steps = dev is None or sys.argv[1] == "steps"
t4 = T()
attention = pyattn.attention  # the first access imports the op's modules
t5 = T()
res["op_import_ms"] = (t5 - t4) * 1e3
if steps:
    from pyattn import jit
    t6 = T()
    jit.toolchain_fingerprint()
    t7 = T()
    from pyattn.kernels.specs import select_attention_spec
    jit.build(select_attention_spec("float16", 64, arch))
    t8 = T()
    res.update(jit_import_ms=(t6 - t5) * 1e3, fingerprint_ms=(t7 - t6) * 1e3, cache_read_ms=(t8 - t7) * 1e3)
    t5 = t8
if dev is not None:
    attention(q, q, q)
    dev.synchronize()
    t9 = T()
    res["load_launch_ms" if steps else "call_ms"] = (t9 - t5) * 1e3
    if not steps:
        res["first_call_ms"] = (t9 - t4) * 1e3
import importlib.util, os
res["bytecode_cached"] = os.path.exists(importlib.util.find_spec("pyattn").cached)  # read, not compiled
print("PYATTN_STARTUP " + json.dumps(res))
"""

# The modules the first call imports: those imported after the context and the upload.
CHILD_IMPORTS = r"""
import sys
import numpy as np
import pyattn
try:
    pyattn.get_device().activate()
except pyattn.NoDeviceError:
    pass
pyattn.asarray
sys.stderr.write("PYATTN_MARK\n")
pyattn.attention
from pyattn import jit
"""


def child_env(cache_dir: str, pycache: str | None = None) -> dict:
    """The children's environment: ``cache_dir`` as the kernel cache; with ``pycache``, a private
    bytecode cache there (``PYTHONDONTWRITEBYTECODE`` cleared, so the first child writes it)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYATTN_CACHE_DIR=cache_dir, PYTHONPATH=path)
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def run_child(cache_dir: str, code: str = CHILD, argv=(), pycache: str | None = None) -> dict:
    """One fresh process running ``code``; the dict it prints on its ``PYATTN_STARTUP`` line."""
    p = subprocess.run([sys.executable, "-c", code, *argv], env=child_env(cache_dir, pycache), capture_output=True,
                       text=True, timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PYATTN_STARTUP ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"start-up child failed (exit {p.returncode}): {(p.stderr or p.stdout)[-800:]}")
    return json.loads(line.split(" ", 1)[1])


def _median(rows: list, keys) -> dict:
    return {k: float(np.median([r[k] for r in rows])) for k in keys if rows and all(k in r for r in rows)}


def measure(runs: int, cache_dir: str, bytecode_cache: bool = True) -> dict:
    """The cold process, then ``runs`` warm ones, then ``runs`` in JIT steps (with a GPU):
    {"cold": {...}, "runs": [...], "median": {...}, "steps": {...}, "bytecode_cached": bool, "no_gpu": ...}."""
    with tempfile.TemporaryDirectory(prefix="pyattn-pyc-") as pyc:
        pycache = pyc if bytecode_cache else None
        cold = run_child(cache_dir, argv=("plain", NO_GPU_ARCH), pycache=pycache)
        warm = [run_child(cache_dir, argv=("plain", NO_GPU_ARCH), pycache=pycache) for _ in range(runs)]
        steps = warm if cold.get("no_gpu") else [run_child(cache_dir, argv=("steps", NO_GPU_ARCH), pycache=pycache)
                                                 for _ in range(runs)]
    return {"cold": cold, "runs": warm, "median": _median(warm, STEPS + SPLIT), "steps_runs": steps,
            "steps": _median(steps, JIT_STEPS), "bytecode_cached": all(r["bytecode_cached"] for r in warm),
            "no_gpu": cold.get("no_gpu")}


def import_profile(cache_dir: str, top: int = 12, pycache: str | None = None) -> list:
    """The ``top`` modules by own import time among those the first call imports:
    [(module, own ms, cumulative ms)]."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", CHILD_IMPORTS],
                       env=child_env(cache_dir, pycache), capture_output=True, text=True, timeout=120)
    lines = p.stderr.splitlines()
    after = lines[lines.index("PYATTN_MARK") + 1:] if "PYATTN_MARK" in lines else []
    rows = []
    for line in after:
        parts = line.split("|")
        if len(parts) == 3 and parts[0].startswith("import time:") and "self" not in parts[0]:
            rows.append((parts[2].strip(), int(parts[0].split(":")[1]) / 1e3, int(parts[1]) / 1e3))
    return sorted(rows, key=lambda r: -r[1])[:top]


def targets(med: dict) -> list:
    names = {"import_pyattn_ms": "import pyattn", "first_call_ms": "first call with a warm cache"}
    return [{"pass": None if k not in med else med[k] <= lim,
             "text": f"{names[k]}: {harness.fmt(med.get(k), '.1f')} ms (target <= {lim:.0f} ms)"}
            for k, lim in TARGETS.items()]


def report(result: dict, runs: int) -> None:
    med, cold, steps = result["median"], result["cold"], result["steps"]
    bytecode = "bytecode cached" if result["bytecode_cached"] else "modules compiled from source (no .pyc)"
    print(f"== start-up of a fresh process (median of {runs}, warm kernel cache, {bytecode}); "
          f"{harness.env_line(result['environment'])}")
    for k in STEPS:
        print(f"  {k[:-3].replace('_', ' '):14} {harness.fmt(med.get(k), '.1f'):>8} ms   (cold cache: "
              f"{harness.fmt(cold.get(k), '.1f')} ms)")
        if k == "first_call_ms":
            for s in SPLIT:
                print(f"    {NAMES[s]:34} {harness.fmt(med.get(s), '.2f'):>8} ms")
    print(f"  {'total':14} {sum(med.get(k, 0.0) for k in STEPS):8.1f} ms")
    if result["no_gpu"]:
        print(f"  no GPU ({result['no_gpu']}): import figures and JIT steps ({NO_GPU_ARCH}) only")
    print(f"  the first call in steps (median of {runs} {'more ' if not result['no_gpu'] else ''}processes):")
    for s in JIT_STEPS:
        print(f"    {NAMES[s]:34} {harness.fmt(steps.get(s), '.2f'):>8} ms")
    if result.get("importtime_top"):
        print("  slowest modules the first call imports (own time, one process):")
    for name, own, cum in result.get("importtime_top", []):
        print(f"    {name:40} own {own:6.2f} ms  cumulative {cum:7.2f} ms")


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--runs", type=int, default=7, help="fresh processes with a warm cache (default 7)")
    p.add_argument("--cache-dir", help="kernel cache to use (default: a new temporary directory)")
    p.add_argument("--importtime", action="store_true", help="also list the slowest modules the first call imports")
    p.add_argument("--no-bytecode-cache", action="store_true",
                   help="no private .pyc cache: the environment as it is (PYTHONDONTWRITEBYTECODE honoured)")
    args = p.parse_args(argv)
    runs = 3 if args.quick else max(1, args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or os.path.join(tmp, "cache")
        result = {"environment": harness.environment(), "cache_dir": "temporary" if not args.cache_dir else cache}
        result.update(measure(runs, cache, bytecode_cache=not args.no_bytecode_cache))
        if args.importtime:
            pyc = None if args.no_bytecode_cache else os.path.join(tmp, "pyc")
            run_child(cache, argv=("plain", NO_GPU_ARCH), pycache=pyc)  # writes that bytecode cache
            result["importtime_top"] = import_profile(cache, pycache=pyc)
    report(result, runs)
    result["targets"] = targets(result["median"])
    harness.print_targets(result["targets"])
    harness.save_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

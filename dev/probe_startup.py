"""Where the first ``attention`` call of a fresh process goes, with a warm kernel cache.

Usage: PYTHONPATH=. python dev/probe_startup.py [--runs 7] [--arch sm_90a] [--cache-dir DIR] [--no-bytecode]

Each run is a fresh process. It imports numpy and pyattn, creates the CUDA context and uploads q
(as ``scripts/bench_startup.py`` does, neither counted), then makes the first call with timers
wrapped around its steps, so the breakdown is of the real call, not of a re-enactment:

- ``import op modules``: the first access of ``pyattn.attention`` (the op, validation, pipeline,
  kernel family and launch modules);
- ``import jit``: ``pyattn.jit`` and the cache modules (the call imports them on its kernel miss);
- ``toolchain fingerprint``: NVRTC identity, header version, kernel-source digest (once a process);
- ``cache key``: rendering the unit and hashing it with the spec and options;
- ``cache read``: trust checks, reading the entry, its checksum;
- ``cuModuleLoadData``, ``function + attributes`` (``cuModuleGetFunction``, four
  ``cuFuncGetAttribute``), ``max dynamic smem`` (``cuFuncSetAttribute``), ``launch``;
- ``rest of the call``: validation, planning, allocation, stream choice and the final
  synchronisation (the kernel itself is microseconds at this shape).

Without a GPU the device steps are faked (a device-less DeviceArray, a module that loads nothing,
a launch that does nothing): the import, JIT and Python steps are real, the CUDA ones read 0. The
cache is filled first by compiling the spec with NVRTC (no GPU needed). ``--no-bytecode`` runs the
children as this environment would (``PYTHONDONTWRITEBYTECODE`` honoured); by default they use a
private bytecode cache (``PYTHONPYCACHEPREFIX``), as an installed wheel would have its ``.pyc``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_startup import child_env  # noqa: E402  (the children's environment, as the benchmark sets it)
STEPS = ("import op modules", "import jit", "toolchain fingerprint", "cache key", "cache read",
         "cuModuleLoadData", "function + attributes", "max dynamic smem", "launch", "rest of the call")

CHILD = r"""
import json, sys, time
T = time.perf_counter
import numpy as np
import pyattn
ARCH = sys.argv[1]
res, times = {}, {}
try:
    dev = pyattn.get_device()
    dev.activate()
    q = pyattn.asarray(np.ones((1, 128, 4, 64), np.float16))
    dev.synchronize()
    gpu = True
except pyattn.NoDeviceError:
    gpu = False
    pyattn.asarray, pyattn.DeviceArray  # what the GPU branch's upload imports

t = T(); pyattn.attention; times["import op modules"] = T() - t
t = T(); from pyattn import jit; from pyattn.jit import cache as _c; times["import jit"] = T() - t

from pyattn.kernels import registry, specs
from pyattn.ops import _fwd, attention as _att
from pyattn.runtime import module


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = T()
        try:
            return fn(*a, **k)
        finally:
            times[name] = times.get(name, 0.0) + T() - t0
    return wrapper


jit.toolchain_fingerprint = timed("toolchain fingerprint", jit.toolchain_fingerprint)
specs.KernelSpec.cache_key = timed("cache key", specs.KernelSpec.cache_key)
_c.KernelCache.get = timed("cache read", _c.KernelCache.get)
if gpu:
    module.Module.__init__ = timed("cuModuleLoadData", module.Module.__init__)
    module.Module.kernel = timed("function + attributes", module.Module.kernel)
    module.Kernel.set_max_dynamic_shared = timed("max dynamic smem", module.Kernel.set_max_dynamic_shared)
    _fwd.launch = timed("launch", _fwd.launch)
else:  # fake device steps: everything else is the real code
    class Dev:
        ordinal, arch, sm_count = 0, ARCH, 132  # an H200's SMs (the plan's grid needs a count)
        def activate(self): pass
    class Stream:
        ptr = handle = 7
    dev, s = Dev(), Stream()
    class Mod:
        def __init__(self, device, image): self.image = image
        def kernel(self, name): return Kern()
    class Kern:
        name = "fake"
        def set_max_dynamic_shared(self, n): pass
        def max_active_blocks(self, threads, smem): return 1  # the planner's occupancy query
    registry.Module = Mod
    _fwd.launch = timed("launch", lambda *a: None)
    _att.start = lambda stream, args, recheck=None: (dev, s, args)
    _att.finish = lambda s, args: None
    _att.bind = lambda *a: None  # the repeat-call binding (it would make pyattn's stream); one call here
    def allocate(device, s, shape, dtype, strides, elem_strides, nbytes):  # run_fwd's result blocks
        return pyattn.DeviceArray(4096, shape, np.dtype(dtype), device, owner=None)
    _fwd.allocate = allocate
    q = pyattn.DeviceArray(4096, (1, 128, 4, 64), np.float16, dev)

t = T()
pyattn.attention(q, q, q)
if gpu:
    dev.synchronize()
total = T() - t
times["rest of the call"] = total - sum(v for k, v in times.items() if k not in ("import op modules", "import jit"))
res = {k: v * 1e3 for k, v in times.items()}
res["call_ms"] = total * 1e3
res["first_call_ms"] = (total + times["import op modules"] + times["import jit"]) * 1e3
res["gpu"] = gpu
import importlib.util, os
res["bytecode"] = os.path.exists(importlib.util.cache_from_source(_att.__file__))
print("PROBE " + json.dumps(res))
"""


def run(env: dict, arch: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, arch], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"probe child failed (exit {p.returncode}): {(p.stderr or p.stdout)[-1500:]}")
    return json.loads(line.split(" ", 1)[1])


def fill_cache(env: dict, arch: str) -> None:
    """Compile the first call's kernel into the cache (NVRTC only: no GPU needed)."""
    code = ("import sys, pyattn\nfrom pyattn import jit\nfrom pyattn.kernels.specs import select_attention_spec\n"
            "try:\n    arch = pyattn.get_device().arch\nexcept pyattn.NoDeviceError:\n    arch = sys.argv[1]\n"
            "jit.build(select_attention_spec('float16', 64, arch))\n")
    subprocess.run([sys.executable, "-c", code, arch], env=env, check=True, timeout=600)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--arch", default="sm_90a", help="arch of the faked device without a GPU (default sm_90a)")
    p.add_argument("--cache-dir", help="kernel cache (default: a new temporary directory)")
    p.add_argument("--no-bytecode", action="store_true", help="no private bytecode cache for the children")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env = child_env(args.cache_dir or os.path.join(tmp, "cache"),
                        None if args.no_bytecode else os.path.join(tmp, "pyc"))
        fill_cache(env, args.arch)
        run(env, args.arch)  # writes the bytecode cache; not counted
        runs = [run(env, args.arch) for _ in range(max(1, args.runs))]
    keys = (*STEPS, "call_ms", "first_call_ms")
    med = {k: float(np.median([r.get(k, 0.0) for r in runs])) for k in keys}
    low = {k: float(np.min([r.get(k, 0.0) for r in runs])) for k in keys}  # steadier on a busy machine
    where = "GPU" if runs[0]["gpu"] else f"no GPU: device steps faked, arch {args.arch}"
    print(f"== first attention call, warm cache, median of {len(runs)} fresh processes ({where}; "
          f"bytecode {'cached' if runs[0]['bytecode'] else 'compiled from source'})")
    print(f"  {'':24} {'median':>7}    {'min':>7}")
    for k in STEPS:
        print(f"  {k:24} {med[k]:7.2f} ms {low[k]:7.2f} ms")
    print(f"  {'first call (all above)':24} {med['first_call_ms']:7.2f} ms {low['first_call_ms']:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

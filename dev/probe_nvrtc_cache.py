"""Dev probe (GPU host): what NVRTC's own compile cache (CUDA 12.9+) does to a process that compiles.

NVRTC 13.x, where a CUDA driver is installed and ``--no-cache`` is not passed, looks compiled
programs up in the driver's compute cache (``~/.nv/ComputeCache``, ``CUDA_CACHE_*``) and adds them
there; to do that it initialises the driver in the compiling process. pyattn passes ``--no-cache``
since this probe, so each case takes pyattn's options without it, plus the options it names.
Each case runs in a fresh child process: compile one variant with no device use, then report
whether the driver is now initialised (``cuDeviceGetCount`` answers ``CUDA_ERROR_NOT_INITIALIZED``
before any ``cuInit``), the compile's time, the compute cache's size, and whether a forked child
can still use the GPU.

    PYTHONPATH=. python dev/probe_nvrtc_cache.py [--spec-arch sm_90a]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
opts_extra = json.loads(sys.argv[1]); arch = sys.argv[2]
from pyattn.jit.headers import check_headers_match_nvrtc
from pyattn.jit.nvrtc import compile_source
from pyattn.jit.source import kernel_headers, render
from pyattn.kernels.specs import KernelSpec
spec = KernelSpec("attn_decode", "bf16", 128, arch, q_tiles=1, kv="int8", key_channel=True)
# pyattn's options less its own --no-cache: each case adds exactly the options it names
opts = [o for o in spec.compile_options((str(check_headers_match_nvrtc()),)) if o != "--no-cache"] + opts_extra
src, hdrs = render(spec), kernel_headers()
t = time.perf_counter()
image, log = compile_source(src, hdrs, opts, name=spec.describe())
dt = time.perf_counter() - t
from cuda.bindings import driver
err, n = driver.cuDeviceGetCount()
res = {"compile_s": round(dt, 3), "driver_initialised": err == driver.CUresult.CUDA_SUCCESS,
       "cuDeviceGetCount": err.name, "log": log[-600:]}
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the forked child: can it use the GPU?
    os.close(r)
    out = []
    (e,) = driver.cuInit(0); out.append(e.name)
    e, dev = driver.cuDeviceGet(0); out.append(e.name)
    e, ctx = driver.cuDevicePrimaryCtxRetain(dev); out.append(e.name)
    if e == driver.CUresult.CUDA_SUCCESS:
        (e,) = driver.cuCtxSetCurrent(ctx); out.append(e.name)
        e, ptr = driver.cuMemAlloc(1 << 20); out.append(e.name)
    os.write(w, json.dumps(out).encode()); os._exit(0)
os.close(w)
os.waitpid(pid, 0)
res["forked_child"] = json.loads(os.read(r, 4096).decode() or "[]")
print(json.dumps(res))
"""


def cache_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-arch", default="sm_90a")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="cudacache_")
    cases = [("default options, empty compute cache", [], {}),
             ("default options again (a hit?)", [], {}),
             ("--no-cache", ["--no-cache"], {}),
             ("--no-cache, a fresh cache dir", ["--no-cache"], {"CUDA_CACHE_PATH": cache + "_b"}),
             ("default, CUDA_CACHE_DISABLE=1, a fresh cache dir", [], {"CUDA_CACHE_DISABLE": "1",
                                                                     "CUDA_CACHE_PATH": cache + "_c"}),
             ("default + --enable-cache-trace (a hit)", ["--enable-cache-trace"], {})]
    for label, extra, env in cases:
        e = dict(os.environ, CUDA_CACHE_PATH=cache)
        e.update(env)
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(extra), args.spec_arch], env=e,
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            print(f"{label}: FAILED rc {p.returncode}\n{p.stderr[-2000:]}")
            continue
        res = json.loads(p.stdout.strip().splitlines()[-1])
        log = res.pop("log").strip().replace("\n", " | ")
        size = cache_bytes(e["CUDA_CACHE_PATH"]) if os.path.isdir(e["CUDA_CACHE_PATH"]) else 0
        print(f"{label}: {res}, compute cache {size} bytes" + (f"\n  log: {log[-400:]}" if log else ""))


if __name__ == "__main__":
    main()

"""Dev probe: which libraries does an NVRTC compile load, and do torch's libraries bind symbols to
them (symbol interposition)? Run: PYTHONPATH=. python dev/probe_nvrtc_maps.py"""
import os, subprocess, sys, textwrap

CHILD = r'''
import sys
def libs():
    return {l.split()[-1] for l in open("/proc/self/maps") if ".so" in l}
before = libs()
from cuda.bindings import nvrtc
err, p = nvrtc.nvrtcCreateProgram(b'extern "C" __global__ void k(float* x){x[0]=1.f;}', b"k.cu", 0, [], [])
mid = libs()
(r,) = nvrtc.nvrtcCompileProgram(p, 1, [b"-arch=sm_90a"])
after = libs()
print("LOADED BY IMPORT+CREATE:", sorted(mid - before))
print("LOADED BY COMPILE:", sorted(after - mid))
sys.stdout.flush()
if len(sys.argv) > 1:
    import torch
'''
r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=200)
print(r.stdout, r.stderr[-500:])
newlibs = [l.split("LOADED BY COMPILE:")[1] for l in r.stdout.splitlines() if l.startswith("LOADED BY COMPILE")]
for line in r.stdout.splitlines():
    if line.startswith("LOADED BY COMPILE"):
        for path in eval(line.split(":", 1)[1]):
            nm = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True).stdout.splitlines()
            print(f"{path}: {len(nm)} exported symbols; sample: {[x.split()[-1] for x in nm[:8]]}")
env = dict(os.environ, LD_DEBUG="bindings", LD_DEBUG_OUTPUT="/tmp/lddbg")
subprocess.run([sys.executable, "-c", CHILD, "torch"], env=env, capture_output=True, text=True, timeout=300)
hits = {}
for f in os.listdir("/tmp"):
    if f.startswith("lddbg"):
        for line in open(os.path.join("/tmp", f), errors="replace"):
            if "binding file" in line and ("nvrtc" in line.split(" to ")[-1] or "builtins" in line.split(" to ")[-1]):
                src = line.split("binding file ")[1].split(" [")[0]
                key = (os.path.basename(src), line.split(" to ")[-1].split(" [")[0].split("/")[-1])
                sym = line.rsplit("symbol `", 1)[-1].split("'")[0]
                hits.setdefault(key, []).append(sym)
print("bindings INTO nvrtc libraries (file -> lib: n symbols, sample):")
for (src, dst), syms in sorted(hits.items()):
    print(f"  {src} -> {dst}: {len(syms)} {syms[:6]}")

"""Dev probe: why does `import torch` fail after an NVRTC 13.0 compile in the same process?

Run on the GPU machine: PYTHONPATH=. python dev/probe_nvrtc_torch.py
Builds (with the machine's gcc/g++) an LD_PRELOAD shim that logs every locale call glibc exports,
internal aliases included, and a small C++ library that reports what torch's C++ code would see
(std::locale, isspace, stream splitting), then runs children: compile vs. load only vs. compile in
a spawned child process, each followed by `import torch`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <locale.h>
#include <stdio.h>
static const char* who(void* a) { Dl_info i; return dladdr(a, &i) && i.dli_fname ? i.dli_fname : "?"; }
#define REAL(name, type) static type real = 0; if (!real) real = (type)dlsym(RTLD_NEXT, name)
typedef locale_t (*nl_t)(int, const char*, locale_t);
typedef locale_t (*dl_t)(locale_t);
typedef void (*fl_t)(locale_t);
typedef char* (*sl_t)(int, const char*);
locale_t newlocale(int m, const char* n, locale_t b) { REAL("newlocale", nl_t);
  locale_t r = real(m, n, b); fprintf(stderr, "SHIM newlocale(0x%x, %s, %p) -> %p from %s\n", m, n ? n : "(null)", (void*)b, (void*)r, who(__builtin_return_address(0))); return r; }
locale_t __newlocale(int m, const char* n, locale_t b) { REAL("__newlocale", nl_t);
  locale_t r = real(m, n, b); fprintf(stderr, "SHIM __newlocale(0x%x, %s, %p) -> %p from %s\n", m, n ? n : "(null)", (void*)b, (void*)r, who(__builtin_return_address(0))); return r; }
locale_t duplocale(locale_t b) { REAL("duplocale", dl_t);
  locale_t r = real(b); fprintf(stderr, "SHIM duplocale(%p) -> %p from %s\n", (void*)b, (void*)r, who(__builtin_return_address(0))); return r; }
locale_t __duplocale(locale_t b) { REAL("__duplocale", dl_t);
  locale_t r = real(b); fprintf(stderr, "SHIM __duplocale(%p) -> %p from %s\n", (void*)b, (void*)r, who(__builtin_return_address(0))); return r; }
void freelocale(locale_t b) { REAL("freelocale", fl_t);
  fprintf(stderr, "SHIM freelocale(%p) from %s\n", (void*)b, who(__builtin_return_address(0))); real(b); }
void __freelocale(locale_t b) { REAL("__freelocale", fl_t);
  fprintf(stderr, "SHIM __freelocale(%p) from %s\n", (void*)b, who(__builtin_return_address(0))); real(b); }
locale_t uselocale(locale_t l) { REAL("uselocale", dl_t);
  locale_t r = real(l); fprintf(stderr, "SHIM uselocale(%p) -> %p from %s\n", (void*)l, (void*)r, who(__builtin_return_address(0))); return r; }
locale_t __uselocale(locale_t l) { REAL("__uselocale", dl_t);
  locale_t r = real(l); fprintf(stderr, "SHIM __uselocale(%p) -> %p from %s\n", (void*)l, (void*)r, who(__builtin_return_address(0))); return r; }
char* setlocale(int c, const char* l) { REAL("setlocale", sl_t);
  char* r = real(c, l); if (l) fprintf(stderr, "SHIM setlocale(%d, %s) -> %s from %s\n", c, l, r ? r : "(null)", who(__builtin_return_address(0))); return r; }
"""

_CXX = r"""
#include <cctype>
#include <cstring>
#include <locale>
#include <sstream>
#include <string>
extern "C" int c_isspace() { return isspace(' ') != 0; }
extern "C" int c_isalpha_space() { return isalpha(' ') != 0; }
extern "C" const unsigned short* c_table() { return *__ctype_b_loc(); }
extern "C" int cxx_isspace() { return std::isspace(' ', std::locale()) ? 1 : 0; }
extern "C" void cxx_name(char* out) { std::string n = std::locale().name(); std::strncpy(out, n.c_str(), 255); }
extern "C" void cxx_split(char* out) { std::istringstream is("str tag"); std::string a, b; is >> a >> b; std::string r = a + "|" + b; std::strncpy(out, r.c_str(), 255); }
extern "C" void cxx_join(char* out) { std::ostringstream os; os << "str" << ' ' << "tag" << " " << 1.5; std::strncpy(out, os.str().c_str(), 255); }
"""

_CHILD = r"""
import ctypes, sys, os
lib = ctypes.CDLL(os.environ["PROBE_CXX"])
lib.c_table.restype = ctypes.c_void_p
def look(tag):
    buf = ctypes.create_string_buffer(256)
    out = [f"c_isspace={lib.c_isspace()}", f"c_isalpha(' ')={lib.c_isalpha_space()}", f"table={lib.c_table():#x}",
           f"cxx_isspace={lib.cxx_isspace()}"]
    lib.cxx_name(buf); out.append(f"cxx_locale={buf.value.decode()!r}")
    lib.cxx_split(buf); out.append(f"split={buf.value.decode()!r}")
    lib.cxx_join(buf); out.append(f"join={buf.value.decode()!r}")
    print(tag, " ".join(out), flush=True)
mode = sys.argv[1]
look("BEFORE")
src = '#include <cuda_fp16.h>\nextern "C" __global__ void k(__half* x) { x[0] = __float2half(1.5f); }\n'
if mode == "load":
    from cuda.bindings import nvrtc
    print("nvrtc", nvrtc.nvrtcVersion())
elif mode == "create":
    from cuda.bindings import nvrtc
    err, p = nvrtc.nvrtcCreateProgram(b"extern \"C\" __global__ void k(){}", b"k.cu", 0, [], [])
    nvrtc.nvrtcDestroyProgram(p)
elif mode in ("compile", "trivial"):
    from pyattn.jit.nvrtc import compile_source
    from pyattn.jit.headers import cuda_include_dir
    if mode == "trivial":
        compile_source('extern "C" __global__ void k(float* x) { x[0] = 1.f; }', (), ("-arch=sm_90a",), name="t")
    else:
        compile_source(src, (), ("-arch=sm_90a", "-std=c++17", f"-I{cuda_include_dir()[0]}"), name="probe")
elif mode == "child":
    import subprocess
    code = ("from pyattn.jit.nvrtc import compile_source; from pyattn.jit.headers import cuda_include_dir; "
            "img, _ = compile_source(%r, (), ('-arch=sm_90a', '-std=c++17', '-I' + str(cuda_include_dir()[0])), "
            "name='probe'); print(len(img))" % src)
    print("child cubin bytes", subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip())
look("AFTER ")
try:
    import torch
    print("TORCH OK", float(torch.ones(3, device="cuda").sum()))
except Exception as e:
    print("TORCH FAIL", type(e).__name__, str(e)[:160].replace("\n", " | "))
look("TORCH ")
"""


def main():
    with tempfile.TemporaryDirectory() as d:
        shim, cxx = os.path.join(d, "shim.so"), os.path.join(d, "cxx.so")
        open(os.path.join(d, "shim.c"), "w").write(_SHIM)
        open(os.path.join(d, "cxx.cpp"), "w").write(_CXX)
        for cmd in (["gcc", "-shared", "-fPIC", "-O1", "-o", shim, os.path.join(d, "shim.c"), "-ldl"],
                    ["g++", "-shared", "-fPIC", "-O1", "-o", cxx, os.path.join(d, "cxx.cpp")]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                print("build failed:", " ".join(cmd), r.stderr[-800:])
                return
        env = dict(os.environ, PYTHONPATH=ROOT, PROBE_CXX=cxx)
        for mode in ("load", "create", "trivial", "compile", "child"):
            r = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=240)
            print(f"-- mode={mode} rc={r.returncode}")
            print(textwrap.indent((r.stdout + r.stderr[-600:]).strip(), "   "))
        r = subprocess.run([sys.executable, "-c", _CHILD, "trivial"], env=dict(env, LD_PRELOAD=shim),
                           capture_output=True, text=True, timeout=240)
        calls = [ln for ln in r.stderr.splitlines() if ln.startswith("SHIM")]
        mine = [ln for ln in calls if "nvrtc" in ln.rsplit(" from ", 1)[-1]]
        print(f"-- shim, mode=trivial: {len(calls)} locale calls, {len(mine)} from libnvrtc (first 80, in order)")
        for ln in mine[:80]:
            print("   ", ln)
        print(textwrap.indent(r.stdout.strip(), "   "))


if __name__ == "__main__":
    main()

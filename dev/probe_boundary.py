"""Dev probe (not a benchmark): facts that decide the design of the array boundary (issue 11).

Run on a GPU machine: PYTHONPATH=. python dev/probe_boundary.py [locale|dlpack|host|numpy|all]
1. locale: what an NVRTC compile changes in the process, and whether restoring it lets a later
   `import torch` work (subprocesses; an LD_PRELOAD shim logs setlocale/uselocale/setenv calls
   when gcc is there).
2. dlpack: bfloat16 / fp8 / fp16 / fp32 device arrays through pyattn.runtime.dlpack into torch and CuPy.
3. host: per-call costs of the driver and torch calls a tiny op makes.
4. numpy: pinned/pageable copy rates, page-fault cost, the NumPy paths' floors.
Uses ctypes freely: this is a probe, not the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import ctypes, locale, os, sys, threading
libc = ctypes.CDLL(None)
libc.uselocale.restype = ctypes.c_void_p
libc.uselocale.argtypes = [ctypes.c_void_p]
libc.getenv.restype = ctypes.c_char_p
def snap():
    cats = [(n, getattr(locale, n)) for n in ("LC_CTYPE", "LC_NUMERIC", "LC_COLLATE", "LC_TIME", "LC_MONETARY", "LC_MESSAGES")]
    g = {n: locale.setlocale(c) for n, c in cats}
    tl = libc.uselocale(None)
    env = {k: (libc.getenv(k.encode()) or b"").decode() for k in ("LANG", "LC_ALL", "LC_CTYPE", "LC_NUMERIC")}
    return g, hex(tl or 0), env, locale.localeconv()["decimal_point"]
mode = sys.argv[1]
before = snap()
if mode != "none":
    from pyattn.jit.nvrtc import compile_source
    from pyattn.jit.headers import cuda_include_dir
    inc = str(cuda_include_dir()[0])
    src = '#include <cuda_fp16.h>\nextern "C" __global__ void k(__half* x) { x[0] = __float2half(1.5f); }\n'
    def comp():
        compile_source(src, (), ("-arch=sm_90a", "-std=c++17", f"-I{inc}"), name="probe")
    if mode.startswith("thread"):
        t = threading.Thread(target=comp); t.start(); t.join()
    else:
        comp()
after = snap()
print("BEFORE", before)
print("AFTER ", after)
if mode.endswith("restore"):
    for cat in ("LC_CTYPE", "LC_NUMERIC", "LC_COLLATE", "LC_TIME", "LC_MONETARY", "LC_MESSAGES"):
        locale.setlocale(getattr(locale, cat), before[0][cat])
    print("RESTORED", snap())
try:
    import torch
    x = torch.ones(3, device="cuda")
    print("TORCH OK", float(x.sum()))
except Exception as e:
    print("TORCH FAIL", type(e).__name__, str(e)[:300].replace("\n", " | "))
"""

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <locale.h>
#include <stdio.h>
#include <stdlib.h>
static const char* who(void* addr) { Dl_info i; return dladdr(addr, &i) && i.dli_fname ? i.dli_fname : "?"; }
char* setlocale(int cat, const char* loc) {
  static char* (*real)(int, const char*) = 0; if (!real) real = dlsym(RTLD_NEXT, "setlocale");
  char* r = real(cat, loc);
  if (loc) fprintf(stderr, "SHIM setlocale(%d, \"%s\") -> \"%s\" from %s\n", cat, loc, r ? r : "(null)", who(__builtin_return_address(0)));
  return r;
}
locale_t uselocale(locale_t l) {
  static locale_t (*real)(locale_t) = 0; if (!real) real = dlsym(RTLD_NEXT, "uselocale");
  locale_t r = real(l);
  if (l) fprintf(stderr, "SHIM uselocale(%p) -> %p from %s\n", (void*)l, (void*)r, who(__builtin_return_address(0)));
  return r;
}
int setenv(const char* n, const char* v, int o) {
  static int (*real)(const char*, const char*, int) = 0; if (!real) real = dlsym(RTLD_NEXT, "setenv");
  fprintf(stderr, "SHIM setenv(%s=%s) from %s\n", n, v, who(__builtin_return_address(0)));
  return real(n, v, o);
}
int putenv(char* s) {
  static int (*real)(char*) = 0; if (!real) real = dlsym(RTLD_NEXT, "putenv");
  fprintf(stderr, "SHIM putenv(%s) from %s\n", s, who(__builtin_return_address(0)));
  return real(s);
}
"""


def probe_locale():
    print("== locale: what a compile changes, and whether import torch survives it")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for mode in ("none", "compile", "thread", "compile_restore"):
        r = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=240)
        print(f"-- mode={mode} rc={r.returncode}")
        print(textwrap.indent((r.stdout + r.stderr[-1500:]).strip(), "   "))
    with tempfile.TemporaryDirectory() as d:
        so = os.path.join(d, "shim.so")
        c = os.path.join(d, "shim.c")
        open(c, "w").write(_SHIM)
        b = subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", so, c, "-ldl"], capture_output=True, text=True)
        if b.returncode:
            print("-- shim: gcc failed:", b.stderr[-500:])
            return
        r = subprocess.run([sys.executable, "-c", _CHILD, "compile"], env=dict(env, LD_PRELOAD=so),
                           capture_output=True, text=True, timeout=240)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("SHIM")]
        print(f"-- shim (LD_PRELOAD) during compile + import torch: {len(lines)} calls")
        seen = {}
        for ln in lines:
            seen[ln] = seen.get(ln, 0) + 1
        for ln, n in list(seen.items())[:60]:
            print(f"   {n:4d} x {ln}")
        print(textwrap.indent(r.stdout.strip(), "   "))


class _Export:
    """A wrapper whose __dlpack__ is pyattn.runtime.dlpack's export of a DeviceArray."""

    def __init__(self, a):
        self.a = a

    def __dlpack_device__(self):
        return (2, self.a.device.ordinal)

    def __dlpack__(self, stream=None, max_version=None, **kw):
        from pyattn.runtime.dlpack import export_capsule
        self.a.stream.synchronize()
        return export_capsule(self.a.ptr, self.a.shape, self.a.strides, self.a.dtype, self.a.device.ordinal, self.a,
                              versioned=max_version is not None and max_version >= (1, 0))


def probe_dlpack():
    import ml_dtypes
    import pyattn
    print("== dlpack: DeviceArray -> torch / CuPy for every dtype")
    rng = np.random.default_rng(0)
    host = rng.standard_normal((3, 5, 8)).astype(np.float32)
    import torch
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        cupy = None
        print("cupy import failed", e)
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        h = host.astype(dt)
        a = pyattn.asarray(h)
        a.stream.synchronize()
        for name, fn in (("torch.from_dlpack", lambda: torch.from_dlpack(_Export(a))),
                         ("cupy.from_dlpack", (lambda: cupy.from_dlpack(_Export(a))) if cupy else None)):
            if fn is None:
                continue
            try:
                t = fn()
                back = t.float().cpu().numpy() if name.startswith("torch") else cupy.asnumpy(t).astype(np.float32)
                ok = np.array_equal(back, h.astype(np.float32))
                ptr = t.data_ptr() if name.startswith("torch") else t.data.ptr
                print(f"   {np.dtype(dt).name:14} {name:18} -> {t.dtype} {tuple(t.shape)} values equal: {ok}, "
                      f"zero-copy: {ptr == a.ptr}")
            except Exception as e:  # noqa: BLE001
                print(f"   {np.dtype(dt).name:14} {name:18} FAILED {type(e).__name__}: {str(e)[:200]}")
    # strided (transposed) export
    a = pyattn.asarray(host.astype(ml_dtypes.bfloat16)).transpose(2, 0, 1)
    t = torch.from_dlpack(_Export(a))
    print("   transposed bf16 -> torch strides", t.stride(), "equal:",
          np.array_equal(t.float().cpu().numpy(), host.transpose(2, 0, 1).astype(ml_dtypes.bfloat16).astype(np.float32)))
    # cost of one export + import
    a = pyattn.asarray(host.astype(ml_dtypes.bfloat16))
    a.stream.synchronize()
    e = _Export(a)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        torch.from_dlpack(e)
    print(f"   torch.from_dlpack(bf16 export) {1e6 * (time.perf_counter() - t0) / n:.1f} us/call (incl. a stream sync)")


def _us(fn, n=20000):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


def probe_host():
    import pyattn
    import torch
    from cuda.bindings import driver as d
    from pyattn.runtime.memory import get_pool
    print("== host: per-call costs (us)")
    dev = pyattn.get_device()
    dev.activate()
    s = pyattn.Stream()
    ev = pyattn.Event()
    h = s.handle
    print(f"   cuEventRecord                 {_us(lambda: d.cuEventRecord(ev.handle, h)):.2f}")
    print(f"   cuStreamWaitEvent             {_us(lambda: d.cuStreamWaitEvent(h, ev.handle, 0)):.2f}")
    pool = get_pool(dev)
    print(f"   pool alloc + free (Allocation) {_us(lambda: pool.allocate(4096, s).free()):.2f}")
    print(f"   driver.CUstream(int)          {_us(lambda: d.CUstream(12345)):.2f}")
    print(f"   cuCtxGetCurrent               {_us(lambda: d.cuCtxGetCurrent()):.2f}")
    t = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    print(f"   t.data_ptr()                  {_us(t.data_ptr):.2f}")
    print(f"   t.shape                       {_us(lambda: t.shape):.2f}")
    print(f"   t.stride()                    {_us(t.stride):.2f}")
    print(f"   t.dtype                       {_us(lambda: t.dtype):.2f}")
    print(f"   t.get_device()                {_us(t.get_device):.2f}")
    print(f"   t.requires_grad               {_us(lambda: t.requires_grad):.2f}")
    print(f"   type(t).__module__            {_us(lambda: type(t).__module__):.2f}")
    print(f"   torch._C._cuda_getCurrentRawStream(0) {_us(lambda: torch._C._cuda_getCurrentRawStream(0)):.2f}")
    print(f"   torch.cuda.current_stream()   {_us(torch.cuda.current_stream):.2f}")
    print(f"   t.__cuda_array_interface__    {_us(lambda: t.__cuda_array_interface__, 2000):.2f}")
    q = pyattn.asarray(np.random.default_rng(0).standard_normal((1, 16, 2, 64)).astype(np.float16))
    for _ in range(100):
        pyattn.attention(q, q, q, stream=s)
    s.synchronize()
    print(f"   pyattn.attention(DeviceArray, stream=s) {_us(lambda: pyattn.attention(q, q, q, stream=s), 5000):.2f}")
    try:
        print(f"   pyattn.attention(torch)       {_us(lambda: pyattn.attention(t, t, t), 1000):.2f}")
    except Exception as e:  # noqa: BLE001
        print("   pyattn.attention(torch) failed", e)
    import torch.nn.functional as F
    tb = t.transpose(1, 2)
    print(f"   torch SDPA tiny               {_us(lambda: F.scaled_dot_product_attention(tb, tb, tb), 5000):.2f}")
    torch.cuda.synchronize()


def _ms(fn, n=7):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def probe_numpy():
    from concurrent.futures import ThreadPoolExecutor

    import pyattn
    from cuda.bindings import driver as d
    from pyattn.runtime.errors import check
    from pyattn.runtime.memory import get_pool
    from pyattn.runtime.pinned import PinnedBuffer
    print("== numpy: copy rates and floors")
    print("   cpus:", len(os.sched_getaffinity(0)))
    dev = pyattn.get_device()
    dev.activate()
    s = pyattn.Stream()
    nin, nout = 48 << 20, 16 << 20
    src = np.random.default_rng(0).integers(0, 255, nin, dtype=np.uint8)
    pin_in, pin_out = PinnedBuffer(nin), PinnedBuffer(nout)
    dst = pin_in.array(np.uint8, (nin,))
    dbuf = get_pool(dev).allocate(nin, s)

    def h2d():
        check(d.cuMemcpyHtoDAsync(dbuf.ptr, pin_in.ptr, nin, s.handle), "h2d")
        s.synchronize()

    def d2h():
        check(d.cuMemcpyDtoHAsync(pin_out.ptr, dbuf.ptr, nout, s.handle), "d2h")
        s.synchronize()
    th, td = _ms(h2d), _ms(d2h)
    print(f"   pinned H2D 48 MiB {th:.3f} ms ({nin / th / 1e6:.1f} GB/s), D2H 16 MiB {td:.3f} ms "
          f"({nout / td / 1e6:.1f} GB/s), floor (sum) {th + td:.3f} ms")
    s2 = pyattn.Stream()
    dbuf2 = get_pool(dev).allocate(nout, s2)

    def both():
        check(d.cuMemcpyHtoDAsync(dbuf.ptr, pin_in.ptr, nin, s.handle), "h2d")
        check(d.cuMemcpyDtoHAsync(pin_out.ptr, dbuf2.ptr, nout, s2.handle), "d2h")
        s.synchronize()
        s2.synchronize()
    print(f"   H2D 48 MiB and D2H 16 MiB concurrently: {_ms(both):.3f} ms")
    for workers in (1, 4, 8, 12, 16):
        ex = ThreadPoolExecutor(workers)
        cuts = np.linspace(0, nin, workers + 1).astype(int)

        def par():
            list(ex.map(lambda i: np.copyto(dst[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]]), range(workers)))
        t = _ms(par)
        print(f"   staging copy 48 MiB, {workers:2d} threads: {t:.3f} ms = {nin / t / 1e6:.1f} GB/s")
        ex.shutdown()
    pout = pin_out.array(np.uint8, (nout,))
    print(f"   np.empty(16 MiB) + copy from pinned (page faults): {_ms(lambda: np.copyto(np.empty(nout, np.uint8), pout)):.3f} ms")
    warm = np.empty(nout, np.uint8)
    print(f"   copy from pinned into touched memory: {_ms(lambda: np.copyto(warm, pout)):.3f} ms")
    print(f"   PinnedBuffer(16 MiB) alloc+free: {_ms(lambda: PinnedBuffer(nout).close()):.3f} ms")
    q = np.random.default_rng(1).standard_normal((1, 4096, 16, 128)).astype(np.float16)
    print(f"   pyattn.attention(numpy (1,4096,16,128) fp16) today: {_ms(lambda: pyattn.attention(q, q, q)):.3f} ms")
    # decode floor: B=1, 32k cache, Hq32 Hkv8 D128 bf16
    import ml_dtypes
    cache = pyattn.PagedKVCache(2048 + 64, 16, 8, 128, "bfloat16")
    sid = cache.add_sequence()
    kv = np.random.default_rng(2).standard_normal((1, 32768, 8, 128)).astype(ml_dtypes.bfloat16)
    cache.append([sid], kv, kv)
    qd = np.random.default_rng(3).standard_normal((1, 1, 32, 128)).astype(ml_dtypes.bfloat16)
    dq = pyattn.asarray(qd)
    ds = pyattn.Stream()

    def dev_decode():
        pyattn.decode(dq, cache, [sid], stream=ds)
        ds.synchronize()
    print(f"   decode B1 32k, device q, wall incl. sync: {_ms(dev_decode, 50):.4f} ms")
    pq = PinnedBuffer(qd.nbytes)
    po = PinnedBuffer(qd.nbytes)

    def floor_decode():
        check(d.cuMemcpyHtoDAsync(dq.ptr, pq.ptr, qd.nbytes, ds.handle), "h2d")
        o = pyattn.decode(dq, cache, [sid], stream=ds)
        check(d.cuMemcpyDtoHAsync(po.ptr, o.ptr, qd.nbytes, ds.handle), "d2h")
        ds.synchronize()
    print(f"   decode B1 32k floor (pinned H2D q + kernel + pinned D2H, one sync): {_ms(floor_decode, 50):.4f} ms")
    print(f"   decode B1 32k NumPy q today: {_ms(lambda: pyattn.decode(qd, cache, [sid]), 50):.4f} ms")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    for name, fn in (("locale", probe_locale), ("dlpack", probe_dlpack), ("host", probe_host), ("numpy", probe_numpy)):
        if what in ("all", name):
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                print(f"== {name} probe failed: {e}")

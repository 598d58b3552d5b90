"""Whether the GPU can read the caller's pageable NumPy memory itself (HMM), and how fast.

Issue 11's NumPy floor: staging pageable inputs into pinned memory moves every byte through host
memory three times (read, write, DMA read), which bounds a NumPy call at ~2x the pinned-copy floor on
the H200 hosts (BENCHMARKS.md). Linux HMM (open GPU kernel modules, a recent kernel) lets a kernel
dereference malloc'd memory and lets ``cuMemPrefetchAsync`` migrate it to the GPU: no staging copy.
This probe prints the driver's attributes for that and, where it is on, times on fresh 48 MiB
NumPy arrays (q, k, v of (1, 4096, 16, 128) fp16):
  * a copy kernel reading the pageable array directly (pages fault and migrate on first touch);
  * ``cuMemPrefetchAsync`` of the array to the device, then the copy kernel reading it;
  * the CPU reading the array back afterwards (the cost the caller would pay later);
against the pinned H2D of the same bytes and the staged route (memcpy into pinned, then H2D).

Usage: PYTHONPATH=. python dev/probe_hmm.py [--mib 48] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import struct
import time

import numpy as np
from cuda.bindings import driver as d

import pyattn
from pyattn.jit.nvrtc import compile_source
from pyattn.runtime.errors import check
from pyattn.runtime.launch import launch
from pyattn.runtime.memory import get_pool
from pyattn.runtime.module import Module
from pyattn.runtime.pinned import PinnedBuffer

SRC = r"""
struct P { const int4* src; int4* dst; long long n; };
extern "C" __global__ void copy16(const __grid_constant__ P p) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x)
    p.dst[i] = p.src[i];
}
"""


def read_file(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"({exc.strerror})"


def attr(dev_handle, name: str):
    a = getattr(d.CUdevice_attribute, name, None)
    if a is None:
        return "(not in these bindings)"
    err, v = d.cuDeviceGetAttribute(a, dev_handle)
    return v if err == d.CUresult.CUDA_SUCCESS else f"({err.name})"


def prefetch(ptr: int, nbytes: int, ordinal: int, stream) -> None:
    loc = d.CUmemLocation()
    loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    try:
        check(d.cuMemPrefetchAsync(ptr, nbytes, loc, 0, stream.handle), "cuMemPrefetchAsync")
    except TypeError:  # 12.x bindings: the v2 entry point takes the location
        check(d.cuMemPrefetchAsync_v2(ptr, nbytes, loc, 0, stream.handle), "cuMemPrefetchAsync_v2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = pyattn.get_device()
    dev.activate()
    handle = check(d.cuDeviceGet(dev.ordinal), "cuDeviceGet")
    print(f"kernel {platform.release()}; THP {read_file('/sys/kernel/mm/transparent_hugepage/enabled')}; "
          f"uvm_disable_hmm {read_file('/sys/module/nvidia_uvm/parameters/uvm_disable_hmm')}; "
          f"driver {read_file('/proc/driver/nvidia/version').splitlines()[0] if os.path.exists('/proc/driver/nvidia/version') else '?'}")
    for name in ("CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS",
                 "CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES",
                 "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS", "CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY",
                 "CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST",
                 "CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED"):
        print(f"{name[len('CU_DEVICE_ATTRIBUTE_'):]}: {attr(handle, name)}")
    s = pyattn.Stream()
    nbytes = args.mib << 20
    gb = nbytes / 1e9
    alloc = get_pool(dev).allocate(nbytes, s)
    pin = PinnedBuffer(nbytes)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, nbytes, dtype=np.uint8)

    def timed(f):
        s.synchronize()
        t = time.perf_counter()
        f()
        s.synchronize()
        return 1e3 * (time.perf_counter() - t)

    def report(label, ts):
        t = float(np.median(ts))
        print(f"{label}: {t:.3f} ms ({gb / t * 1e3:.1f} GB/s), all {', '.join(f'{x:.2f}' for x in ts)}")

    report("H2D from pinned", [timed(lambda: check(d.cuMemcpyHtoDAsync(alloc.ptr, pin.ptr, nbytes, s.handle),
                                                   "cuMemcpyHtoDAsync")) for _ in range(args.reps)])
    staged = []
    for _ in range(args.reps):
        src = base.copy()
        staged.append(timed(lambda: (np.copyto(pin.array(np.uint8, (nbytes,)), src),
                                     check(d.cuMemcpyHtoDAsync(alloc.ptr, pin.ptr, nbytes, s.handle), "H2D"))))
    report("memcpy into pinned (1 thread) + H2D", staged)
    if attr(handle, "CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS") != 1:
        print("pageable memory access is off on this host: no HMM route to time")
        return
    image, _ = compile_source(SRC, (), (f"-arch={dev.arch}", "--no-cache"), name="copy16")
    kern = Module(dev, image).kernel("copy16")
    grid = (dev.sm_count * 8, 1, 1)

    def direct(src):
        launch(kern, grid, (256, 1, 1), 0, s, struct.pack("QQq", src.ctypes.data, alloc.ptr, nbytes // 16))

    for label, warm in (("kernel reads the fresh pageable array (first touch)", False),
                        ("kernel reads it again (pages already moved)", True)):
        ts, back = [], []
        for _ in range(args.reps):
            src = base.copy()  # fresh pages, faulted in on the CPU
            if warm:
                direct(src)
                s.synchronize()
            ts.append(timed(lambda: direct(src)))
            t = time.perf_counter()
            ok = int(src[:: 4096].sum()) == int(base[:: 4096].sum())  # a touch a page: migrates back
            back.append(1e3 * (time.perf_counter() - t))
            assert ok
        report(label, ts)
        print(f"   then the CPU touching each page again: median {float(np.median(back)):.3f} ms")
    ts, back = [], []
    for _ in range(args.reps):
        src = base.copy()

        def pf():
            prefetch(src.ctypes.data, nbytes, dev.ordinal, s)
            direct(src)
        ts.append(timed(pf))
        t = time.perf_counter()
        assert int(src[:: 4096].sum()) == int(base[:: 4096].sum())
        back.append(1e3 * (time.perf_counter() - t))
    report("cuMemPrefetchAsync to the device + the copy kernel", ts)
    print(f"   then the CPU touching each page again: median {float(np.median(back)):.3f} ms")
    got = np.empty(16, np.uint8)
    check(d.cuMemcpyDtoH(got.ctypes.data, alloc.ptr, 16), "cuMemcpyDtoH")
    print("device copy matches the source:", bool((got == base[:16]).all()))


if __name__ == "__main__":
    main()

"""Where the time of a NumPy call goes on this machine: host memcpy into pinned memory (1 and N
threads; pageable to pageable as the control), page-locking the caller's own array in place
(cuMemHostRegister), and H2D from pinned, registered and pageable memory (the driver's pageable
copies also a slice a thread, 1-16 threads on streams of their own); staging into write-combined
pinned memory, alone and under DMA; a NumPy attention call with cached and write-combined staging
buffers (A/B/A/B). Decided how ``pyattn.pipeline`` moves NumPy data."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cuda.bindings import driver as d

import pyattn
from pyattn.pipeline.transfer import split_range
from pyattn.runtime.errors import check
from pyattn.runtime.memory import get_pool
from pyattn.runtime.pinned import PinnedBuffer


def ms(f, n=5):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def copy_in_threads(ex, dst, src, cuts):
    """Copy ``src`` into ``dst`` (1-D, same size), a byte range of ``cuts`` a task on ``ex``."""
    list(ex.map(lambda c: np.copyto(dst[c[0]:c[1]], src[c[0]:c[1]]), cuts))


def copy_rates(label, dst, src, counts):
    """Print the rate of ``copy_in_threads`` on each thread count of ``counts``."""
    for workers in counts:
        with ThreadPoolExecutor(workers) as ex:
            cuts = split_range(src.nbytes, workers)
            t = ms(lambda: copy_in_threads(ex, dst, src, cuts))
        print(f"memcpy {label} {workers} threads: {t:.2f} ms = {src.nbytes / t / 1e6:.1f} GB/s")


def main():
    dev = pyattn.get_device()
    dev.activate()
    s = pyattn.Stream()
    nbytes = 3 * 16 << 20  # q, k, v of (1, 4096, 16, 128) fp16
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    pin = PinnedBuffer(nbytes)
    dst = pin.array(np.uint8, (nbytes,))
    gb = nbytes / 1e9
    t = ms(lambda: np.copyto(dst, src))
    print(f"memcpy pageable->pinned 1 thread: {t:.2f} ms = {gb / t * 1e3:.1f} GB/s")
    copy_rates("pageable->pinned", dst, src, (4, 8, 16))
    # the host's own copy rate, as a control: pageable to pageable (both faulted in), same threads
    copy_rates("pageable->pageable", np.empty_like(src), src, (1, 4, 8, 16))
    alloc = get_pool(dev).allocate(nbytes, s)
    staging_under_dma(dev, src, nbytes, alloc)

    def h2d(ptr):
        check(d.cuMemcpyHtoDAsync(alloc.ptr, ptr, nbytes, s.handle), "cuMemcpyHtoDAsync")
        s.synchronize()
    t = ms(lambda: h2d(pin.ptr))
    print(f"H2D from pinned: {t:.2f} ms = {gb / t * 1e3:.1f} GB/s")
    t = ms(lambda: h2d(src.ctypes.data))
    print(f"H2D from pageable (driver staging): {t:.2f} ms = {gb / t * 1e3:.1f} GB/s")
    pageable_threads(src, alloc)
    for flags in (0,):
        def reg():
            check(d.cuMemHostRegister(src.ctypes.data, nbytes, flags), "cuMemHostRegister")

        def unreg():
            check(d.cuMemHostUnregister(src.ctypes.data), "cuMemHostUnregister")
        t0 = time.perf_counter(); reg(); t1 = time.perf_counter()
        t = ms(lambda: h2d(src.ctypes.data))
        t2 = time.perf_counter(); unreg(); t3 = time.perf_counter()
        print(f"cuMemHostRegister {nbytes >> 20} MiB: {1e3 * (t1 - t0):.2f} ms, unregister {1e3 * (t3 - t2):.2f} ms; "
              f"H2D from registered: {t:.2f} ms = {gb / t * 1e3:.1f} GB/s")
        ts = []
        for _ in range(3):
            a = time.perf_counter(); reg(); unreg(); ts.append(time.perf_counter() - a)
        print(f"register+unregister again: {1e3 * np.median(ts):.2f} ms")
    q = np.random.default_rng(1).standard_normal((1, 4096, 16, 128)).astype(np.float16)
    from pyattn.runtime.pinned import get_staging
    pool = get_staging(dev)
    for wc in (False, True, False, True):  # A/B/A/B: the staging pool's buffers cached or write-combined
        pool.write_combined = wc
        t = ms(lambda: pyattn.attention(q, q, q), n=9)
        print(f"pyattn.attention(numpy), staging write-combined={wc}: {t:.2f} ms")


def pageable_threads(src, alloc):
    """The driver's pageable H2D of ``src`` and D2H of 16 MiB into NumPy memory, a slice a thread
    (1-16), each on a stream of its own: does the driver's own staging scale with threads?"""
    out = np.empty(16 << 20, np.uint8)
    streams = [pyattn.Stream() for _ in range(16)]
    for h2d in (True, False):
        buf = src if h2d else out
        for n in (1, 2, 4, 8, 16):
            cuts = split_range(buf.nbytes, n)

            def one(i):
                (a, b), st = cuts[i], streams[i].handle
                if h2d:
                    check(d.cuMemcpyHtoDAsync(alloc.ptr + a, buf.ctypes.data + a, b - a, st), "cuMemcpyHtoDAsync")
                else:
                    check(d.cuMemcpyDtoHAsync(buf.ctypes.data + a, alloc.ptr + a, b - a, st), "cuMemcpyDtoHAsync")
                streams[i].synchronize()
            with ThreadPoolExecutor(n) as ex:
                t = ms(lambda: list(ex.map(one, range(n))))
            print(f"{'H2D from' if h2d else 'D2H into'} pageable {buf.nbytes >> 20} MiB, {n} threads: {t:.2f} ms = "
                  f"{buf.nbytes / t / 1e6:.1f} GB/s")


def staging_under_dma(dev, src, nbytes, alloc):
    """8-thread staging of ``src`` into cached and write-combined pinned memory, alone and while
    the DMA engine reads another pinned buffer (as a pipelined NumPy call does), and H2D from each."""
    s2 = pyattn.Stream()
    other = PinnedBuffer(nbytes)
    gb = nbytes / 1e9
    ex = ThreadPoolExecutor(8)
    cuts = split_range(nbytes, 8)
    for wc in (False, True):
        dst_buf = PinnedBuffer(nbytes, write_combined=wc)
        dst = dst_buf.array(np.uint8, (nbytes,))

        def par():
            copy_in_threads(ex, dst, src, cuts)
        alone = ms(par)

        def busy():  # queue ~8 H2D copies of 48 MiB from the other buffer, stage meanwhile
            for _ in range(8):
                check(d.cuMemcpyHtoDAsync(alloc.ptr, other.ptr, nbytes, s2.handle), "cuMemcpyHtoDAsync")
            t = time.perf_counter()
            par()
            dt = time.perf_counter() - t
            s2.synchronize()
            return dt
        under = 1e3 * float(np.median([busy() for _ in range(5)]))

        def h2d():
            check(d.cuMemcpyHtoDAsync(alloc.ptr, dst_buf.ptr, nbytes, s2.handle), "cuMemcpyHtoDAsync")
            s2.synchronize()
        t = ms(h2d)
        print(f"staging 8 threads into {'write-combined' if wc else 'cached'} pinned memory: alone {alone:.2f} ms "
              f"({gb / alone * 1e3:.1f} GB/s), under DMA {under:.2f} ms ({gb / under * 1e3:.1f} GB/s); "
              f"H2D from it {t:.2f} ms ({gb / t * 1e3:.1f} GB/s)")
    ex.shutdown()


if __name__ == "__main__":
    main()

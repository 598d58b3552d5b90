"""Dev probe: ways to stage 48 MiB of NumPy data into pinned memory and send it to the GPU.

A: workers copy 2 MiB pieces and each issues its piece's H2D; B: workers only copy, the main thread
issues one H2D per 8 MiB as the pieces complete in order; C: as B with a sender thread; plus the
per-call time of cuMemcpyHtoDAsync in A (does the async copy block?).
"""
import queue, threading, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from cuda.bindings import driver as drv
import pyattn
from pyattn.runtime.pinned import PinnedBuffer
dev = pyattn.get_device(); dev.activate()
s = pyattn.Stream()
N = 48 << 20
src = np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8)
pin = PinnedBuffer(N); stg = pin.array(np.uint8, (N,))
dbuf = pyattn.empty((N,), np.uint8)
ex = ThreadPoolExecutor(8)
P = 2 << 20
pieces = [(a, min(a + P, N)) for a in range(0, N, P)]
def med(fn, n=9):
    fn(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e3)
    return round(float(np.median(ts)), 3)
def floor():
    drv.cuMemcpyHtoDAsync(dbuf.ptr, pin.ptr, N, s.handle); s.synchronize()
print("H2D floor 48MiB ms", med(floor))
def stage_only():
    fs = [ex.submit(lambda sh=pieces[i::8]: [np.copyto(stg[a:b], src[a:b]) for a, b in sh]) for i in range(8)]
    for f in fs: f.result()
print("staging only ms", med(stage_only))
lat = []
def A():
    def w(sh):
        dev.activate()
        for a, b in sh:
            np.copyto(stg[a:b], src[a:b])
            t = time.perf_counter(); drv.cuMemcpyHtoDAsync(dbuf.ptr + a, pin.ptr + a, b - a, s.handle); lat.append(time.perf_counter() - t)
    fs = [ex.submit(w, pieces[i::8]) for i in range(8)]
    for f in fs: f.result()
    s.synchronize()
print("A workers copy+H2D ms", med(A), " H2D call us median/max", round(np.median(lat) * 1e6, 1), round(max(lat) * 1e6, 1))
def B(seg=8 << 20):
    futs = [ex.submit(np.copyto, stg[a:b], src[a:b]) for a, b in pieces]
    done = 0
    per = seg // P
    for i in range(0, len(futs), per):
        for f in futs[i:i + per]: f.result()
        end = pieces[min(i + per, len(pieces)) - 1][1]
        drv.cuMemcpyHtoDAsync(dbuf.ptr + done, pin.ptr + done, end - done, s.handle); done = end
    s.synchronize()
print("B workers copy, main H2D per 8 MiB ms", med(B), " per 4 MiB", med(lambda: B(4 << 20)), " per 16 MiB", med(lambda: B(16 << 20)))
def C():
    q = queue.Queue()
    def sender():
        dev.activate(); done = 0
        while True:
            item = q.get()
            if item is None: return
            a, b = item
            drv.cuMemcpyHtoDAsync(dbuf.ptr + a, pin.ptr + a, b - a, s.handle)
    th = threading.Thread(target=sender); th.start()
    futs = [ex.submit(np.copyto, stg[a:b], src[a:b]) for a, b in pieces]
    for f, p in zip(futs, pieces):
        f.result(); q.put(p)
    q.put(None); th.join(); s.synchronize()
print("C sender thread ms", med(C))
lat.clear()
def A1():  # one worker H2D per 8 MiB: each worker copies 4 contiguous pieces then sends them as one
    groups = [pieces[i:i + 4] for i in range(0, len(pieces), 4)]
    def w(gs):
        dev.activate()
        for g in gs:
            for a, b in g:
                np.copyto(stg[a:b], src[a:b])
            a, b = g[0][0], g[-1][1]
            t = time.perf_counter(); drv.cuMemcpyHtoDAsync(dbuf.ptr + a, pin.ptr + a, b - a, s.handle); lat.append(time.perf_counter() - t)
    fs = [ex.submit(w, groups[i::6]) for i in range(6)]
    for f in fs: f.result()
    s.synchronize()
print("A1 6 workers, 8 MiB each copy+H2D ms", med(A1), " H2D call us median/max", round(np.median(lat) * 1e6, 1), round(max(lat) * 1e6, 1))
lat.clear()
wstreams = [pyattn.Stream() for _ in range(8)]
def A_streams():
    def w(sh, st):
        dev.activate()
        for a, b in sh:
            np.copyto(stg[a:b], src[a:b])
            t = time.perf_counter(); drv.cuMemcpyHtoDAsync(dbuf.ptr + a, pin.ptr + a, b - a, st.handle); lat.append(time.perf_counter() - t)
    fs = [ex.submit(w, pieces[i::8], wstreams[i]) for i in range(8)]
    for f in fs: f.result()
    for st in wstreams: st.synchronize()
print("A' per-worker streams ms", med(A_streams), " H2D call us median/max", round(np.median(lat) * 1e6, 1), round(max(lat) * 1e6, 1))
lat.clear()
def h2d_alone():
    for a, b in pieces:
        t = time.perf_counter(); drv.cuMemcpyHtoDAsync(dbuf.ptr + a, pin.ptr + a, b - a, s.handle); lat.append(time.perf_counter() - t)
    s.synchronize()
print("H2D calls alone, one thread, 2 MiB each: ms", med(h2d_alone), " call us median/max", round(np.median(lat) * 1e6, 1), round(max(lat) * 1e6, 1))

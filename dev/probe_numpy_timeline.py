"""Dev probe: the timeline of one NumPy ``attention`` call, (1, 4096, 16, 128) fp16 (issue 11).

Usage: PYTHONPATH=. python dev/probe_numpy_timeline.py [--causal] [--pinned] [--ab ROUNDS] [--piece-mib N]

Prints, in ms from the call's start: each staging piece's host copy (thread, start, end, GB/s)
and its H2D issue, the calling thread's own H2D copies (pinned pieces); each chunk's launch (host time, and GPU start/end of its kernel and its result
copy from timing events); the call's end. Then the bounds of the same run: pinned H2D of 48 MiB and
D2H of 16 MiB alone and together (full duplex), and 48 MiB staged by the workers with and without
a DMA reading host memory at the same time; and a cProfile of the calling thread. ``--ab N``
first times the upload's two orderings (``host._SIGNALS``: flags the workers set, or each worker
queueing its own copy) and piece sizes against each other, N alternating rounds, and the floor;
``--piece-mib N`` takes the timeline at pieces of N MiB.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import pyattn
import pyattn.pipeline.chunks as C
import pyattn.pipeline.host as H
import pyattn.pipeline.transfer as TR
from pyattn.runtime.pinned import PinnedBuffer

T = time.perf_counter


def med(fn, n=7):
    fn()
    ts = []
    for _ in range(n):
        t = T()
        fn()
        ts.append((T() - t) * 1e3)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pinned", action="store_true", help="q, k, v in pinned_empty arrays (sent in place)")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="time the upload variants first")
    ap.add_argument("--variants", default="w4,f4,f2,f1", help="--ab's variants: w (workers send) or f (flags), "
                    "then the piece size in MiB")
    ap.add_argument("--piece-mib", type=int, default=0, help="the timeline with pieces of this many MiB")
    ap.add_argument("--ab-only", action="store_true", help="stop after --ab (A/B runs of two source trees)")
    a = ap.parse_args()
    dev = pyattn.get_device()
    dev.activate()
    q, k, v = (np.random.default_rng(i).standard_normal((1, 4096, 16, 128)).astype(np.float16) for i in range(3))
    if a.pinned:
        pinned = [pyattn.pinned_empty(x.shape, x.dtype) for x in (q, k, v)]
        for d, x in zip(pinned, (q, k, v)):
            d[...] = x
        q, k, v = pinned
    call = lambda: pyattn.attention(q, k, v, causal=a.causal)  # noqa: E731
    if a.ab:
        ab(call, a.ab, a.variants.split(","))
        if a.ab_only:
            return
    TR.PIECE_BYTES = a.piece_mib << 20 or TR.PIECE_BYTES
    print(f"uninstrumented call (signals {H._SIGNALS}, pieces {TR.PIECE_BYTES >> 20} MiB): median "
          f"{med(call, 9):.3f} ms")

    pieces, launches, h2ds = [], [], []
    orig_send, orig_stage, orig_launch, orig_h2d = H._send, H._stage, C._Call._launch, H.h2d

    def send(device, dst, src, stage_ptr, dev_ptr, n, s):
        device.activate()
        t0 = T()
        TR.copy_into(dst, src)
        t1 = T()
        orig_h2d(dev_ptr, stage_ptr, n, s)
        pieces.append((threading.get_ident() % 1000, t0, t1, T(), n))

    def stage(dst, src, flags, i):  # the flag path: "h2d issued" reads as the flag's time
        t0 = T()
        TR.copy_into(dst, src)
        t1 = T()
        orig_stage(dst[:0], src[:0], flags, i)
        pieces.append((threading.get_ident() % 1000, t0, t1, T(), dst.nbytes))

    def h2d(dev_ptr, src_ptr, n, s):  # the calling thread's own H2D copies (pinned pieces, small uploads)
        t = T()
        orig_h2d(dev_ptr, src_ptr, n, s)
        h2ds.append((T(), n, t))

    def launch(self, i, devs, shared, width):
        st = self.streams[i % len(self.streams)]
        e0 = st.record(timing=True)
        t = T()
        orig_launch(self, i, devs, shared, width)
        launches.append((i, t, T(), e0, st.record(timing=True)))

    H._send, H._stage, C._Call._launch, H.h2d = send, stage, launch, h2d
    call()
    pieces.clear(), launches.clear(), h2ds.clear()
    s0 = pyattn.Stream()
    start = s0.record(timing=True)
    t0 = T()
    call()
    t_end = T()
    H._send, H._stage, C._Call._launch, H.h2d = orig_send, orig_stage, orig_launch, orig_h2d
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    print(f"instrumented call: {ms(t_end):.3f} ms; {len(pieces)} staged pieces, {len(h2ds)} H2D copies by the "
          f"calling thread, {len(launches)} chunks")
    for tid, a0, a1, a2, n in sorted(pieces, key=lambda p: p[1]):
        print(f"  piece thr {tid:3d} copy {ms(a0):7.3f}-{ms(a1):7.3f} ({n / (a1 - a0) / 1e9:5.1f} GB/s) "
              f"h2d issued {ms(a2):7.3f}")
    if h2ds:
        print(f"  calling thread's H2D copies issued {ms(h2ds[0][0]):7.3f} .. {ms(h2ds[-1][0]):7.3f} "
              f"({sum(h[1] for h in h2ds) / 2**20:.0f} MiB); calls took "
              + ", ".join(f"{(h[0] - h[2]) * 1e6:.0f}" for h in h2ds) + " us")
    for i, h0, h1, e0, e1 in launches:
        print(f"  chunk {i}: host launch {ms(h0):7.3f}-{ms(h1):7.3f}; GPU (from the start event, "
              f"same clock only roughly) queued-start {start.elapsed_ms(e0):7.3f} end of kernel+D2H {start.elapsed_ms(e1):7.3f}")

    # The set-up before the first copy: each step's start and duration, one call.
    import pyattn.ops.attention as OA
    from pyattn.runtime import memory as M
    stamps, undo = [], []

    def wrap(mod, name):
        f = getattr(mod, name)

        def w(*args, **kw):
            t = T()
            r = f(*args, **kw)
            stamps.append((name, t, T()))
            return r
        setattr(mod, name, w)
        undo.append((mod, name, f))
    for mod, name in ((C, "pinned_empty"), (C, "plan_chunks"), (H, "_plan_pieces"), (H, "_waves"), (H, "get_pool"),
                      (H, "get_staging"), (OA, "read_args"), (OA, "signature"), (C, "attention_numpy"),
                      (H, "_upload_signalled"), (H, "upload"), (C, "get_device"), (C, "per_device"),
                      (H, "executor")):
        wrap(mod, name)
    M.DevicePool.allocate, real_alloc = (lambda self, *a, _f=M.DevicePool.allocate, **k: (
        stamps.append(("DevicePool.allocate", T(), None)) or _f(self, *a, **k))), M.DevicePool.allocate
    from pyattn.runtime import pinned as PN
    PN.StagingPool.acquire, real_acq = (lambda self, *a, _f=PN.StagingPool.acquire: (
        stamps.append(("StagingPool.acquire", T(), None)) or _f(self, *a))), PN.StagingPool.acquire
    call()
    stamps.clear()
    t0 = T()
    call()
    for name, a0, a1 in stamps:
        print(f"  {name:22} start {(a0 - t0) * 1e3:7.3f} ms" + (f", {(a1 - a0) * 1e3:7.3f} ms" if a1 else ""))
    for mod, name, f in undo:
        setattr(mod, name, f)
    M.DevicePool.allocate = real_alloc
    PN.StagingPool.acquire = real_acq

    import cProfile
    import pstats

    pr = cProfile.Profile()  # the calling thread only (the workers are not profiled)
    pr.enable()
    for _ in range(5):
        call()
    pr.disable()
    print("== cProfile of 5 calls, the calling thread (tottime)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)

    # bounds
    N_IN, N_OUT = 48 << 20, 16 << 20
    pin_in, pin_out = PinnedBuffer(N_IN), PinnedBuffer(N_OUT)
    d_in, d_out = pyattn.empty((N_IN,), np.uint8), pyattn.empty((N_OUT,), np.uint8)
    s1, s2 = pyattn.Stream(), pyattn.Stream()
    from cuda.bindings import driver as drv

    def h2d():
        drv.cuMemcpyHtoDAsync(d_in.ptr, pin_in.ptr, N_IN, s1.handle)
        s1.synchronize()

    def d2h():
        drv.cuMemcpyDtoHAsync(pin_out.ptr, d_out.ptr, N_OUT, s2.handle)
        s2.synchronize()

    def both():
        drv.cuMemcpyHtoDAsync(d_in.ptr, pin_in.ptr, N_IN, s1.handle)
        drv.cuMemcpyDtoHAsync(pin_out.ptr, d_out.ptr, N_OUT, s2.handle)
        s1.synchronize()
        s2.synchronize()
    print(f"bounds: H2D 48 MiB {med(h2d):.3f} ms, D2H 16 MiB {med(d2h):.3f} ms, both at once {med(both):.3f} ms")
    src = np.random.default_rng(0).integers(0, 255, N_IN, dtype=np.uint8)
    stg = pin_in.array(np.uint8, (N_IN,))
    ex, workers = TR.executor()
    parts = TR.split_range(N_IN, 12)

    def stage():
        TR.finish_copies([ex.submit(TR.copy_into, stg[x:y], src[x:y]) for x, y in parts])
    print(f"staging 48 MiB on {workers} workers: {med(stage):.3f} ms")
    big = PinnedBuffer(256 << 20)
    dbig = pyattn.empty((256 << 20,), np.uint8)

    def stage_under_dma():
        drv.cuMemcpyHtoDAsync(dbig.ptr, big.ptr, 256 << 20, s1.handle)  # ~5 ms of DMA reading host memory
        t = T()
        stage()
        dt = T() - t
        s1.synchronize()
        return dt
    stage_under_dma()
    print(f"staging 48 MiB under a DMA: {np.median([stage_under_dma() for _ in range(5)]) * 1e3:.3f} ms")


def ab(call, rounds, names):
    """The upload variants in alternating rounds (median of 5 calls each), against the floor."""
    from pyattn.runtime.pinned import PinnedBuffer as PB

    from cuda.bindings import driver as drv
    n_in, n_out = 48 << 20, 16 << 20
    pin_in, pin_out = PB(n_in), PB(n_out)
    d_in, d_out = pyattn.empty((n_in,), np.uint8), pyattn.empty((n_out,), np.uint8)
    st = pyattn.Stream()

    def floor():
        drv.cuMemcpyHtoDAsync(d_in.ptr, pin_in.ptr, n_in, st.handle)
        drv.cuMemcpyDtoHAsync(pin_out.ptr, d_out.ptr, n_out, st.handle)
        st.synchronize()
    variants = {f"{'flags' if n[0] == 'f' else 'workers send'}, {n[1:]} MiB": (n[0] == "f", int(n[1:]) << 20)
                for n in names}
    keep = H._SIGNALS, TR.PIECE_BYTES
    times = {name: [] for name in variants}
    fl = []
    for _ in range(rounds):
        fl.append(med(floor, 5))
        for name, (sig, piece) in variants.items():
            H._SIGNALS, TR.PIECE_BYTES = sig, piece
            times[name].append(med(call, 5))
    H._SIGNALS, TR.PIECE_BYTES = keep
    f = float(np.median(fl))
    print(f"A/B, {rounds} alternating rounds, median of 5 calls each; floor (pinned H2D 48 MiB then D2H 16 MiB) "
          f"{f:.3f} ms")
    for name, ts in times.items():
        print(f"  {name:22} {min(ts):.3f}-{max(ts):.3f} ms, median {np.median(ts):.3f} = "
              f"{np.median(ts) / f:.2f}x the floor")


if __name__ == "__main__":
    main()

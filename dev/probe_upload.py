"""Dev probe: where the time of a NumPy attention call's upload goes (per-piece copy and H2D times)."""
import time, threading
import numpy as np
import pyattn
import pyattn.pipeline.host as H
q, k, v = (np.random.default_rng(i).standard_normal((1, 4096, 16, 128)).astype(np.float16) for i in range(3))
for _ in range(3): pyattn.attention(q, k, v)
rec = []
orig_send = H._send
def send(device, pieces, stage_ptr, dev_ptr, s):
    device.activate()
    for dst, src, so, do, n in pieces:
        t0 = time.perf_counter(); H._copy(dst, src); t1 = time.perf_counter()
        H.h2d(dev_ptr + do, stage_ptr + so, n, s); t2 = time.perf_counter()
        rec.append((threading.get_ident(), t0, t1, t2, n))
H._send = send
for piece in (2 << 20, 6 << 20):
    H._PIECE_BYTES = piece
    for _ in range(2): pyattn.attention(q, k, v)
    rec.clear()
    t0 = time.perf_counter(); pyattn.attention(q, k, v); t1 = time.perf_counter()
    print(f"piece {piece >> 20} MiB: total {1e3 * (t1 - t0):.3f} ms; first copy starts {1e3 * (min(r[1] for r in rec) - t0):.3f}, "
          f"last H2D issued {1e3 * (max(r[3] for r in rec) - t0):.3f}")
    cp = [(r[2] - r[1]) * 1e6 for r in rec]; hd = [(r[3] - r[2]) * 1e6 for r in rec]
    print(f"   copy us/piece median {np.median(cp):.0f} max {max(cp):.0f} (GB/s per thread {np.median([r[4] / (r[2] - r[1]) / 1e9 for r in rec]):.1f});"
          f" H2D call us median {np.median(hd):.0f} max {max(hd):.0f}; pieces {len(rec)}")
    ts = []
    for _ in range(7):
        a = time.perf_counter(); pyattn.attention(q, k, v); ts.append(time.perf_counter() - a)
    print(f"   median total {1e3 * np.median(ts):.3f} ms")
H._send = orig_send
for piece in (2 << 20, 6 << 20):
    H._PIECE_BYTES = piece
    ts = []
    for _ in range(9):
        a = time.perf_counter(); pyattn.attention(q, k, v); ts.append(time.perf_counter() - a)
    print(f"uninstrumented piece {piece >> 20} MiB: median {1e3 * np.median(ts):.3f} ms")
# set-up time before the first copy: stamps of the steps
import pyattn.pipeline.chunks as C, pyattn.runtime.memory as M, pyattn.ops.attention as OA
H._PIECE_BYTES = 4 << 20
stamps = []
def wrap(mod, name):
    f = getattr(mod, name)
    def w(*a, **kw):
        t = time.perf_counter(); r = f(*a, **kw); stamps.append((name, t, time.perf_counter())); return r
    setattr(mod, name, w)
for m, n in ((C, "pinned_empty"), (C, "plan_chunks"), (C, "prepare_mask"), (H, "_plan_pieces"), (H, "_waves"),
             (H, "get_pool"), (H, "get_staging"), (OA, "make_problem"), (C, "attention_numpy"), (H, "_upload_waves")):
    wrap(m, n)
pyattn.attention(q, k, v); stamps.clear()
t0 = time.perf_counter(); pyattn.attention(q, k, v)
for name, a, b in stamps:
    print(f"  {name:16} start {1e3 * (a - t0):7.3f} dur {1e3 * (b - a):7.3f}")

"""Whether bench_boundary's tiny calls are host- or GPU-bound: for the tiny attention (1, 16, 2, 64) fp16
and the tiny decode (2 x 256 bf16 tokens, GQA 8/2, D 64), host submit time per call (a short loop, no
sync, the launch queue far from full) against GPU time per call (events around a long loop), with the
GPU's clocks raised first by a busy matmul loop, then left idle; an empty CuPy kernel's launch rate as
the floor; each call's kernels (grid, block, shared bytes).

Usage: PYTHONPATH=. python dev/probe_tiny_gpu.py
"""
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.runtime.stream import Event  # noqa: E402


def clocks():
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


def heat():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(60):
        a @ a
    torch.cuda.synchronize()


def measure(name, fn, s, dev):
    for _ in range(50):
        fn()
    dev.synchronize()
    t = time.perf_counter()
    for _ in range(100):
        fn()
    host = (time.perf_counter() - t) / 100 * 1e6
    dev.synchronize()
    e0, e1 = Event(dev, timing=True), Event(dev, timing=True)
    s.record(e0)
    for _ in range(2000):
        fn()
    s.record(e1)
    e1.synchronize()
    gpu = e0.elapsed_ms(e1) / 2000 * 1e3
    t = time.perf_counter()
    for _ in range(2000):
        fn()
    dev.synchronize()
    wall = (time.perf_counter() - t) / 2000 * 1e3 * 1e3
    print(f"{name:34} host submit {host:6.2f} us | GPU {gpu:6.2f} us | loop + sync {wall:6.2f} us | clocks {clocks()}")


def main():
    dev = pyattn.get_device()
    from pyattn.runtime.stream import default_stream
    s = default_stream(dev)
    rng = np.random.default_rng(0)
    d = pyattn.asarray(rng.standard_normal((1, 16, 2, 64)).astype(np.float16))
    cache, ids, hq = harness.tiny_decode(rng)
    qd = pyattn.asarray(hq)
    import cupy
    empty = cupy.RawKernel('extern "C" __global__ void e() {}', "e")
    cs = cupy.cuda.ExternalStream(s.ptr)

    def launch_empty():
        with cs:
            empty((1,), (32,), ())

    from pyattn.runtime import launch as L
    seen = []
    real = L.launch

    def spy(kernel, grid, block, smem, st, params):
        seen.append((getattr(kernel, "name", "?"), grid, block, smem))
        return real(kernel, grid, block, smem, st, params)

    for tag, fn in (("attention", lambda: pyattn.attention(d, d, d)), ("decode", lambda: pyattn.decode(qd, cache, ids))):
        fn()
        import pyattn.ops._fwd as F, pyattn.ops._decode as Dd
        F.launch, Dd.launch = spy, spy
        seen.clear()
        fn()
        F.launch, Dd.launch = real, real
        print(tag, "launches:", seen)
    dev.synchronize()
    for phase in ("idle clocks", "after a busy matmul loop"):
        if phase != "idle clocks":
            heat()
        print("==", phase, clocks())
        measure("empty CuPy kernel", launch_empty, s, dev)
        measure("attention DeviceArray (1,16,2,64)", lambda: pyattn.attention(d, d, d), s, dev)
        measure("decode DeviceArray q (2 x 256)", lambda: pyattn.decode(qd, cache, ids), s, dev)
        for n in (1, 2, 4):
            measure(f"decode num_splits={n}", lambda: pyattn.decode(qd, cache, ids, num_splits=n), s, dev)


if __name__ == "__main__":
    main()

"""Dev probe (GPU): which stream-ordered frees the driver takes while torch captures a CUDA graph on
another stream (torch.cuda.graph's default global capture mode), with this thread's capture mode
left global or exchanged to relaxed (``cuThreadExchangeStreamCaptureMode``), as
``pyattn.runtime.memory._free_async`` does.

    PYTHONPATH=. python dev/probe_capture_frees.py

Per case: the free's CUresult, and whether the capture around it still ended and replayed. Cases: a
block of pyattn's pool allocated eagerly, and a block allocated in an earlier capture (a graph's
own), each freed on its own stream, which does not capture.
"""

from __future__ import annotations

import torch
from cuda.bindings import driver

import pyattn
from pyattn.runtime.memory import get_pool


def main() -> None:
    dev = pyattn.get_device()
    pool, other = get_pool(dev), pyattn.Stream(dev)
    side = torch.cuda.Stream()

    def graph_block():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            block = pool.allocate(1 << 20, pyattn.Stream(dev, handle=side.cuda_stream))
        ptr, block.ptr = block.ptr, 0  # (freed by hand below)
        return ptr, side.cuda_stream, g

    for kind in ("eager block", "graph block"):
        for relaxed in (False, True):
            if kind == "eager block":
                block = pool.allocate(1 << 20, other)
                ptr, handle, keep = block.ptr, other.handle, None
                block.ptr = 0
            else:
                ptr, handle, keep = graph_block()
            torch.cuda.synchronize()
            s, g, x = torch.cuda.Stream(), torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
            res = None
            try:
                with torch.cuda.graph(g, stream=s):
                    x += 1
                    if relaxed:
                        mode = driver.cuThreadExchangeStreamCaptureMode(
                            driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)[1]
                    res = driver.cuMemFreeAsync(driver.CUdeviceptr(ptr), driver.CUstream(int(handle)))[0]
                    if relaxed:
                        driver.cuThreadExchangeStreamCaptureMode(mode)
                    x += 1
                g.replay()
                torch.cuda.synchronize()
                print(f"{kind:12s} relaxed={relaxed!s:5s} free -> {res.name}; capture ended, replayed: x = {x.item()}")
            except Exception as exc:  # noqa: BLE001
                print(f"{kind:12s} relaxed={relaxed!s:5s} free -> {getattr(res, 'name', res)}; capture failed: "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                torch.cuda.synchronize()
            del keep


if __name__ == "__main__":
    main()

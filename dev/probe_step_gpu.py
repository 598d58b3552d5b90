"""Dev probe (GPU): the GPU time of a serving step, one token appended to every sequence then a
decode, on a bf16 ``PagedKVCache`` (page 16, GQA 32 / 8, D 128, 1k-token prefixes), torch tensors
in and out on the harness's stream: back to back, and behind a torch op (a model kernel before the
append, as in a layer), with the op's own time taken off.

    PYTHONPATH=. python dev/probe_step_gpu.py [--batches 1,8,64]

The harness's pre-roll (``harness.Bench.gpu_ms``) keeps host gaps out, but only for loops of at most
``Mailbox.SLOTS`` (8) steps: an append takes a pinned mailbox slot whose reuse waits for the kernel
that read it, so a longer loop blocks the host on a GPU still held by the pre-roll, and the figure
becomes the host's. (``dev/probe_decode_step.py``'s "GPU-side" column times a loop with no pre-roll:
on these sizes it is host time.)
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "scripts")
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.runtime.mailbox import Mailbox  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    args = ap.parse_args()
    bench = harness.Bench(torch)
    s = bench.stream
    loop = Mailbox.SLOTS - 2
    for B in (int(b) for b in args.batches.split(",")):
        cache = pyattn.PagedKVCache(B * 700 + 64, 16, 8, 128, "bfloat16")  # room for the prefix and every step
        ids = [cache.add_sequence() for _ in range(B)]
        kv = torch.randn(B, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
        cache.append(ids, kv, kv, stream=s)
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(B, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4096, device="cuda")

        def step():
            cache.append(ids, kn, kn, stream=s)
            return pyattn.decode(q, cache, ids, stream=s)

        def model_step():
            x.mul_(1.0)
            return step()

        bench.unheld.clear()
        us = {name: bench.gpu_ms(fn, loop=loop, reps=25, label=name).ms * 1e3
              for name, fn in (("step", step), ("op", lambda: x.mul_(1.0)), ("op + step", model_step))}
        held = "" if not bench.unheld else f" (pre-roll not held: {bench.unheld})"
        print(f"B={B:3d}: step (append + decode) {us['step']:6.1f} us | behind a torch op "
              f"{us['op + step'] - us['op']:6.1f} us (the op alone {us['op']:4.1f}){held}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

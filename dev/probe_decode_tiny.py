"""The tiny decode of scripts/bench_boundary.py (2 sequences x 256 bf16 tokens, GQA 8/2, D 64): wall
time per call of a Python loop against the kernel's GPU time, at num_splits 1, 2 (the automatic
choice there) and 4, so a host-time figure can be told from a GPU-bound loop.

Usage: PYTHONPATH=. python dev/probe_decode_tiny.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402


def main() -> None:
    bench = harness.open_bench()
    rng = np.random.default_rng(0)
    cache, ids, hq = harness.tiny_decode(rng)
    q = pyattn.asarray(hq)
    for splits in (None, 1, 2, 4):
        fn = lambda: pyattn.decode(q, cache, ids, num_splits=splits, stream=bench.stream)  # noqa: E731
        wall = bench.wall_ms(fn, loop=200, reps=5) * 1e3
        gpu = bench.gpu_ms(fn, loop=50, reps=5).ms * 1e3
        print(f"num_splits={splits}: wall {wall:.1f} us per call, GPU {gpu:.1f} us per call")


if __name__ == "__main__":
    main()

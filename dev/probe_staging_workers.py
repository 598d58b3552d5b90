"""How many staging workers a NumPy call should have (issue 11): ``pyattn.attention`` on NumPy
(1, 4096, 16, 128) fp16 with each worker count's executor in turn, alternating rounds in one process.

Alone, more threads stage faster (``dev/probe_host_copy.py``); inside a call the workers share the
GIL with the calling thread, which queues the device side while they copy. Each round times 7
calls a count (median) after one untimed call; the printout gives every round and in how many
rounds the second count beat the first. Decided ``pipeline.transfer.executor``'s count.

``--out`` passes a NumPy ``out=`` (the result's last copy, into pageable memory, also runs on the
workers while the calling thread waits).

Usage: PYTHONPATH=. python dev/probe_staging_workers.py [--workers 8,4] [--rounds 12] [--causal] [--out]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import pyattn
import pyattn.pipeline.transfer as TR
from pyattn.runtime._resource import STAGING_THREADS, register_staging_thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="8,4", help="worker counts, timed in this order each round")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", action="store_true", help="pass a NumPy out= array")
    args = ap.parse_args()
    pyattn.get_device().activate()
    q, k, v = (np.random.default_rng(i).standard_normal((1, 4096, 16, 128)).astype(np.float16) for i in range(3))
    out = np.empty_like(q) if args.out else None
    call = lambda: pyattn.attention(q, k, v, causal=args.causal, out=out)  # noqa: E731
    call()
    counts = [int(x) for x in args.workers.split(",")]
    pools = {n: (ThreadPoolExecutor(n, thread_name_prefix=STAGING_THREADS, initializer=register_staging_thread), n)
             for n in counts}
    keep, res = TR._executor, {n: [] for n in counts}
    try:
        for _ in range(args.rounds):
            for n in counts:
                TR._executor = pools[n]
                call()
                ts = []
                for _ in range(7):
                    t = time.perf_counter()
                    call()
                    ts.append(time.perf_counter() - t)
                res[n].append(1e3 * float(np.median(ts)))
    finally:
        TR._executor = keep
    for n in counts:
        label = ("causal" if args.causal else "plain") + (", out=" if args.out else "")
        print(f"{label}, {n} workers: median {np.median(res[n]):.3f} ms; rounds "
              + " ".join(f"{t:.3f}" for t in res[n]))
    if len(counts) > 1:
        a, b = counts[0], counts[1]
        print(f"  {b} workers faster than {a} in {sum(y < x for x, y in zip(res[a], res[b]))} of {args.rounds} rounds")


if __name__ == "__main__":
    main()

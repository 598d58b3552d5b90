"""The issue-13 chunk (4096 new tokens over 16384 cached, bf16, Hq 32, Hkv 8, D 128) for Nsight Compute.

    ncu --clock-control none -k regex:attn_prefill --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python3 dev/profile_chunk.py paged [page]
    ncu ... -k regex:attn_fwd ... python3 dev/profile_chunk.py dense

``paged``: pyattn.prefill over a PagedKVCache (pages of 16 by default, interleaved with a twin
sequence as in scripts/bench_serving.py); ``dense``: pyattn.attention on the same keys laid out
contiguously. Each runs its kernel 4 times (the first two are skipped above: load, caches).
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "scripts")
import bench_serving  # noqa: E402
import harness  # noqa: E402
import pyattn  # noqa: E402


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "paged"
    page = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    P, N, HQ, HKV, D = 16384, 4096, bench_serving.HQ, bench_serving.HKV, bench_serving.D
    g = torch.Generator(device="cuda").manual_seed(13)
    k, v = (torch.randn(P + N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qd = harness.to_pyattn(q.view(1, N, HQ, D), bench.stream)
    if which == "dense":
        kd, vd = (harness.to_pyattn(x.view(1, P + N, HKV, D), bench.stream) for x in (k, v))
        call = lambda: pyattn.attention(qd, kd, vd, causal=True, stream=bench.stream)  # noqa: E731
    else:
        cache, ids = bench_serving.fill(bench, [k], [v], page, twin=True)
        call = lambda: pyattn.prefill(qd, cache, ids, stream=bench.stream)  # noqa: E731
    for _ in range(4):
        call()
    bench.sync()
    print(f"profile_chunk: {which} ran 4 calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

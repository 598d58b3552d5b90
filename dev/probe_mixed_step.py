"""Dev probe (GPU): why a mixed step in one paged_prefill launch is slower than its split (issue 13).

Usage: PYTHONPATH=. python dev/probe_mixed_step.py [--ncu]
       ncu --clock-control none --profile-from-start off -k regex:attn_prefill --metrics \\
           gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,\\
           dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,\\
           launch__grid_size python dev/probe_mixed_step.py --ncu

``scripts/bench_engine.py``'s mixed step (63 decode rows over 4k cached tokens plus one 2048-token
chunk over a 4k prefix, vLLM-layout torch pools): the one-launch ``paged_prefill``, the chunk alone
and the 63 decode rows alone through ``paged_prefill`` (the split's prefill half, and what the
decode rows cost on prefill tiles), and the one launch with the chunk's keys taken away (what the
grid itself costs), GPU us by CUDA events. ``--ncu``: one call of each, between
``cudaProfilerStart`` / ``Stop``, for the command above: per launch its duration and the SMs'
active cycles (avg / max / min: a max far above the avg is a tail of a few SMs).
"""

from __future__ import annotations

import argparse
import sys

sys.path.insert(0, "scripts")
import harness  # noqa: E402
from bench_engine import HQ, D, pools  # noqa: E402

import pyattn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    bench = harness.open_bench(need_torch=True)
    torch = bench.torch
    n_dec, L, chunk, prefix = 63, 4096, 2048, 4096
    kp, vp, table, lens, width = pools(torch, [L] * n_dec + [prefix + chunk], 5)
    total, top = n_dec + chunk, width * 16
    q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor(list(range(n_dec + 1)) + [total], dtype=torch.int32, device="cuda")
    cu_chunk = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    cu_dec = torch.arange(n_dec + 1, dtype=torch.int32, device="cuda")
    calls = {
        "one launch": lambda: pyattn.paged_prefill(q, kp, vp, cu, block_table=table, seq_lens=lens,
                                                   max_seqlen_q=chunk, max_seqlen_k=top),
        "chunk alone": lambda: pyattn.paged_prefill(q[n_dec:], kp, vp, cu_chunk, block_table=table[n_dec:],
                                                    seq_lens=lens[n_dec:], max_seqlen_q=chunk, max_seqlen_k=top),
        "decode rows alone (prefill tiles)": lambda: pyattn.paged_prefill(
            q[:n_dec], kp, vp, cu_dec, block_table=table[:n_dec], seq_lens=lens[:n_dec], max_seqlen_q=1,
            max_seqlen_k=top),
        # The one launch's grid and blocks with the chunk's work gone (its sequence's keys 0: its
        # blocks only write zeros): what the grid's shape costs the decode rows.
        "decode rows + a keyless 2048-token row": lambda: pyattn.paged_prefill(
            q, kp, vp, cu, block_table=table, seq_lens=lens_keyless, max_seqlen_q=chunk, max_seqlen_k=top),
    }
    lens_keyless = lens.clone()
    lens_keyless[-1] = 0
    for fn in calls.values():  # compile, load, plan
        fn()
    torch.cuda.synchronize()
    if args.ncu:
        torch.cuda.cudart().cudaProfilerStart()
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    for name, fn in calls.items():
        t = bench.gpu_ms(fn, loop=10, reps=7, label=name)
        print(f"{name:40s} {t.ms * 1e3:8.1f} us")


if __name__ == "__main__":
    main()

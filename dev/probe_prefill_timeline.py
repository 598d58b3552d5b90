"""Dev probe (GPU): a timeline of attn_fwd_tma's blocks (a block a query tile), from clock stamps (issue 15).

Nsight Compute put the d = 64 bool mask kernel's SMs idle 11% of its time with the mask all True
(dense 1.3%) at the same grid and one block an SM: this says where that idle time sits. It copies
``pyattn/`` and ``kernels_src/`` to a temporary directory, patches stamps into the block-a-tile
``attn_fwd_wgmma`` (the TMA kernel's non-persistent path): ``%globaltimer`` at entry (thread 0),
when each consumer warpgroup is past its stores, when the producer thread has issued its last copy,
and the SM (``%smid``), written to a module global ``pyattn_tl``; then runs each case in a child
process on that copy with a fresh kernel cache: two calls, a sync, then the call whose stamps are
read. Printed per case: the kernel's span; the SMs' time without a block (before their first,
between blocks, after their last) as a share of span x SMs; block durations (p10/p50/p90/max);
blocks an SM; and mean durations by query head and by row block, to see whether some heads' or
row blocks' blocks run long.

    PYTHONPATH=. python dev/probe_prefill_timeline.py [--head-dim 64] [--seqlen 16384]
        [--cases dense,ones,random,causal,causal-random]

Stamps cost a few instructions; the figures are for telling blocks apart, not for the benchmark
tables. Shapes as bench_prefill's: (1, S, 2048 / D, D) bf16, NumPy-made device arrays.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _patched import run_patched
_SLOTS = 8  # entry, wg 0..2 past their stores, SM + 1, producer done, (spare)
_DECL = ("extern \"C\" __device__ unsigned long long pyattn_tl[8 * 65536];\n"
         "__device__ __forceinline__ unsigned long long* pyattn_tl_at() {\n"
         "  return pyattn_tl + 8 * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)); }\n"
         "__device__ __forceinline__ unsigned long long pyattn_tl_now() {\n"
         "  unsigned long long t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); return t; }\n"
         "__device__ __forceinline__ unsigned long long pyattn_tl_smid() {\n"
         "  unsigned s; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s)); return 1ull + s; }\n")
# (text, its replacement); each text must occur exactly once
_PATCHES = [
    ("namespace pyattn {\n", "namespace pyattn {\n" + _DECL),
    ("  // Blocks start in the order of x, then y.", "  if (threadIdx.x == 0) { pyattn_tl_at()[0] = pyattn_tl_now(); "
     "pyattn_tl_at()[4] = pyattn_tl_smid(); }\n  // Blocks start in the order of x, then y."),
    ("        if (threadIdx.x == Tr::kConsumerThreads && ml.n_tiles > 0) ml.produce_tma(sQ);\n",
     "        if (threadIdx.x == Tr::kConsumerThreads && ml.n_tiles > 0) ml.produce_tma(sQ);\n"
     "        if (threadIdx.x == Tr::kConsumerThreads) pyattn_tl_at()[5] = pyattn_tl_now();\n"),
    ("\n  wgmma_fwd_store<Tr>(ml, p, at, sm.o);\n}\n",
     "\n  wgmma_fwd_store<Tr>(ml, p, at, sm.o);\n"
     "  if (threadIdx.x % 128 == 0) pyattn_tl_at()[1 + threadIdx.x / 128] = pyattn_tl_now();\n}\n"),
]
CASES = "dense,ones,random"


def _patch(dst: Path) -> None:
    path = dst / "kernels_src" / "attention_fwd_wgmma.cuh"
    text = path.read_text()
    for old, new in _PATCHES:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)


def _child(cases: str, S: int, D: int) -> None:
    import ml_dtypes
    import numpy as np
    from cuda.bindings import driver

    import pyattn
    from pyattn.kernels import registry

    rng = np.random.default_rng(0)
    H = 2048 // D
    q, k, v = (pyattn.asarray(rng.standard_normal((1, S, H, D), np.float32).astype(ml_dtypes.bfloat16))
               for _ in range(3))
    masks = {"ones": np.ones((S, S), bool), "random": rng.random((S, S), np.float32) < 0.5}
    dev = pyattn.get_device()
    for case in cases.split(","):
        causal = case.startswith("causal")
        content = case.removeprefix("causal").lstrip("-") or "dense"
        mask = None if content == "dense" else pyattn.asarray(masks[content])
        for _ in range(2):
            pyattn.attention(q, k, v, causal=causal, mask=mask)
        dev.synchronize()
        handles = [kk.module.handle for kk in registry.loaded_kernels().values() if "attn_fwd_tma" in kk.name]
        for h in handles:
            _, ptr, size = driver.cuModuleGetGlobal(h, b"pyattn_tl")
            driver.cuMemsetD8(ptr, 0, size)
        dev.synchronize()
        pyattn.attention(q, k, v, causal=causal, mask=mask)
        dev.synchronize()
        for h in handles:
            _, ptr, size = driver.cuModuleGetGlobal(h, b"pyattn_tl")
            host = np.zeros(size // 8, np.uint64)
            driver.cuMemcpyDtoH(host.ctypes.data, ptr, size)
            rows = host.reshape(-1, _SLOTS).astype(np.int64)
            index = np.nonzero(rows[:, 0] != 0)[0]
            if len(index):
                _summary(case, rows[index], index, S, H, D)


def _summary(case: str, rows, index, S: int, H: int, D: int) -> None:
    import numpy as np

    t0 = rows[:, 0].min()
    start = (rows[:, 0] - t0) / 1e3
    end = (rows[:, 1:4].max(axis=1) - t0) / 1e3  # the last consumer warpgroup past its stores
    dur = end - start
    sm = rows[:, 4] - 1
    span = end.max()
    n_sm = len(np.unique(sm))
    before = after = between = 0.0
    per_sm = np.bincount(sm)
    last_ends = []
    for s in np.unique(sm):
        o = np.argsort(start[sm == s])
        st, en = start[sm == s][o], end[sm == s][o]
        before += st[0]
        after += span - en[-1]
        between += np.clip(st[1:] - en[:-1], 0, None).sum()
        last_ends.append(en[-1])
    cells = span * n_sm
    n_mb = (int(index.max()) + 1) // H  # grid (row blocks, heads, 1); every block stamps its entry
    bm = -(-S // (64 * n_mb)) * 64  # block_m: whole warpgroups of 64 rows
    m_block, head = index % n_mb, index // n_mb
    by_head = np.array([dur[head == h].mean() for h in np.unique(head)])
    by_mb = np.array([dur[m_block == m].mean() for m in np.unique(m_block)])
    print(f"{case} (d {D}, S {S}, {H} heads, {bm} rows a block): {len(rows)} blocks on {n_sm} SMs "
          f"({per_sm[per_sm > 0].min()}-{per_sm.max()} an SM), span {span:.1f} us; SM time without a block: "
          f"before its first {100 * before / cells:.1f}%, between blocks {100 * between / cells:.1f}%, after its "
          f"last {100 * after / cells:.1f}%; SMs' last block ends p10/p50/max "
          f"{'/'.join(f'{x:.0f}' for x in np.percentile(last_ends, [10, 50, 100]))} us", flush=True)
    print(f"  block us p10/p50/p90/max {'/'.join(f'{x:.1f}' for x in np.percentile(dur, [10, 50, 90, 100]))}; "
          f"by head mean min/max {by_head.min():.1f}/{by_head.max():.1f} (head 0 {by_head[0]:.1f}); by row block "
          f"min/max {by_mb.min():.1f}/{by_mb.max():.1f} (first {by_mb[0]:.1f}, last {by_mb[-1]:.1f}); "
          f"producer done before the last warpgroup by p50 "
          f"{np.median(end - (rows[:, 5] - t0) / 1e3):.1f} us", flush=True)
    waves = np.argsort(start)
    first = dur[waves[:n_sm]].mean()
    rest = dur[waves[n_sm:]].mean() if len(rows) > n_sm else float("nan")
    print(f"  first wave's blocks {first:.1f} us, the rest {rest:.1f} us; the 8 longest (block, SM, us): "
          + ", ".join(f"({index[i]}, {sm[i]}, {dur[i]:.1f})" for i in np.argsort(-dur)[:8]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="comma list of dense|ones|random, each optionally causal-")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.cases, args.seqlen, args.head_dim)
        return 0
    return run_patched(__file__, _patch, ["--cases", args.cases, "--seqlen", str(args.seqlen), "--head-dim",
                                          str(args.head_dim)])


if __name__ == "__main__":
    sys.exit(main())

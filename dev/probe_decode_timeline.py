"""Dev probe (GPU): a timeline of the TMA decode kernels' blocks, from clock stamps (issue 12's fixed cost).

The per-call time of a decode is linear in its bytes with a fixed part of ~10 us that is inside
the kernel (Nsight Compute's kernel duration equals the per-call time back to back: thirty-second
session). This probe says where in the block it goes. It copies ``pyattn/`` and ``kernels_src/``
to a temporary directory, patches stamps into ``attn_decode16_tma`` and ``attn_decode_q8_tma``, their
swapped-role consumers included (thread 0, the first consumer warp's lane 0: ``%globaltimer`` at
entry and exit, ``clock64`` after
the barrier set-up, when Q has landed, when the first stage is full, after the key loop, before
the split combine, when a block learns it combines, at exit; written to a module global,
``pyattn_tl``, read back after the call), then runs each point's decode in a child process on that
copy with a fresh kernel cache: three calls, a sync, then the call whose stamps are read. Printed
per point: the kernel's span (first block in to last block out), the blocks' start skew, and each
phase's median and maximum over blocks in microseconds (clock cycles at the block's own
globaltimer rate); "combine" over the blocks that combined.

    PYTHONPATH=. python dev/probe_decode_timeline.py [--points bf16:1x4096,int8:1x1024,...]

Stamps cost a few instructions and registers; the figures are for telling phases apart, not for
the benchmark tables. Points: ``kind:BxL`` over bench_quant's caches
(Hq 32, Hkv 8, D 128, page 16, q_len 1; data under the L2's size stays there between calls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from _patched import ROOT, run_patched
POINTS = "bf16:1x1024,bf16:1x4096,int8:1x1024,int8:1x32768,int8:8x4096"
_ENTRY = "  extern __shared__ __align__(16) unsigned char smem_raw[];\n"
# Thread 0 (the first consumer warp's lane 0) writes each stamp straight to its block's slots of
# pyattn_tl, so the same anchors serve the kernels' own consumers and the swapped-role ones
# (decode_swap.cuh), which are functions of their own.
_SLOT = "if (threadIdx.x == 0) pyattn_tl_at()[{i}] = {v};"
_BEGIN = ("  " + _SLOT.format(i=0, v="pyattn_tl_now()") + " " + _SLOT.format(i=2, v="clock64()") + " "
          + _SLOT.format(i=13, v="pyattn_tl_smid()") + "\n")
_EXIT = ("  " + _SLOT.format(i=1, v="pyattn_tl_now()") + " " + _SLOT.format(i=9, v="clock64()") + "\n")
_Q_LANDED = "  decode_sync<Tr>();  // Q landed for every consumer warp\n"
_FIRST_FULL = "    pipe::wait(full0 + 8 * st, (j / S) & 1);\n"
# The key loops' ends: the m16 kernels' epilogue calls (below), the swapped consumers' first lines after
# the loop.
_SWAP16_END = "  // O^T element (tile dm, e): channel 16 dm + g + 8 (e >> 1), row 2t + (e & 1)\n"
_SWAP8_END = "  q8s_epilogue<Tr>(p, w.acc, w.cmax, w.csum, vref, w.sl2, smem_raw, blk);\n"
_LOOP_STAMP = "  " + _SLOT.format(i=6, v="clock64()") + "\n"
# The m16 kernels' epilogue call (the swapped consumers end in decode_swap.cuh's swap_epilogue).
_EPILOGUE = ("  decode_epilogue<Tr>(p, acc, row_max, row_sum, sl2, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, "
             "blk.n_rows);\n")
# (file, [(anchor, text put before it, text put after it)]): every occurrence of an anchor is patched,
# and each must occur at least once (the combine's sub-phase stamps, slots 10-12, only where their
# lines are)
_KERNEL = [
    (_ENTRY, "", _BEGIN),
    ("  __syncthreads();  // the last block-wide barrier: a producer leaves when its copies are issued\n", "",
     "  " + _SLOT.format(i=3, v="clock64()") + "\n"),
    (_Q_LANDED, "", "  " + _SLOT.format(i=4, v="clock64()") + "\n"),
    (_FIRST_FULL, "", "    if (j == 0) " + _SLOT.format(i=5, v="clock64()") + "\n"),
]
_PATCHES = {
    # (its first stage's wait is Q8TmaStage's, in decode_q8_swap.cuh)
    "attention_decode_q8_tma.cuh": [e for e in _KERNEL if e[0] != _FIRST_FULL] + [(_EPILOGUE, _LOOP_STAMP, _EXIT)],
    "attention_decode_tma.cuh": _KERNEL + [(_EPILOGUE, _LOOP_STAMP, _EXIT), (_SWAP16_END, _LOOP_STAMP, "")],
    "decode_q8_swap.cuh": [(_Q_LANDED, "", "  " + _SLOT.format(i=4, v="clock64()") + "\n"),
                           (_FIRST_FULL, "", "    if (j == 0) " + _SLOT.format(i=5, v="clock64()") + "\n"),
                           (_SWAP8_END, _LOOP_STAMP, "")],
    "decode_swap.cuh": [("  decode_merge<Tr>(p, smem_raw, blk.split, blk.kv_head, blk.b, blk.r0, blk.n_rows);\n", "",
                         _EXIT)],
    "decode_common.cuh": [
        ("#pragma once\n", "", "extern \"C\" __device__ unsigned long long pyattn_tl[14 * 16384];\n"
         "__device__ __forceinline__ unsigned long long* pyattn_tl_at() {\n"
         "  return pyattn_tl + 14 * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)); }\n"
         "__device__ __forceinline__ unsigned long long pyattn_tl_now() {\n"
         "  unsigned long long t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); return t; }\n"
         "__device__ __forceinline__ unsigned long long pyattn_tl_smid() {\n"
         "  unsigned s; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s)); return 1ull + s; }\n"),
    ],
    "decode_merge.cuh": [
        ("  __threadfence();  // this block's partial stores are visible device-wide before it is counted\n"
         "  decode_sync<Tr>();\n", "", "  if (threadIdx.x == 0) pyattn_tl_at()[10] = clock64();\n"),
        ("  if (!s_last) return;\n", "", "  if (threadIdx.x == 0) pyattn_tl_at()[8] = clock64();\n"),
        ("  __threadfence();  // every other split's stores (fenced before their counts) are read after this\n", "",
         "  if (threadIdx.x == 0) pyattn_tl_at()[11] = clock64();\n"),
        ("  // -- out = sum_s w_s o_s / l", "  if (threadIdx.x == 0) pyattn_tl_at()[12] = clock64();\n", ""),
        ("  if (p.num_splits > 1 && p.split_counters != nullptr) decode_combine_last<Tr>(",
         "  if (threadIdx.x == 0) pyattn_tl_at()[7] = clock64();\n", ""),
    ],
}


def _patch(dst: Path) -> None:
    for name, edits in _PATCHES.items():
        path = dst / "kernels_src" / name
        text = path.read_text()
        for anchor, before, after in edits:
            if name == "decode_merge.cuh" and "pyattn_tl_at()[1" in before + after and anchor not in text:
                continue  # a combine sub-phase stamp whose line this tree's merge does not have
            assert text.count(anchor) >= 1, (name, anchor)
            text = text.replace(anchor, before + anchor + after)
        path.write_text(text)


def _modules() -> list:
    """The module handles of the loaded TMA decode kernels (a dev probe may read the registry)."""
    from pyattn.kernels import registry

    return [k.module.handle for k in list(registry._kernels.values())
            if "decode_tma" in k.name or "decode_swap" in k.name]


def _child(points: str) -> None:
    import numpy as np
    import torch
    from cuda.bindings import driver

    sys.path.insert(0, str(ROOT / "dev"))
    from probe_decode_fixed import decode_point, harness, qc  # (its scripts/ path, then pyattn from the copy)

    import pyattn

    bench = harness.Bench(torch)
    for point in points.split(","):
        cache, seqs, q, *_ = decode_point(bench, point)
        for _ in range(3):
            pyattn.decode(q, cache, seqs, stream=bench.stream)
        bench.sync()
        for handle in _modules():
            err, ptr, size = driver.cuModuleGetGlobal(handle, b"pyattn_tl")
            assert err == driver.CUresult.CUDA_SUCCESS, err
            driver.cuMemsetD8(ptr, 0, size)
        bench.sync()
        pyattn.decode(q, cache, seqs, stream=bench.stream)
        bench.sync()
        for handle in _modules():
            _, ptr, size = driver.cuModuleGetGlobal(handle, b"pyattn_tl")
            host = np.zeros(size // 8, np.uint64)
            driver.cuMemcpyDtoH(host.ctypes.data, ptr, size)
            rows = host.reshape(-1, 14)
            index = np.nonzero(rows[:, 0] != 0)[0]
            rows = rows[index]
            if len(rows):
                _summary(point, rows.astype(np.int64))
                if SPREAD:
                    _spread(point, rows.astype(np.int64), index, driver)
        cache = seqs = q = None
        qc.drop(bench)


def _summary(point: str, rows) -> None:
    """Rows: g0, g1 (globaltimer ns), c0, set-up, Q, first stage, loop end, pre-combine, counted last, exit,
    then in the combine: fenced and synced, acquire fence, LSE pass (clock64)."""
    g_start = int(rows[:, 0].min())
    span = (int(rows[:, 1].max()) - g_start) / 1e3
    skew = (int(rows[:, 0].max()) - g_start) / 1e3
    names = ("set-up", "Q landed", "first stage", "key loop", "epilogue", "combine")
    phases = {k: [] for k in names}
    sub = {k: [] for k in ("fence + barrier", "counter", "acquire fence", "LSE pass", "partials")}
    for g0, g1, c0, s0, s1, s2, s3, pre, last, end, fenced, acquired, lsed, _ in rows.tolist():
        ns = (g1 - g0) / max(end - c0, 1)  # this block's ns per cycle
        pre = pre or end
        marks = (c0, s0, s1, s2, s3, pre)
        for k, a, b in zip(names, marks, marks[1:]):
            phases[k].append((b - a) * ns)
        if last:
            phases["combine"].append((end - pre) * ns)
            marks = (pre, fenced, last, acquired, lsed, end)
            for k, a, b in zip(sub, marks, marks[1:]):
                if a and b:  # (slots 10-12 stay 0 where the tree's merge has no such line)
                    sub[k].append((b - a) * ns)
    cells = [f"{k} {statistics.median(v) / 1e3:.2f}/{max(v) / 1e3:.2f}" for k, v in phases.items() if v]
    cells += [f"(combine: {k} {statistics.median(v) / 1e3:.2f})" for k, v in sub.items() if v]
    print(f"{point}: {len(rows)} blocks, span {span:.2f} us, start skew {skew:.2f} us, "
          f"{sum(1 for r in rows.tolist() if r[8])} combining; phases median/max us: " + ", ".join(cells), flush=True)


SPREAD = False


def _spread(point: str, rows, index, driver) -> None:
    """How the blocks' key loops differ: their percentiles, by SM, within a unit (the splits of one
    (batch, kv head): consecutive block indices, grid.x = splits), and when the blocks end."""
    import numpy as np

    ns = (rows[:, 1] - rows[:, 0]) / np.maximum(rows[:, 9] - rows[:, 2], 1)
    loop = (rows[:, 6] - rows[:, 5]) * ns / 1e3
    end = (rows[:, 1] - rows[:, 0].min()) / 1e3
    sm = rows[:, 13] - 1
    pct = np.percentile(loop, [0, 10, 50, 90, 100])
    by_sm = {s: loop[sm == s].mean() for s in np.unique(sm)}
    per_sm = np.bincount(sm)
    means = np.array(list(by_sm.values()))
    print(f"  {point} key loop us p0/p10/p50/p90/max {'/'.join(f'{x:.1f}' for x in pct)}; blocks an SM "
          f"{per_sm.min()}-{per_sm.max()} over {len(by_sm)} SMs; SM means {means.min():.1f}-{means.max():.1f} "
          f"(sd {means.std():.1f}); block ends p50/p90/max "
          f"{'/'.join(f'{x:.1f}' for x in np.percentile(end, [50, 90, 100]))} us")
    splits = int(os.environ.get("SPLITS", "0"))
    if splits > 1:
        units = index // splits
        spread = [loop[units == u].max() - loop[units == u].min() for u in np.unique(units)]
        mean_gap = [loop[units == u].max() - loop[units == u].mean() for u in np.unique(units)]
        print(f"  {point} within a unit ({splits} splits): max - min key loop median {np.median(spread):.1f} us, "
              f"max - mean median {np.median(mean_gap):.1f} us (the global max - median "
              f"{pct[4] - pct[2]:.1f})")
    slow = np.argsort(-loop)[:8]
    print(f"  {point} slowest blocks (index, SM, key loop us, blocks on that SM): "
          + ", ".join(f"({index[i]}, {sm[i]}, {loop[i]:.1f}, {per_sm[sm[i]]})" for i in slow))


def main() -> int:
    global SPREAD
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--spread", action="store_true", help="also how the blocks' key loops differ (SPLITS=n: "
                    "within each unit of n splits)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    SPREAD = args.spread
    if args.child:
        _child(args.points)
        return 0
    return run_patched(__file__, _patch, ["--points", args.points] + (["--spread"] if args.spread else []))


if __name__ == "__main__":
    sys.exit(main())

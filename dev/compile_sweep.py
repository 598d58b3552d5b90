"""Cold NVRTC compile time of every kernel variant the library's lists name, per arch (no GPU).

Usage: PYTHONPATH=. python dev/compile_sweep.py [--archs sm_80,sm_90a] [--top 20]
       [--shard K/N] [--cpus a,b] [--names FILE] [--out FILE] [--repeat N]

``--shard K/N`` compiles every N-th variant from the K-th (0-based) over all archs, so that N
processes, each pinned to two cores of its own (``--cpus``), screen the list on a larger host;
``--names`` keeps only the variants named in a file (one ``describe()`` a line, a leading time
column allowed), to re-time the screen's slowest alone; ``--out`` writes ``seconds<TAB>name`` lines;
``--repeat N`` compiles each variant N times and keeps the fastest (on a shared 2-core machine one
compile of a variant ranged 1.5-3.7 s from run to run: the fastest is the compile's own cost).

The variants: ``warmup_specs``, the modifier / block-sparse / 8-bit / backward lists of
``tests/test_compile_variants.py``, every 8-bit decode variant (int8 / fp8, per-token /
per-channel, every head-dim bucket and q_tiles), the serving and issue-13 warm lists of
``dev/warm_serving.py`` / ``dev/warm_issue13.py``, and the TMA prefill's mask-table rows (sm_90a).
Each is compiled once with NVRTC (``pyattn.jit.compile_spec``, no cache), one at a time, and
timed: the JIT promise is <= 2 s for any variant on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import test_compile_variants  # noqa: E402
import warm_issue13  # noqa: E402
import warm_serving  # noqa: E402
from pyattn import jit  # noqa: E402
from pyattn.kernels.families import tile_table  # noqa: E402
from pyattn.kernels.specs import KernelSpec, backward_specs, decode_max_q_tiles, warmup_specs  # noqa: E402
from pyattn.runtime.device import SUPPORTED_ARCHS  # noqa: E402


def variants(arch: str) -> list:
    specs = list(warmup_specs(arch)) + test_compile_variants._modifier_specs(arch)
    specs += test_compile_variants._sparse_and_quant_specs(arch)
    specs += list(backward_specs(arch)) + warm_serving.serving_specs(arch) + warm_issue13.specs(arch)
    specs += [KernelSpec("attn_decode", "bf16", d, arch, q_tiles=mt, kv=kv, key_channel=kch)
              for kv in ("int8", "fp8e4m3") for kch in (False, True) for d in (64, 128, 256)
              for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1)]
    if arch == "sm_90a":  # the TMA prefill's mask-table rows (test_tma_variants_with_modifiers_compile's)
        specs += [KernelSpec("attn_fwd_tma", tag, r.max_head_dim, arch, mask=mask, **mods)
                  for mask, table in (("bits", "dense"), ("f16", "mask2"), ("bf16", "mask2"), ("f32", "mask4"),
                                      ("bf16_row", "dense"), ("f32_row", "dense"))
                  for r in tile_table("attn_fwd_tma", arch, table=table) for tag in ("f16", "bf16")
                  for mods in ({}, {"softcap": True, "alibi": True})]
    return list(dict.fromkeys(specs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(SUPPORTED_ARCHS))
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--shard", default="0/1", help="K/N: every N-th variant from the K-th")
    ap.add_argument("--names", help="a file of variant names to keep (the last tab-separated column)")
    ap.add_argument("--out", help="write seconds<TAB>name lines here")
    ap.add_argument("--cpus", help="pin this process (and NVRTC's threads) to these cores, e.g. 0,1")
    ap.add_argument("--repeat", type=int, default=1, help="compiles of each variant; the fastest is kept")
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    k, n = (int(x) for x in args.shard.split("/"))
    keep = None
    if args.names:
        with open(args.names) as f:
            keep = {line.rstrip("\n").split("\t")[-1] for line in f if line.strip()}
    res = []
    index = 0
    for arch in args.archs.split(","):
        listed = [s for s in variants(arch) if keep is None or s.describe() in keep]
        specs = [s for i, s in enumerate(listed, index) if i % n == k]
        index += len(listed)
        if not specs:
            continue
        for s in specs:
            times = []
            for _ in range(max(1, args.repeat)):
                t = time.perf_counter()
                jit.compile_spec(s)
                times.append(time.perf_counter() - t)
            res.append((min(times), s.describe()))
        print(f"{arch}: {len(specs)} variants, worst {max(r[0] for r in res[-len(specs):]):.2f} s", flush=True)
    res.sort(reverse=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(f"{dt:.3f}\t{name}\n" for dt, name in res)
    for dt, name in res[:args.top]:
        print(f"  {dt:6.2f} s  {name}")
    print(f"{len(res)} variants, {sum(r[0] > 2 for r in res)} over 2 s")


if __name__ == "__main__":
    main()

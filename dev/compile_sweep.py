"""Cold NVRTC compile time of every kernel variant the library's lists name, per arch (no GPU).

Usage: PYTHONPATH=. python dev/compile_sweep.py [--archs sm_80,sm_90a] [--top 20]

The variants: ``warmup_specs``, the modifier / block-sparse / 8-bit / backward lists of
``tests/test_compile_variants.py``, every 8-bit decode variant (int8 / fp8, per-token /
per-channel, every head-dim bucket and q_tiles), and the serving and issue-13 warm lists of
``dev/warm_serving.py`` / ``dev/warm_issue13.py``. Each is compiled once with NVRTC
(``pyattn.jit.compile_spec``, no cache), one at a time, and timed: the JIT promise is <= 2 s for
any variant on a 2-core machine.
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
from pyattn.kernels.specs import KernelSpec, backward_specs, decode_max_q_tiles, warmup_specs  # noqa: E402
from pyattn.runtime.device import SUPPORTED_ARCHS  # noqa: E402


def variants(arch: str) -> list:
    specs = list(warmup_specs(arch)) + test_compile_variants._modifier_specs(arch)
    specs += test_compile_variants._sparse_and_quant_specs(arch)
    specs += list(backward_specs(arch)) + warm_serving.serving_specs(arch) + warm_issue13.specs(arch)
    specs += [KernelSpec("attn_decode", "bf16", d, arch, q_tiles=mt, kv=kv, key_channel=kch)
              for kv in ("int8", "fp8e4m3") for kch in (False, True) for d in (64, 128, 256)
              for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1)]
    return list(dict.fromkeys(specs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(SUPPORTED_ARCHS))
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    res = []
    for arch in args.archs.split(","):
        specs = variants(arch)
        for s in specs:
            t = time.perf_counter()
            jit.compile_spec(s)
            res.append((time.perf_counter() - t, s.describe()))
        print(f"{arch}: {len(specs)} variants, worst {max(r[0] for r in res[-len(specs):]):.2f} s", flush=True)
    res.sort(reverse=True)
    for dt, name in res[:args.top]:
        print(f"  {dt:6.2f} s  {name}")
    print(f"{len(res)} variants, {sum(r[0] > 2 for r in res)} over 2 s")


if __name__ == "__main__":
    main()

"""Dev helper: compile the serving kernels (paged prefill, tree verification, their split combine,
and the dense / decode kernels the serving tests and benchmark compare against) in parallel, so a
GPU session spends its minutes running them, not compiling them one by one on first use.

Usage: PYTHONPATH=. python dev/warm_serving.py [--arch sm_90a] [--workers 16]
"""

from __future__ import annotations

import argparse
import time

import pyattn.jit as jit
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec, decode_specs, select_attention_spec
from pyattn.ops._prefill import prefill_specs


def serving_specs(arch: str) -> list:
    specs = []
    for dtype in ("float16", "bfloat16"):
        for d in (40, 64, 96, 128, 256):
            for softcap, alibi in ((False, False), (True, False), (False, True)):
                for tree in (False, True):
                    if not (tree and alibi):  # pages of 8 (the cp.async gather) and of 16 (TMA boxes)
                        for page in (8, 16):
                            specs += prefill_specs(dtype, d, arch, False, softcap, alibi, tree, page)
        specs.append(select_attention_spec(dtype, 128, arch))
        tag = "bf16" if dtype == "bfloat16" else "f16"
        specs += [KernelSpec("kv_append", tag, 32, arch, kv=kv) for kv in ("", "int8")]
    specs += decode_specs(arch, (64, 128), q_tiles=(1, 2))
    specs += [KernelSpec("split_combine", t, d, arch) for t in ("f16", "bf16") for d in HEAD_DIM_BUCKETS]
    return list(dict.fromkeys(specs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=None, help="default: the GPU's")
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    if args.arch is None:
        import pyattn

        args.arch = pyattn.get_device().arch
    specs = serving_specs(args.arch)
    t0 = time.perf_counter()
    built = jit.build_many(specs, workers=args.workers)
    print(f"warm_serving: {len(built)} variants for {args.arch} in {time.perf_counter() - t0:.1f} s "
          f"({sum(b for *_, b in built)} compiled)")


if __name__ == "__main__":
    main()

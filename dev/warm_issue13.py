"""Dev helper: precompile, in parallel, the kernels the per-channel key scale and SparQ tests and
benchmarks use on this machine's GPU (a fresh GPU machine has an empty cache; the tests would
otherwise compile them one at a time as hypothesis reaches them).

Usage: PYTHONPATH=. python dev/warm_issue13.py [--arch sm_90a]
"""

from __future__ import annotations

import argparse
import time

import pyattn
import pyattn.jit as jit
from pyattn.kernels.families.decode import tma_decode_serves
from pyattn.kernels.specs import KernelSpec, decode_max_q_tiles


def specs(arch: str) -> list:
    out = []
    for tag in ("f16", "bf16"):
        out += [KernelSpec("kv_append", tag, 32, arch, kv=kv) for kv in ("", "int8", "fp8e4m3")]
        out += [KernelSpec("kv_key_pages", tag, 32, arch, kv=kv) for kv in ("int8", "fp8e4m3")]
        out += [KernelSpec("kv_sparq", tag, 32, arch)]
        out += [KernelSpec(f"sparq_{st}", tag, 32, arch) for st in ("score", "select")]
        for d in (64, 128, 256):
            out.append(KernelSpec("split_combine", tag, d, arch))
            for kv in ("int8", "fp8e4m3"):
                for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1):
                    for mods in (False, True):
                        out += [KernelSpec("attn_decode", tag, d, arch, q_tiles=mt, kv=kv, key_channel=kc,
                                           softcap=mods, alibi=mods) for kc in (False, True)]
                        if tma_decode_serves(arch, d, 16, kv):  # pages of 16+ slots; <= 8 rows: swapped roles
                            out += [KernelSpec(fam, tag, d, arch, q_tiles=mt, kv=kv, key_channel=kc, softcap=mods,
                                               alibi=mods) for kc in (False, True)
                                    for fam in ("attn_decode_tma",) + ("attn_decode_swap",) * (mt == 1)]
            for mt in range(1, decode_max_q_tiles(arch, d) + 1):  # SparQ's decode over chosen keys (16-bit)
                out.append(KernelSpec("attn_decode", tag, d, arch, q_tiles=mt))
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=None)
    args = ap.parse_args()
    arch = args.arch or pyattn.get_device().arch
    todo = specs(arch)
    t = time.perf_counter()
    built = jit.build_many(todo)
    print(f"{len(todo)} variants for {arch}, {sum(b for *_, b in built)} compiled, {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()

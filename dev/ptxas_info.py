"""Dev probe (no GPU): registers, spills and shared memory of kernel variants as ptxas reports them.

Usage: PYTHONPATH=. python dev/ptxas_info.py [--arch sm_90a] [--mods] [--backward] [--decode] [--paged] [--log]

Compiles the library's own rendered units (``pyattn.jit.source.render``) with NVRTC plus
``--ptxas-options=-v`` and prints ptxas's one-line summary per variant, with the compile time:
a quick check that a kernel change did not push a tile over 255 registers (spills) before
spending GPU time on it. ``--mods`` adds the score-modifier variants of every attention family;
``--backward`` takes the backward's main kernels instead, ``--decode`` the paged decode's, ``--paged``
the paged prefill's (cp.async gather and TMA page boxes, plain and soft-cap + ALiBi); ``--log`` prints ptxas's whole log
(its warnings, e.g. wgmma serialisation).
"""

from __future__ import annotations

import argparse
import re
import time

from pyattn.jit.headers import check_headers_match_nvrtc
from pyattn.jit.nvrtc import compile_source
from pyattn.jit.source import kernel_headers, render
from pyattn.kernels.specs import select_attention_spec, select_backward_specs

_MODS = ({}, {"softcap": True}, {"alibi": True}, {"mask": "bool"}, {"mask": "bf16"},
         {"mask": "f32", "softcap": True, "alibi": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--mods", action="store_true")
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--decode", action="store_true", help="the 16-bit paged decode variants instead")
    ap.add_argument("--kv", default="", help="with --decode: an 8-bit cache kind (int8, fp8e4m3), per-token "
                    "and per-channel keys (the TMA kernel's m16 row tiles and its swapped roles too)")
    ap.add_argument("--paged", action="store_true", help="the paged prefill variants instead")
    ap.add_argument("--log", action="store_true")
    args = ap.parse_args()
    include = str(check_headers_match_nvrtc())
    headers = kernel_headers()
    specs = []
    if args.decode:
        from pyattn.kernels.specs import decode_specs
        specs = [sp for sp in decode_specs(args.arch, head_dims=tuple(args.dims), q_tiles=(1, 2))
                 if sp.family.startswith("attn_decode")]
        if args.kv:
            from pyattn.kernels.specs import KernelSpec
            from pyattn.kernels.families.decode import tma_decode_serves
            specs = [KernelSpec("attn_decode", "bf16", d, args.arch, q_tiles=1, kv=args.kv, key_channel=kc)
                     for d in args.dims for kc in (False, True)]
            specs += [KernelSpec(fam, "bf16", d, args.arch, q_tiles=1, kv=args.kv, **mods)
                      for d in args.dims if tma_decode_serves(args.arch, d, 16, args.kv)
                      for fam in ("attn_decode_tma", "attn_decode_swap")
                      for mods in ({}, {"softcap": True, "alibi": True}, {"key_channel": True})]
    if args.paged:
        from pyattn.kernels.specs import KernelSpec
        specs = [KernelSpec(fam, "bf16", d, args.arch, softcap=m, alibi=m) for d in args.dims if d % 64 == 0
                 for fam in ("attn_prefill_wgmma", "attn_prefill_tma") for m in (False, True)]
    for d in () if args.decode or args.paged else args.dims:
        for mods in _MODS if args.mods else _MODS[:1]:
            if args.backward:
                if "mask" not in mods:
                    specs.append(select_backward_specs("bfloat16", d, args.arch, **mods)[1])
            else:
                specs.append(select_attention_spec("bfloat16", d, args.arch, **mods))
    for spec in dict.fromkeys(specs):
        opts = list(spec.compile_options((include,))) + ["--ptxas-options=-v"]
        t0 = time.perf_counter()
        _, log = compile_source(render(spec), headers, opts, name=spec.entry_name)
        dt = time.perf_counter() - t0
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        print(f"{spec.describe():60} {dt:5.2f} s  regs {regs.group(1) if regs else '?':>3}  "
              f"spill st/ld {spill.group(1) + '/' + spill.group(2) if spill else '?'}")
        if args.log:
            print(log)


if __name__ == "__main__":
    main()

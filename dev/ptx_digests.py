"""Dev probe (no GPU): a digest of every sm_90a wgmma-family variant's PTX, to show that a kernel
change leaves the variants it does not target as they were.

Usage: PYTHONPATH=. python dev/ptx_digests.py OUT.json        (digests of this tree)
       PYTHONPATH=. python dev/ptx_digests.py --families sparq,attn_fwd_mma [--archs sm_90a,sm_80] OUT.json
       PYTHONPATH=. python dev/ptx_digests.py --all [--archs sm_90a,sm_80] OUT.json
       python dev/ptx_digests.py --compare A.json B.json          (which variants differ)

Run it on the tree before a change (e.g. ``git stash``) and after, then compare. The PTX is
normalised first: comments, ``.loc`` / ``.file`` line info and the ``.global`` constants of the
traits are dropped, and a traits type's trailing ``false`` / ``0`` arguments (``ELb0EE`` /
``ELi0EE`` in the mangled names) are read as absent, so that new defaulted template arguments
alone do not count as a change. Where two digests differ only by PTX register numbering, compare the variants' SASS
(``dev/sass_map.py --all``). The variants: the attn_fwd_tma / attn_fwd_wgmma / attn_fwd_fp8 /
paged prefill / tree ones of ``dev/compile_sweep.py``'s lists, and the prefill selections at
d = 64 / 128 / 256, 1k / 4k keys, causal or not, with and without a soft-cap, on a small grid
(the twenty-ninth session checked its o_stage change so).
``--families`` (comma-separated family names) instead digests those families' variants of
``dev/compile_sweep.py``'s lists on each of ``--archs`` (default sm_90a; a family that does not
compile for an arch simply has no variants there), ``--all`` every family's: for a header that
families other than the wgmma ones include (e.g. sparq.cuh: ``--families sparq --archs
sm_90a,sm_80``). Without either, the output is the default set above.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
FAMILIES = ("attn_fwd_tma", "attn_fwd_wgmma", "attn_fwd_fp8", "attn_prefill_wgmma", "attn_tree_wgmma")


def variants() -> list:
    from pyattn.kernels.specs import select_attention_spec

    out = family_variants(FAMILIES, ["sm_90a"])
    for d in (64, 128, 256):
        for causal in (False, True):
            for cap in ({}, {"softcap": 20.0}):
                for keys in (1024, 4096):
                    out.append(select_attention_spec("bfloat16", d, "sm_90a", keys=keys, causal=causal, queries=1000,
                                                     batch_heads=16, sm_count=132, **cap))
                    out.append(select_attention_spec("bfloat16", d, "sm_90a", keys=keys, causal=causal, **cap))
                    out.append(select_attention_spec("float16", d, "sm_90a", keys=keys, causal=causal, **cap))
    return list(dict.fromkeys(out))


def family_variants(families, archs) -> list:
    """compile_sweep's variants of `families` (None: every family) on each of `archs`."""
    import compile_sweep

    out = []
    for arch in archs:
        out += [s for s in compile_sweep.variants(arch) if families is None or s.family in families]
    return list(dict.fromkeys(out))


def digest(spec) -> tuple:
    from pyattn.jit import compile_spec

    image, _ = compile_spec(spec.replace(ptx=True))
    text = image.decode() if isinstance(image, bytes) else image
    kept = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("//", ".global", ".loc", ".file")):
            continue
        if ".debug_str" in stripped:
            break
        while True:  # trailing defaulted false / 0 template arguments, however many
            short = line.replace("ELb0EE", "EE").replace("ELi0EE", "EE")
            if short == line:
                break
            line = short
        kept.append(line)
    return f"{spec.describe()} {spec.entry_name}", hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="where the digests go (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print the variants whose digests differ")
    ap.add_argument("--families", type=lambda v: set(v.split(",")), help="comma-separated family names")
    ap.add_argument("--all", action="store_true", help="every family's compile_sweep variants")
    ap.add_argument("--archs", type=lambda v: v.split(","), help="with --families / --all (default sm_90a)")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                print(("differs  " if k in a and k in b else "only in " + ("A  " if k in a else "B  ")) + k)
        return 0
    if args.out is None:
        ap.error("OUT.json is required")
    if args.families is None and not args.all:
        if args.archs is not None:
            ap.error("--archs goes with --families or --all")
        specs = variants()
    else:
        specs = family_variants(None if args.all else args.families, args.archs or ["sm_90a"])
        if not specs:
            ap.error("no variants for those families / archs")
    with ProcessPoolExecutor(os.cpu_count() or 2) as ex:
        res = dict(ex.map(digest, specs))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=0, sort_keys=True)
    print(f"{len(res)} variants -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

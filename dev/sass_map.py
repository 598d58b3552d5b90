"""Dev probe (no GPU): a map of one kernel variant's SASS, to count instructions per region.

Usage: PYTHONPATH=. python dev/sass_map.py [--dtype bfloat16] [--head-dim 128] [--keys 4096]
       [--causal] [--softcap 30] [--mask bf16] [--nvdisasm PATH] [--all]

Compiles the variant ``select_attention_spec`` picks (the library's own rendered unit, cubin for
sm_90a through NVRTC), disassembles it with ``nvdisasm`` (PyPI's ``nvidia-cuda-nvdisasm`` wheel
carries it; pip-install it into any venv and pass its ``nvidia/cu13/bin/nvdisasm``, or set
NVDISASM), and prints the landmarks with their instruction index: branches with their targets
(a target below the branch closes a loop), wgmma groups, barriers, mbarrier waits and arrivals,
TMA copies and global stores. The distance between two landmarks is the instruction count of
that stretch, e.g. a persistent block's per-tile set-up and epilogue against one key tile's
loop body (BENCHMARKS.md, twenty-seventh session). ``--all`` prints every instruction.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

from pyattn.jit.headers import check_headers_match_nvrtc
from pyattn.jit.nvrtc import compile_source
from pyattn.jit.source import kernel_headers, render
from pyattn.kernels.specs import select_attention_spec

_LANDMARK = re.compile(r"\bBRA\b|HGMMA|BAR\.|SYNCS|WARPGROUP|EXIT|RET|CALL|USETMAXREG|STG|UTMALDG")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--mask", default="none", help="a mask tensor's kind (bool as bits: bits; bf16, f16, f32)")
    ap.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    ap.add_argument("--all", action="store_true", help="every instruction, not only the landmarks")
    a = ap.parse_args()
    mods = {"softcap": a.softcap} if a.softcap else {}
    if a.mask != "none":
        mods["mask"] = a.mask
    spec = select_attention_spec(a.dtype, a.head_dim, "sm_90a", keys=a.keys, causal=a.causal, **mods)
    options = list(spec.compile_options((str(check_headers_match_nvrtc()),)))
    cubin, _ = compile_source(render(spec), kernel_headers(), options, name=spec.entry_name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([a.nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout
    ins, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            ins.append(m.group(1))
    print(f"{spec.entry_name}: {len(ins)} instructions")
    for i, text in enumerate(ins):
        if a.all or _LANDMARK.search(text):
            m = re.search(r"(\.L_x_\d+)", text)
            target = f"  -> {labels[m.group(1)]}" if m and m.group(1) in labels else ""
            print(f"{i:6d}  {text[:100]}{target}")


if __name__ == "__main__":
    main()

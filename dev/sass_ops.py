"""Dev probe (no GPU): opcode counts of decode variants' SASS, to check what a kernel change adds or removes.

Usage: PYTHONPATH=. python dev/sass_ops.py [--family attn_decode_swap] [--kv int8,fp8e4m3] [--key-channel]
       [--head-dim 128] [--arch sm_90a] [--ops HADD2,HMMA,PRMT,...] [--ldg] [--nvdisasm PATH]

Compiles each variant (``KernelSpec(family, "bf16", head_dim, arch, q_tiles=1, kv=...)``, per-token
keys and, with ``--key-channel``, per-channel ones too) through NVRTC to a cubin, disassembles it
with ``nvdisasm`` (as dev/sass_map.py: PyPI's ``nvidia-cuda-nvdisasm`` wheel, or NVDISASM) and prints
its static instruction count and the counts of ``--ops`` (opcodes without their modifiers). Static
counts: an unrolled stage body counts once, so a change's difference in a loop's opcodes is its
difference a stage (BENCHMARKS.md, thirty-fifth session: int8 codes biased by 1152, HADD2 128 -> 0
a stage). ``--kv ""`` takes the 16-bit cache.

``--ldg``: also the destination registers of the unpredicated ``LDG.E.CONSTANT`` loads (``__ldg``:
the decodes' page-table lookups) in program order, and how many are distinct. Lookups meant to be
in flight together load into distinct registers; one register loaded again and again means ptxas
waits for each before the next (a clamp placed at the load did that to the cp.async decode:
BENCHMARKS.md, sixty-first session, section 3).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

from pyattn.jit.headers import check_headers_match_nvrtc
from pyattn.jit.nvrtc import compile_source
from pyattn.jit.source import kernel_headers, render
from pyattn.kernels.specs import KernelSpec

_OP = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


_LDG = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+LDG\.E\.CONSTANT(?:\.\w+)* (R\d+),")


def disassemble(spec, nvdisasm: str) -> str:
    """The variant's SASS text (NVRTC cubin through ``nvdisasm -c``)."""
    options = list(spec.compile_options((str(check_headers_match_nvrtc()),)))
    cubin, _ = compile_source(render(spec), kernel_headers(), options, name=spec.entry_name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout


def opcode_counts(sass: str) -> collections.Counter:
    """Opcode -> count over SASS text (modifiers dropped: HMMA.16816.F32 is HMMA)."""
    return collections.Counter(m.group(1) for m in map(_OP.match, sass.splitlines()) if m)


def ldg_registers(sass: str) -> list:
    """Destination registers of the unpredicated ``LDG.E.CONSTANT`` loads, in program order."""
    return [m.group(1) for m in map(_LDG.match, sass.splitlines()) if m]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="attn_decode_swap")
    ap.add_argument("--kv", default="int8,fp8e4m3", help="comma list of cache kinds ('' for 16 bits)")
    ap.add_argument("--key-channel", action="store_true", help="per-channel key scales too (8-bit kinds)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--ops", default="HADD2,HMUL2,HFMA2,PRMT,LOP3,F2FP,HMMA,FADD,FMUL,FFMA,MUFU,LDS,STS")
    ap.add_argument("--ldg", action="store_true", help="the __ldg loads' destination registers too")
    ap.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    a = ap.parse_args()
    ops = a.ops.split(",")
    for kv in a.kv.split(","):
        for kc in (False, True) if a.key_channel and kv else (False,):
            spec = KernelSpec(a.family, "bf16", a.head_dim, a.arch, q_tiles=1, kv=kv, key_channel=kc)
            sass = disassemble(spec, a.nvdisasm)
            counts = opcode_counts(sass)
            cells = " ".join(f"{op} {counts[op]}" for op in ops)
            print(f"{spec.describe():70} total {sum(counts.values()):5}  {cells}", flush=True)
            if a.ldg:
                regs = ldg_registers(sass)
                print(f"  __ldg loads {len(regs)}, {len(set(regs))} distinct registers: {' '.join(regs)}", flush=True)


if __name__ == "__main__":
    main()

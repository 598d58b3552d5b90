"""Kernel specs derive exactly what they derived before the families refactor (CPU only).

``tests/data/spec_snapshot.json`` was written by this module (``python tests/test_spec_snapshot.py``)
from ``pyattn/kernels/specs.py`` as it stood before the kernel families moved into
``pyattn/kernels/families/`` (commit "tests: pin every kernel spec's derived facts"). It holds:

* ``specs``: for every variant the ops and warmup produce (standard, warmup and decode specs,
  block-sparse, TF32, decode with soft-cap / ALiBi / two row tiles / 8-bit caches, kv_append,
  merge_states, attn_sparse, on every arch), its threads, shared-memory bytes,
  tiles, grid, and a digest of its rendered translation unit without the shared-memory
  ``static_assert`` lines (the one change to rendering): the unit spells out the template id,
  the entry name, the launch bounds, the header and the params struct;
* ``reasons``: the tile reasons, referenced by index;
* ``exhaustive``: per (family, arch), a digest over every combination of in-domain field values:
  the facts of each combination that validates and the error message of each that does not.

Regenerate it only for an intended change of kernels or tiles, and say why in the commit.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path

import pytest

from pyattn.jit.source import render
from pyattn.kernels.specs import (DTYPES, HEAD_DIM_BUCKETS, KV_KINDS, MASK_KINDS, KernelSpec, decode_max_q_tiles,
                                  decode_specs, select_attention_spec, standard_specs, tile_config, warmup_specs)
from pyattn.runtime.device import SUPPORTED_ARCHS

SNAPSHOT = Path(__file__).resolve().parent / "data" / "spec_snapshot.json"
FAMILY_NAMES = ("attn_fwd_mma", "attn_fwd_simt", "attn_fwd_tf32", "attn_fwd_wgmma", "attn_fwd_tma", "merge_states",
                "attn_decode",
                "kv_append", "attn_sparse")
# The rendered-unit lines the families refactor added: C++ traits vs Python shared-memory bytes.
_SMEM_ASSERT = re.compile(r"^static_assert\(.*::kSmemBytes == \d+, .*\);\n", re.M)
# ... and those the fifty-second session added to every unit alike: the entry point's wait for the
# stream's previous kernel (kernels_src/pdl.cuh; test_spec_render checks them).
_PDL_LINES = re.compile(r'^(#include "pdl\.cuh"|  pyattn::pdl::wait\(\);)\n', re.M)
# ... and the fifty-third session's fields: DecodeParams' pool page count the decode clamps page
# entries to, KvAppendParams' device lengths its slots shift by (both for max_seqlen's unchecked
# tables), which grew the structs by 8 and 24 bytes.
# The fifty-fourth session's: AttnFwdParams' and AttnBwdParams' packed row counts that varlen
# offsets are clamped into (attention_varlen's unchecked device offsets), 8 bytes each.
_MAX_SEQLEN_FIELDS = re.compile(r"^  (int num_pages|const int\* dst_base|int\* len_out|int per_seq|int base_max"
                                r"|int total_q|int total_k);\n", re.M)


def _render_digest(spec) -> str:
    unit = _MAX_SEQLEN_FIELDS.sub("", _PDL_LINES.sub("", _SMEM_ASSERT.sub("", render(spec))))
    unit = unit.replace("sizeof(DecodeParams) == 376", "sizeof(DecodeParams) == 368")
    unit = unit.replace("sizeof(KvAppendParams) == 256", "sizeof(KvAppendParams) == 232")
    unit = unit.replace("sizeof(AttnFwdParams) == 312", "sizeof(AttnFwdParams) == 304")
    unit = unit.replace("sizeof(AttnBwdParams) == 440", "sizeof(AttnBwdParams) == 432")
    unit = unit.replace("sizeof(PagedFwdParams) == 424", "sizeof(PagedFwdParams) == 416")
    return hashlib.sha256(unit.encode()).hexdigest()[:16]


def _facts(spec, reasons: dict) -> list:
    """``[threads, shared_bytes, tiles, grid, render digest]``; the rendered unit holds the template
    id, the entry name, the launch bounds, the header and the params struct."""
    t = spec.tiles
    tiles = [t.block_m, t.block_n, t.warps, t.min_blocks, t.m_tiles, t.stages, t.overlap,
             reasons.setdefault(t.reason, len(reasons))]
    try:
        grid = list(spec.grid(2, 3, 1000, slots=132))  # slots: a persistent kernel's (one block an H100 SM)
    except ZeroDivisionError:  # kv_append (block_m 0): launched by its own grid-stride rule
        grid = None
    return [spec.threads, spec.shared_bytes, tiles, grid, _render_digest(spec)]


def _curated(arch: str) -> list:
    """The variants the ops and ``pyattn warmup`` produce on ``arch`` (see the module docstring)."""
    specs = warmup_specs(arch) + decode_specs(arch, HEAD_DIM_BUCKETS, (1, 2))
    for name in DTYPES:
        for d in HEAD_DIM_BUCKETS:
            specs.append(select_attention_spec(name, d, arch, ptx=True))
            specs.append(select_attention_spec(name, d, arch, mask=("bool", "f16", "bf16", "f32")[d // 64 % 4],
                                               softcap=d % 64 == 0, alibi=d > 128))
            specs.append(select_attention_spec(name, d, arch, allow_tf32=True, softcap=True))
            tag = DTYPES[name][0]
            specs += [KernelSpec("merge_states", tag, d, arch), KernelSpec("attn_sparse", tag, d, arch)]
            if tag != "f32":
                for sp in (1, 2):  # block-sparse: the tensor-core kernel attention picks, then mma.sync with mods
                    specs.append(select_attention_spec(name, d, arch, sparse=sp))
                    specs.append(select_attention_spec(name, d, arch, softcap=True, sparse=sp))
                for mt in range(1, decode_max_q_tiles(arch, d) + 1):
                    specs += [KernelSpec("attn_decode", tag, d, arch, q_tiles=mt, softcap=sc, alibi=al)
                              for sc, al in ((True, False), (False, True), (True, True))]
                for kv in ("int8", "fp8e4m3"):
                    if d in (64, 128, 256):
                        specs += [KernelSpec("attn_decode", tag, d, arch, q_tiles=mt, kv=kv, softcap=mt == 1)
                                  for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1)]
        if DTYPES[name][0] != "f32":
            specs += [KernelSpec("kv_append", DTYPES[name][0], 32, arch, kv=kv) for kv in KV_KINDS]
    return list(dict.fromkeys(specs + standard_specs(arch)))


def _exhaustive(family: str, arch: str) -> str:
    """Digest over every in-domain field combination of ``family`` on ``arch``: facts or error."""
    h, reasons = hashlib.sha256(), {}
    for dtype, d, mask, softcap, alibi, q_tiles, sparse, kv in itertools.product(
            ("f32", "f16", "bf16"), HEAD_DIM_BUCKETS, MASK_KINDS, (False, True), (False, True), (0, 1, 2),
            (0, 1, 2), KV_KINDS):
        try:
            spec = KernelSpec(family, dtype, d, arch, False, mask, softcap, alibi, q_tiles, sparse, kv)
        except ValueError as exc:
            h.update(f"{dtype},{d},{mask},{softcap},{alibi},{q_tiles},{sparse},{kv}: {exc}\n".encode())
            continue
        h.update(json.dumps([spec.describe(), _facts(spec, reasons)], sort_keys=True).encode() + b"\n")
    for d, kv, sparse in itertools.product(HEAD_DIM_BUCKETS, KV_KINDS, (0, 1, 2)):
        try:
            t = tuple(tile_config(family, arch, d, kv, sparse))
        except ValueError as exc:
            t = str(exc)
        h.update(json.dumps([d, kv, sparse, t]).encode() + b"\n")
    return h.hexdigest()[:16]


def snapshot() -> dict:
    """Everything the snapshot file holds, computed from the code as it is now."""
    reasons, specs = {}, {}
    for arch in SUPPORTED_ARCHS:
        for spec in _curated(arch):
            specs[spec.describe()] = _facts(spec, reasons)
    exhaustive = {f"{family}@{arch}": _exhaustive(family, arch) for family in FAMILY_NAMES
                  for arch in SUPPORTED_ARCHS}
    return {"reasons": list(reasons), "specs": specs, "exhaustive": exhaustive}


@pytest.fixture(scope="module")
def pinned():
    return json.loads(SNAPSHOT.read_text())


@pytest.fixture(scope="module")
def now():
    return snapshot()


def test_reasons_are_the_pinned_ones(pinned, now):
    assert now["reasons"] == pinned["reasons"]


def test_every_pinned_spec_derives_the_same_facts(pinned, now):
    assert sorted(now["specs"]) == sorted(pinned["specs"])
    for name, facts in pinned["specs"].items():
        assert now["specs"][name] == facts, name


def test_every_field_combination_validates_and_derives_as_before(pinned, now):
    changed = [k for k, v in pinned["exhaustive"].items() if now["exhaustive"][k] != v]
    assert not changed


if __name__ == "__main__":  # regenerate (see the module docstring)
    snap = snapshot()
    lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(snap.pop("specs").items())]
    body = json.dumps(snap, indent=1, sort_keys=True)[:-2]  # one spec per line, for readable diffs
    SNAPSHOT.parent.mkdir(exist_ok=True)
    SNAPSHOT.write_text(body + ',\n "specs": {\n' + ",\n".join(lines) + "\n }\n}\n")
    print(f"wrote {SNAPSHOT}")

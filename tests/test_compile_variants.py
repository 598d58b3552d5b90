"""NVRTC compilation of every kernel variant: the warm-up set per arch, and the modifier, TMA, fp8,
block-sparse, 8-bit decode, backward, per-channel and SparQ variants per arch.

CPU only: NVRTC needs no GPU or driver. Compiling all 5 archs x 32-40 variants happens once per
session (into ``session_cache_dir``, which ``test_cli``'s ``demo`` reuses), then reads are cheap.

What a cubin says about its arch, checked empirically with NVRTC 13.x:

* it is an ELF64 file for ``EM_CUDA`` (machine 190);
* the SM number sits in ``e_flags``: bits 8..15 when ``e_ident[EI_ABIVERSION] >= 8`` (CUDA 12.8+
  cubins; e.g. sm_90a -> 0x..5a..), bits 0..7 in the older ABI. The flags do not distinguish
  sm_90 from sm_90a;
* NVRTC records its target in a note as the text ``-arch sm_90a `` (with the trailing space), which
  does distinguish the ``a`` variants.

Compile errors, the toolchain fingerprint and header discovery are test_compile_nvrtc.py's; the
ParamStruct layouts checked by NVRTC test_compile_layout.py's.
"""

from __future__ import annotations

import re
import struct

import pytest

import pyattn.jit as jit
from pyattn.jit.cache import KernelCache
from pyattn.kernels.families import WGMMA_ARCHS
from pyattn.kernels.specs import KernelSpec, warmup_specs

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
EM_CUDA = 190


def _all_specs():
    return [s for a in ARCHS for s in warmup_specs(a)]


def _elf_sm(image: bytes) -> int:
    """The SM number a cubin's ELF header declares (see the module docstring)."""
    (e_flags,) = struct.unpack_from("<I", image, 48)
    return (e_flags >> 8) & 0xFF if image[8] >= 8 else e_flags & 0xFF


@pytest.fixture(scope="module")
def built(session_cache_dir):
    """build_many over every standard variant of every arch, once; returns [(spec, meta, built, image)]."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYATTN_CACHE_DIR", str(session_cache_dir))
        specs = _all_specs()
        results = jit.build_many(specs, workers=2)
        cache = KernelCache(session_cache_dir)
        fp = jit.toolchain_fingerprint()
        out = []
        for spec, meta, was_built in results:
            hit = cache.get(spec.cache_key(fp))
            assert hit is not None, f"{spec.describe()} missing from the cache after build_many"
            out.append((spec, meta, was_built, hit[0]))
        return out


def test_build_many_returns_one_result_per_spec_in_order(built):
    specs = _all_specs()
    # 158 attention variants (sm_90a: 30) + 8 paged-cache kernels per arch (+ 6 TMA decode and 6 of its
    # swapped-role blocks on sm_90a), + on sm_90a the fp8 attention variants (d = 128, 256) and their V^T pass
    assert len(specs) == 213
    assert [s for s, *_ in built] == specs


def test_every_variant_is_a_cubin_for_its_arch(built):
    for spec, meta, _, image in built:
        what = spec.describe()
        assert meta["format"] == "cubin", what
        assert meta["entry"] == spec.entry_name and meta["spec"] == what
        assert image[:4] == b"\x7fELF", what
        assert image[4] == 2, what  # ELFCLASS64
        assert struct.unpack_from("<H", image, 18)[0] == EM_CUDA, what
        assert _elf_sm(image) == int(re.match(r"sm_(\d+)", spec.arch).group(1)), what
        assert f"-arch {spec.arch} ".encode() in image, what
        others = [a for a in ARCHS if a != spec.arch]
        assert not any(f"-arch {a} ".encode() in image for a in others), what
        assert spec.entry_name.encode() + b"\0" in image, what  # the extern "C" symbol, unmangled


def test_second_build_many_compiles_nothing(built, session_cache_dir, monkeypatch):
    monkeypatch.setenv("PYATTN_CACHE_DIR", str(session_cache_dir))
    again = jit.build_many(_all_specs(), workers=2)
    assert len(again) == len(_all_specs())
    assert [b for _, _, b in again] == [False] * len(again)
    assert [m["entry"] for _, m, _ in again] == [m["entry"] for _, m, _, _ in built]


def _cubins(specs, session_cache_dir, monkeypatch) -> list:
    """Build ``specs`` into the session cache (two workers); each must give a cubin under its own
    entry name. Returns the specs."""
    monkeypatch.setenv("PYATTN_CACHE_DIR", str(session_cache_dir))
    for spec, meta, _ in jit.build_many(specs, workers=2):
        assert meta["format"] == "cubin" and meta["entry"] == spec.entry_name
    return specs


def _modifier_specs(arch):
    """Score-modifier variants for ``arch``: every family/dtype with soft-cap + ALiBi and a mask kind
    (all four kinds across the list), at the smallest and largest head-dim buckets."""
    kinds = ("bool", "f16", "bf16", "f32")
    pairs = [("attn_fwd_mma", "f16"), ("attn_fwd_mma", "bf16"), ("attn_fwd_simt", "f32"), ("attn_fwd_simt", "bf16")]
    specs = [KernelSpec(fam, dt, d, arch, mask=kinds[(i + j) % 4], softcap=True, alibi=True)
             for i, (fam, dt) in enumerate(pairs) for j, d in enumerate((32, 256))]
    # decode takes no mask tensor; two row tiles at d=32 (its largest q_tiles), one at d=256
    specs += [KernelSpec("attn_decode", "bf16", d, arch, softcap=True, alibi=True, q_tiles=mt)
              for d, mt in ((32, 2), (256, 1))]
    if arch in WGMMA_ARCHS:  # the TMA decode's swapped-role blocks (up to 8 rows), 16-bit caches
        specs += [KernelSpec("attn_decode_swap", "f16", d, arch, softcap=True, alibi=True, q_tiles=1) for d in (64, 256)]
    return specs


def test_tma_variants_with_modifiers_compile(session_cache_dir, monkeypatch):
    """attn_fwd_tma (sm_90a only): every bucket its table has, fp16 and bf16, with soft-cap + ALiBi
    and (the row's own tile: ALiBi may take fewer warpgroups) with a soft-cap alone; every row of
    its mask tables (bool masks: packed to bits, on the dense rows)."""
    from pyattn.kernels.families import tile_table

    specs = [KernelSpec("attn_fwd_tma", tag, r.max_head_dim, "sm_90a", softcap=True, alibi=alibi)
             for r in tile_table("attn_fwd_tma", "sm_90a") for tag in ("f16", "bf16") for alibi in (True, False)]
    # Mask tensors: every mask table's rows, alone (the fast path that skips the mask-free tiles)
    # and with the other modifiers.
    specs += [KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", mask=mask, **mods)
              for mask, table in (("bits", "dense"), ("f16", "mask2"), ("f32", "mask4"), ("bf16_row", "dense"),
                                  ("f32_row", "dense"))
              for r in tile_table("attn_fwd_tma", "sm_90a", table=table)
              for mods in ({}, {"softcap": True, "alibi": True})]
    assert {s.head_dim for s in specs} == {64, 128, 192, 256}
    for spec in _cubins(specs, session_cache_dir, monkeypatch):
        assert spec.entry_name.startswith("pyattn_attn_fwd_tma_")
        assert spec.entry_name.endswith(("_softcap_alibi", "_softcap")) or spec.mask != "none"
    # and the kernel that packs bool masks for it
    [bits] = _cubins([KernelSpec("mask_bits", "f16", 32, "sm_90a")], session_cache_dir, monkeypatch)
    assert bits.entry_name == "pyattn_mask_bits_f16_d32_m0n0w8"


def test_fp8_variants_with_modifiers_compile(session_cache_dir, monkeypatch):
    """attn_fwd_fp8 (sm_90a only): every row of its table with soft-cap + ALiBi, and with a bool mask
    packed to bits (warm-up builds the plain ones and the fp8_vt pass)."""
    from pyattn.kernels.families import tile_table

    specs = [KernelSpec("attn_fwd_fp8", "e4m3", r.max_head_dim, "sm_90a", **mods)
             for r in tile_table("attn_fwd_fp8", "sm_90a")
             for mods in ({"softcap": True, "alibi": True}, {"mask": "bits", "softcap": True})]
    assert {s.head_dim for s in specs} == {128, 256}
    for spec in _cubins(specs, session_cache_dir, monkeypatch):
        assert spec.entry_name.startswith("pyattn_attn_fwd_fp8_e4m3_")


@pytest.mark.parametrize("arch", ARCHS)
def test_modifier_variants_compile_for_every_arch(arch, session_cache_dir, monkeypatch):
    specs = _modifier_specs(arch)
    assert {s.mask for s in specs} == {"bool", "f16", "bf16", "f32", "none"}
    for spec in _cubins(specs, session_cache_dir, monkeypatch):
        mask = f"_mask{spec.mask}" if spec.mask != "none" else ""
        assert spec.entry_name.endswith(f"{mask}_softcap_alibi")


def _sparse_and_quant_specs(arch):
    """The block-sparse prefill variants (plain and with soft-cap, which runs on mma.sync) and the
    8-bit-cache decode kernels of ``arch`` (cp.async, and on sm_90a the TMA-fed one, with m16 row
    tiles and with swapped roles, page boxes or gathered rows), at the head-dim extremes of each."""
    from pyattn.kernels.specs import select_attention_spec

    specs = [select_attention_spec(dt, d, arch, softcap=cap, sparse=sp)
             for dt, d, cap, sp in (("float16", 64, False, 1), ("bfloat16", 256, False, 1), ("bfloat16", 128, True, 1),
                                    ("bfloat16", 128, False, 2), ("float16", 256, True, 2))]
    specs += [KernelSpec("attn_decode", tag, d, arch, q_tiles=1, kv=kv, softcap=mods, alibi=mods)
              for tag, d, kv, mods in (("f16", 64, "int8", True), ("bf16", 128, "fp8e4m3", False),
                                       ("bf16", 256, "int8", False), ("f16", 128, "fp8e4m3", True))]
    if arch in WGMMA_ARCHS:  # the TMA-fed 8-bit decode (128-column boxes; per-token or per-channel keys)
        specs += [KernelSpec("attn_decode_tma", tag, d, arch, q_tiles=1, kv=kv, softcap=mods, alibi=mods,
                             key_channel=kc)
                  for tag, d, kv, mods, kc in (("bf16", 128, "int8", False, False), ("f16", 128, "fp8e4m3", True, False),
                                               ("bf16", 256, "fp8e4m3", False, True), ("f16", 256, "int8", True, False),
                                               ("bf16", 128, "int8", True, True))]
        # up to 8 rows: the same kernel with the keys on the MMAs' M side
        specs += [KernelSpec("attn_decode_swap", tag, d, arch, q_tiles=1, kv=kv, softcap=mods, alibi=mods,
                             key_channel=kc)
                  for tag, d, kv, mods, kc in (("bf16", 128, "int8", False, False), ("f16", 128, "fp8e4m3", True, True),
                                               ("bf16", 256, "fp8e4m3", True, False), ("f16", 256, "int8", False, True))]
        # pages TMA boxes do not take: the producers gather the rows (per-token keys)
        specs += [KernelSpec(family, tag, d, arch, q_tiles=1, kv=kv, softcap=mods, alibi=mods, gather=True)
                  for family, tag, d, kv, mods in (("attn_decode_swap", "bf16", 128, "int8", False),
                                                   ("attn_decode_swap", "f16", 256, "fp8e4m3", True),
                                                   ("attn_decode_tma", "f16", 128, "fp8e4m3", True),
                                                   ("attn_decode_tma", "bf16", 256, "int8", False))]
    return specs


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_and_quantized_decode_variants_compile_for_every_arch(arch, session_cache_dir, monkeypatch):
    for spec in _cubins(_sparse_and_quant_specs(arch), session_cache_dir, monkeypatch):
        assert spec.entry_name.endswith(("_sparse", "_sparse64")) or "_kv" in spec.entry_name


def _backward_specs(arch):
    """The backward's kernels of ``arch``: both row kernels of a 16-bit and the fp32 dtype, and the main
    kernel of each path (tensor cores at d=128 with both modifiers and at d=64: mma.sync with P in
    registers, or wgmma on sm_90a; mma.sync's split path at d=256; CUDA cores at d=64 with both
    modifiers).
    ``backward_specs(arch)`` lists all 30 per arch; compiling them all for every arch is a dev
    check (about a minute here), not CI's."""
    from pyattn.kernels.specs import select_backward_specs

    specs = [s for dt, d, mods in (("float16", 128, {"softcap": True, "alibi": True}), ("bfloat16", 64, {}),
                                   ("bfloat16", 256, {}), ("float32", 64, {"softcap": True, "alibi": True}))
             for s in select_backward_specs(dt, d, arch, **mods)]
    return list(dict.fromkeys(specs))


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_variants_compile_for_every_arch(arch, session_cache_dir, monkeypatch):
    specs = _backward_specs(arch)
    # sm_90a: the warpgroup-MMA main kernel up to d=128, mma.sync's at d=256
    wgmma = {"attn_bwd_wgmma"} if arch == "sm_90a" else set()
    assert {s.family for s in specs} == {"attn_bwd_pre", "attn_bwd_mma", "attn_bwd_simt", "attn_bwd_convert"} | wgmma
    _cubins(specs, session_cache_dir, monkeypatch)


def _issue13_specs(arch):
    """The per-channel key-scale and SparQ kernels of ``arch``: every family and template argument,
    spread over the archs to keep CI short (each compiles once per session; fp8 decode where the
    conversion is one instruction, sm_89+, as sm_80/86's software one is the slow compile)."""
    fp8 = arch in ("sm_89", "sm_90a")
    specs = [KernelSpec("kv_key_pages", "bf16", 32, arch, kv="int8"), KernelSpec("kv_key_pages", "f16", 32, arch,
                                                                                 kv="fp8e4m3"),
             KernelSpec("kv_sparq", "f16" if fp8 else "bf16", 32, arch),
             *(KernelSpec(f"sparq_{st}", "bf16", 32, arch) for st in ("score", "select")),
             KernelSpec("attn_decode", "bf16", 128, arch, q_tiles=1, kv="fp8e4m3" if fp8 else "int8", key_channel=True)]
    if arch == "sm_80":
        specs += [KernelSpec(f"sparq_{st}", "f16", 32, arch) for st in ("score", "select")]
    if arch == "sm_90a":
        specs += [KernelSpec("attn_decode", "f16", 64, arch, q_tiles=1, kv="fp8e4m3", key_channel=True, softcap=True,
                             alibi=True),
                  KernelSpec("attn_decode", "bf16", 256, arch, q_tiles=1, kv="int8", key_channel=True)]
    return specs


@pytest.mark.parametrize("arch", ARCHS)
def test_per_channel_and_sparq_variants_compile_for_every_arch(arch, session_cache_dir, monkeypatch):
    specs = _issue13_specs(arch)
    assert {s.family for s in specs} == {"kv_key_pages", "kv_sparq", "sparq_score", "sparq_select", "attn_decode"}
    for spec in _cubins(specs, session_cache_dir, monkeypatch):
        assert not spec.key_channel or spec.entry_name.endswith("_kch")

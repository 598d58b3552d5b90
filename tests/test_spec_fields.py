"""KernelSpec itself (CPU only, no compiler): field validation, frozen and hashable specs, the
standard spec lists and their entry names, compile options, ``describe`` and the cache keys (every
field, the toolchain, the compile options and the rendered source change them)."""

from __future__ import annotations

import re

import pytest

from _specs_helpers import ARCHS, DTYPE_NAMES, HEADER_FOR, _expected
from pyattn.jit.source import render
from pyattn.kernels.families import MmaTile, override_tiles, tile_table
from pyattn.kernels.families.base import FixedTile
from pyattn.kernels.specs import DTYPES, HEAD_DIM_BUCKETS, MAX_HEAD_DIM, KernelSpec, standard_specs

TOOLCHAIN = "nvrtc=13.0;headers=13.0@/x;src=abc;pyattn=0.0"


@pytest.mark.parametrize("kwargs, match", [
    ({"family": "attn_fwd_wgmma2"}, r"^family: expected one of .*got 'attn_fwd_wgmma2'"),
    ({"family": "attn_fwd_wgmma", "head_dim": 96}, r"^family: attn_fwd_wgmma takes"),
    ({"family": "attn_fwd_wgmma", "arch": "sm_80"}, r"^family: attn_fwd_wgmma takes"),
    ({"family": "attn_fwd_wgmma", "dtype": "f32"}, r"^family: attn_fwd_wgmma takes"),
    ({"family": "attn_fwd"}, r"^family:"),
    ({"family": "attn_fwd_mma", "dtype": "f32"}, r"^dtype:"),  # tensor cores take 16-bit inputs only
    ({"family": "attn_fwd_mma", "dtype": "f64"}, r"^dtype:"),
    ({"family": "attn_fwd_mma", "head_dim": 48}, r"^head_dim: expected one of"),
    ({"family": "attn_fwd_mma", "arch": "sm_75"}, r"^arch: expected one of"),
    ({"dtype": "f64"}, r"^dtype: expected one of \['bf16', 'e4m3', 'f16', 'f32'\], got 'f64'"),
    ({"dtype": "float16"}, r"^dtype:"),  # the NumPy name is not a spec tag
    ({"head_dim": 48}, r"^head_dim: expected one of"),
    ({"head_dim": 0}, r"^head_dim:"),
    ({"head_dim": 288}, r"^head_dim:"),
    ({"arch": "sm_75"}, r"^arch: expected one of"),
    ({"arch": "sm_90"}, r"^arch:"),  # sm_90a only: the 'a' features never run elsewhere
    ({"arch": "sm_120"}, r"^arch:"),
    ({"arch": "compute_90a"}, r"^arch:"),
])
def test_spec_validation(kwargs, match):
    base = {"family": "attn_fwd_simt", "dtype": "f16", "head_dim": 64, "arch": "sm_90a"}
    with pytest.raises(ValueError, match=match):
        KernelSpec(**{**base, **kwargs})


@pytest.mark.parametrize("family, dtype", [("attn_fwd_simt", "f32"), ("attn_fwd_simt", "f16"),
                                           ("attn_fwd_simt", "bf16"), ("attn_fwd_mma", "f16"),
                                           ("attn_fwd_mma", "bf16")])
def test_spec_accepts_every_family_dtype_pair_the_kernels_compile(family, dtype):
    # the SIMT kernel still compiles for every dtype; only selection keeps it to fp32
    spec = KernelSpec(family, dtype, 128, "sm_90a")
    assert (spec.family, spec.dtype) == (family, dtype)
    assert spec.header == HEADER_FOR[family]


def test_spec_is_frozen_and_hashable():
    for family in ("attn_fwd_simt", "attn_fwd_mma"):
        a = KernelSpec(family, "f16", 64, "sm_90a")
        b = KernelSpec(family, "f16", 64, "sm_90a")
        assert a == b and hash(a) == hash(b) and len({a, b}) == 1
        with pytest.raises(AttributeError):
            a.head_dim = 128
    assert KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a") != KernelSpec("attn_fwd_mma", "f16", 64, "sm_90a")


@pytest.mark.parametrize("arch", ARCHS)
def test_standard_specs_cover_every_dtype_and_bucket(arch):
    specs = standard_specs(arch)
    # sm_90a: the TMA kernel's 4 buckets, and its short row (q_tiles 1) where a short call (under a
    # dense row's min_keys: d = 64) runs, that row's small-grid row (q_tiles 2), and the d = 128
    # row's variant with the last round split by keys (q_tiles 3)
    short = {r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a") if r.min_keys > 1}
    assert short == {r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="short")} == {64}
    assert len(specs) == len(set(specs)) == (30 if arch == "sm_90a" else 32)
    assert {(s.dtype, s.head_dim) for s in specs if s.q_tiles == 3} == (
        {("f16", 128), ("bf16", 128)} if arch == "sm_90a" else set())
    assert {(s.family, s.dtype, s.head_dim) for s in specs} == {
        (*_expected(name, arch, d)[:1], DTYPES[name][0], _expected(name, arch, d)[1])
        for name in DTYPE_NAMES for d in HEAD_DIM_BUCKETS} | {
        ("attn_fwd_tf32", "f32", d) for d in HEAD_DIM_BUCKETS}  # allow_tf32=True
    for q_tiles in (1, 2):
        assert {(s.dtype, s.head_dim) for s in specs if s.q_tiles == q_tiles} == (
            {(tag, d) for tag in ("f16", "bf16") for d in short} if arch == "sm_90a" else set())
    by_kind = {}
    for s in specs:
        by_kind[(s.family, s.dtype)] = by_kind.get((s.family, s.dtype), 0) + 1
    tc = "attn_fwd_tma" if arch == "sm_90a" else "attn_fwd_mma"
    n = 7 if arch == "sm_90a" else 8  # sm_90a: 4 buckets, the short row, its small-grid row, d = 128 split
    assert by_kind == {("attn_fwd_simt", "f32"): 8, (tc, "f16"): n, (tc, "bf16"): n, ("attn_fwd_tf32", "f32"): 8}
    assert all(s.arch == arch and not s.ptx for s in specs)


@pytest.mark.parametrize("arch", ARCHS)
def test_entry_names_are_unique_c_identifiers(arch):
    names = [s.entry_name for s in standard_specs(arch)]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names)
    # one arch's cubin holds one spec; across archs (arch, entry) pairs stay distinct too
    everything = [(s.arch, s.entry_name) for a in ARCHS for s in standard_specs(a)]
    assert len(set(everything)) == len(everything) == 32 * len(ARCHS) - 2  # sm_90a: 30 variants


def test_compile_options():
    spec = KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a")
    opts = spec.compile_options(("/inc/a", "/inc/b"))
    assert opts[0] == "-arch=sm_90a"
    assert opts[-2:] == ("-I/inc/a", "-I/inc/b")
    assert "-std=c++17" in opts
    # NVRTC's own compute-cache lookups initialise the driver in a process that only compiles
    assert "--no-cache" in opts
    assert spec.replace(ptx=True).compile_options()[0] == "-arch=compute_90a"
    assert KernelSpec("attn_fwd_simt", "f16", 64, "sm_100a", True).compile_options()[0] == "-arch=compute_100a"
    mma = KernelSpec("attn_fwd_mma", "bf16", 128, "sm_80")
    assert mma.compile_options()[0] == "-arch=sm_80"
    assert mma.replace(ptx=True).compile_options()[0] == "-arch=compute_80"


def test_describe_names_the_variant():
    assert KernelSpec("attn_fwd_simt", "bf16", 96, "sm_89").describe() == "attn_fwd_simt[bf16, d=96, sm_89]"
    assert KernelSpec("attn_fwd_simt", "bf16", 96, "sm_89", True).describe().endswith(", ptx]")
    assert KernelSpec("attn_fwd_mma", "f16", 256, "sm_90a").describe() == "attn_fwd_mma[f16, d=256, sm_90a]"


# --------------------------------------------------------------------------------------------
# Cache keys
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["attn_fwd_simt", "attn_fwd_mma"])
def test_cache_key_is_stable(family):
    a = KernelSpec(family, "f16", 64, "sm_90a")
    key = a.cache_key(TOOLCHAIN)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert key == a.cache_key(TOOLCHAIN) == KernelSpec(family, "f16", 64, "sm_90a").cache_key(TOOLCHAIN)


def test_cache_key_differs_for_every_field_and_toolchain():
    base = KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a")
    variants = [base, base.replace(dtype="bf16"), base.replace(dtype="f32"),
                base.replace(head_dim=96), base.replace(arch="sm_100a"),
                base.replace(ptx=True), base.replace(family="attn_fwd_mma"),
                base.replace(mask="bool"), base.replace(mask="f32"),
                base.replace(softcap=True), base.replace(alibi=True),
                base.replace(family="attn_decode", q_tiles=1),
                base.replace(family="attn_decode", q_tiles=2),
                base.replace(family="attn_decode", q_tiles=1, kv="int8"),
                base.replace(family="attn_decode", q_tiles=1, kv="int8", key_channel=True),
                base.replace(family="attn_decode_swap", head_dim=128, q_tiles=1, kv="int8"),
                base.replace(family="attn_decode_swap", head_dim=128, q_tiles=1, kv="int8", gather=True)]
    # every field of the spec is covered above
    assert set(KernelSpec.FIELDS) == {"family", "dtype", "head_dim", "arch", "ptx",
                                                                 "mask", "softcap", "alibi", "q_tiles", "sparse", "kv",
                                                                 "key_channel", "gather"}
    keys = {v.cache_key(TOOLCHAIN) for v in variants}
    keys |= {base.cache_key(TOOLCHAIN.replace("nvrtc=13.0", "nvrtc=13.1")),
             base.cache_key(TOOLCHAIN.replace("src=abc", "src=abd")),
             base.cache_key(TOOLCHAIN.replace("pyattn=0.0", "pyattn=0.1"))}
    assert len(keys) == len(variants) + 3


def test_cache_key_keys_are_unique_across_all_standard_specs():
    keys = [s.cache_key(TOOLCHAIN) for a in ARCHS for s in standard_specs(a)]
    assert len(set(keys)) == len(keys)


def test_cache_key_changes_with_compile_options(monkeypatch):
    spec = KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a")
    before = spec.cache_key(TOOLCHAIN)
    original = KernelSpec.compile_options
    monkeypatch.setattr(KernelSpec, "compile_options", lambda self, inc=(): original(self, inc) + ("-use_fast_math",))
    assert spec.cache_key(TOOLCHAIN) != before


def test_cache_key_changes_with_the_rendered_source():
    spec = KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a")
    before_key, before_src = spec.cache_key(TOOLCHAIN), render(spec)
    with override_tiles("attn_fwd_simt", "sm_90a", (FixedTile(MAX_HEAD_DIM, 32, 32, 8, "test"),)):
        assert render(spec) != before_src  # what NVRTC compiles changed ...
        assert spec.cache_key(TOOLCHAIN) != before_key  # ... so the key must too
    assert spec.cache_key(TOOLCHAIN) == before_key  # and the table is back after the block


@pytest.mark.parametrize("change", ["block_n", "warps", "m_tiles", "min_blocks"])
def test_mma_cache_key_changes_with_the_tile_table(change):
    spec = KernelSpec("attn_fwd_mma", "bf16", 128, "sm_90a")
    t = spec.tiles
    before_key, before_src = spec.cache_key(TOOLCHAIN), render(spec)
    new = {"block_n": t.block_n, "warps": t.warps, "m_tiles": t.m_tiles, "min_blocks": t.min_blocks}
    new[change] += 16 if change == "block_n" else 1
    table = (MmaTile(MAX_HEAD_DIM, new["block_n"], new["warps"], new["m_tiles"], new["min_blocks"], "test"),)
    with override_tiles("attn_fwd_mma", "sm_90a", table):
        assert tuple(spec.tiles)[:3] + (spec.tiles.min_blocks, spec.tiles.m_tiles) != (
            t.block_m, t.block_n, t.warps, t.min_blocks, t.m_tiles)  # the override took effect
        assert render(spec) != before_src
        assert spec.cache_key(TOOLCHAIN) != before_key
        assert KernelSpec("attn_fwd_mma", "bf16", 128, "sm_80").cache_key(TOOLCHAIN) != before_key

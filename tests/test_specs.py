"""Kernel specs, parameter structs, arch mapping and source rendering (CPU only, no compiler)."""

from __future__ import annotations

import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyattn import PyattnError
from pyattn.jit.source import kernel_headers, render
from pyattn.kernels.families import MmaTile, override_tiles, tile_table
from pyattn.kernels.families.base import FixedTile
from pyattn.kernels.params import ATTN_FWD_PARAMS, ParamStruct
from pyattn.kernels.specs import (DTYPES, HEAD_DIM_BUCKETS, MASK_KINDS, MAX_HEAD_DIM, KernelSpec, TileConfig,
                                  select_attention_spec, standard_specs, tile_config)
from pyattn.runtime.device import SUPPORTED_ARCHS, arch_for_capability

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# Opt-in shared memory per block (bytes), from the CUDA programming guide's per-capability table.
OPTIN_SMEM = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024,
              "sm_90a": 227 * 1024, "sm_100a": 227 * 1024}
# Resident threads per SM, same table.
MAX_THREADS_PER_SM = {"sm_80": 2048, "sm_86": 1536, "sm_89": 1536, "sm_90a": 2048, "sm_100a": 2048}
# Which family serves which dtype: fp32 stays on CUDA cores, 16-bit inputs go to the tensor cores.
FAMILY_FOR = {"float32": "attn_fwd_simt", "float16": "attn_fwd_mma", "bfloat16": "attn_fwd_mma"}
HEADER_FOR = {"attn_fwd_simt": "attention_fwd.cuh", "attn_fwd_mma": "attention_fwd_mma.cuh",
              "attn_fwd_tf32": "attention_fwd_tf32.cuh", "attn_fwd_wgmma": "attention_fwd_wgmma.cuh",
              "attn_fwd_tma": "attention_fwd_tma.cuh"}
TRAITS_FOR = {"attn_fwd_simt": "AttnFwdSimtTraits", "attn_fwd_mma": "AttnFwdMmaTraits",
              "attn_fwd_tf32": "AttnFwdTf32Traits", "attn_fwd_wgmma": "AttnFwdWgmmaTraits",
              "attn_fwd_tma": "AttnFwdWgmmaTraits"}


def _expected(dtype_name, arch, d):
    """(family, bucket) that a plain (long) call selects: on sm_90a 16-bit inputs go to the TMA-fed
    wgmma kernel (64-wide buckets; every bucket has a TMA row)."""
    if arch == "sm_90a" and dtype_name != "float32":
        return "attn_fwd_tma", -(-d // 64) * 64
    return FAMILY_FOR[dtype_name], min(b for b in HEAD_DIM_BUCKETS if b >= d)
TOOLCHAIN = "nvrtc=13.0;headers=13.0@/x;src=abc;pyattn=0.0"


def test_supported_archs_are_the_documented_ones():
    assert tuple(SUPPORTED_ARCHS) == ARCHS


# --------------------------------------------------------------------------------------------
# Spec selection
# --------------------------------------------------------------------------------------------
def test_head_dim_buckets_fit_the_kernel():
    assert list(HEAD_DIM_BUCKETS) == sorted(set(HEAD_DIM_BUCKETS))
    assert MAX_HEAD_DIM == HEAD_DIM_BUCKETS[-1] == 256
    assert all(b % 32 == 0 for b in HEAD_DIM_BUCKETS)  # kernel: static_assert(HEAD_DIM % 32 == 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_select_picks_the_smallest_bucket_not_below_head_dim(dtype_name, arch):
    for d in range(8, 257, 8):
        spec = select_attention_spec(dtype_name, d, arch)
        family, bucket = _expected(dtype_name, arch, d)
        assert spec.head_dim == bucket, d
        assert spec.head_dim >= d and spec.head_dim - d < (64 if arch == "sm_90a" and family != FAMILY_FOR[
            dtype_name] else 32)
        assert (spec.dtype, spec.arch, spec.ptx, spec.family) == (DTYPES[dtype_name][0], arch, False, family)
        # score modifiers take the same family and bucket (wgmma on sm_90a compiles them in), except an
        # f32 mask at d=256, whose tiles do not fit the TMA kernel's ring (the cp.async one copies them)
        for mods in (dict(softcap=True), dict(alibi=True), dict(mask="bool"), dict(mask="f32", softcap=True)):
            m = select_attention_spec(dtype_name, d, arch, **mods)
            same = family.replace("attn_fwd_tma", "attn_fwd_wgmma") \
                if mods.get("mask") == "f32" and spec.head_dim == 256 else family
            assert (m.family, m.head_dim) == (same, spec.head_dim), mods
        assert spec in standard_specs(arch)  # warmup precompiles everything attention can select


def test_allow_tf32_selects_the_tf32_family_for_float32_only():
    spec = select_attention_spec("float32", 100, "sm_80", allow_tf32=True)
    assert spec == KernelSpec("attn_fwd_tf32", "f32", 128, "sm_80") and spec in standard_specs("sm_80")
    assert spec.template_id == ("pyattn::attn_fwd_tf32<pyattn::AttnFwdTf32Traits<128, 32, 4, 1>, "
                                "pyattn::ScoreMods<0, 0, false>>")
    assert select_attention_spec("float16", 64, "sm_90a", allow_tf32=True).family == "attn_fwd_tma"
    assert select_attention_spec("float16", 64, "sm_80", allow_tf32=True).family == "attn_fwd_mma"
    with pytest.raises(ValueError, match="^dtype: the TF32 family takes f32"):
        KernelSpec("attn_fwd_tf32", "f16", 64, "sm_80")
    for arch, limit in (("sm_80", 163), ("sm_86", 99), ("sm_89", 99), ("sm_90a", 227), ("sm_100a", 227)):
        for d in HEAD_DIM_BUCKETS:
            assert KernelSpec("attn_fwd_tf32", "f32", d, arch).shared_bytes <= limit * 1024, (arch, d)


def test_select_spot_values_and_ptx_flag():
    assert select_attention_spec("float16", 8, "sm_80").head_dim == 32
    assert select_attention_spec("float16", 32, "sm_80").head_dim == 32
    assert select_attention_spec("float16", 40, "sm_80").head_dim == 64
    assert select_attention_spec("float32", 136, "sm_89").head_dim == 160
    assert select_attention_spec("bfloat16", 256, "sm_100a").head_dim == 256
    spec = select_attention_spec("bfloat16", 72, "sm_90a", ptx=True)
    assert spec == KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", ptx=True)
    spec = select_attention_spec("bfloat16", 72, "sm_90a", mask="bool")  # packed to bits, on the dense row
    assert spec == KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", mask="bits")
    assert spec.template_id == ("pyattn::attn_fwd_tma<pyattn::AttnFwdWgmmaTraits<__nv_bfloat16, 128, 128, 128, 2, 3, "
                                "true, 0, true, true, true>, pyattn::ScoreMods<5, 0, false>>")
    assert spec.shared_bytes == select_attention_spec("bfloat16", 72, "sm_90a").shared_bytes
    spec = select_attention_spec("bfloat16", 72, "sm_90a", mask="bool", tma=False)
    assert spec == KernelSpec("attn_fwd_wgmma", "bf16", 128, "sm_90a", mask="bool")
    spec = select_attention_spec("float16", 200, "sm_90a", mask="f32", softcap=True, alibi=True)
    assert spec.template_id.endswith("pyattn::ScoreMods<4, 1, true>, false>")
    assert spec.entry_name.endswith("_maskf32_softcap_alibi")
    spec = select_attention_spec("float16", 100, "sm_90a")
    assert spec.template_id == ("pyattn::attn_fwd_tma<pyattn::AttnFwdWgmmaTraits<__half, 128, 128, 128, 2, 3, "
                                "true, 0, true, true, true>, pyattn::ScoreMods<0, 0, false>>")
    # 2 consumer + 1 producer warpgroups, persistent ("p")
    assert spec.tiles.warps == 12 and spec.entry_name.endswith("_m128n128w12p")
    # + the stages' mbarriers and the query tile's two
    assert spec.threads == 384 and spec.shared_bytes == (128 + 2 * 3 * 128) * 128 * 2 + 16 * 3 + 16 + 1024
    assert select_attention_spec("float16", 64, "sm_86") == KernelSpec("attn_fwd_mma", "f16", 64, "sm_86")
    assert select_attention_spec("float32", 64, "sm_86") == KernelSpec("attn_fwd_simt", "f32", 64, "sm_86")
    assert select_attention_spec("float32", 200, "sm_90a", ptx=True) == KernelSpec("attn_fwd_simt", "f32", 224,
                                                                                    "sm_90a", ptx=True)


@pytest.mark.parametrize("d", [257, 264, 512])
def test_select_rejects_head_dim_above_max(d):
    with pytest.raises(ValueError, match=rf"^head_dim: at most 256 is supported, got {d}"):
        select_attention_spec("float16", d, "sm_90a")


def test_select_rejects_unsupported_arch():
    with pytest.raises(ValueError, match=r"^arch:"):
        select_attention_spec("float16", 64, "sm_75")
    with pytest.raises(ValueError, match=r"^arch:"):
        select_attention_spec("float32", 64, "sm_75")


def test_select_rejects_unknown_dtype():
    with pytest.raises(ValueError, match=r"^dtype: expected one of"):
        select_attention_spec("float64", 64, "sm_90a")
    with pytest.raises(ValueError, match=r"^dtype:"):
        select_attention_spec("f16", 64, "sm_90a")  # the spec tag is not a NumPy name


# --------------------------------------------------------------------------------------------
# KernelSpec validation and derived facts
# --------------------------------------------------------------------------------------------
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
    # dense row's min_keys: d = 64) runs, and that row's small-grid row (q_tiles 2)
    short = {r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a") if r.min_keys > 1}
    assert short == {r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="short")} == {64}
    assert len(specs) == len(set(specs)) == (28 if arch == "sm_90a" else 32)
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
    n = 6 if arch == "sm_90a" else 8
    assert by_kind == {("attn_fwd_simt", "f32"): 8, (tc, "f16"): n, (tc, "bf16"): n, ("attn_fwd_tf32", "f32"): 8}
    assert all(s.arch == arch and not s.ptx for s in specs)


@pytest.mark.parametrize("arch", ARCHS)
def test_entry_names_are_unique_c_identifiers(arch):
    names = [s.entry_name for s in standard_specs(arch)]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names)
    # one arch's cubin holds one spec; across archs (arch, entry) pairs stay distinct too
    everything = [(s.arch, s.entry_name) for a in ARCHS for s in standard_specs(a)]
    assert len(set(everything)) == len(everything) == 32 * len(ARCHS) - 4  # sm_90a: 28 variants


@pytest.mark.parametrize("arch", ARCHS)
def test_tiles_satisfy_the_kernel_static_asserts(arch):
    for s in standard_specs(arch):
        t = s.tiles
        assert isinstance(t, TileConfig) and t.reason, s.describe()
        if s.q_tiles:  # attn_fwd_tma's short row, or (2) its small-grid row
            short = tile_table(s.family, arch, table="short")[0]
            assert t == (short.mods_row if s.q_tiles == 2 else short).config()
        else:
            assert t == tile_config(s.family, arch, s.head_dim)
        if s.family == "attn_fwd_simt":  # AttnFwdSimtTraits
            assert t.block_n == 32 and s.head_dim % 32 == 0 and t.block_m % t.warps == 0, s.describe()
        elif s.family in ("attn_fwd_wgmma", "attn_fwd_tma"):  # one m64 row block per warpgroup; 64-wide buckets
            assert t.block_m == 64 * (t.warps // 4 - t.ws) and t.warps % 4 == 0 and s.head_dim % 64 == 0, s.describe()
            # overlap keeps V_{j-1} through tile j: 3 stages, or 2 with K and V on barriers of their own
            assert t.block_n % 16 == 0 and (t.stages >= 3 or not t.overlap or t.split_kv), s.describe()
            assert not t.split_kv or (s.family in ("attn_fwd_tma", "attn_fwd_fp8") and t.overlap), s.describe()
        else:  # AttnFwdMmaTraits/Tf32Traits: the kernel derives BLOCK_M itself, so the grid must agree
            assert s.family in ("attn_fwd_mma", "attn_fwd_tf32")
            assert s.head_dim % 32 == 0 and t.block_n % 16 == 0, s.describe()
            assert t.m_tiles >= 1 and t.block_m == 16 * t.m_tiles * t.warps, s.describe()
        assert s.threads == 32 * t.warps and 32 <= s.threads <= 1024
        # __launch_bounds__(threads, min_blocks) must ask for a residency the SM can hold
        assert isinstance(t.min_blocks, int) and t.min_blocks >= 1, s.describe()
        assert t.min_blocks * s.threads <= MAX_THREADS_PER_SM[arch], s.describe()


def test_simt_tiles_are_the_same_on_every_arch():
    for d in HEAD_DIM_BUCKETS:
        assert len({tile_config("attn_fwd_simt", a, d) for a in ARCHS}) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_mma_tile_table_covers_every_bucket(arch):
    for d in HEAD_DIM_BUCKETS:
        t = tile_config("attn_fwd_mma", arch, d)
        assert t.m_tiles >= 1 and t.block_m == 16 * t.m_tiles * t.warps and t.block_n % 16 == 0
    with pytest.raises(ValueError, match=r"^head_dim:"):
        tile_config("attn_fwd_mma", arch, MAX_HEAD_DIM + 32)


def test_tile_config_rejects_unsupported_arch():
    for family in ("attn_fwd_simt", "attn_fwd_mma"):
        with pytest.raises(ValueError, match=r"^arch:"):
            tile_config(family, "sm_75", 64)


def test_optin_limits_are_the_documented_ones():
    assert OPTIN_SMEM == {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90a": 232448, "sm_100a": 232448}


def test_shared_bytes_fit_every_supported_arch():
    smallest = min(OPTIN_SMEM.values())
    assert smallest == 101376
    for arch in ARCHS:
        for s in standard_specs(arch):
            t, d = s.tiles, s.head_dim
            if s.family == "attn_fwd_simt":
                # Q tile + padded K tile + V tile, fp32 (the layout attention_fwd.cuh carves out)
                assert s.shared_bytes == 4 * (t.block_m * d + t.block_n * (d + 1) + t.block_n * d)
                # the SIMT tiles are the same everywhere, so they must fit the smallest arch too
                assert s.shared_bytes <= smallest, s.describe()
            elif s.family in ("attn_fwd_wgmma", "attn_fwd_tma"):
                # AttnFwdWgmmaTraits::kSmemBytes: unpadded swizzled tiles, O's staging tile (o_stage), a
                # full and an empty mbarrier per stage when warp-specialized (four with K and V split), two
                # for the query tile when persistent, + 1024 for atom alignment
                assert s.shared_bytes == ((t.block_m + 2 * t.stages * t.block_n) * d * 2 + t.block_m * d * 2 * t.o_stage
                                          + 16 * t.stages * t.ws * (1 + t.split_kv) + 16 * t.persistent + 1024)
            elif s.family == "attn_fwd_tf32":
                # AttnFwdTf32Traits::kSmemBytes: Q and 2 K stages padded by 4 floats, 2 V stages by 8
                bm = 16 * t.m_tiles * t.warps
                assert s.shared_bytes == 4 * ((bm + 2 * t.block_n) * (d + 4) + 2 * t.block_n * (d + 8))
            else:
                # AttnFwdMmaTraits::kSmemElems: Q + 2 stages of K and V, rows padded by 8 16-bit elements
                assert s.shared_bytes == 2 * (16 * t.m_tiles * t.warps + 4 * t.block_n) * (d + 8)
            assert 0 < s.shared_bytes <= OPTIN_SMEM[arch], s.describe()


@pytest.mark.parametrize("seqlen_q, blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (1000, 63), (1024, 64)])
def test_grid_rounds_query_tiles_up(seqlen_q, blocks):
    spec = KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a")
    assert spec.tiles.block_m == 16
    assert spec.grid(3, 8, seqlen_q) == (blocks, 8, 3)


def test_mma_grid_uses_its_own_block_m():
    spec = KernelSpec("attn_fwd_mma", "f16", 64, "sm_90a")
    bm = spec.tiles.block_m
    assert bm == 16 * spec.tiles.m_tiles * spec.tiles.warps
    assert spec.grid(2, 4, 0) == (0, 4, 2)
    assert spec.grid(2, 4, 1) == (1, 4, 2)
    assert spec.grid(2, 4, bm) == (1, 4, 2)
    assert spec.grid(2, 4, bm + 1) == (2, 4, 2)


@settings(max_examples=100, deadline=None)
@given(b=st.integers(1, 65535), h=st.integers(1, 65535), s=st.integers(0, 2**31 - 1),
       arch=st.sampled_from(ARCHS), spec_args=st.sampled_from([("attn_fwd_simt", "f32"), ("attn_fwd_mma", "f16"),
                                                             ("attn_fwd_mma", "bf16")]),
       d=st.sampled_from(HEAD_DIM_BUCKETS))
def test_grid_covers_every_query_once(b, h, s, arch, spec_args, d):
    spec = KernelSpec(*spec_args, d, arch)
    x, y, z = spec.grid(b, h, s)
    bm = spec.tiles.block_m
    assert (y, z) == (h, b)
    assert x * bm >= s and (x - 1) * bm < max(s, 1)
    assert x <= 2**31 - 1


def test_compile_options():
    spec = KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a")
    opts = spec.compile_options(("/inc/a", "/inc/b"))
    assert opts[0] == "-arch=sm_90a"
    assert opts[-2:] == ("-I/inc/a", "-I/inc/b")
    assert "-std=c++17" in opts
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
                base.replace(family="attn_decode", q_tiles=1, kv="int8", key_channel=True)]
    # every field of the spec is covered above
    assert set(KernelSpec.FIELDS) == {"family", "dtype", "head_dim", "arch", "ptx",
                                                                 "mask", "softcap", "alibi", "q_tiles", "sparse", "kv",
                                                                 "key_channel"}
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


# --------------------------------------------------------------------------------------------
# Compute capability -> arch
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cc, arch", [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"),
                                      ((9, 0), "sm_90a"), ((10, 0), "sm_100a")])
def test_arch_for_capability(cc, arch):
    assert arch_for_capability(*cc) == arch


@pytest.mark.parametrize("cc", [(7, 5), (7, 0), (8, 7), (9, 1), (10, 3), (12, 0), (12, 1)])
def test_arch_for_unsupported_capability_raises(cc):
    with pytest.raises(PyattnError, match=rf"compute capability {cc[0]}\.{cc[1]} is not supported"):
        arch_for_capability(*cc)


# --------------------------------------------------------------------------------------------
# Parameter structs
# --------------------------------------------------------------------------------------------
C_TYPES = {"ptr": "const void*", "mut_ptr": "void*", "f32_ptr": "float*", "f32_cptr": "const float*",
           "i32_cptr": "const int*", "u64_cptr": "const unsigned long long*",
           "i64": "long long", "i32": "int", "f32": "float"}
CODES = {"ptr": "Q", "mut_ptr": "Q", "f32_ptr": "Q", "f32_cptr": "Q", "i32_cptr": "Q", "u64_cptr": "Q", "i64": "q", "i32": "i", "f32": "f"}


def _calc_size(fields):
    return (struct.calcsize("@" + "".join(CODES[k] for _, k in fields)) + 7) // 8 * 8


def test_attn_params_layout():
    p = ATTN_FWD_PARAMS
    assert p.size == _calc_size(p.fields) == struct.calcsize("@" + p.format[1:] + "0q")
    names = [n for n, _ in p.fields]
    assert len(set(names)) == len(names)
    for required in ("q", "k", "v", "o", "lse", "q_stride_b", "o_stride_h", "heads_kv", "group", "causal",
                     "scale_log2", "scale"):
        assert required in names


@pytest.mark.parametrize("fields, size", [
    ((("a", "ptr"), ("b", "i32")), 16),              # trailing padding to 8
    ((("a", "i32"), ("b", "ptr")), 16),              # interior padding before the pointer
    ((("a", "i32"), ("b", "f32"), ("c", "i64")), 16),
    ((("a", "f32_ptr"),), 8),
    ((("a", "i32"), ("b", "i64"), ("c", "i32")), 24),
])
def test_param_struct_size_and_padding(fields, size):
    p = ParamStruct("S", fields)
    assert p.size == size == _calc_size(fields)
    assert len(p.pack({n: 1 for n, _ in fields})) == size


def test_c_declaration_lists_every_field_and_asserts_the_size():
    p = ATTN_FWD_PARAMS
    decl = p.c_declaration()
    assert decl.startswith("struct AttnFwdParams {")
    body = decl[decl.index("{") + 1:decl.index("};")]
    declared = re.findall(r"^\s+(.+?)\s+(\w+);$", body, re.M)
    assert declared == [(C_TYPES[k], n) for n, k in p.fields]  # every field, in order, with its C type
    assert f"static_assert(sizeof(AttnFwdParams) == {p.size}," in decl


def _value(kind):
    return {
        "ptr": st.integers(0, 2**64 - 1), "mut_ptr": st.integers(0, 2**64 - 1), "f32_ptr": st.integers(0, 2**64 - 1),
        "f32_cptr": st.integers(0, 2**64 - 1), "i32_cptr": st.integers(0, 2**64 - 1),
            "u64_cptr": st.integers(0, 2**64 - 1),
        "i64": st.integers(-2**63, 2**63 - 1), "i32": st.integers(-2**31, 2**31 - 1),
        "f32": st.floats(width=32, allow_nan=False),
    }[kind]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_attn_params_pack_round_trips(data):
    p = ATTN_FWD_PARAMS
    values = {n: data.draw(_value(k), label=n) for n, k in p.fields}
    raw = p.pack(values)
    assert len(raw) == p.size
    got = struct.unpack(p.format, raw[:struct.calcsize(p.format)])
    assert list(got) == [values[n] for n, _ in p.fields]
    assert raw[struct.calcsize(p.format):] == b"\0" * (p.size - struct.calcsize(p.format))


FIELD_LISTS = st.lists(st.sampled_from(sorted(CODES)), min_size=1, max_size=12).map(
    lambda kinds: tuple((f"f{i}", k) for i, k in enumerate(kinds)))


@settings(max_examples=150, deadline=None)
@given(fields=FIELD_LISTS, data=st.data())
def test_any_param_struct_pack_round_trips(fields, data):
    p = ParamStruct("S", fields)
    values = {n: data.draw(_value(k), label=n) for n, k in fields}
    raw = p.pack(values)
    align = max(struct.calcsize("@" + code) for code in p.format[1:])  # C pads to the widest member
    assert len(raw) == p.size and p.size % align == 0
    assert p.size >= struct.calcsize(p.format)
    assert list(struct.unpack(p.format, raw[:struct.calcsize(p.format)])) == [values[n] for n, _ in fields]


def test_pack_refuses_missing_and_out_of_range_values():
    p = ATTN_FWD_PARAMS
    good = {n: 0 for n, _ in p.fields}
    with pytest.raises(KeyError):
        p.pack({k: v for k, v in good.items() if k != "seqlen_k"})
    with pytest.raises(struct.error):
        p.pack({**good, "seqlen_q": 2**31})  # an i32 must not wrap silently
    with pytest.raises(struct.error):
        p.pack({**good, "q": -1})


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_render_contains_entry_template_and_struct(arch):
    for spec in standard_specs(arch):
        src = render(spec)
        t = spec.tiles
        assert (f'extern "C" __global__ void __launch_bounds__({32 * t.warps}, {t.min_blocks})\n'
                f'{spec.entry_name}(') in src
        assert f'#include "{HEADER_FOR[spec.family]}"' in src
        for family, other in HEADER_FOR.items():
            assert family == spec.family or f'#include "{other}"' not in src
        assert f"pyattn::{spec.family}<pyattn::{TRAITS_FOR[spec.family]}<" in spec.template_id
        assert f"  {spec.template_id}(params);" in src
        assert spec.params.c_declaration() in src
        assert f"static_assert(sizeof({spec.params.name}) == {spec.params.size}" in src
        assert f"const __grid_constant__ pyattn::{spec.params.name} params" in src
        # the traits' own shared-memory size must equal what the launch asks for (checked by NVRTC)
        assert f"static_assert({spec.traits}::kSmemBytes == {spec.shared_bytes}, " in src
        assert spec.traits.startswith(f"pyattn::{TRAITS_FOR[spec.family]}<") and spec.traits in spec.template_id
        # the struct is declared before the template header that uses it
        assert src.index("struct AttnFwdParams") < src.index(f'#include "{spec.header}"')
        assert src.index('#include "common.cuh"') < src.index(f'#include "{spec.header}"')


def test_template_id_encodes_the_spec():
    spec = KernelSpec("attn_fwd_simt", "bf16", 160, "sm_80")
    t = spec.tiles
    assert spec.template_id == (f"pyattn::attn_fwd_simt<pyattn::AttnFwdSimtTraits<__nv_bfloat16, 160, "
                                f"{t.block_m}, {t.block_n}, {t.warps}>, pyattn::ScoreMods<0, 0, false>>")
    mods = KernelSpec("attn_fwd_simt", "f32", 32, "sm_80", mask="bf16", softcap=True, alibi=True)
    assert mods.template_id.endswith(", pyattn::ScoreMods<3, 1, true>>")
    assert mods.entry_name.endswith("_maskbf16_softcap_alibi")
    assert "float, 32," in KernelSpec("attn_fwd_simt", "f32", 32, "sm_80").template_id
    assert "__half, 64," in KernelSpec("attn_fwd_simt", "f16", 64, "sm_80").template_id


@pytest.mark.parametrize("arch", ARCHS)
def test_mma_template_id_encodes_the_spec(arch):
    for dtype, ctype in (("f16", "__half"), ("bf16", "__nv_bfloat16")):
        for d in HEAD_DIM_BUCKETS:
            spec = KernelSpec("attn_fwd_mma", dtype, d, arch)
            t = spec.tiles
            # AttnFwdMmaTraits<T, HEAD_DIM, BLOCK_N, WARPS, M_TILES>: BLOCK_M is derived, not passed
            assert spec.template_id == (f"pyattn::attn_fwd_mma<pyattn::AttnFwdMmaTraits<{ctype}, {d}, "
                                        f"{t.block_n}, {t.warps}, {t.m_tiles}>, pyattn::ScoreMods<0, 0, false>, false>")
            assert spec.entry_name == f"pyattn_attn_fwd_mma_{dtype}_d{d}_m{t.block_m}n{t.block_n}w{t.warps}"


@pytest.mark.parametrize("family", ["attn_fwd_simt", "attn_fwd_mma"])
def test_template_id_matches_the_header_signature(family):
    # the included header defines the traits with as many template parameters as the id passes
    headers = dict(kernel_headers())
    text = headers[HEADER_FOR[family]]
    m = re.search(rf"template <([^>]*)>\s*struct {TRAITS_FOR[family]}\b", text)
    assert m, f"{TRAITS_FOR[family]} not defined in {HEADER_FOR[family]}"
    assert re.search(rf"__device__[^(]*\b{family}\(", text)
    n_params = len(m.group(1).split(","))
    spec = KernelSpec(family, "f16", 64, "sm_90a")
    args = spec.template_id[spec.template_id.index(f"{TRAITS_FOR[family]}<") + len(TRAITS_FOR[family]) + 1:]
    args = args[:args.index(">")]
    assert len(args.split(",")) == n_params


def test_tma_kernel_selection():
    """attn_fwd_tma takes 16-bit sm_90a calls whose bucket its table for the mask kind has, from the
    row's min_keys on; block-sparse lists and layouts TMA cannot map go to attn_fwd_wgmma."""
    from pyattn.kernels.families import tile_table

    for table, mask in (("dense", "none"), ("dense", "bool"), ("mask2", "bf16"), ("mask2", "f16"), ("mask4", "f32")):
        rows = {r.max_head_dim: r for r in tile_table("attn_fwd_tma", "sm_90a", table=table)}
        for d in (64, 128, 192, 256):
            row = rows.get(d)
            shorts = {r.max_head_dim: r for r in tile_table("attn_fwd_tma", "sm_90a", table="short")}
            short = shorts.get(d) if table == "dense" else None
            # where the short row serves: below its max_keys, max_keys_mods with a mask tensor
            limit = (short.max_keys_mods if mask != "none" and short.max_keys_mods else short.max_keys) if short else 0
            first = max(row.min_keys, limit, 1) if row else 1 << 20  # the row's first call
            spec = select_attention_spec("bfloat16", d, "sm_90a", mask=mask, keys=first)
            assert spec.family == ("attn_fwd_tma" if row else "attn_fwd_wgmma"), (mask, d)
            if row is None:
                continue
            assert spec.tiles.block_n == row.block_n and spec.tiles.stages == row.stages
            # a mask tensor takes the row's warpgroups_mods where it names them (registers)
            wgs = row.warpgroups_mods if mask != "none" and row.warpgroups_mods else row.warpgroups
            assert spec.tiles.block_m == 64 * wgs
            if first > 1:  # below: the short row where one serves the mask kind, else cp.async
                below = select_attention_spec("bfloat16", d, "sm_90a", mask=mask, keys=first - 1)
                if short:  # its mods_row with a mask tensor (registers)
                    want = short.mods_row if mask != "none" and short.mods_row else short
                    assert (below.family, below.q_tiles, below.tiles) == ("attn_fwd_tma", 1, want.config())
                else:
                    assert below.family == "attn_fwd_wgmma"
            for kw in (dict(sparse=1), dict(sparse=2), dict(tma=False)):
                assert select_attention_spec("float16", d, "sm_90a", mask=mask, **kw).family == "attn_fwd_wgmma", kw
            assert select_attention_spec("float16", d, "sm_90a", mask=mask, softcap=True,
                                         alibi=True).family == "attn_fwd_tma"
            assert spec.mask == ("bits" if mask == "bool" else mask)  # a bool mask reaches it packed
    assert 256 not in {r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="mask4")}  # 256 KiB
    for arch in ("sm_80", "sm_89", "sm_100a"):
        assert select_attention_spec("bfloat16", 128, arch).family == "attn_fwd_mma"
    with pytest.raises(ValueError, match="attn_fwd_tma has no row for bucket 256 on sm_90a with a f32 mask"):
        KernelSpec("attn_fwd_tma", "bf16", 256, "sm_90a", mask="f32")
    with pytest.raises(ValueError, match="attn_fwd_tma"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_80")
    with pytest.raises(ValueError, match="attn_fwd_tma"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", sparse=1)


# (B, S, H, causal) at d = 64 on an H200 (132 SMs), bf16, keys = queries: whether the short row's
# small-grid row (1) or the row that serves the call otherwise (0) measured faster, by more than the
# noise (dev/probe_small_grid.py, BENCHMARKS.md 2026-11-28)
SMALL_GRID_MEASURED = [
    (1, 1024, 32, False, 1), (1, 1024, 24, False, 1), (1, 1024, 40, False, 0), (16, 1024, 32, False, 0),
    (1, 1024, 32, True, 1), (1, 2048, 32, True, 1), (2, 2048, 8, True, 1), (1, 2048, 40, True, 0),
    (1, 2048, 44, True, 0), (16, 1024, 32, True, 0),
    (2, 2048, 8, False, 1), (1, 2048, 16, False, 1), (1, 4096, 8, False, 1), (1, 8192, 4, False, 1),
    (1, 16384, 2, False, 1), (1, 32768, 1, False, 1), (1, 4096, 9, False, 0), (1, 4096, 10, False, 0),
    (1, 4096, 12, False, 0), (1, 4096, 16, False, 0), (1, 2048, 20, False, 0), (1, 2048, 32, False, 0),
    (1, 8192, 8, False, 0), (4, 2048, 8, False, 0),
    (1, 8192, 8, True, 1), (1, 16384, 4, True, 1), (1, 8192, 16, True, 0), (1, 16384, 8, True, 0),
    (1, 32768, 2, True, 0),
]


def _small_grid_row():
    """attn_fwd_tma's short row that has a small-grid row (``small_grid_rate``); skips without one."""
    from pyattn.kernels.families import tile_table

    rows = [r for r in tile_table("attn_fwd_tma", "sm_90a", table="short") if r.small_grid_rate]
    if not rows:
        pytest.skip("no short row with a small-grid row")
    (row,) = rows
    return row


@pytest.mark.parametrize("B, S, H, causal, small", SMALL_GRID_MEASURED)
def test_small_grids_pick_the_row_that_measured_faster(B, S, H, causal, small):
    """The small-grid rule (short_small_grid's rounds-an-SM model, its simulation of causal calls on
    the dense row, and the row's small_grid_rate) picks, for every measured d = 64 shape, the row
    that measured faster: q_tiles 2 for the short row's small-grid row, else the short row (1) or
    the dense table's row (0) as the keys select."""
    row = _small_grid_row()
    plain = select_attention_spec("bfloat16", 64, "sm_90a", keys=S, causal=causal)
    got = select_attention_spec("bfloat16", 64, "sm_90a", keys=S, causal=causal, queries=S, batch_heads=B * H,
                                sm_count=132)
    assert got.q_tiles == (2 if small else plain.q_tiles)
    if small:
        assert got.tiles == row.mods_row.config() and "_m64n128w8p" in got.entry_name


def test_small_grid_row_only_for_plain_calls_on_a_known_grid():
    """The small-grid row takes plain calls only: a mask tensor or ALiBi keep their own rows (the
    short row's mods_row at q_tiles 1 below its keys), as do an unknown grid (sm_count 0) and
    buckets without such a row; a soft-cap rides along. Causal calls past the short row's keys are
    simulated: one query tile over a million keys stays on the dense row (a unit pairs two tiles)."""
    row = _small_grid_row()
    D = row.max_head_dim
    small = dict(keys=1000, queries=1000, batch_heads=1, sm_count=132)
    assert select_attention_spec("bfloat16", D, "sm_90a", **small).q_tiles == 2
    assert select_attention_spec("bfloat16", D, "sm_90a", **{**small, "sm_count": 0}).q_tiles == 1
    for mods in ({"alibi": True}, {"mask": "bool"}, {"mask": "bf16", "mask_rows": True}):
        assert select_attention_spec("bfloat16", D, "sm_90a", **small, **mods).q_tiles == 1, mods
    long = {**small, "keys": 1 << 20}
    assert select_attention_spec("bfloat16", D, "sm_90a", **long).q_tiles == 2
    for mods in ({"causal": True}, {"alibi": True}, {"mask": "bool"}):
        assert select_attention_spec("bfloat16", D, "sm_90a", **long, **mods).q_tiles == 0, mods
    capped = select_attention_spec("float16", D, "sm_90a", softcap=30.0, **small)
    assert capped.q_tiles == 2 and capped.softcap == 1  # a row max: the bounded soft-cap is the 3-warpgroup row's
    assert select_attention_spec("bfloat16", 128, "sm_90a", **small).q_tiles in (0, 1)
    with pytest.raises(ValueError, match="q_tiles"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", q_tiles=2)
    assert KernelSpec("attn_fwd_tma", "bf16", D, "sm_90a", q_tiles=2) in standard_specs("sm_90a")


def test_causal_small_grid_simulation():
    """_causal_makespans on hand-countable grids (one SM): a dense row of key-tile works 2, 3 and 5
    for one (batch, head) runs them one after another (10 steps); the small-grid row's units pair
    its 64-row tiles' works and its blocks take them by stride, each step costing its rows over the
    dense row's, times its blocks an SM, over the rate."""
    from pyattn.kernels.families import tile_table
    from pyattn.kernels.families.small_grid import _causal_makespans

    row = _small_grid_row()
    big = next(r for r in tile_table("attn_fwd_tma", "sm_90a") if r.max_head_dim == row.max_head_dim)
    assert (big.warpgroups, big.block_n, row.mods_row.warpgroups, row.mods_row.block_n) == (3, 128, 1, 128)
    # 576 queries and keys: dense row blocks of 192 rows see 192 / 384 / 576 keys: 2, 3, 5 key tiles
    small, dense = _causal_makespans(row, big, 576, 576, 1, 1)
    assert dense == 10
    # 9 tiles of 64 rows see 1, 1, 2, ..., 5 key tiles (ceil(64 (i + 1) / 128)); pairs (0, 8) (1, 7)
    # (2, 6) (3, 5) of works 6, 5, 6, 5 and the middle (4) of 3 alone: 25 steps on 2 blocks by stride
    step = 1 * 128 * row.mods_row.min_blocks / (3 * 128 * row.small_grid_rate)
    assert small == pytest.approx(max(6 + 6 + 3, 5 + 5) * step)
    # two (batch, head)s on 132 SMs: each dense block alone on an SM, the longest (5) the time
    assert _causal_makespans(row, big, 576, 576, 2, 132)[1] == 5


def test_small_grid_model_counts_rounds_an_sm():
    """short_small_grid's model on a made-up GPU of 10 SMs: at a rate of 0.84 the small-grid row
    takes the grids where it needs no more rounds than the big row (128 rows an SM a round against
    192), not those where it needs one more; at a rate of 0.5 it takes none."""
    from pyattn.kernels.families import override_tiles, tile_table
    from pyattn.kernels.families.small_grid import short_small_grid

    short = tile_table("attn_fwd_tma", "sm_90a", table="short")
    D = _small_grid_row().max_head_dim
    # 1000 queries: 6 tiles of 192 rows, 16 of 64; 10 SMs: 10 big blocks, 20 small ones a round
    for rate, flips in ((0.84, [1, 2]), (0.5, [])):
        rows = tuple(r._replace(small_grid_rate=rate) if r.small_grid_rate else r for r in short)
        with override_tiles("attn_fwd_tma", "sm_90a", rows, table="short"):
            picks = [short_small_grid("sm_90a", D, 1000, bh, False, 10) for bh in range(1, 7)]
        # bh 1: 6 big units (1 round, 192 rows) vs 16 small (1 round, 128 rows): small at 0.84;
        # bh 2: 12 (2 rounds, 384) vs 32 (2 rounds, 256); bh 3: 18 (2, 384) vs 48 (3, 384): big
        assert [bh for bh, p in enumerate(picks, 1) if p] == flips, (rate, picks)


def test_short_row_of_the_tma_kernel():
    """q_tiles = 1 names attn_fwd_tma's short row (persistent blocks of three warpgroups at d = 64) and,
    with a mask tensor or ALiBi, its mods_row: one m64 row tile (one consumer warpgroup) a block,
    two blocks an SM; only buckets with such a row, masks that ride the dense rows, below its
    max_keys; every score modifier."""
    from pyattn.kernels.families import tile_table

    (row,) = tile_table("attn_fwd_tma", "sm_90a", table="short")
    plain = KernelSpec("attn_fwd_tma", "f16", row.max_head_dim, "sm_90a", softcap=True, q_tiles=1)
    assert plain.tiles == row.config() and (plain.tiles.persistent, plain.tiles.block_m) == (True, 192)
    assert plain.shared_bytes + 1024 <= 228 * 1024
    spec = KernelSpec("attn_fwd_tma", "f16", row.max_head_dim, "sm_90a", softcap=True, alibi=True, q_tiles=1)
    t = spec.tiles
    assert (t.block_m, t.warps, t.min_blocks, t.persistent) == (64, 8, 2, True) and t == row.mods_row.config()
    assert 2 * (spec.shared_bytes + 1024) <= 228 * 1024  # two blocks an SM (1 KiB reserved a block)
    assert ", 1, 3, true, 0, true, true, true>" in spec.template_id and "_m64n128w8p" in spec.entry_name
    for mask, rows in (("none", False), ("bool", False), ("bf16", True)):
        limit = row.max_keys_mods if mask != "none" and row.max_keys_mods else row.max_keys
        for keys, q_tiles in ((1, 1), (limit - 1, 1), (limit, 0)):
            got = select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=keys, mask=mask, mask_rows=rows)
            assert (got.family, got.q_tiles) == ("attn_fwd_tma", q_tiles), (keys, mask)
    # ALiBi counts as a modifier there; a soft-cap does not (it keeps the dense row's warpgroups)
    if row.max_keys_mods > row.max_keys:
        for kw, q_tiles in ((dict(alibi=True), 1), (dict(softcap=True), 0)):
            assert select_attention_spec("float16", 64, "sm_90a", keys=row.max_keys, **kw).q_tiles == q_tiles
    # causal calls without a mask tensor or ALiBi: up to max_keys_causal (its units balance causal rows)
    assert row.max_keys_causal > row.max_keys
    for kw, limit in (({}, row.max_keys_causal), (dict(softcap=True), row.max_keys_causal),
                      (dict(alibi=True), row.max_keys_mods or row.max_keys), (dict(mask="bool"), row.max_keys_mods)):
        for keys, q_tiles in ((limit - 1, 1), (limit, 0)):
            got = select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=keys, causal=True, **kw)
            assert got.q_tiles == q_tiles, (kw, keys)
    assert select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=row.max_keys_causal - 1).q_tiles == 0
    assert select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=1, mask="bf16").q_tiles == 0
    assert select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=1, tma=False).q_tiles == 0
    for bad, match in ((dict(head_dim=128), "no short row for bucket 128"), (dict(q_tiles=3), "takes 0"),
                       (dict(mask="f32"), "no short row for bucket 64 on sm_90a with a f32 mask")):
        with pytest.raises(ValueError, match=match):
            KernelSpec(**{**dict(family="attn_fwd_tma", dtype="f16", head_dim=64, arch="sm_90a", q_tiles=1), **bad})


def test_bool_masks_reach_only_the_tma_kernel_packed():
    """attn_fwd_tma reads bool masks as bits (no ring space, the dense rows); no other family reads
    bits, and attn_fwd_tma no bool bytes."""
    from pyattn.kernels.families import tile_table

    for r in tile_table("attn_fwd_tma", "sm_90a"):
        spec = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", mask="bits")
        dense = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", alibi=True)  # (warpgroups_mods)
        assert (spec.tiles, spec.shared_bytes) == (dense.tiles, dense.shared_bytes)
        assert spec.tiles.block_m == 64 * (r.warpgroups_mods or r.warpgroups)
        assert spec.entry_name == dense.entry_name.replace("_alibi", "_maskbits")
    with pytest.raises(ValueError, match="packed to bits"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", mask="bool")
    for family, arch in (("attn_fwd_wgmma", "sm_90a"), ("attn_fwd_mma", "sm_80"), ("attn_fwd_simt", "sm_80")):
        for kind in ("bits", "bf16_row"):
            with pytest.raises(ValueError, match=rf"mask: {kind} masks .* are read by attn_fwd_tma / attn_fwd_fp8 only"):
                KernelSpec(family, "f16", 128, arch, mask=kind)
    with pytest.raises(ValueError, match="mask/softcap/alibi"):
        KernelSpec("attn_decode", "f16", 128, "sm_80", mask="bits")
    short = select_attention_spec("bfloat16", 64, "sm_90a", mask="bool", keys=1000)  # the short row
    assert (short.family, short.mask, short.q_tiles) == ("attn_fwd_tma", "bits", 1)
    assert select_attention_spec("bfloat16", 64, "sm_90a", mask="bool", sparse=1).mask == "bool"  # cp.async


def test_key_padding_float_masks_take_one_row_a_stage():
    """A float mask broadcast over the query rows runs attn_fwd_tma's dense rows with one mask row
    a stage (MASK_ROW, after PERSIST in the traits), short d=64 calls the short row's; other
    archs keep the plain kind."""
    from pyattn.kernels.families import tile_table

    sizes = {"f16": 2, "bf16": 2, "f32": 4}
    for r in tile_table("attn_fwd_tma", "sm_90a"):
        dense = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", alibi=True)  # (warpgroups_mods)
        for kind, size in sizes.items():
            spec = select_attention_spec("bfloat16", r.max_head_dim, "sm_90a", mask=kind, mask_rows=True)
            assert spec.mask == f"{kind}_row" and spec.tiles == dense.tiles
            assert spec.shared_bytes == dense.shared_bytes + r.stages * r.block_n * size <= 227 * 1024
            # (PERSIST, MASK_ROW[, SPLIT_KV, POLY_EXP, O_STAGE]): the traits' 11th and 12th arguments
            traits = re.search(r"AttnFwdWgmmaTraits<([^>]*)>", spec.template_id).group(1).split(", ")
            assert traits[10:12] == [str(r.persistent).lower(), "true"], traits
            assert spec.template_id.endswith(f"pyattn::ScoreMods<{MASK_KINDS[kind]}, 0, false>>")
            assert select_attention_spec("bfloat16", r.max_head_dim, "sm_90a", mask=kind).mask == kind
    assert select_attention_spec("bfloat16", 128, "sm_80", mask="f32", mask_rows=True).mask == "f32"
    short = select_attention_spec("bfloat16", 64, "sm_90a", mask="f32", mask_rows=True, keys=100)
    assert (short.mask, short.q_tiles, short.tiles.block_m) == ("f32_row", 1, 64)


def test_packed_mask_layout():
    """A bool mask packs to rows of whole 128-key groups of u32 words; broadcast axes stay one row
    (a key-padding mask: a row per batch entry) and step 0."""
    from pyattn.ops._fwd import packed_mask_layout
    from pyattn.validate.options import MaskInfo

    class P:
        batch, heads_q, seqlen_q, seqlen_k = 2, 8, 300, 4100

    P.mask = MaskInfo("bool", (8 * 300 * 4100, 300 * 4100, 4100, 1), True)
    assert packed_mask_layout(P) == ((2, 8, 300), 132, (8 * 300 * 132, 300 * 132, 132, 1))
    P.mask = MaskInfo("bool", (4100, 0, 0, 1), True)  # (B, 1, 1, Sk)
    assert packed_mask_layout(P) == ((2, 1, 1), 132, (132, 0, 0, 1))
    P.mask = MaskInfo("bool", (0, 0, 1, 0), True)  # broadcast over keys: packed like any other
    assert packed_mask_layout(P) == ((1, 1, 300), 132, (0, 0, 132, 1))
    P.seqlen_k = 128
    assert packed_mask_layout(P)[1] == 4
    P.seqlen_k = 0
    assert packed_mask_layout(P)[1] == 0


@pytest.mark.parametrize("mask", ["f16", "bf16", "f32"])
def test_tma_shared_memory_fits(mask):
    """Every attn_fwd_tma row's shared memory (mask tiles included) fits the 227 KiB opt-in limit,
    and the mask tile is unpadded (swizzled), unlike attn_fwd_wgmma's padded rows."""
    from pyattn.kernels.families import tile_table

    sizes = {"f16": 2, "bf16": 2, "f32": 4}
    for r in tile_table("attn_fwd_tma", "sm_90a", table=f"mask{sizes[mask]}"):
        spec = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", mask=mask)
        t = spec.tiles
        kv = (t.block_m + 2 * t.stages * t.block_n) * r.max_head_dim * 2
        barriers = 16 * t.stages * (2 if t.split_kv else 1)  # split K / V: V's full / empty pair a stage too
        assert spec.shared_bytes == kv + t.stages * t.block_m * t.block_n * sizes[mask] + barriers + 1024
        assert spec.shared_bytes <= 227 * 1024
        wg = KernelSpec("attn_fwd_wgmma", "bf16", r.max_head_dim, "sm_90a", mask=mask)
        assert wg.shared_bytes - (wg.tiles.block_m + 2 * wg.tiles.stages * wg.tiles.block_n) * r.max_head_dim * 2 \
            == wg.tiles.stages * wg.tiles.block_m * (wg.tiles.block_n * sizes[mask] + 16) + \
            (16 * wg.tiles.stages if wg.tiles.ws else 0) + 1024


def test_tma_map_layouts():
    """rank4: zero strides and size-1 axes become size-1 axes stepped by 16 bytes; a broadcast row
    axis or a stepped stride off 16 bytes cannot be mapped (None)."""
    from pyattn.runtime.tensormap import rank4

    assert rank4(128, 4096, 16, 2, (4096 * 16 * 128, 16 * 128, 128), 2) == (
        (128, 4096, 16, 2), (16 * 128 * 2, 128 * 2, 4096 * 16 * 128 * 2))
    assert rank4(64, 300, 4, 3, (0, 4 * 64, 64), 2) == ((64, 300, 4, 1), (512, 128, 16))  # varlen / broadcast b
    assert rank4(64, 1, 1, 1, (7, 3, 5), 2) == ((64, 1, 1, 1), (16, 16, 16))  # size-1 axes are never stepped
    assert rank4(64, 0, 2, 1, (0, 128, 64), 2) == ((64, 1, 2, 1), (16, 128, 16))  # no keys: nothing is read
    assert rank4(64, 90, 2, 1, (0, 0, 64), 2) is None  # keys broadcast along the sequence
    assert rank4(72, 10, 2, 1, (0, 2 * 76, 76), 2) is None  # 152-byte head stride: not whole 16 bytes


def test_tma_mask_maps():
    """A mask's map: keys innermost, broadcast axes of size 1, a key-padding mask (query stride 0)
    one row; masks TMA cannot read (keys broadcast or strided, rows off 16 bytes) get none, so the
    call keeps attn_fwd_wgmma."""
    import numpy as np

    from pyattn.ops._fwd import mask_layout
    from pyattn.validate.options import MaskInfo

    class P:  # the fields mask_layout reads
        batch, heads_q, seqlen_q, seqlen_k = 2, 8, 300, 4096

    def layout(kind, strides):
        P.mask = MaskInfo(kind, strides, True)
        return mask_layout(P)

    full = (8 * 300 * 4096, 300 * 4096, 4096, 1)
    assert layout("bool", full) == ((4096, 300, 8, 2), (4096, 300 * 4096, 8 * 300 * 4096))
    assert layout("bf16", (0, 0, 4096, 1)) == ((4096, 300, 1, 1), (8192, 16, 16))  # (Sq, Sk) broadcast
    assert layout("f32", (4096, 0, 0, 1)) == ((4096, 1, 1, 2), (16, 16, 4 * 4096))  # key padding (B, 1, 1, Sk)
    assert layout("bool", (0, 0, 4096, 0)) is None  # broadcast over keys
    assert layout("bool", (0, 0, 8192, 2)) is None  # strided keys
    assert layout("bool", (0, 0, 4100, 1)) is None  # rows of 4100 bytes: not whole 16 bytes
    P.mask = None
    assert mask_layout(P) is None
    assert np.dtype(bool).itemsize == 1  # the u8 map reads numpy/torch bools as bytes


def test_persistent_grid_is_the_gpus_slots_or_the_tiles():
    """A persistent tile launches min(query tiles, slots) blocks in x; slots must be given."""
    spec = select_attention_spec("bfloat16", 128, "sm_90a")
    assert spec.tiles.persistent
    assert spec.grid(4, 16, 4096, slots=132) == (132, 1, 1)  # 4 * 16 * 32 tiles
    assert spec.grid(1, 2, 200, slots=132) == (4, 1, 1)  # 2 heads x 2 row blocks
    assert spec.grid(1, 1, 1, slots=264) == (1, 1, 1)
    with pytest.raises(ValueError, match="slots"):
        spec.grid(1, 1, 1)
    plain = KernelSpec("attn_fwd_wgmma", "bf16", 128, "sm_90a")
    assert not plain.tiles.persistent and plain.grid(4, 16, 4096, slots=132) == (32, 16, 4)


def test_persistent_slots_weigh_rounding_against_block_starts():
    """Non-causal calls always take the GPU's slots; causal ones take one unit (a pair of row
    blocks) a block when whole rounds of units would lose more than the blocks' starts cost."""
    from types import SimpleNamespace

    from pyattn.ops._fwd import persistent_slots

    tiles = select_attention_spec("bfloat16", 128, "sm_90a").tiles  # 128 x 128 tiles
    P = lambda S, H, B, causal: SimpleNamespace(seqlen_q=S, heads_q=H, batch=B, causal=causal)  # noqa: E731
    assert persistent_slots(P(16384, 16, 1, False), tiles, 132) == 132
    assert persistent_slots(P(4096, 16, 4, True), tiles, 132) == 132  # 1024 units: 3.1% < 4 / 33
    assert persistent_slots(P(16384, 16, 1, True), tiles, 132) == 1024  # 3.1% > 4 / 129: one unit a block
    assert persistent_slots(P(16384, 16, 1, True), tiles, 128) == 128  # 1024 units in 8 whole rounds
    assert persistent_slots(P(300, 3, 1, True), tiles, 132) == 132  # 6 units: one round
    # an odd count of row blocks (127): two (batch, head)s a group of 127 units, a lone last one 64
    assert persistent_slots(P(16256, 3, 1, True), tiles, 132) == 127 + 64
    assert persistent_slots(P(0, 3, 1, True), tiles, 132) == 132


def test_bounded_softcap_is_chosen_by_value_dtype_and_modifiers():
    """KernelSpec.softcap 2 (the wgmma kernels' softmax without a row max) exactly for bf16 calls on
    sm_90a with 0 < cap <= SOFTCAP_BOUNDED_MAX and nothing added after the cap (a bool mask is a
    predicate and may come along); any other soft-cap keeps 1, none 0."""
    from pyattn.kernels.specs import SOFTCAP_BOUNDED_MAX

    def kind(dtype="bfloat16", arch="sm_90a", **kw):
        return select_attention_spec(dtype, 128, arch, **kw).softcap

    assert kind(softcap=0.0) == 0 and kind() == 0
    assert kind(softcap=0.5) == kind(softcap=SOFTCAP_BOUNDED_MAX) == kind(softcap=50.0, mask="bool") == 2
    assert select_attention_spec("bfloat16", 64, "sm_90a", softcap=30.0, keys=512).softcap == 1  # the short row
    assert select_attention_spec("bfloat16", 128, "sm_90a", softcap=30.0, tma=False).softcap == 2  # attn_fwd_wgmma
    assert kind(softcap=SOFTCAP_BOUNDED_MAX + 0.01) == 1
    for kw in (dict(dtype="float16"), dict(alibi=True), dict(mask="bf16"), dict(mask="f32"), dict(arch="sm_89"),
               dict(tma=False, mask="bf16")):
        assert kind(**{"softcap": 30.0, **kw}) == 1, kw
    spec = select_attention_spec("bfloat16", 128, "sm_90a", softcap=30.0)
    assert spec.template_id.endswith(", pyattn::ScoreMods<0, 2, false>>") and spec.entry_name.endswith("_softcapb")
    assert KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", softcap=True).softcap == 1  # a bool is 0 / 1
    for bad in (dict(dtype="f16"), dict(alibi=True), dict(mask="bf16"), dict(family="attn_fwd_mma", arch="sm_80"),
                dict(family="attn_decode", q_tiles=1), dict(family="attn_prefill_wgmma"),
                dict(head_dim=64, q_tiles=1)):
        args = {"family": "attn_fwd_tma", "dtype": "bf16", "head_dim": 128, "arch": "sm_90a", "softcap": 2, **bad}
        with pytest.raises(ValueError, match="bounded soft-cap"):
            KernelSpec(**args)
    with pytest.raises(ValueError, match="softcap: expected 0"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", softcap=3)

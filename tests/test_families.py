"""Kernel family records, the tile-table override hook and the shared-memory agreement (CPU only)."""

from __future__ import annotations

import re
import types

import pytest

from pyattn import CompileError
from pyattn.jit.source import kernel_headers, render
from pyattn.kernels import registry
from pyattn.kernels.families import (FAMILIES, BwdTile, BwdWgmmaTile, DecodeTile, MmaTile, WgmmaTile, check_spec,
                                     get_family, override_tiles, tile_config, tile_table)
from pyattn.kernels.families.base import (HEAD_DIM_BUCKETS, MAX_HEAD_DIM, WGMMA_BWD_MAX_HEAD_DIM, Alignment, FixedTile,
                                          TileConfig)
from pyattn.kernels.specs import FAMILIES as FAMILY_NAMES
from pyattn.kernels.specs import KernelSpec
from pyattn.runtime.device import SUPPORTED_ARCHS

ROW_TYPES = (FixedTile, MmaTile, WgmmaTile, DecodeTile, BwdTile, BwdWgmmaTile)


def test_registry_is_the_family_names_in_order():
    assert tuple(FAMILIES) == FAMILY_NAMES
    assert all(record.name == name for name, record in FAMILIES.items())
    with pytest.raises(TypeError):
        FAMILIES["x"] = FAMILIES["attn_fwd_mma"]  # a constant table, not a place to register at run time
    with pytest.raises(ValueError, match=r"^family: expected one of \('attn_fwd_mma', .*got 'nope'"):
        get_family("nope")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_record_names_real_headers_and_consistent_tables(name):
    record = FAMILIES[name]
    headers = dict(kernel_headers())
    assert record.header in headers
    for table, by_arch in record.tables.items():
        assert by_arch and set(by_arch) <= set(SUPPORTED_ARCHS), (name, table)
        for arch, rows in by_arch.items():
            assert rows and len({type(r) for r in rows}) == 1 and type(rows[0]) in ROW_TYPES, (name, table, arch)
            bounds = [r.max_head_dim for r in rows]
            # every family covers every head dim, but the wgmma backward (dK + dV in registers: <= 128;
            # select_backward_specs sends larger ones to attn_bwd_mma), the TMA kernel with an f32
            # mask (its d=256 ring does not fit: tma_serves sends it to attn_fwd_wgmma) and its short
            # rows (two one-warpgroup blocks an SM fit at d = 64 only; tma_serves_short); the paged
            # prefill's TMA page boxes name the buckets measured (64, 128, 256; prefill_tma_serves)
            top = WGMMA_BWD_MAX_HEAD_DIM if name == "attn_bwd_wgmma" else \
                192 if (name, table) == ("attn_fwd_tma", "mask4") else \
                64 if (name, table) == ("attn_fwd_tma", "short") else MAX_HEAD_DIM
            if name == "attn_fwd_fp8":  # fp8 rows are whole 128-byte rows: buckets 128 and 256 (smaller pad up)
                assert bounds == [128, 256], bounds
            else:
                assert bounds == sorted(set(bounds)) and bounds[-1] == top, (name, table, arch)
            assert all(r.reason.strip() and isinstance(r.config(), TileConfig) for r in rows), (name, table, arch)
    if record.traits is not None:  # the traits struct the static_assert names is in the header
        spec = next(s for s in _some_specs() if s.family == name)
        struct = spec.traits.split("<")[0].split("::")[-1]
        # (in any header: the paged prefill families reuse the dense kernels' traits)
        assert re.search(rf"struct {struct}\b", "".join(headers.values()))


def test_alignment_needs():
    tensor_cores = Alignment(qkv=16, out_elems=2)  # cp.async of 16-byte chunks; stores of element pairs
    assert {n: FAMILIES[n].alignment for n in ("attn_fwd_mma", "attn_fwd_tf32", "attn_fwd_wgmma")} == dict.fromkeys(
        ("attn_fwd_mma", "attn_fwd_tf32", "attn_fwd_wgmma"), tensor_cores)
    assert FAMILIES["attn_sparse"].alignment == Alignment(qkv=16, out=16)
    assert FAMILIES["attn_decode"].alignment == FAMILIES["kv_append"].alignment == Alignment(pool=16)
    assert FAMILIES["attn_fwd_simt"].alignment == FAMILIES["merge_states"].alignment == Alignment()
    assert KernelSpec("attn_fwd_mma", "f16", 64, "sm_80").alignment == tensor_cores


def _some_specs():
    for arch in SUPPORTED_ARCHS:
        for d in HEAD_DIM_BUCKETS:
            yield KernelSpec("attn_fwd_simt", "f32", d, arch)
            yield KernelSpec("attn_fwd_mma", "bf16", d, arch, sparse=d % 64 // 32 + 1)
            yield KernelSpec("attn_fwd_tf32", "f32", d, arch, softcap=True)
            yield KernelSpec("merge_states", "f16", d, arch)
            yield KernelSpec("attn_decode", "f16", d, arch, q_tiles=1)
            if d in (64, 128, 256):
                yield KernelSpec("attn_decode", "bf16", d, arch, q_tiles=1, kv="int8")
            if d % 64 == 0 and arch == "sm_90a":
                yield KernelSpec("attn_fwd_wgmma", "f16", d, arch, sparse=d // 64 % 3)
                yield KernelSpec("attn_fwd_tma", "bf16", d, arch, alibi=d == 192)
                if d in (128, 256):
                    yield KernelSpec("attn_fwd_fp8", "e4m3", d, arch, softcap=d == 256)
                yield KernelSpec("attn_prefill_wgmma", "bf16", d, arch, softcap=d == 128)
                if d != 192:
                    yield KernelSpec("attn_prefill_tma", "bf16", d, arch, alibi=d == 128)
                yield KernelSpec("attn_tree_wgmma", "f16", d, arch)
                yield KernelSpec("attn_decode_tma", "bf16", d, arch, q_tiles=1, alibi=d == 128)
                if d in (128, 256):
                    yield KernelSpec("attn_decode_swap", "bf16", d, arch, q_tiles=1, kv="int8", softcap=d == 256)
                yield KernelSpec("attn_decode_swap", "f16", d, arch, q_tiles=1, alibi=d == 64)
                if d <= 128:
                    yield KernelSpec("attn_bwd_wgmma", "bf16", d, arch, alibi=d == 64)
            yield KernelSpec("attn_prefill_mma", "f16", d, arch, alibi=d == 64)
            yield KernelSpec("attn_tree_mma", "bf16", d, arch)
            yield KernelSpec("attn_bwd_mma", "bf16", d, arch, softcap=d % 64 == 0)
            yield KernelSpec("attn_bwd_simt", "f32", d, arch, alibi=True)
        yield KernelSpec("attn_bwd_pre", "f16", 32, arch)
        yield KernelSpec("attn_bwd_convert", "f32", 32, arch)


def test_render_asserts_shared_memory_exactly_for_families_with_traits():
    for spec in _some_specs():
        src = render(spec)
        asserts = re.findall(r"^static_assert\((.*)::kSmemBytes == (\d+), ", src, re.M)
        if spec.traits is None:
            assert spec.shared_bytes == 0 and not asserts, spec.describe()
        else:
            assert asserts == [(spec.traits, str(spec.shared_bytes))], spec.describe()
            assert src.index(f'#include "{spec.header}"') < src.index("::kSmemBytes ==") < src.index('extern "C"')


def test_a_formula_that_disagrees_with_the_traits_fails_to_compile():
    from pyattn.jit.headers import cuda_include_dir
    from pyattn.jit.nvrtc import compile_source

    spec = KernelSpec("attn_fwd_mma", "f16", 64, "sm_80")
    fields = ("describe", "header", "params", "traits", "threads", "tiles", "entry_name", "template_id")
    wrong = types.SimpleNamespace(**{f: getattr(spec, f) for f in fields}, shared_bytes=spec.shared_bytes + 16)
    with pytest.raises(CompileError) as info:
        compile_source(render(wrong), kernel_headers(), spec.compile_options((str(cuda_include_dir()[0]),)),
                       name="wrong smem")
    assert "the traits' shared memory differs from the family's formula" in info.value.log


@pytest.mark.parametrize("spec, match", [
    (("attn_fwd_wgmma", "f32", 64, "sm_90a", False, "none", True), r"^family: attn_fwd_wgmma takes f16/bf16"),
    (("attn_fwd_wgmma", "f16", 96, "sm_90a"), r"^family: attn_fwd_wgmma takes"),
    (("attn_fwd_mma", "f32", 64, "sm_80"), r"^dtype: the tensor-core family takes f16 or bf16, got 'f32'"),
    (("kv_append", "f32", 32, "sm_80"), r"^dtype: kv_append takes f16 or bf16, got 'f32'"),
    (("attn_decode", "f16", 64, "sm_80", False, "bool", False, False, 1), r"^mask/softcap/alibi: only attention"),
    (("attn_decode", "f16", 64, "sm_80", False, "none", True, True, 3), r"^q_tiles: attn_decode at head_dim 64"),
    (("attn_decode", "f16", 96, "sm_80", False, "none", False, False, 1, 0, "int8"), r"^head_dim: 8-bit caches"),
    (("merge_states", "f16", 64, "sm_80", False, "none", False, False, 1), r"^q_tiles: only attn_fwd_tma / attn_decode"
     r" / attn_decode_tma / attn_decode_swap takes"),
    (("attn_fwd_simt", "f16", 64, "sm_80", False, "none", False, False, 0, 1),
     r"^sparse: block-sparse tile lists are read by attn_fwd_mma / attn_fwd_wgmma, got attn_fwd_simt"),
    (("attn_sparse", "f16", 64, "sm_80", False, "none", False, False, 0, 0, "int8"),
     r"^kv: only attn_decode / attn_decode_tma / attn_decode_swap / kv_append / kv_key_pages read quantized caches, "
     r"got attn_sparse"),
    (("attn_decode", "f16", 64, "sm_80", False, "none", False, False, 1, 0, "", True),
     r"^key_channel: per-channel key scales are read by attn_decode / attn_decode_tma / attn_decode_swap over an "
     r"8-bit cache"),
    (("kv_append", "f16", 32, "sm_80", False, "none", False, False, 0, 0, "int8", True), r"^key_channel: "),
    (("kv_key_pages", "f16", 32, "sm_80"), r"^kv: kv_key_pages quantizes 8-bit caches"),
])
def test_constraints_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        KernelSpec(*spec)


def test_check_spec_is_what_kernel_spec_runs():
    spec = KernelSpec("attn_decode", "f16", 64, "sm_80", q_tiles=1)
    check_spec(spec)  # a valid spec passes
    with pytest.raises(ValueError, match=r"^q_tiles:"):
        check_spec(types.SimpleNamespace(**{**spec.asdict(), "q_tiles": 0}))


def test_tile_lookups_and_their_errors():
    assert tile_config("attn_fwd_mma", "sm_86", 128) == tile_table("attn_fwd_mma", "sm_86")[1].config()
    assert tile_config("attn_fwd_mma", "sm_86", 128, sparse=2) == tile_table("attn_fwd_mma", "sm_86", "sparse64")[
        0].config()
    assert tile_config("attn_decode", "sm_90a", 64, kv="fp8e4m3").reason.startswith("H200, bf16 q")
    with pytest.raises(ValueError, match=r"^arch: the wgmma family needs one of \('sm_90a',\), got 'sm_80'"):
        tile_config("attn_fwd_wgmma", "sm_80", 64)
    with pytest.raises(ValueError, match=r"^arch: no tile config for attn_fwd_mma on 'sm_75'"):
        tile_table("attn_fwd_mma", "sm_75")
    with pytest.raises(ValueError, match=r"^table: attn_fwd_mma has tile tables \('dense', 'sparse64'\)"):
        tile_table("attn_fwd_mma", "sm_80", "kv8")


def test_override_tiles_replaces_one_table_for_the_block_only():
    spec = KernelSpec("attn_decode", "bf16", 128, "sm_90a", q_tiles=1)
    other = KernelSpec("attn_decode", "bf16", 128, "sm_80", q_tiles=1)
    before, before_other = spec.tiles, other.tiles
    rows = (DecodeTile(128, 16, 4, 2, 2, 3, "tuning"),) + tile_table("attn_decode", "sm_90a")[1:]
    with override_tiles("attn_decode", "sm_90a", rows) as active:
        assert active == rows and tile_table("attn_decode", "sm_90a") == rows
        assert (spec.tiles.block_n, spec.tiles.warps, spec.tiles.min_blocks, spec.tiles.reason) == (64, 4, 3, "tuning")
        assert spec.entry_name.endswith("_m16n64w4s2") and "16, 4, 1, 2, 0, 0>" in spec.template_id
        assert other.tiles == before_other  # another arch keeps its table
        assert KernelSpec("attn_decode", "bf16", 128, "sm_90a", q_tiles=1, kv="int8").tiles.reason.startswith("H200")
        with override_tiles("attn_decode", "sm_90a", rows[:1] + (rows[1]._replace(warps=2),)):
            assert tile_config("attn_decode", "sm_90a", 256).warps == 2  # nested: innermost wins ...
        assert tile_config("attn_decode", "sm_90a", 256).warps == rows[1].warps  # ... until its block ends
    assert spec.tiles == before


def test_override_tiles_restores_after_an_exception_and_forgets_loaded_kernels(monkeypatch):
    spec = KernelSpec("attn_fwd_simt", "f32", 64, "sm_89")
    before = spec.tiles
    monkeypatch.setitem(registry._kernels, (0, spec), "a kernel built from the old table")
    with pytest.raises(RuntimeError, match="inside"):
        with override_tiles("attn_fwd_simt", "sm_89", (FixedTile(MAX_HEAD_DIM, 32, 32, 8, "test"),)):
            assert registry.loaded_kernels() == {} and spec.tiles.warps == 8
            registry._kernels[(0, spec)] = "a kernel built from the override"
            raise RuntimeError("inside")
    assert spec.tiles == before and registry.loaded_kernels() == {}


def test_override_tiles_checks_the_rows():
    mma = tile_table("attn_fwd_mma", "sm_80")
    with pytest.raises(TypeError, match=r"^rows: expected a non-empty sequence of MmaTile"):
        with override_tiles("attn_fwd_mma", "sm_80", (FixedTile(MAX_HEAD_DIM, 16, 32, 4, "x"),)):
            pass
    with pytest.raises(TypeError, match=r"^rows:"):
        with override_tiles("attn_fwd_mma", "sm_80", ()):
            pass
    with pytest.raises(ValueError, match=r"^rows: expected ascending max_head_dim"):
        with override_tiles("attn_fwd_mma", "sm_80", mma[::-1]):
            pass
    with pytest.raises(ValueError, match=r"^arch: the wgmma family needs"):
        with override_tiles("attn_fwd_wgmma", "sm_80", tile_table("attn_fwd_wgmma", "sm_90a")):
            pass
    assert tile_table("attn_fwd_mma", "sm_80") == mma

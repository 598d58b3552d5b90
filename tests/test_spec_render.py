"""Parameter structs and source rendering (CPU only, no compiler): ParamStruct sizes, padding,
C declarations and packing (with Hypothesis round trips), and what ``render`` writes: entry,
launch bounds, header, template id and the shared-memory static_assert."""

from __future__ import annotations

import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _specs_helpers import ARCHS, HEADER_FOR
from pyattn.jit.source import kernel_headers, render
from pyattn.kernels.params import ATTN_FWD_PARAMS, ParamStruct
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec, standard_specs

TRAITS_FOR = {"attn_fwd_simt": "AttnFwdSimtTraits", "attn_fwd_mma": "AttnFwdMmaTraits",
              "attn_fwd_tf32": "AttnFwdTf32Traits", "attn_fwd_wgmma": "AttnFwdWgmmaTraits",
              "attn_fwd_tma": "AttnFwdWgmmaTraits"}


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
        # the entry's first statement waits for the stream's previous kernel (kernels_src/pdl.cuh)
        assert f"params) {{\n  pyattn::pdl::wait();\n  {spec.template_id}(params);\n}}" in src
        assert src.index('#include "pdl.cuh"') < src.index(f'#include "{spec.header}"')
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

"""Spec selection (CPU only, no compiler): which family and head-dim bucket ``select_attention_spec``
picks per dtype and arch (TF32 opt-in, PTX flag, score modifiers), its refusals, the bounded soft-cap
choice, and compute capability -> arch."""

from __future__ import annotations

import pytest

from _specs_helpers import ARCHS, DTYPE_NAMES, FAMILY_FOR, _expected
from pyattn import PyattnError
from pyattn.kernels.specs import (DTYPES, HEAD_DIM_BUCKETS, MAX_HEAD_DIM, KernelSpec, select_attention_spec,
                                  standard_specs)
from pyattn.runtime.device import SUPPORTED_ARCHS, arch_for_capability


def test_supported_archs_are_the_documented_ones():
    assert tuple(SUPPORTED_ARCHS) == ARCHS


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

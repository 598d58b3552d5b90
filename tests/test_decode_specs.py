"""Decode kernel specs and parameter structs (CPU only): ``attn_decode`` / ``attn_decode_tma`` /
``kv_append`` specs, their shared memory against ``AttnDecodeTraits`` in decode_common.cuh, TMA
selection, the warmed spec lists, the parameter structs and the kernel's split bound."""

from __future__ import annotations

import pathlib
import re
import struct

import pytest

from pyattn.kernels.families import WGMMA_ARCHS, DecodeTile, override_tiles, tile_table
from pyattn.kernels.families.decode import decode_row, tma_decode_serves, tma_gathers
from pyattn.kernels.params import DECODE_PARAMS, KV_APPEND_PARAMS
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec, decode_max_q_tiles, decode_specs, tile_config

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
OPTIN_SMEM = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90a": 232448, "sm_100a": 232448}
CUH = pathlib.Path(__file__).resolve().parents[1] / "kernels_src" / "decode_common.cuh"  # AttnDecodeTraits


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="f32", q_tiles=1), r"^dtype: attn_decode takes f16 or bf16"),
    (dict(q_tiles=0), r"^q_tiles: attn_decode at head_dim 128 on sm_90a takes 1 to 2, got 0"),
    (dict(q_tiles=3), r"^q_tiles: .* got 3"),
    (dict(head_dim=256, q_tiles=2), r"^q_tiles: attn_decode at head_dim 256 on sm_90a takes 1 to 1"),
    (dict(mask="bool", q_tiles=1), r"^mask/softcap/alibi:"),
    (dict(family="merge_states", q_tiles=1),
     r"^q_tiles: only attn_fwd_tma / attn_decode / attn_decode_tma / attn_decode_swap takes q_tiles"),
    (dict(family="kv_append", head_dim=32, q_tiles=1), r"^q_tiles: only attn_fwd_tma / attn_decode"),
    (dict(family="attn_fwd_mma", q_tiles=1), r"^q_tiles: only attn_fwd_tma / attn_decode"),
    (dict(family="merge_states", softcap=True), r"^mask/softcap/alibi:"),
    (dict(family="kv_append", head_dim=32, dtype="f32"), r"^dtype: kv_append takes f16 or bf16"),
])
def test_decode_spec_rejected(kw, match):
    args = {"family": "attn_decode", "dtype": "f16", "head_dim": 128, "arch": "sm_90a", **kw}
    with pytest.raises(ValueError, match=match):
        KernelSpec(**args)


def _cuh_smem(d, kpw, warps, mt, stages, kv=0, producer=0, swap=0, gather=0):
    """kPipeBytes / kMergeBytes evaluated from AttnDecodeTraits' own constexpr lines."""
    body = CUH.read_text().split("struct AttnDecodeTraits {")[1].split("};")[0]
    env = {"HEAD_DIM_": d, "KEYS_PER_WARP_": kpw, "WARPS_": warps, "M_TILES_": mt, "STAGES_": stages, "KV_": kv,
           "PRODUCER_": producer, "SWAP_": swap, "GATHER_": gather}
    for name, expr in re.findall(r"static constexpr int (\w+) = ([^;]+);", body):
        if name != "kSmemBytes":
            # plain integer arithmetic on the names above; `c ? a : b` read as Python's `a if c else b`
            expr = re.sub(r"^(.+?)\?(.+?):(.+)$", r"(\2) if (\1) else (\3)", " ".join(expr.split()), flags=re.S)
            env[name] = eval(expr.replace("/", "//"), {}, env)
    assert re.search(r"kSmemBytes = kPipeBytes > kMergeBytes \? kPipeBytes : kMergeBytes;", body)
    return max(env["kPipeBytes"], env["kMergeBytes"])


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_specs_fit_and_match_traits(arch):
    names = set()
    for d in HEAD_DIM_BUCKETS:
        t = tile_config("attn_decode", arch, d)
        for mt in range(1, decode_max_q_tiles(arch, d) + 1):
            for tag, ctype in (("f16", "__half"), ("bf16", "__nv_bfloat16")):
                for sc, al in ((False, False), (True, False), (False, True), (True, True)):
                    spec = KernelSpec("attn_decode", tag, d, arch, q_tiles=mt, softcap=sc, alibi=al)
                    names.add(spec.entry_name)
                    assert spec.entry_name == (f"pyattn_attn_decode_{tag}_d{d}_m{16 * mt}n{t.block_n}w{t.warps}"
                                               f"s{t.stages}" + "_softcap" * sc + "_alibi" * al)
            kpw = t.block_n // t.warps
            ring = (16 * mt + 2 * t.stages * t.block_n) * (d + 8) * 2
            merge = t.warps * 16 * mt * ((d + 8) + 2) * 4
            assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, t.warps, mt, t.stages)
            assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt)
            assert spec.tiles.block_m == 16 * mt and spec.threads == 32 * t.warps
            assert spec.template_id == (f"pyattn::attn_decode<pyattn::AttnDecodeTraits<{ctype}, {d}, {kpw}, "
                                        f"{t.warps}, {mt}, {t.stages}, 0, 0>, true, true>")
            assert kpw % 16 == 0 and t.stages >= 2 and (t.block_n * d // 8) % (32 * t.warps) == 0  # static_asserts
    n_variants = sum(decode_max_q_tiles(arch, d) for d in HEAD_DIM_BUCKETS) * 2 * 4
    assert len(names) == n_variants


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_decode_specs_fit_and_match_traits(arch):
    for d in (64, 128, 256):
        for kv, num in (("int8", 1), ("fp8e4m3", 2)):
            t = tile_config("attn_decode", arch, d, kv)
            for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1):
                spec = KernelSpec("attn_decode", "bf16", d, arch, q_tiles=mt, kv=kv)
                kpw = t.block_n // t.warps
                ring = 16 * mt * (d + 8) * 2 + t.stages * t.block_n * 2 * (d + 4)  # Q + codes + scales
                merge = t.warps * 16 * mt * ((d + 8) + 2) * 4
                assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, t.warps, mt, t.stages, num)
                assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt, kv)
                assert spec.entry_name.endswith(f"_kv{kv}")
                assert spec.template_id.endswith(f"{t.stages}, {num}, 0>, false, false>")
    with pytest.raises(ValueError, match="head_dim"):
        KernelSpec("attn_decode", "bf16", 96, arch, q_tiles=1, kv="int8")
    with pytest.raises(ValueError, match="kv"):
        KernelSpec("attn_fwd_mma", "bf16", 128, arch, kv="int8")


@pytest.mark.parametrize("arch", ARCHS)
def test_per_channel_key_decode_specs_fit_and_match_traits(arch):
    """key_scales="channel": the ring adds each 16-key segment's page record per stage (16 bytes,
    fp16 channel scales, 16 slots x 4 kept fp16 values)."""
    for d in (64, 128, 256):
        for kv, num in (("int8", 3), ("fp8e4m3", 4)):
            t = tile_config("attn_decode", arch, d, kv)
            for mt in range(1, decode_max_q_tiles(arch, d, kv) + 1):
                spec = KernelSpec("attn_decode", "bf16", d, arch, q_tiles=mt, kv=kv, key_channel=True)
                ring = 16 * mt * (d + 8) * 2 + t.stages * t.block_n * 2 * (d + 4) + t.stages * t.block_n // 16 * (16 + d * 2 + 128)
                merge = t.warps * 16 * mt * ((d + 8) + 2) * 4
                kpw = t.block_n // t.warps
                assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, t.warps, mt, t.stages, num)
                assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt, kv)
                assert spec.entry_name.endswith(f"_kv{kv}_kch") and kpw % 16 == 0
                assert spec.template_id.endswith(f"{t.stages}, {num}, 0>, false, false>")


@pytest.mark.parametrize("arch", WGMMA_ARCHS)
def test_tma_decode_specs_fit_and_match_traits(arch):
    """attn_decode_tma: producer warps past the consumers (no more than the ring's stages: their
    parity waits' rule), the ring's K / V unpadded after Q and 1024 bytes of alignment slack; the
    traits' own formula gives the same bytes."""
    for d in (64, 128, 192, 256):
        t = tile_config("attn_decode_tma", arch, d)
        consumers = t.warps - t.ws
        assert 1 <= t.ws <= t.stages and t.block_n & (t.block_n - 1) == 0 and 16 <= t.block_n <= 256  # static_asserts
        for mt in range(1, decode_row(arch, d, tma=True).max_q_tiles + 1):
            spec = KernelSpec("attn_decode_tma", "bf16", d, arch, q_tiles=mt)
            kpw = t.block_n // consumers
            ring = 16 * mt * (d + 8) * 2 + 1024 + 2 * t.stages * t.block_n * d * 2
            merge = consumers * 16 * mt * ((d + 8) + 2) * 4
            assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, consumers, mt, t.stages, 0, t.ws)
            assert spec.shared_bytes <= OPTIN_SMEM[arch], (arch, d, mt)
            assert spec.threads == 32 * t.warps and spec.entry_name.endswith(f"s{t.stages}tma")
            assert spec.template_id == (f"pyattn::attn_decode<pyattn::AttnDecodeTraits<__nv_bfloat16, {d}, {kpw}, "
                                        f"{consumers}, {mt}, {t.stages}, 0, {t.ws}>, false, false>")
    for bad in (dict(head_dim=96), dict(head_dim=64, kv="int8"), dict(head_dim=64, kv="int8", key_channel=True)):
        with pytest.raises(ValueError, match="attn_decode_tma"):
            KernelSpec("attn_decode_tma", "bf16", arch=arch, q_tiles=1, **bad)


@pytest.mark.parametrize("arch", WGMMA_ARCHS)
def test_tma_decode_specs_of_8_bit_caches_fit_and_match_traits(arch):
    """attn_decode_tma on 8-bit caches: the producer warp, Q, 1024 bytes of slack, then per stage K
    and V codes in 128-column boxes and their fp32 scales (per-channel keys: and each 16-key
    segment's page record, at most 2 stages so that 2 blocks still fit an SM); the traits' formula
    gives the same bytes, and the kernel's static_asserts hold (block_n a power of two, at most 16
    segments: a producer lane pair each)."""
    for d in (128, 256):
        for kv, num in (("int8", 1), ("fp8e4m3", 2)):
            for kc in (False, True):
                t = tile_config("attn_decode_tma", arch, d, kv)
                stages = min(t.stages, 2) if kc else t.stages
                consumers = t.warps - t.ws
                assert 1 <= t.ws <= stages and t.block_n & (t.block_n - 1) == 0 and 16 <= t.block_n <= 256 \
                    and t.block_n // 16 <= 16
                for mt in range(1, decode_row(arch, d, kv, tma=True).max_q_tiles + 1):
                    spec = KernelSpec("attn_decode_tma", "bf16", d, arch, q_tiles=mt, kv=kv, key_channel=kc)
                    kpw = t.block_n // consumers
                    ring = (16 * mt * (d + 8) * 2 + 1024 + stages * t.block_n * 2 * (d + 4)
                            + kc * stages * t.block_n // 16 * (16 + d * 2 + 128))
                    merge = consumers * 16 * mt * ((d + 8) + 2) * 4
                    assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, consumers, mt, stages,
                                                                              num + 2 * kc, t.ws)
                    assert spec.shared_bytes * t.min_blocks <= OPTIN_SMEM[arch], (arch, d, mt, kv, kc)
                    assert spec.threads == 32 * t.warps
                    assert spec.entry_name.endswith(f"s{stages}tma_kv{kv}" + "_kch" * kc)
                    assert spec.template_id.endswith(f"{mt}, {stages}, {num + 2 * kc}, {t.ws}>, false, false>")


@pytest.mark.parametrize("d", [64, 128])
def test_tma_decode_two_row_tiles_launch_for_one_block_an_sm(d):
    """attn_decode_tma's two-row-tile variant is bounded for one block an SM (2 blocks of 5 warps
    cap registers at 168, where its accumulators spilled); one row tile keeps the row's bound."""
    row = decode_row("sm_90a", d, tma=True)
    one = KernelSpec("attn_decode_tma", "bf16", d, "sm_90a", q_tiles=1)
    two = KernelSpec("attn_decode_tma", "bf16", d, "sm_90a", q_tiles=2)
    assert row.max_q_tiles == 2 and row.min_blocks == 2
    assert (one.tiles.min_blocks, two.tiles.min_blocks) == (2, 1)
    assert two.tiles.block_n == one.tiles.block_n and two.tiles.stages == one.tiles.stages


def test_tma_decode_per_channel_row_is_data():
    """A row's ``channel`` (keys per warp, stages) sets the per-channel variant's tile, and only its:
    the tuning hook dev/probe_q8_rows.py times."""
    base = tile_table("attn_decode_tma", "sm_90a", "kv8")
    with override_tiles("attn_decode_tma", "sm_90a", (base[0]._replace(channel=(16, 3)),) + base[1:], table="kv8"):
        kc = KernelSpec("attn_decode_tma", "bf16", 128, "sm_90a", q_tiles=1, kv="int8", key_channel=True)
        tok = KernelSpec("attn_decode_tma", "bf16", 128, "sm_90a", q_tiles=1, kv="int8")
        assert (kc.tiles.block_n, kc.tiles.stages) == (16 * base[0].warps, 3)
        assert (tok.tiles.block_n, tok.tiles.stages) == (base[0].keys_per_warp * base[0].warps, base[0].stages)
        assert kc.template_id.endswith(f"16, {base[0].warps}, 1, 3, 3, 1>, false, false>")


@pytest.mark.parametrize("kv", ["int8", "fp8e4m3"])
@pytest.mark.parametrize("d", [128, 256])
def test_tma_decode_launch_bounds_follow_the_variants_own_ring(kv, d):
    """Every one-row-tile attn_decode_tma variant asks its launch bounds for as many blocks an SM
    as its own shared memory lets in (at most the row's): the per-channel variant's 2-stage ring
    with its page records, not the per-token row's 3 stages plus records (which fit once and left
    the kernel without a register cap: 207 registers, one block an SM, 1.46x slower at B8 x 32k)."""
    row = decode_row("sm_90a", d, kv, tma=True)
    for key_channel in (False, True):
        spec = KernelSpec("attn_decode_tma", "bf16", d, "sm_90a", q_tiles=1, kv=kv, key_channel=key_channel)
        fit = (228 << 10) // (spec.shared_bytes + 1024)
        assert spec.tiles.min_blocks == max(1, min(row.min_blocks, fit)), (key_channel, spec.shared_bytes)
    if d == 128:  # the measured case: both variants two blocks an SM (168 registers)
        kc = KernelSpec("attn_decode_tma", "bf16", d, "sm_90a", q_tiles=1, kv=kv, key_channel=True)
        assert kc.tiles.min_blocks == 2


@pytest.mark.parametrize("arch, d, page, kv, tma", [
    ("sm_90a", 128, 16, "", True), ("sm_90a", 64, 256, "", True), ("sm_90a", 256, 1024, "", True),
    ("sm_90a", 128, 8, "", "swap"),   # boxes of 8 slots, too small for TMA to pay: gathered up to 8 rows
    ("sm_90a", 64, 48, "", "swap"),   # not a power of two (a box could straddle pages): likewise
    ("sm_90a", 96, 16, "", False),    # not whole 64-column boxes
    ("sm_90a", 128, 16, "int8", True), ("sm_90a", 256, 64, "fp8e4m3", True),
    ("sm_90a", 64, 16, "int8", False),   # 8-bit: boxes of 128 columns (the 64 bucket keeps cp.async)
    ("sm_90a", 128, 8, "fp8e4m3", "gather"), ("sm_90a", 256, 1, "int8", "gather"),  # rows by cp.async
    ("sm_90a", 128, 48, "int8", "gather"), ("sm_90a", 64, 8, "int8", False), ("sm_80", 128, 16, "int8", False),
    ("sm_80", 128, 8, "int8", False), ("sm_80", 128, 16, "", False), ("sm_89", 128, 16, "", False)])
@pytest.mark.parametrize("key_channel", [False, True])
def test_tma_decode_selection(arch, d, page, kv, tma, key_channel):
    """Per-channel key scales take the same kernel as per-token ones (page records by bulk copies);
    up to 8 rows take the TMA kernel's swapped-role blocks, 9 and more its m16 row tiles. 8-bit
    caches on pages TMA boxes do not take ("gather") take them too, their rows gathered by the
    producers (no tensor maps), but per-channel keys there keep the cp.async kernel; 16-bit caches
    there ("swap") likewise, with swapped roles only (up to 8 rows)."""
    from pyattn.ops._decode import _spec
    kc = key_channel and bool(kv)
    if tma:  # boxes (True) or gathered rows
        assert tma_gathers(page) is (tma != True)  # noqa: E712
    for rows in (1, 4, 8, 9, 16):
        served = tma is True or tma == "gather" and not kc or tma == "swap" and rows <= 8
        assert tma_decode_serves(arch, d, page, kv, kc, rows) is served, rows
        spec = _spec("bfloat16", d, arch, False, rows, False, False, kv, 0, kc, page)
        family = ("attn_decode_swap" if rows <= 8 else "attn_decode_tma") if served else "attn_decode"
        assert spec.family == family, rows
        assert spec.gather is (served and tma_gathers(page)), rows
        assert spec.tiles.block_m == (8 if family == "attn_decode_swap" else 16), rows


@pytest.mark.parametrize("kv, num", [("", 0), ("int8", 1), ("fp8e4m3", 2)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kc", [False, True])
def test_swapped_decode_specs_fit_and_match_traits(kv, num, d, kc):
    """attn_decode_swap: attn_decode_tma's ring and rows (16- or 8-bit) at blocks of 8 query rows
    (Q and the warp merge sized for 8, the merge's rows at d + 4 / d + 2), the traits' SWAP_ set;
    its shared memory is the traits' formula's and its launch bounds ask for the blocks that fit."""
    if (kc and not kv) or (kv and d == 64):  # per-channel keys are 8-bit; 8-bit boxes are 128 columns
        return
    t = tile_config("attn_decode_swap", "sm_90a", d, kv)
    tma = KernelSpec("attn_decode_tma", "bf16", d, "sm_90a", q_tiles=1, kv=kv, key_channel=kc)
    spec = KernelSpec("attn_decode_swap", "bf16", d, "sm_90a", q_tiles=1, kv=kv, key_channel=kc)
    st = spec.tiles
    assert (st.block_m, st.block_n, st.stages, st.warps) == (8, tma.tiles.block_n, tma.tiles.stages, t.warps)
    consumers, stages = st.warps - st.ws, st.stages
    ring = 8 * (d + 8) * 2 + 1024 + (stages * st.block_n * 2 * (d + 4) if kv else 2 * stages * st.block_n * d * 2)
    ring += kc * stages * st.block_n // 16 * (16 + d * 2 + 128)
    merge = consumers * 8 * (d + (4 if kv else 6)) * 4
    assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, st.block_n // consumers, consumers, 1, stages,
                                                              num + 2 * kc, st.ws, 1)
    assert st.min_blocks == max(1, min(t.min_blocks, (228 << 10) // (spec.shared_bytes + 1024)))
    assert spec.template_id.endswith(f"1, {stages}, {num + 2 * kc}, {st.ws}, 1>, false, false>")
    assert spec.entry_name != tma.entry_name
    with pytest.raises(ValueError, match="q_tiles"):
        KernelSpec("attn_decode_swap", "bf16", d, "sm_90a", q_tiles=2, kv=kv)


@pytest.mark.parametrize("family", ["attn_decode_tma", "attn_decode_swap"])
@pytest.mark.parametrize("kv, num", [("", 0), ("int8", 1), ("fp8e4m3", 2)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gathered_decode_specs_fit_and_match_traits(family, kv, num, d):
    """gather: the family row's own (keys per warp, stages, producer warps), the TMA ring's layout
    and shared memory (the traits' formula, GATHER_ set), its own entry name; refused where the row
    has no gathered variant (16-bit m16 rows), for per-channel keys and for the cp.async family."""
    if kv and d == 64:  # 8-bit boxes are 128 columns
        return
    swap = int(family == "attn_decode_swap")
    row = next(r for r in tile_table(family, "sm_90a", "kv8" if kv else "dense") if r.max_head_dim >= d)
    if not row.gather:
        assert not kv and not swap  # the measured exception: 16-bit m16 rows keep the cp.async kernel
        with pytest.raises(ValueError, match="^gather: attn_decode_tma's row at head_dim"):
            KernelSpec(family, "bf16", d, "sm_90a", q_tiles=1, gather=True)
        return
    kpw, stages, producers = row.gather
    spec = KernelSpec(family, "bf16", d, "sm_90a", q_tiles=1, kv=kv, gather=True)
    st = spec.tiles
    assert (st.block_n, st.stages, st.ws, st.warps) == (kpw * row.warps, stages, producers, row.warps + producers)
    assert producers <= stages  # the traits' parity-wait rule
    rows = 8 if swap else 16
    codes = stages * st.block_n * 2 * (d + 4) if kv else 2 * stages * st.block_n * d * 2
    ring = rows * (d + 8) * 2 + 1024 + codes
    merge = row.warps * rows * (d + ((2 if kv else 4) if swap else 8) + 2) * 4
    assert spec.shared_bytes == max(ring, merge) == _cuh_smem(d, kpw, row.warps, 1, stages, num, producers, swap, 1)
    assert spec.shared_bytes <= OPTIN_SMEM["sm_90a"]
    assert spec.template_id.endswith(f"{num}, {producers}, {swap}, 1>, false, false>")
    plain = KernelSpec(family, "bf16", d, "sm_90a", q_tiles=1, kv=kv)
    assert spec.entry_name.endswith("_gather") and spec.entry_name != plain.entry_name
    bad = [dict(family="attn_decode", kv=kv)] + [dict(family=family, kv=kv, key_channel=True)] * bool(kv)
    for kw in bad:
        with pytest.raises(ValueError, match="^gather: "):
            KernelSpec(dtype="bf16", head_dim=d, arch="sm_90a", q_tiles=1, gather=True, **kw)


def test_decode_shared_bytes_when_the_warp_merge_dominates():
    # No shipped tile has merge > ring; a hypothetical 16-warp d=32 tile does (the traits allow it).
    rows = (DecodeTile(32, 16, 16, 2, 2, 1, "test"),) + tile_table("attn_decode", "sm_90a")
    with override_tiles("attn_decode", "sm_90a", rows):
        spec = KernelSpec("attn_decode", "f16", 32, "sm_90a", q_tiles=2)
        ring, merge = (32 + 2 * 2 * 256) * 40 * 2, 16 * 32 * (40 + 2) * 4
        assert merge > ring and spec.shared_bytes == merge == _cuh_smem(32, 16, 16, 2, 2)


def test_append_templates():
    assert KernelSpec("kv_append", "f16", 32, "sm_80").template_id == "pyattn::kv_append<__half, 0>"
    assert KernelSpec("kv_append", "bf16", 32, "sm_80", kv="fp8e4m3").template_id == \
        "pyattn::kv_append<__nv_bfloat16, 2>"
    assert KernelSpec("attn_decode", "f16", 64, "sm_80", q_tiles=1).params is DECODE_PARAMS


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_specs_list(arch):
    """Both decode kernels of sm_90a are warmed (pages of 16 and more take the TMA one, up to 8 rows
    its swapped-role blocks)."""
    specs = decode_specs(arch)
    tma = 6 if arch in WGMMA_ARCHS else 0
    assert len(specs) == 8 + 2 * tma and len(set(specs)) == 8 + 2 * tma
    fams = [s.family for s in specs]
    assert (fams.count("attn_decode"), fams.count("attn_decode_tma"), fams.count("attn_decode_swap"),
            fams.count("kv_append")) == (6, tma, tma, 2)
    assert all(s.arch == arch and s.q_tiles == (s.family != "kv_append") for s in specs)
    both = decode_specs(arch, q_tiles=(1, 2))
    assert len(both) == 12 + (16 if tma else 0)  # q_tiles 2 only where it fits: d=64 and d=128


CODES = {"ptr": "Q", "mut_ptr": "Q", "f32_ptr": "Q", "f32_cptr": "Q", "i32_cptr": "Q", "i32_ptr": "Q", "u64_cptr": "Q",
         "i64": "q", "i32": "i", "f32": "f"}
C_TYPES = {"ptr": "const void*", "mut_ptr": "void*", "f32_ptr": "float*", "f32_cptr": "const float*",
           "i32_cptr": "const int*", "i32_ptr": "int*", "u64_cptr": "const unsigned long long*",
           "i64": "long long", "i32": "int", "f32": "float"}


@pytest.mark.parametrize("p", [DECODE_PARAMS, KV_APPEND_PARAMS], ids=["decode", "kv_append"])
def test_decode_param_structs(p):
    fmt = "@" + "".join(CODES[k] for _, k in p.fields)
    assert p.size == struct.calcsize(fmt + "0q") == (struct.calcsize(fmt) + 7) // 8 * 8
    names = [n for n, _ in p.fields]
    assert len(set(names)) == len(names)
    decl = p.c_declaration()
    body = decl[decl.index("{") + 1:decl.index("};")]
    assert re.findall(r"^\s+(.+?)\s+(\w+);$", body, re.M) == [(C_TYPES[k], n) for n, k in p.fields]
    assert f"static_assert(sizeof({p.name}) == {p.size}," in decl
    assert len(p.pack({n: 1 for n in names})) == p.size


def test_decode_kernel_reads_only_declared_fields():
    used = set(re.findall(r"\bp\.(\w+)", CUH.read_text()))
    assert used and used <= {n for n, _ in DECODE_PARAMS.fields}

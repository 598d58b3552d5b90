"""Tile tables and what they fix (CPU only, no compiler): the kernels' static asserts and launch
bounds, every family's shared-memory formula against the arch's opt-in limit (attn_fwd_tma's mask
tiles included), and the launch grids (plain and persistent, with the persistent slots)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _specs_helpers import ARCHS
from pyattn.kernels.families import tile_table
from pyattn.kernels.specs import (HEAD_DIM_BUCKETS, MAX_HEAD_DIM, KernelSpec, TileConfig, select_attention_spec,
                                  standard_specs, tile_config)

# Opt-in shared memory per block (bytes), from the CUDA programming guide's per-capability table.
OPTIN_SMEM = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024,
              "sm_90a": 227 * 1024, "sm_100a": 227 * 1024}
# Resident threads per SM, same table.
MAX_THREADS_PER_SM = {"sm_80": 2048, "sm_86": 1536, "sm_89": 1536, "sm_90a": 2048, "sm_100a": 2048}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiles_satisfy_the_kernel_static_asserts(arch):
    for s in standard_specs(arch):
        t = s.tiles
        assert isinstance(t, TileConfig) and t.reason, s.describe()
        if s.q_tiles in (1, 2):  # attn_fwd_tma's short row, or (2) its small-grid row
            short = tile_table(s.family, arch, table="short")[0]
            assert t == (short.mods_row if s.q_tiles == 2 else short).config()
        elif s.q_tiles == 3:  # its table's row, the last round split by keys
            assert t == tile_config(s.family, arch, s.head_dim)._replace(tail_split=True) and t.persistent
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

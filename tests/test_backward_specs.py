"""Spec selection and tile tables of the backward kernels, and its launch plan's bookkeeping (CPU only)."""

from __future__ import annotations

import re
import types

import pytest

from pyattn.jit.source import kernel_headers, render
from pyattn.kernels.families import BwdTile, BwdWgmmaTile, override_tiles, tile_table
from pyattn.kernels.families.backward import bwd_row
from pyattn.kernels.specs import (HEAD_DIM_BUCKETS, KernelSpec, backward_specs, row_pass_rows_per_warp,
                                  select_backward_specs)
from pyattn.ops import _bwd
from pyattn.runtime.device import SUPPORTED_ARCHS
from pyattn.validate.attention import AttentionProblem
from pyattn.validate.backward import BackwardProblem

OPTIN = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90a": 232448, "sm_100a": 232448}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_selection_per_dtype_bucket_and_modifiers(arch):
    for d in range(8, 257, 8):
        bucket = min(b for b in HEAD_DIM_BUCKETS if b >= d)
        # 16-bit: warpgroup MMA on sm_90a up to d=128 (buckets of 64), mma.sync otherwise
        wgmma = arch == "sm_90a" and d <= 128
        tc = ("attn_bwd_wgmma", -(-d // 64) * 64) if wgmma else ("attn_bwd_mma", bucket)
        for name, want in (("float16", tc), ("bfloat16", tc), ("float32", ("attn_bwd_simt", bucket))):
            pre, main, conv = select_backward_specs(name, d, arch, softcap=d % 16 == 0, alibi=d % 24 == 0)
            assert (main.family, main.head_dim, main.arch) == (*want, arch)
            assert (main.softcap, main.alibi) == (d % 16 == 0, d % 24 == 0)
            # the row kernels read the head dim at run time: one variant per dtype
            assert (pre.family, conv.family) == ("attn_bwd_pre", "attn_bwd_convert")
            assert pre.head_dim == conv.head_dim == 32
            assert pre.dtype == conv.dtype == main.dtype
            plain = select_backward_specs(name, d, arch)
            assert set(plain) <= set(backward_specs(arch))
    with pytest.raises(ValueError, match="^head_dim:"):
        select_backward_specs("float16", 264, arch)
    with pytest.raises(ValueError, match="^dtype:"):
        select_backward_specs("float64", 64, arch)


def test_backward_specs_count_and_unique_entry_names():
    for arch in SUPPORTED_ARCHS:
        specs = backward_specs(arch)
        # f16/bf16 x 8 buckets (sm_90a: wgmma at 64 and 128, mma.sync at the 4 above), simt f32 x 8,
        # pre and convert x 3 dtypes
        assert len(specs) == 2 * (6 if arch == "sm_90a" else 8) + 8 + 3 + 3
        names = [s.entry_name for s in specs]
        assert len(set(names)) == len(names)
        assert all(re.fullmatch(r"pyattn_attn_bwd_\w+", n) for n in names)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_tiles_fit_shared_memory_and_the_static_asserts(arch):
    for d in HEAD_DIM_BUCKETS:
        spec = KernelSpec("attn_bwd_mma", "bf16", d, arch)
        r = bwd_row(spec)
        assert isinstance(r, BwdTile) and r.max_head_dim >= d
        keys_per_warp = r.block_n // (r.warps // r.split)
        assert keys_per_warp % 16 == 0 and (r.block_m // r.split) % 16 == 0 and (d // r.split) % 16 == 0
        assert (r.block_m // r.dq_warps_m) % 16 == 0 and (d // (r.warps // r.dq_warps_m)) % 16 == 0
        assert r.block_m <= _bwd.VARLEN_ROW_PAD and r.stages in (1, 2)
        # dK + dV of a warp's keys in registers: at most 128 fp32 values per thread
        assert 2 * keys_per_warp * (d // r.split) // 32 <= 128
        smem = 2 * (2 * r.block_n * (d + 8) + 2 * r.stages * r.block_m * (d + 8)
                    + (1 if r.split == 1 else 2) * r.block_n * (r.block_m + 8)) + 8 * r.stages * r.block_m
        assert spec.shared_bytes == smem <= OPTIN[arch], spec.describe()
        simt = KernelSpec("attn_bwd_simt", "f32", d, arch)
        assert 0 < simt.shared_bytes <= min(OPTIN.values())  # one table for every arch
        src = render(spec)
        assert f"static_assert({spec.traits}::kSmemBytes == {spec.shared_bytes}," in src


def test_template_ids_match_the_header_signatures():
    headers = dict(kernel_headers())
    for family, header, traits in (("attn_bwd_mma", "attention_bwd_mma.cuh", "AttnBwdMmaTraits"),
                                   ("attn_bwd_simt", "attention_bwd_simt.cuh", "AttnBwdSimtTraits")):
        m = re.search(rf"template <([^>]*)>\s*struct {traits}\b", headers[header])
        dtype = "bf16" if family == "attn_bwd_mma" else "f32"
        tid = KernelSpec(family, dtype, 64, "sm_90a", softcap=True).template_id
        args = tid[tid.index(f"{traits}<") + len(traits) + 1:]
        assert len(args[:args.index(">")].split(",")) == len(m.group(1).split(","))
        assert tid.endswith(", pyattn::BwdMods<true, false>>")
    with pytest.raises(ValueError, match="^head_dim: attn_bwd_pre reads the head dim at run time"):
        KernelSpec("attn_bwd_pre", "f16", 64, "sm_80")
    with pytest.raises(ValueError, match="^mask/softcap/alibi:"):
        KernelSpec("attn_bwd_mma", "f16", 64, "sm_80", mask="bool")
    with pytest.raises(ValueError, match="^dtype:"):
        KernelSpec("attn_bwd_mma", "f32", 64, "sm_80")


def test_override_tiles_reaches_the_template_and_shared_memory():
    rows = tile_table("attn_bwd_mma", "sm_90a")
    new = (BwdTile(64, 128, 128, 8, 1, 4, 2, "tuning"),) + rows[1:]
    spec = KernelSpec("attn_bwd_mma", "f16", 64, "sm_90a")
    before = spec.template_id
    with override_tiles("attn_bwd_mma", "sm_90a", new):
        assert "AttnBwdMmaTraits<__half, 64, 128, 128, 8, 1, 4, 2>" in spec.template_id
        assert spec.tiles.block_m == 128 and spec.shared_bytes != KernelSpec("attn_bwd_mma", "f16", 128,
                                                                               "sm_90a").shared_bytes
    assert spec.template_id == before


def test_wgmma_rows_fit_and_split_dq_one_way():
    for d in (64, 128):
        spec = KernelSpec("attn_bwd_wgmma", "bf16", d, "sm_90a")
        r = tile_table("attn_bwd_wgmma", "sm_90a")[0 if d == 64 else 1]
        assert isinstance(r, BwdWgmmaTile) and spec.tiles.block_n == 64 * r.warpgroups == spec.threads // 2
        # dQ by rows (block_m = block_n) or by 64-wide head-dim blocks (block_m = 64)
        assert r.block_m == 64 * r.warpgroups or (r.block_m == 64 and (d // r.warpgroups) % 64 == 0)
        assert spec.shared_bytes <= OPTIN["sm_90a"] and r.block_m <= _bwd.VARLEN_ROW_PAD
    for d, arch in ((64, "sm_80"), (96, "sm_90a"), (256, "sm_90a")):
        with pytest.raises(ValueError, match="^family: attn_bwd_wgmma takes"):
            KernelSpec("attn_bwd_wgmma", "bf16", d, arch)


def _problem(layout="bshd", B=2, Sq=100, Sk=70, Hq=4, Hkv=2, D=64, deterministic=False, total_q=0):
    strides = (0, 1, 1) if layout == "thd" else (1, 1, 1)
    base = AttentionProblem(B, Hq, Hkv, Sq, Sk, D, "bfloat16", layout, 1, 0.125, True, strides, strides, strides,
                            total_q=total_q, align=16)
    k_shape = (Sk * B, Hkv, D) if layout == "thd" else (B, Sk, Hkv, D)
    return BackwardProblem(base, strides, strides, (0, 1, 1), None, None, None, deterministic, k_shape)


def test_scratch_layout_dense_and_varlen():
    # dense: per (batch, head) the rows of a whole number of query tiles
    acc_b, acc_h, m_blocks, offs = _bwd._scratch(_problem().base, 64, False)
    assert (acc_h, acc_b, m_blocks) == (128, 4 * 128, 2)
    rows = 2 * 4 * 128
    assert offs[:3] == (0, rows, 2 * rows) and offs[3] == -1 and offs[4] == 2 * rows + rows * 64
    acc_b, acc_h, m_blocks, offs = _bwd._scratch(_problem().base, 64, True)
    assert offs[3] == 2 * rows + rows * 64 and offs[4] == offs[3] + 64  # 2 x 4 x 2 counters, in a 256-byte region
    # varlen: each sequence's rows padded by VARLEN_ROW_PAD, so its last query tile stays its own
    P = _problem("thd", B=3, Sq=90, total_q=150).base
    acc_b, acc_h, m_blocks, offs = _bwd._scratch(P, 64, False)
    assert (acc_b, acc_h, m_blocks) == (0, 150 + 3 * _bwd.VARLEN_ROW_PAD, 2)
    # an empty problem still gets a (small) block
    assert _bwd._scratch(_problem(Sq=0).base, 64, True)[3][4] == 64


@pytest.mark.parametrize("head_dim, itemsize, rows", [(8, 2, 32), (40, 2, 4), (64, 2, 4), (128, 2, 2), (256, 2, 1),
                                                      (8, 4, 16), (64, 4, 2), (256, 4, 1)])
def test_row_pass_rows_per_warp(head_dim, itemsize, rows):
    """A row's 16-byte chunks on the next power of two of lanes (at most 32); the rest of the warp
    takes further rows."""
    assert row_pass_rows_per_warp(head_dim, itemsize) == rows


def test_plan_grids_and_static_fields(monkeypatch):
    monkeypatch.setattr(_bwd, "get_kernel", lambda spec, device: spec)
    dev = types.SimpleNamespace(arch="sm_90a", ordinal=0)
    plan = _bwd.build_bwd_plan(_problem(deterministic=True), dev)
    pre, main, conv = plan.launches
    bm = main.kernel.tiles.block_m
    # d=64 in 16 bits: 8 chunks of 16 bytes per row on 8 lanes, 4 rows per warp, 32 per block of 8 warps
    assert pre.kernel.family == "attn_bwd_pre" and pre.grid == (-(-(-(-100 // bm) * bm) // 32), 4, 2)
    # deterministic: key blocks slowest (kv heads, batch, key blocks)
    assert main.kernel.family == "attn_bwd_wgmma" and main.grid == (2, 2, 1)
    assert main.block == (main.kernel.threads, 1, 1)
    assert main.shared_bytes == main.kernel.shared_bytes and conv.grid == (-(-100 // 32), 4, 2)
    assert plan.grads[0][0] == (2, 100, 4, 64) and plan.grads[1][0] == plan.grads[2][0] == (2, 70, 2, 64)
    params = plan.packer.pack(*range(1, 17))
    assert len(params) == main.kernel.params.size
    assert _bwd.build_bwd_plan(_problem(Sk=300), dev).launches[1].grid == (3, 2, 2)  # key blocks fastest
    none = _bwd.build_bwd_plan(_problem(Sq=0, Sk=0), dev)
    assert none.launches == (None, None, None)

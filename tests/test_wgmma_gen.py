"""kernels_src/wgmma.cuh is what pyattn.jit.wgmma_gen generates for the wgmma tile tables' shapes."""

from __future__ import annotations

import re

import pytest

from pyattn.jit.source import kernel_source_dir
from pyattn.jit.wgmma_gen import main, wgmma_header
from pyattn.kernels.families import FAMILIES, WgmmaTile, wgmma_fp8_shapes, wgmma_shapes


def test_checked_in_header_is_current():
    # On failure: python -m pyattn.jit.wgmma_gen (after a tile-table change), and commit the header.
    assert (kernel_source_dir() / "wgmma.cuh").read_text() == wgmma_header(wgmma_shapes(), wgmma_fp8_shapes())
    assert main(["--check"]) == 0


def test_header_holds_exactly_the_shapes_in_use():
    # the tables' block_n (64, 128), head dims 64..256, and 8 (a bounded soft-cap's row sums: P times ones)
    assert wgmma_shapes() == (8, 64, 128, 192, 256)
    text = (kernel_source_dir() / "wgmma.cuh").read_text()
    for ctype in ("__half", "__nv_bfloat16"):
        assert [int(n) for n in re.findall(rf"struct Mma<{ctype}, (\d+), TRANS_B>", text)] == list(wgmma_shapes())
    for n in wgmma_shapes():
        assert text.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.") == 4  # ss and rs, fp16 and bf16
    # fp8 (attn_fwd_fp8): its rows' block_n and head dims, k32, no transpose immediates
    assert wgmma_fp8_shapes() == (128, 256)
    assert [int(n) for n in re.findall(r"struct Mma<fp8e4m3, (\d+), TRANS_B>", text)] == list(wgmma_fp8_shapes())
    for n in wgmma_fp8_shapes():
        assert text.count(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{") == 2
        assert text.count(f"m64n{n}k32.f32.e4m3.e4m3 {{") == 2
    assert "struct Mma<fp8e4m3" not in wgmma_header(wgmma_shapes())  # none without fp8 shapes


def test_shapes_follow_the_tables():
    tables = dict(FAMILIES["attn_fwd_wgmma"].tables)
    tables["extra"] = {"sm_90a": (WgmmaTile(256, 96, 1, 2, False, 1, "test"),)}
    assert wgmma_shapes(tables) == (8, 64, 96, 128, 192, 256)
    assert "struct Mma<__half, 96, TRANS_B>" in wgmma_header(wgmma_shapes(tables))


@pytest.mark.parametrize("shapes", [(), (12,), (264,), (0,)])
def test_generator_rejects_shapes_the_isa_lacks(shapes):
    with pytest.raises(ValueError, match=r"^shapes:"):
        wgmma_header(shapes)

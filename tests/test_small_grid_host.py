"""Small grids on the d = 64 short row, through the fake driver of ``fake_driver.py`` (no GPU; an
sm_90a of 132 SMs): which attn_fwd_tma entry a plain call launches as its query tiles fill fewer or
more rounds of the GPU's SMs (``short_small_grid``), below the short row's keys and past them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from pyattn.kernels.families import tile_table

ROW = next((r for r in tile_table("attn_fwd_tma", "sm_90a", table="short") if r.small_grid_rate), None)
DENSE = next((r for r in tile_table("attn_fwd_tma", "sm_90a") if ROW and r.max_head_dim == ROW.max_head_dim), None)
pytestmark = pytest.mark.skipif(ROW is None, reason="no short row with a small-grid row")


@pytest.fixture
def gpu(monkeypatch):
    with fake_driver.installed(monkeypatch, torch=False, record_launches=True) as fake:
        yield fake


def _launch(B, Sq, Sk, H, Hkv=None, **opts):
    q = pyattn.empty((B, Sq, H, 64), ml_dtypes.bfloat16)
    k, v = (pyattn.empty((B, Sk, Hkv or H, 64), ml_dtypes.bfloat16) for _ in range(2))
    fake_driver.LAUNCHES.clear()
    pyattn.attention(q, k, v, **opts)
    ((name, grid, *_),) = [x for x in fake_driver.LAUNCHES if "attn_fwd_tma" in (x[0] or "")]
    return name, grid


@pytest.mark.parametrize("B, Sq, Sk, H, causal, want", [
    (1, 1000, 1000, 32, False, "small"),    # 192 units of 192 rows, 2 rounds; 512 of 64, 2 rounds
    (1, 777, 1500, 32, True, "small"),      # 5 x 32 / 2 = 80 causal pairs: 1 round either way
    (2, 2048, 2048, 8, True, "small"),      # a small model's prompt: 11 x 16 / 2 = 88 pairs
    (16, 1000, 1000, 32, False, "short"),   # bench_prefill's shape: 3072 units
    (1, 1000, 1000, 40, False, "short"),    # 240 units, 2 rounds; 640 small ones take 3
    (2, 2048, 2048, 8, False, "small"),     # past the short row's keys: 11 dense-row tiles x 16 = 176
    (1, 32768, 32768, 1, False, "small"),   # 171 tiles of one head
    (1, 4096, 4096, 10, False, "dense"),    # 220 tiles, 2 rounds; 640 small ones take 3
    (1, 8192, 8192, 8, True, "small"),      # causal past the short row's keys: simulated, 0.86
    (1, 8192, 8192, 16, True, "dense"),     # the same with 16 heads: 1.00, the dense row
])
def test_plain_calls_on_few_tiles_launch_the_one_warpgroup_row(gpu, B, Sq, Sk, H, causal, want):
    name, grid = _launch(B, Sq, Sk, H, causal=causal)
    tiles = {"small": ROW.mods_row, "short": ROW, "dense": DENSE}[want]
    flags = ("p" if tiles.persistent else "") + ("o" if tiles.o_stage else "")  # entry_name's ring letters
    assert name.endswith(f"_d64_m{64 * tiles.warpgroups}n{tiles.block_n}w{4 * (tiles.warpgroups + 1)}{flags}"), name
    if tiles.persistent:
        assert grid[1:] == (1, 1)  # a one-dimensional grid of blocks that walk the units


def test_alibi_keeps_its_own_row_and_a_softcap_the_small_grid_row(gpu):
    slopes = pyattn.asarray(np.linspace(0.1, 0.5, 32).astype(np.float32))
    name, _ = _launch(1, 1000, 1000, 32, alibi_slopes=slopes)
    assert name.endswith("_d64_m64n128w8p_alibi"), name
    name, _ = _launch(1, 1000, 1000, 32, softcap=30.0)
    assert name.endswith("_d64_m64n128w8p_softcap"), name


def test_launched_names_the_entry_that_ran(gpu, launched):
    """conftest's ``launched`` (what GPU tests assert the row they check by) records each launch's
    entry name, read back from the function handle: here the small-grid row's, as the fake driver
    saw it, and the spec that the call's full arguments select."""
    from pyattn.kernels.specs import select_attention_spec

    name, _ = _launch(1, 1000, 1000, 32)
    spec = select_attention_spec("bfloat16", 64, "sm_90a", keys=1000, queries=1000, batch_heads=32, sm_count=132)
    assert launched == [name] and name == spec.entry_name and spec.q_tiles == 2

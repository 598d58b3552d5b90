"""GPU tests of the TMA-fed sm_90a kernel's (attn_fwd_tma) persistent blocks and its rows of several
warpgroups against the fp64 reference: blocks walking more work units than the GPU has SMs,
warpgroups ending at their own last key tile, the short row and its mods_row, the short row's
small-grid row, row blocks that see no key, and varlen launches whose tiles lie past their
sequence's end; marked ``gpu``, skipped without an sm_90a GPU.

The kernel's views, layouts and modifiers: test_gpu_tma_views.py; its mask tensors:
test_gpu_tma_masks.py; shared helpers: _tma_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.kernels.families import tile_table
from pyattn.kernels.specs import select_attention_spec

from _tma_helpers import _tma_row, check_varlen
from test_gpu_attention import _check, _inputs
from test_gpu_wgmma_ws import _is_sm90a

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]


# Persistent blocks (one an SM) walk work units (a query tile, or a causal pair of row blocks):
# these shapes have more units than any GPU has SMs, so each block carries its ring's phase bits,
# its query tile's barriers and its ping-pong turns from one tile to the next. 601 keys: d = 64 takes
# its short row (persistent), the other buckets their table's row.
PERSISTENT_DIMS = [d for d in (64, 128, 192, 256)
                   if select_attention_spec("bfloat16", d, "sm_90a", keys=601).tiles.persistent]


@pytest.mark.parametrize("D", PERSISTENT_DIMS or [128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B, H, Hkv", [(2, 48, 12), (1, 45, 15)])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_persistent_blocks_walk_many_tiles(D, causal, B, H, Hkv, launched):
    """B x H heads of 550 queries: an odd count of row blocks (3 of 192 rows, 5 of 128, the last
    partial), so causal units pair row blocks (n - 1 - i, i) of one (batch, head) and the middle
    blocks of two; with 45 (batch, head)s the last one's middle block goes alone (GQA 4 / 3)."""
    rng = np.random.default_rng(D + causal + H)
    Sq, Sk = 550, 601
    spec = select_attention_spec("bfloat16", D, "sm_90a", keys=Sk, causal=causal)
    assert spec.family == "attn_fwd_tma" and spec.tiles.persistent
    assert -(-Sq // spec.tiles.block_m) % 2 == 1
    q, k, v = _inputs(rng, B, Sq, Sk, H, Hkv, D, "bfloat16")
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), causal=causal, return_lse=True)
    assert spec.entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, causal=causal)


# Rows that bound their warpgroups' tiles (three warpgroups in persistent blocks: d = 64's short
# row; two on 64-key tiles): each warpgroup computes the key tiles up to the last its own 64 rows
# see and only waits for and frees the rest. (The other multi-warpgroup rows take the same shapes.)
MULTI_WG_DIMS = [r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a") if r.warpgroups >= 2]


@pytest.mark.parametrize("D", MULTI_WG_DIMS or [128])
@pytest.mark.parametrize("band", ["causal", "window", "causal_window"])
@pytest.mark.parametrize("offset", [0, 13, 64, 77, 200])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_warpgroups_end_at_their_own_last_tile(D, band, offset, launched):
    """Bottom-right bands whose diagonal (Sk - Sq = offset) falls at and off the warpgroups' 64-row
    edges, a window's right edge (41 past the diagonal) alike: a warpgroup whose rows end a tile
    early skips the block's last tiles, the others compute them (GQA 2, 24 heads so that
    persistent blocks take several tiles, a partial last row block)."""
    rng = np.random.default_rng(D + offset)
    Sq, Sk = 1000, 1000 + offset
    spec = select_attention_spec("bfloat16", D, "sm_90a", keys=Sk)
    assert spec.family == "attn_fwd_tma" and spec.tiles.block_m >= 128, spec
    opts = {"causal": {"causal": True}, "window": {"window": (300, 41)},
            "causal_window": {"causal": True, "window": (250, 0)}}[band]
    q, k, v = _inputs(rng, 1, Sq, Sk, 24, 12, D, "bfloat16")
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **opts)
    assert spec.entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)


SHORT_DIMS = [r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="short")]


@pytest.mark.parametrize("D", SHORT_DIMS or [64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (100, 7)])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_short_row_and_its_mods_row(D, causal, window, launched):
    """Calls of few keys take the short row (at d = 64 persistent blocks of three warpgroups; with
    ALiBi its mods_row: one consumer warpgroup a block, two blocks an SM). 2 x 48 heads of 333
    queries (GQA 4, the last row block partial: more query tiles than blocks); odd key count."""
    if D not in SHORT_DIMS:
        pytest.skip(f"attn_fwd_tma has no short row for d={D}")
    rng = np.random.default_rng(D + 2 * causal + (window is None))
    Sq, Sk = 333, 1001
    row = _tma_row(D, table="short")
    specs = []
    for alibi, want in ((False, row), (True, row.mods_row or row)):
        specs.append(select_attention_spec("bfloat16", D, "sm_90a", keys=Sk, alibi=alibi))
        assert (specs[-1].family, specs[-1].q_tiles, specs[-1].tiles) == ("attn_fwd_tma", 1, want.config())
    q, k, v = _inputs(rng, 2, Sq, Sk, 48, 12, D, "bfloat16")
    for spec, opts in zip(specs, (dict(causal=causal, window=window),
                                  dict(causal=causal, window=window,
                                       alibi_slopes=rng.uniform(0.01, 0.5, 48).astype(np.float32)))):
        on_device = {n: pyattn.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
        launched.clear()
        out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **on_device)
        assert spec.entry_name in launched, launched
        _check(out.numpy(), lse.numpy(), q, k, v, **opts)


SMALL_GRID_DIMS = [r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="short")
                   if r.mods_row and r.small_grid_rate]


@pytest.mark.parametrize("D", SMALL_GRID_DIMS or [64])
@pytest.mark.parametrize("case", ["plain", "causal", "gqa_window", "softcap", "fp16_lse", "long_keys", "long_window",
                                  "long_causal"])
def test_small_grids_run_the_short_rows_small_grid_row(D, case, launched):
    """A plain call whose query tiles would leave the GPU's SMs a short last round runs the short
    row's one-warpgroup mods_row (spec q_tiles 2: 64-row tiles, two blocks an SM; short_small_grid):
    one prompt of 32 heads at 1000 queries (the (B, S, H) that measured 17-21% faster), odd sizes,
    causal bottom-right over more keys, GQA with a window, a soft-cap, fp16 with the LSE; and past the
    short row's keys (the dense row's domain), non-causal GQA calls of 8 heads, one with a window,
    and a causal call of 2 heads over 8300 keys (bottom-right; the simulated pick)."""
    if D not in SMALL_GRID_DIMS:
        pytest.skip(f"attn_fwd_tma's short row has no small-grid row for d={D}")
    rng = np.random.default_rng(D + len(case))
    B, Sq, Sk, Hq, Hkv, dtype = 1, 1000, 1000, 32, 32, "bfloat16"
    opts = {"causal": {"causal": True}, "gqa_window": {"window": (200, 17)}, "softcap": {"softcap": 20.0}}.get(case, {})
    if case == "causal":
        Sq, Sk = 777, 1500
    if case == "gqa_window":
        Hkv = 4
    if case == "fp16_lse":
        dtype, B, Hq, Hkv, Sq = "float16", 2, 6, 2, 1234
    if case.startswith("long"):
        Sq, Sk, Hq, Hkv = 2000, 4099, 8, 2
        opts = {"window": (1000, 300)} if case == "long_window" else {}
    if case == "long_causal":
        Sq, Sk, Hq, Hkv, opts = 8000, 8300, 2, 1, {"causal": True}
    sm = pyattn.get_device().sm_count
    spec = select_attention_spec(dtype, D, "sm_90a", keys=Sk, causal=bool(opts.get("causal")),
                                 softcap=opts.get("softcap", 0.0), queries=Sq, batch_heads=B * Hq, sm_count=sm)
    row = _tma_row(D, table="short")
    assert (spec.family, spec.q_tiles, spec.tiles) == ("attn_fwd_tma", 2, row.mods_row.config())
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **opts)
    assert spec.entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window", [None, (64, 0)])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_persistent_blocks_skip_empty_tiles(window, D):
    """Causal bottom-right with 700 queries over 90 keys: the first row blocks see no key (no key
    tiles: stored as 0 / LSE -inf without a query tile loaded), between tiles that do; 40 heads
    so that blocks meet both kinds (d = 64: the short row's)."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 700, 90, 40, 8, D, "bfloat16")
    opts = dict(causal=True, window=window)
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **opts)
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)
    assert np.isneginf(lse.numpy()[:, :, :610]).all()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_varlen_many_sequences(causal, D):
    """40 sequences of 1..700 queries in one launch of max-length row blocks: most tiles lie past
    their sequence's end and every role skips them (d = 64: the short row's)."""
    rng = np.random.default_rng(17 + causal)
    check_varlen(rng, [(int(a), int(b)) for a, b in zip(rng.integers(1, 701, 40), rng.integers(1, 701, 40))], D,
                 causal)

"""GPU tests of attn_fwd_tma's rows of three consumer warpgroups (192 query rows a block, the
warpgroups' GEMM turns round robin on named barriers 1-3) against the fp64 reference; marked
``gpu``, skipped without an sm_90a GPU. ALiBi and float masks keep such a row's
``warpgroups_mods`` (two: at 160 registers a thread they spill); bool masks (packed bits) run at
three; both checked here too."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import pyattn
from pyattn.kernels.families import tile_table
from pyattn.kernels.specs import select_attention_spec

from _tma_helpers import check_varlen  # noqa: E402
from test_gpu_attention import _check, _inputs  # noqa: E402
from test_gpu_wgmma_ws import _is_sm90a  # noqa: E402

# (short_row_on_any_grid: the calls here have few query tiles, which would otherwise run the short
# row's one-warpgroup small-grid row, non-causal ones past its keys too, not the rows under test)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations", "short_row_on_any_grid")]
ROWS = {r.max_head_dim: r for r in tile_table("attn_fwd_tma", "sm_90a") if r.warpgroups == 3}
CASES = ["plain", "causal", "window", "causal_window", "top_left", "softcap", "rows_without_keys", "fp16_mqa", "bhsd",
         "alibi", "bool_mask"]


@pytest.mark.parametrize("D", sorted(ROWS) or [64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.usefixtures("no_causal_short_row")  # its causal cases run the dense row, not the short one
def test_three_warpgroups_match_the_reference(D, case, launched):
    """1000 query rows (a partial block of 192: the last, or with causal the first, whose rows
    before 0 are computed and not stored) over a few more keys than the row's min_keys; windows and
    causal bounds that fall inside a warpgroup's 64 rows; causal bottom-right with more queries
    than keys (the first rows see no key: 0 / LSE -inf)."""
    if D not in ROWS:
        pytest.skip(f"attn_fwd_tma has no three-warpgroup row for d={D}")
    row = ROWS[D]
    mods = case in ("alibi", "bool_mask")  # (the short row's max_keys_mods: a mask tensor or ALiBi)
    short = next((r for r in tile_table("attn_fwd_tma", "sm_90a", table="short") if r.max_head_dim == D), None)
    below = (short.max_keys_mods if mods and short.max_keys_mods else short.max_keys) if short else 0  # short row's
    rng = np.random.default_rng(CASES.index(case))
    B, Sq, Sk, Hq, Hkv, dtype, layout = 2, 1000, max(row.min_keys, below) + 77, 4, 2, "bfloat16", "bshd"
    opts = {"causal": {"causal": True}, "window": {"window": (300, 41)}, "softcap": {"softcap": 15.0, "causal": True},
            "causal_window": {"causal": True, "window": (250, 0)}, "top_left": {"causal": "top_left"},
            "rows_without_keys": {"causal": True}, "bool_mask": {"causal": True}}.get(case, {})
    if case == "rows_without_keys":
        Sq = Sk + 333
    if case == "fp16_mqa":
        dtype, Hq, Hkv = "float16", 6, 1
    if case == "bhsd":
        layout = opts["layout"] = "bhsd"
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype, layout)
    if case == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, Hq).astype(np.float32)
    if case == "bool_mask":
        opts["mask"] = rng.random((1, Hq, Sq, Sk)) < 0.7
    spec = select_attention_spec(dtype, D, "sm_90a", keys=Sk, mask="bool" if case == "bool_mask" else "none",
                                 alibi=case == "alibi", softcap=case == "softcap", causal=bool(opts.get("causal")))
    wgs = row.warpgroups_mods if case == "alibi" and row.warpgroups_mods else 3
    assert (spec.family, spec.q_tiles, spec.tiles.block_m) == ("attn_fwd_tma", 0, 64 * wgs)
    on_device = {n: pyattn.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **on_device)
    assert spec.entry_name in launched, launched  # the row asserted above is the one that ran
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)
    if case == "rows_without_keys":
        assert np.isneginf(lse.numpy()[:, :, :333]).all()


@pytest.mark.parametrize("D", sorted(ROWS) or [64])
@pytest.mark.parametrize("causal", [False, True])
def test_three_warpgroups_varlen(D, causal, launched):
    """Seven sequences of 1..3000 queries and keys in one launch of max-length row blocks: blocks
    past a short sequence's end exit, and a block's three warpgroups end inside different ones."""
    if D not in ROWS:
        pytest.skip(f"attn_fwd_tma has no three-warpgroup row for d={D}")
    assert select_attention_spec("bfloat16", D, "sm_90a", keys=3000).tiles.block_m == 192
    lens = [(1, 2100), (191, 193), (3000, 2500), (64, 3000), (500, 17), (2049, 2049), (1234, 2600)]
    check_varlen(np.random.default_rng(5 + causal), lens, D, causal)
    assert [n for n in launched if "attn_fwd" in n and f"_d{D}_m192" not in n] == [], launched


@pytest.mark.parametrize("mod", ["bool_mask", "bf16_mask", "f32_mask", "softcap", "alibi"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.usefixtures("no_causal_short_row")
def test_warpgroups_wholly_past_the_end(mod, causal, launched):
    """A last row block whose last warpgroups have no row inside the sequence (their scores are
    never stored) takes the fast paths of rows inside, with every modifier; the rows inside, in
    that block's first warpgroup, still match the reference. (Causal blocks are bottom-aligned:
    there the first block's first warpgroups lie before row 0.) 2100 keys: the dense row's calls
    (from 2048), 4096 + 200 with a mask tensor or ALiBi (the short row's max_keys_mods)."""
    D = 64
    if D not in ROWS:
        pytest.skip("attn_fwd_tma has no three-warpgroup row for d=64")
    rng = np.random.default_rng(7 + causal)
    tensor = mod.endswith("_mask")
    Sk = 4096 + 200 if tensor or mod == "alibi" else 2100
    spec = select_attention_spec("bfloat16", D, "sm_90a", keys=Sk, mask="bool" if mod == "bool_mask" else
                                 mod[:-5] if tensor else "none", alibi=mod == "alibi", softcap=mod == "softcap",
                                 causal=causal)
    bm = spec.tiles.block_m
    Sq = 3 * bm + 20  # the last block: 20 rows in its first warpgroup, the others wholly past the end
    q, k, v = _inputs(rng, 1, Sq, Sk, 2, 2, D, "bfloat16", "bshd")
    opts = {"causal": causal}
    if mod == "softcap":
        opts["softcap"] = 15.0
    if mod == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, 2).astype(np.float32)
    if tensor:
        mask = rng.random((1, 2, Sq, Sk)) < 0.7
        mask[..., :, :512] = True  # all-visible tiles next to mixed ones
        opts["mask"] = mask if mod == "bool_mask" else np.where(mask, rng.standard_normal(mask.shape), -np.inf).astype(
            {"bf16_mask": ml_dtypes.bfloat16, "f32_mask": np.float32}[mod])
    on_device = {n: pyattn.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **on_device)
    assert spec.family == "attn_fwd_tma" and spec.entry_name in launched and bm - (Sq % bm) > 64, (spec, launched)
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)

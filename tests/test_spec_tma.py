"""attn_fwd_tma's selection on sm_90a (CPU only, no compiler): which of its tables' rows a call
takes, its short row (and mods_row), bool masks packed to bits, key-padding float masks one row a
stage, and the mask layouts and TMA maps a call needs (calls TMA cannot map keep attn_fwd_wgmma).
The short row's small-grid row is test_spec_small_grid.py's."""

from __future__ import annotations

import re

import pytest

from pyattn.kernels.specs import MASK_KINDS, KernelSpec, select_attention_spec


def test_tma_kernel_selection():
    """attn_fwd_tma takes 16-bit sm_90a calls whose bucket its table for the mask kind has, from the
    row's min_keys on; block-sparse lists and layouts TMA cannot map go to attn_fwd_wgmma."""
    from pyattn.kernels.families import tile_table

    for table, mask in (("dense", "none"), ("dense", "bool"), ("mask2", "bf16"), ("mask2", "f16"), ("mask4", "f32")):
        rows = {r.max_head_dim: r for r in tile_table("attn_fwd_tma", "sm_90a", table=table)}
        for d in (64, 128, 192, 256):
            row = rows.get(d)
            shorts = {r.max_head_dim: r for r in tile_table("attn_fwd_tma", "sm_90a", table="short")}
            short = shorts.get(d) if table == "dense" else None
            # where the short row serves: below its max_keys, max_keys_mods with a mask tensor
            limit = (short.max_keys_mods if mask != "none" and short.max_keys_mods else short.max_keys) if short else 0
            first = max(row.min_keys, limit, 1) if row else 1 << 20  # the row's first call
            spec = select_attention_spec("bfloat16", d, "sm_90a", mask=mask, keys=first)
            assert spec.family == ("attn_fwd_tma" if row else "attn_fwd_wgmma"), (mask, d)
            if row is None:
                continue
            assert spec.tiles.block_n == row.block_n and spec.tiles.stages == row.stages
            # a float mask takes the row's warpgroups_mods where it names them (registers); bits do not
            wgs = row.warpgroups_mods if mask not in ("none", "bool") and row.warpgroups_mods else row.warpgroups
            assert spec.tiles.block_m == 64 * wgs
            if first > 1:  # below: the short row where one serves the mask kind, else cp.async
                below = select_attention_spec("bfloat16", d, "sm_90a", mask=mask, keys=first - 1)
                if short:  # its mods_row with a mask tensor (registers)
                    want = short.mods_row if mask != "none" and short.mods_row else short
                    assert (below.family, below.q_tiles, below.tiles) == ("attn_fwd_tma", 1, want.config())
                else:
                    assert below.family == "attn_fwd_wgmma"
            for kw in (dict(sparse=1), dict(sparse=2), dict(tma=False)):
                assert select_attention_spec("float16", d, "sm_90a", mask=mask, **kw).family == "attn_fwd_wgmma", kw
            assert select_attention_spec("float16", d, "sm_90a", mask=mask, softcap=True,
                                         alibi=True).family == "attn_fwd_tma"
            assert spec.mask == ("bits" if mask == "bool" else mask)  # a bool mask reaches it packed
    assert 256 not in {r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="mask4")}  # 256 KiB
    for arch in ("sm_80", "sm_89", "sm_100a"):
        assert select_attention_spec("bfloat16", 128, arch).family == "attn_fwd_mma"
    with pytest.raises(ValueError, match="attn_fwd_tma has no row for bucket 256 on sm_90a with a f32 mask"):
        KernelSpec("attn_fwd_tma", "bf16", 256, "sm_90a", mask="f32")
    with pytest.raises(ValueError, match="attn_fwd_tma"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_80")
    with pytest.raises(ValueError, match="attn_fwd_tma"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", sparse=1)


def test_short_row_of_the_tma_kernel():
    """q_tiles = 1 names attn_fwd_tma's short row (persistent blocks of three warpgroups at d = 64) and,
    with a mask tensor or ALiBi, its mods_row: one m64 row tile (one consumer warpgroup) a block,
    two blocks an SM; only buckets with such a row, masks that ride the dense rows, below its
    max_keys; every score modifier."""
    from pyattn.kernels.families import tile_table

    (row,) = tile_table("attn_fwd_tma", "sm_90a", table="short")
    plain = KernelSpec("attn_fwd_tma", "f16", row.max_head_dim, "sm_90a", softcap=True, q_tiles=1)
    assert plain.tiles == row.config() and (plain.tiles.persistent, plain.tiles.block_m) == (True, 192)
    assert plain.shared_bytes + 1024 <= 228 * 1024
    spec = KernelSpec("attn_fwd_tma", "f16", row.max_head_dim, "sm_90a", softcap=True, alibi=True, q_tiles=1)
    t = spec.tiles
    assert (t.block_m, t.warps, t.min_blocks, t.persistent) == (64, 8, 2, True) and t == row.mods_row.config()
    assert 2 * (spec.shared_bytes + 1024) <= 228 * 1024  # two blocks an SM (1 KiB reserved a block)
    assert ", 1, 3, true, 0, true, true, true>" in spec.template_id and "_m64n128w8p" in spec.entry_name
    for mask, rows in (("none", False), ("bool", False), ("bf16", True)):
        limit = row.max_keys_mods if mask != "none" and row.max_keys_mods else row.max_keys
        for keys, q_tiles in ((1, 1), (limit - 1, 1), (limit, 0)):
            got = select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=keys, mask=mask, mask_rows=rows)
            assert (got.family, got.q_tiles) == ("attn_fwd_tma", q_tiles), (keys, mask)
    # ALiBi counts as a modifier there; a soft-cap does not (it keeps the dense row's warpgroups)
    if row.max_keys_mods > row.max_keys:
        for kw, q_tiles in ((dict(alibi=True), 1), (dict(softcap=True), 0)):
            assert select_attention_spec("float16", 64, "sm_90a", keys=row.max_keys, **kw).q_tiles == q_tiles
    # causal calls without a mask tensor or ALiBi: up to max_keys_causal (its units balance causal rows)
    assert row.max_keys_causal > row.max_keys
    for kw, limit in (({}, row.max_keys_causal), (dict(softcap=True), row.max_keys_causal),
                      (dict(alibi=True), row.max_keys_mods or row.max_keys), (dict(mask="bool"), row.max_keys_mods)):
        for keys, q_tiles in ((limit - 1, 1), (limit, 0)):
            got = select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=keys, causal=True, **kw)
            assert got.q_tiles == q_tiles, (kw, keys)
    assert select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=row.max_keys_causal - 1).q_tiles == 0
    assert select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=1, mask="bf16").q_tiles == 0
    assert select_attention_spec("float16", row.max_head_dim, "sm_90a", keys=1, tma=False).q_tiles == 0
    for bad, match in ((dict(head_dim=128), "no short row for bucket 128"), (dict(q_tiles=4), "takes 0"),
                       (dict(q_tiles=3), "splits the last round by keys"),  # d = 64: three warpgroups
                       (dict(mask="f32"), "no short row for bucket 64 on sm_90a with a f32 mask")):
        with pytest.raises(ValueError, match=match):
            KernelSpec(**{**dict(family="attn_fwd_tma", dtype="f16", head_dim=64, arch="sm_90a", q_tiles=1), **bad})


def test_bool_masks_reach_only_the_tma_kernel_packed():
    """attn_fwd_tma reads bool masks as bits (the dense rows; a row with ``stage_bits`` puts
    block_m x block_n / 8 bytes of them in each stage, the others no ring space); no other family
    reads bits, and attn_fwd_tma no bool bytes."""
    from pyattn.kernels.families import tile_table

    for r in tile_table("attn_fwd_tma", "sm_90a"):
        spec = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", mask="bits")
        plain = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a")  # (bits keep the row's warpgroups)
        alibi = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", alibi=True)  # (warpgroups_mods)
        ring = r.stages * r.block_n // 8 * 64 * r.warpgroups if r.stage_bits else 0
        assert (spec.tiles, spec.shared_bytes) == (plain.tiles._replace(mask_bits=r.stage_bits),
                                                   plain.shared_bytes + ring)
        assert not plain.tiles.mask_bits
        assert spec.tiles.block_m == 64 * r.warpgroups
        assert alibi.tiles.block_m == 64 * (r.warpgroups_mods or r.warpgroups)
        assert spec.entry_name == plain.entry_name + "_maskbits"
        # soft-capped, bits spill more: the row's warpgroups_mods, as ALiBi (tma._spilling_mods)
        capped = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", mask="bits", softcap=1)
        assert capped.tiles.block_m == alibi.tiles.block_m
    with pytest.raises(ValueError, match="packed to bits"):
        KernelSpec("attn_fwd_tma", "bf16", 128, "sm_90a", mask="bool")
    for family, arch in (("attn_fwd_wgmma", "sm_90a"), ("attn_fwd_mma", "sm_80"), ("attn_fwd_simt", "sm_80")):
        for kind in ("bits", "bf16_row"):
            with pytest.raises(ValueError, match=rf"mask: {kind} masks .* are read by attn_fwd_tma / attn_fwd_fp8 only"):
                KernelSpec(family, "f16", 128, arch, mask=kind)
    with pytest.raises(ValueError, match="mask/softcap/alibi"):
        KernelSpec("attn_decode", "f16", 128, "sm_80", mask="bits")
    short = select_attention_spec("bfloat16", 64, "sm_90a", mask="bool", keys=1000)  # the short row
    assert (short.family, short.mask, short.q_tiles) == ("attn_fwd_tma", "bits", 1)
    assert select_attention_spec("bfloat16", 64, "sm_90a", mask="bool", sparse=1).mask == "bool"  # cp.async


def test_key_padding_float_masks_take_one_row_a_stage():
    """A float mask broadcast over the query rows runs attn_fwd_tma's dense rows with one mask row
    a stage (MASK_ROW, after PERSIST in the traits), short d=64 calls the short row's; other
    archs keep the plain kind."""
    from pyattn.kernels.families import tile_table

    sizes = {"f16": 2, "bf16": 2, "f32": 4}
    for r in tile_table("attn_fwd_tma", "sm_90a"):
        dense = KernelSpec("attn_fwd_tma", "bf16", r.max_head_dim, "sm_90a", alibi=True)  # (warpgroups_mods)
        for kind, size in sizes.items():
            spec = select_attention_spec("bfloat16", r.max_head_dim, "sm_90a", mask=kind, mask_rows=True)
            assert spec.mask == f"{kind}_row" and spec.tiles == dense.tiles
            assert spec.shared_bytes == dense.shared_bytes + r.stages * r.block_n * size <= 227 * 1024
            # (PERSIST, MASK_ROW[, SPLIT_KV, POLY_EXP, O_STAGE]): the traits' 11th and 12th arguments
            traits = re.search(r"AttnFwdWgmmaTraits<([^>]*)>", spec.template_id).group(1).split(", ")
            assert traits[10:12] == [str(r.persistent).lower(), "true"], traits
            assert spec.template_id.endswith(f"pyattn::ScoreMods<{MASK_KINDS[kind]}, 0, false>>")
            assert select_attention_spec("bfloat16", r.max_head_dim, "sm_90a", mask=kind).mask == kind
    assert select_attention_spec("bfloat16", 128, "sm_80", mask="f32", mask_rows=True).mask == "f32"
    short = select_attention_spec("bfloat16", 64, "sm_90a", mask="f32", mask_rows=True, keys=100)
    assert (short.mask, short.q_tiles, short.tiles.block_m) == ("f32_row", 1, 64)


def test_query_fragments_in_registers_on_the_d64_mask_rows():
    """The d = 64 mask-tile rows hold each warp's query rows in registers for Q K^T (q_regs: the
    traits' last argument, entry suffix "q") when the mask comes alone; with a soft-cap or ALiBi
    (they spill with it) and on every other row, Q K^T reads the query tile from shared memory."""
    for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"), ("f32", "bfloat16")):
        spec = select_attention_spec(dtype, 64, "sm_90a", mask=kind, keys=16384)
        assert spec.tiles.q_regs and spec.tiles.block_n == 64, spec.tiles
        assert re.search(r"AttnFwdWgmmaTraits<[^>]*, true>", spec.template_id), spec.template_id
        assert f"w16q_mask{kind}" in spec.entry_name
        for mods in ({"softcap": 30.0}, {"alibi": True}, {"causal": True}):
            other = select_attention_spec(dtype, 64, "sm_90a", mask=kind, keys=16384, **mods)
            assert other.tiles.q_regs == ("causal" in mods) and other.tiles.block_n == 64, (mods, other.tiles)
    for d in (64, 128, 256):
        for mask in ("none", "bool", "bf16"):
            if (d, mask) != (64, "bf16"):
                spec = select_attention_spec("bfloat16", d, "sm_90a", mask=mask, keys=16384)
                assert not spec.tiles.q_regs, spec
    assert not select_attention_spec("bfloat16", 64, "sm_90a", mask="bf16", mask_rows=True, keys=16384).tiles.q_regs


def test_packed_mask_layout():
    """A bool mask packs to rows of whole 128-key groups of u32 words; broadcast axes stay one row
    (a key-padding mask: a row per batch entry) and step 0."""
    from pyattn.ops._fwd import packed_map_layout, packed_mask_layout
    from pyattn.validate.options import MaskInfo

    class P:
        batch, heads_q, seqlen_q, seqlen_k = 2, 8, 300, 4100

    P.mask = MaskInfo("bool", (8 * 300 * 4100, 300 * 4100, 4100, 1), True)
    assert packed_mask_layout(P) == ((2, 8, 300), 132, (8 * 300 * 132, 300 * 132, 132, 1))
    P.mask = MaskInfo("bool", (4100, 0, 0, 1), True)  # (B, 1, 1, Sk)
    assert packed_mask_layout(P) == ((2, 1, 1), 132, (132, 0, 0, 1))
    P.mask = MaskInfo("bool", (0, 0, 1, 0), True)  # broadcast over keys: packed like any other
    assert packed_mask_layout(P) == ((1, 1, 300), 132, (0, 0, 132, 1))
    P.seqlen_k = 128
    assert packed_mask_layout(P)[1] == 4
    # the ring's map over the packed words (stage_bits rows): words innermost, broadcast axes of size 1
    P.seqlen_k = 4100
    P.mask = MaskInfo("bool", (8 * 300 * 4100, 300 * 4100, 4100, 1), True)
    assert packed_map_layout(P) == ((132, 300, 8, 2), (528, 300 * 528, 8 * 300 * 528))
    P.mask = MaskInfo("bool", (4100, 0, 0, 1), True)  # key padding: one row a batch entry
    assert packed_map_layout(P) == ((132, 1, 1, 2), (16, 16, 528))
    # ... or 192 copies of it, so that a staged box (192 rows at row 0: query stride 0) is whole
    assert packed_mask_layout(P, 192) == ((2, 1, 192), 132, (192 * 132, 0, 0, 1))
    assert packed_map_layout(P, 192) == ((132, 192, 1, 2), (528, 16, 192 * 528))
    P.mask = MaskInfo("bool", (0, 300 * 4100, 4100, 1), True)  # broadcast over the batch
    assert packed_map_layout(P) == ((132, 300, 8, 1), (528, 300 * 528, 16))
    P.seqlen_k = 0
    assert packed_mask_layout(P)[1] == 0


def test_tma_map_layouts():
    """rank4: zero strides and size-1 axes become size-1 axes stepped by 16 bytes; a broadcast row
    axis or a stepped stride off 16 bytes cannot be mapped (None)."""
    from pyattn.runtime.tensormap import rank4

    assert rank4(128, 4096, 16, 2, (4096 * 16 * 128, 16 * 128, 128), 2) == (
        (128, 4096, 16, 2), (16 * 128 * 2, 128 * 2, 4096 * 16 * 128 * 2))
    assert rank4(64, 300, 4, 3, (0, 4 * 64, 64), 2) == ((64, 300, 4, 1), (512, 128, 16))  # varlen / broadcast b
    assert rank4(64, 1, 1, 1, (7, 3, 5), 2) == ((64, 1, 1, 1), (16, 16, 16))  # size-1 axes are never stepped
    assert rank4(64, 0, 2, 1, (0, 128, 64), 2) == ((64, 1, 2, 1), (16, 128, 16))  # no keys: nothing is read
    assert rank4(64, 90, 2, 1, (0, 0, 64), 2) is None  # keys broadcast along the sequence
    assert rank4(72, 10, 2, 1, (0, 2 * 76, 76), 2) is None  # 152-byte head stride: not whole 16 bytes


def test_tma_mask_maps():
    """A mask's map: keys innermost, broadcast axes of size 1, a key-padding mask (query stride 0)
    one row; masks TMA cannot read (keys broadcast or strided, rows off 16 bytes) get none, so the
    call keeps attn_fwd_wgmma."""
    import numpy as np

    from pyattn.ops._fwd import mask_layout
    from pyattn.validate.options import MaskInfo

    class P:  # the fields mask_layout reads
        batch, heads_q, seqlen_q, seqlen_k = 2, 8, 300, 4096

    def layout(kind, strides):
        P.mask = MaskInfo(kind, strides, True)
        return mask_layout(P)

    full = (8 * 300 * 4096, 300 * 4096, 4096, 1)
    assert layout("bool", full) == ((4096, 300, 8, 2), (4096, 300 * 4096, 8 * 300 * 4096))
    assert layout("bf16", (0, 0, 4096, 1)) == ((4096, 300, 1, 1), (8192, 16, 16))  # (Sq, Sk) broadcast
    assert layout("f32", (4096, 0, 0, 1)) == ((4096, 1, 1, 2), (16, 16, 4 * 4096))  # key padding (B, 1, 1, Sk)
    assert layout("bool", (0, 0, 4096, 0)) is None  # broadcast over keys
    assert layout("bool", (0, 0, 8192, 2)) is None  # strided keys
    assert layout("bool", (0, 0, 4100, 1)) is None  # rows of 4100 bytes: not whole 16 bytes
    P.mask = None
    assert mask_layout(P) is None
    assert np.dtype(bool).itemsize == 1  # the u8 map reads numpy/torch bools as bytes

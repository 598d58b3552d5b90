"""attn_fwd_tma: attn_fwd_wgmma's kernel warp-specialized, its ring filled by TMA (dense calls, mask
tiles, packed bool masks): its tile tables, selection rules and family record.
"""

# No ``from __future__ import annotations`` here (see wgmma.py).

from ..params import ATTN_FWD_TMA_PARAMS
from .base import TENSOR_CORE_ALIGNMENT, WGMMA_ARCHS, Family, score_mods
from .tables import row as table_row
from .tables import rows as table_rows
from .wgmma import _TAKES, WgmmaTile, _check, _smem_bytes, _table, _traits

__all__ = ["ATTN_FWD_TMA", "tma_serves", "tma_serves_short", "short_limit"]


# attn_fwd_tma: the same kernel, warp-specialized, its ring filled by TMA (one producer thread,
# tensor maps encoded per call), float mask tiles included; no block-sparse lists. Bool masks come
# packed to bits (mask "bits", the mask_bits kernel) and run on the dense rows. Unlike the other
# tables, a row serves exactly the bucket it names, from ``min_keys`` keys on (``tma_serves``);
# other calls run attn_fwd_wgmma. Measured on H200 against attn_fwd_wgmma's row of the same bucket
# (dev/probe_tma.py, bf16, batch 16k / S, hidden 2048, non-causal / causal).
_SM90_TMA = (
    # (d = 64: O staged through shared memory, o_stage, measured 0.5-1.5% slower at 2k-16k on this
    # row, where the short row gains 2%: not set here; BENCHMARKS.md, thirtieth session)
    WgmmaTile(64, 128, 3, 3, True, 1, "three consumer warpgroups (192 query rows, round-robin GEMM turns): "
                                      "S 2k/4k/16k 0.570/1.069/4.246 ms = 1.03/1.08/1.13x cuDNN (causal 0.88/"
                                      "0.98/1.08x) against 0.669/1.250/4.932 for two warpgroups; persistent "
                                      "blocks 1-8% slower from 2k (dev/probe_d64_rows.py, H200). From 2048 keys "
                                      "(below: the short row). At 160 registers ALiBi spills 228 bytes, packed "
                                      "bits 4, mask rows 428-1100 (NVRTC 13.0): ALiBi, float masks and soft-capped "
                                      "bits (116-280) keep two (warpgroups_mods); bits alone at three: S 16k "
                                      "random / all True / causal + random / key padding 6.064/5.383/3.063/5.136 "
                                      "-> 5.754/5.157/2.903/5.051 ms (dev/probe_mask_cost.py --mods-warpgroups 3); "
                                      "their words in the ring (stage_bits, 3 KiB a stage) instead of loaded from L2: "
                                      "5.77-5.80/5.12-5.13/2.86-2.88/5.00-5.02 -> 5.22-5.27/4.61-4.66/2.61-2.63/"
                                      "4.63-4.78 ms (probe_mask_cost.py --flip-stage-bits, 3 rounds). "
                                      "Soft-capped, 1 of 8 key pairs' exp2 on the FMA pipe: cap 30 S 4k/16k "
                                      "1.598/5.943 ms (causal 0.910/3.043) against 1.678/6.230 (0.896/3.217) on the "
                                      "SFU; 2/3/4 of 8 6.163/6.232/6.374 at 16k: the softmax is issue-bound, not "
                                      "SFU-bound; fp16 (a row max) 1.668/6.220 (causal 16k 3.191) against "
                                      "1.729/6.423 (3.337) (dev/probe_poly_exp.py, H200)",
              ws=True, min_keys=2048, warpgroups_mods=2, poly_exp=1, poly_exp_max=1, stage_bits=True),
    WgmmaTile(128, 128, 2, 3, True, 1, "S 1k/2k/4k/16k 1.18/1.24/1.31/1.21x (causal 1.12-1.23x) the cp.async "
                                       "WS row: 632 TFLOP/s at 16k; persistent blocks 1.05/1.07/1.00x (causal "
                                       "1.09/1.07x at 1k/4k) the per-tile launch (dev/probe_persist.py). Soft-"
                                       "capped, 2 of 8 key pairs' exp2 on the FMA pipe: cap 30 S 1k/4k/16k 0.274/"
                                       "0.999/4.006 ms (causal 0.187/0.522/2.021) against 0.299/1.063/4.174 (0.196/"
                                       "0.572/2.139) on the SFU; 1/3/4 of 8 4.066/4.202/4.305 at 16k. Not "
                                       "with a row max (fp16, caps over 51): fp16 S 4k/16k 1.014/4.556 ms with 1 of "
                                       "8, 1.116/4.491 with 2, against 1.022/4.422 on the SFU "
                                       "(dev/probe_poly_exp.py, H200)", ws=True,
              persistent=True, poly_exp=2),
    WgmmaTile(192, 64, 2, 2, True, 1, "K and V on barriers of their own, so overlap and ping-pong on 2 stages: "
                                      "S 1k/4k/16k 0.224/0.806/3.246 ms (causal 0.147/0.421/1.648) against "
                                      "0.230/0.793/3.396 (0.150/0.458/1.722) without overlap (dev/probe_split_kv.py, "
                                      "H200); ptxas: 56 bytes of spill", ws=True, persistent=True, split_kv=True),
    WgmmaTile(256, 64, 2, 2, True, 1, "K and V on barriers of their own, so overlap and ping-pong on 2 stages: "
                                      "S 1k/4k/16k 0.223/0.801/3.241 ms = 0.96/0.94/1.02x cuDNN (causal 0.145/"
                                      "0.430/1.676 = 1.01/1.06/1.08x) against 0.230/0.817/3.437 (0.150/0.433/1.740) "
                                      "without overlap (dev/probe_split_kv.py, H200); ptxas: 64 bytes of spill, as "
                                      "before", ws=True, persistent=True, split_kv=True),
)


# attn_fwd_tma below a row's number of keys: persistent blocks of three consumer warpgroups (a block
# an SM walks the query tiles: at 1k keys a query tile has 8 key tiles, and one tile's prologue and
# epilogue run under another's GEMMs); with a mask tensor or ALiBi one warpgroup, two blocks an SM.
# Causal calls keep it longer (max_keys_causal): there its units pair a row block of many keys with
# one of few, and a warpgroup whose rows end early goes on to the next tile (per-warpgroup bounds).
# Spec q_tiles = 1. Measured on H200 against the dense table (bf16, batch 16k / S, hidden 2048, x cuDNN
# in one run; dev/probe_d64_rows.py, 3 runs):
_SM90_TMA_SHORT = (
    WgmmaTile(64, 128, 3, 3, True, 1, "S 1k: 0.343-0.346 ms = 0.90x cuDNN (causal 0.226-0.230 = 0.87x) against "
                                      "0.349-0.351 (0.238-0.241) for the one-warpgroup row and 0.337-0.340 "
                                      "(0.251-0.252) a block a tile; from 2k a block a tile is faster: below 2048 "
                                      "keys. Causal calls (once an odd count of row blocks had its middle blocks "
                                      "paired: causal 2k 0.384 -> 0.354) below "
                                      "8192 (causal 2k/3k/4k 0.355/0.454/0.620 ms against 0.374/0.467/0.615-"
                                      "0.641 a block a tile; 8k/16k 1.190/2.314 against 1.164/2.216; soft-cap "
                                      "2k/4k 0.530/0.920 against 0.558/0.959). Soft-capped, every exp2 stays on "
                                      "the SFU: 1/2/3/4 of 8 on the FMA pipe took cap 30 S 1k 0.474/0.468/0.477/"
                                      "0.501 ms against 0.469, causal 1k/4k 0.352/0.359/0.371/0.385 and 0.910/"
                                      "0.892/0.918/0.962 against 0.345 and 0.896 (dev/probe_poly_exp.py, H200). O "
                                      "through a staging tile (o_stage): S 1k 0.306 -> 0.300 ms, causal 1k/4k 0.221 "
                                      "-> 0.216 / 0.578 -> 0.570 (3 alternating rounds, dev/gpu_prefill.sh; the "
                                      "dense row, a block a tile, read 4k +1% in 2 rounds of 3 and is not flagged)",
              ws=True, persistent=True, max_keys=2048, max_keys_mods=4096, max_keys_causal=8192, o_stage=True,
              mods_row=WgmmaTile(64, 128, 1, 3, True, 2, "one warpgroup, two blocks an SM: S 1k/2k 0.351/0.633 ms "
                                                         "= 0.88/0.93x cuDNN (causal 0.84/0.88x) against 0.394/"
                                                         "0.663 ms for the cp.async row; with a mask tensor or "
                                                         "ALiBi (the dense row's two warpgroups then) below 4096; "
                                                         "plain calls on a small grid (short_small_grid): "
                                                         "(B, S, H) (1, 1k, 32) 0.027 ms (causal 0.020) against "
                                                         "0.033 (0.024) for the three-warpgroup row, (1, 2k, 32) "
                                                         "causal 0.054 against 0.068, (2, 2k, 8) causal 0.029 "
                                                         "against 0.036 (dev/probe_small_grid.py, H200)",
                                 ws=True, persistent=True),
              small_grid_rate=0.84),  # (1, 4k, 12), (1, 1k, 40): 0.119 / 0.038 ms for the
              # same rows an SM as the 0.100 / 0.034 of three warpgroups; (1, 4k, 16), (1, 2k, 32): 512
              # rows an SM for 576 in 1.068 / 1.06x the time (dev/probe_small_grid.py, H200)
)


# With a float mask tensor, a stage also holds its BLOCK_M x BLOCK_N mask tile (unpadded, swizzled),
# so the rows are those that fit 227 KiB per mask element size; d = 256 with an f32 mask does not
# (256 KiB) and keeps attn_fwd_wgmma. Tables "mask2" (f16 / bf16), "mask4" (f32). (Bool masks had a
# "mask1" table of byte tiles in the ring, 2 stages without overlap at d = 128: 1.17x the dense time
# from the tile shape alone; packed to bits they run the dense rows.)
_SM90_TMA_MASK2 = (
    WgmmaTile(64, 64, 3, 3, True, 1, "16-bit mask on three warpgroups of 64-key tiles, 145 KiB, no spill (128-key "
                                     "tiles at three spill 200 bytes; soft-cap / ALiBi 12-24 bytes here): (1, 16k, "
                                     "32) bf16 zeros / random / causal random 5.868 / 6.227 / 3.096 ms against "
                                     "5.800 / 6.745 / 3.393 on two warpgroups of 128-key tiles (209 KiB), 5.936 / "
                                     "6.385 / 3.111 on 2 stages with K and V split (dev/probe_mask_cost.py --row, "
                                     "H200, one run); from 2048 keys as dense. Q in registers for Q K^T (q_regs, a mask "
                                     "alone): zeros / random / causal random 5.48 / 6.12-6.16 / 2.98-3.01 -> 5.20-5.25 "
                                     "/ 5.91-6.01 / 2.89-2.91 ms (probe_mask_cost.py, two rounds against the tree "
                                     "before); with a soft-cap or ALiBi it spills 16-28 bytes more", ws=True,
                                     min_keys=2048, q_regs=True),
    WgmmaTile(128, 128, 2, 2, True, 1, "16-bit mask, 225 KiB: K and V on barriers of their own, so overlap on 2 "
                                       "stages: (1, 16k, 16) bf16 zeros / random / causal random 3.46 / 3.87 / "
                                       "1.96 ms = 0.99 / 1.15 / 1.15x the dense time against 4.24 / 4.73 / 2.34 "
                                       "ms without overlap (dev/probe_mask_cost.py --row, H200); persistent "
                                       "blocks spill 88 bytes", ws=True, split_kv=True),
    WgmmaTile(192, 64, 2, 2, True, 1, "16-bit mask, 177 KiB, overlap as d = 128: (1, 16k, 10) zeros / random / "
                                      "causal random 3.16 / 3.68 / 1.79 ms = 0.99 / 1.14 / 1.11x against 3.60 / "
                                      "4.03 / 1.97 ms without", ws=True, split_kv=True),
    WgmmaTile(256, 64, 2, 2, True, 1, "16-bit mask, 225 KiB, overlap as d = 128: (1, 16k, 8) zeros / random / "
                                      "causal random 3.22 / 3.34 / 1.65 ms = 1.00 / 1.07 / 1.12x against 3.70 / "
                                      "4.08 / 2.10 ms without; ptxas: 20 bytes of spill", ws=True, split_kv=True),
)
_SM90_TMA_MASK4 = (
    WgmmaTile(64, 64, 3, 3, True, 1, "f32 mask on three warpgroups of 64-key tiles, 217 KiB, no spill (soft-cap / "
                                     "ALiBi included): (1, 16k, 32) f32 zeros / random / causal random 7.27 / 7.36 / "
                                     "3.66-3.70 ms against 8.17 / 8.62 / 4.28-4.32 on two warpgroups of 4 stages "
                                     "(209 KiB), key padding level (dev/probe_mask_cost.py --row, H200, two runs); "
                                     "from 2048 keys as dense. Q in registers for Q K^T (q_regs, a mask alone): zeros / "
                                     "random / causal random 7.02-7.07 / 7.28-7.31 / 3.55-3.62 -> 6.79-6.81 / 7.19-7.22 "
                                     "/ 3.50-3.51 ms (probe_mask_cost.py, two rounds against the tree before)", ws=True,
                                     min_keys=2048, q_regs=True),
    WgmmaTile(128, 64, 2, 3, True, 1, "f32 mask: 225 KiB", ws=True),
    WgmmaTile(192, 64, 2, 2, False, 1, "f32 mask: 209 KiB", ws=True),
)


def _check_tma(spec) -> None:
    _check(spec)
    if spec.mask == "bool":
        raise ValueError(f"mask: attn_fwd_tma reads bool masks packed to bits (mask='bits'), got {spec}")
    if spec.q_tiles not in (0, 1, 2, 3):
        raise ValueError(f"q_tiles: attn_fwd_tma takes 0 (its table's row), 1 (the short row), 2 (the short "
                         f"row's small-grid row) or 3 (the table's row with its last round split by keys), "
                         f"got {spec}")
    if spec.q_tiles == 3:
        if not tma_tail_splits(spec.arch, spec.head_dim, spec.mask, spec.softcap, spec.alibi):
            raise ValueError(f"q_tiles: attn_fwd_tma splits the last round by keys (3) on its persistent "
                             f"two-warpgroup rows up to head dim 128, without a mask tensor, ALiBi or a "
                             f"bounded soft-cap; got {spec}")
        return
    if spec.q_tiles and not tma_serves_short(spec.arch, spec.head_dim, keys=0, mask=spec.mask):
        raise ValueError(f"q_tiles: attn_fwd_tma has no short row for bucket {spec.head_dim} on {spec.arch}"
                         + (f" with a {spec.mask} mask" if spec.mask != "none" else ""))
    if spec.q_tiles == 2 and not table_row(ATTN_FWD_TMA, "short", spec.arch, spec.head_dim).mods_row:
        raise ValueError(f"q_tiles: attn_fwd_tma's short row for bucket {spec.head_dim} on {spec.arch} has no "
                         f"small-grid row (mods_row); got {spec}")
    if not spec.q_tiles and not tma_serves(spec.arch, spec.head_dim, keys=1 << 62, mask=spec.mask):
        raise ValueError(f"head_dim: attn_fwd_tma has no row for bucket {spec.head_dim} on {spec.arch}"
                         + (f" with a {spec.mask} mask" if spec.mask != "none" else ""))


def _wide_mods(mask: str, alibi: bool) -> bool:
    """A mask tensor or ALiBi: the modifiers of the short row's ``max_keys_mods`` and ``mods_row``
    (selection and tiles must agree on them)."""
    return mask != "none" or bool(alibi)


def _spilling_mods(mask: str, alibi: bool, softcap: int) -> bool:
    """The modifiers that take a row's ``warpgroups_mods`` warpgroups: ALiBi, float masks, soft-capped
    bits (they spill at the d = 64 row's three; bits alone spill 24 bytes and run faster: its reason)."""
    return bool(alibi) or (mask != "none" and (mask != "bits" or bool(softcap)))


def _tma_spec_tiles(spec, t):
    """q_tiles = 1: the "short" table's row instead of the table's (its ``mods_row`` with a mask
    tensor or ALiBi); q_tiles = 2: that row's ``mods_row`` (a small grid, ``short_small_grid``);
    q_tiles = 3: the table's row with its last round split by keys (``tail_split``);
    _spilling_mods: the row's ``warpgroups_mods`` warpgroups where it names them."""
    if spec.q_tiles in (1, 2):
        row = table_row(ATTN_FWD_TMA, "short", spec.arch, spec.head_dim)
        row = row.mods_row if row.mods_row and (spec.q_tiles == 2 or _wide_mods(spec.mask, spec.alibi)) else row
        t = row.config()
    else:
        row = table_row(ATTN_FWD_TMA, _table("", 0, spec.mask), spec.arch, spec.head_dim)
        if _spilling_mods(spec.mask, spec.alibi, spec.softcap) and row.warpgroups_mods:
            t = row._replace(warpgroups=row.warpgroups_mods).config()
    # q_regs for a mask alone: with a soft-cap or ALiBi the d = 64 16-bit mask row spills 16-28
    # bytes more with it (NVRTC 13.0), and the f32 row's such calls were not measured with it
    return t._replace(poly_exp=(0, row.poly_exp_max, row.poly_exp)[spec.softcap],
                      mask_bits=spec.mask == "bits" and row.stage_bits,
                      q_regs=row.q_regs and not (spec.softcap or spec.alibi), tail_split=spec.q_tiles == 3)


ATTN_FWD_TMA = Family(
    name="attn_fwd_tma", label="the TMA-fed wgmma family", header="attention_fwd_tma.cuh",
    params=ATTN_FWD_TMA_PARAMS,
    tables={"dense": {arch: _SM90_TMA for arch in WGMMA_ARCHS},
            "short": {arch: _SM90_TMA_SHORT for arch in WGMMA_ARCHS},
            **{f"mask{n}": {arch: rows for arch in WGMMA_ARCHS}
               for n, rows in ((2, _SM90_TMA_MASK2), (4, _SM90_TMA_MASK4))}},
    template_id=lambda spec, t: f"pyattn::attn_fwd_tma<{_traits(spec, t)}, {score_mods(spec)}>",
    dtypes=("f16", "bf16"), mods=("mask", "softcap", "alibi", "tma_masks", "softcap_bounded"),
    alignment=TENSOR_CORE_ALIGNMENT,
    traits=_traits, smem_bytes=_smem_bytes, table_for=_table, spec_tiles=_tma_spec_tiles, takes=_TAKES,
    check=_check_tma, q_tiles=True,
)


def tma_tail_splits(arch: str, head_dim: int, mask: str = "none", softcap: int = 0, alibi: bool = False) -> bool:
    """Whether attn_fwd_tma's table row for these (q_tiles 0, any number of keys) has the variant
    whose last round of query tiles is split by keys (spec ``q_tiles`` 3, kernels_src/fwd_tail_split.cuh):
    persistent rows of two consumer warpgroups up to head dim 128, without a mask tensor, ALiBi
    (not measured) or a bounded soft-cap (``softcap`` 2: its O and LSE take other sums)."""
    if head_dim > 128 or mask != "none" or alibi or softcap == 2 or not tma_serves(arch, head_dim, keys=1 << 62):
        return False
    row = table_row(ATTN_FWD_TMA, "dense", arch, head_dim)
    return row.persistent and row.warpgroups == 2


def tma_serves(arch: str, head_dim: int, keys: int, mask: str = "none") -> bool:
    """Whether attn_fwd_tma runs a call of ``keys`` keys (seqlen_k; varlen: the longest) at
    head-dim bucket ``head_dim`` (a multiple of 64) on ``arch`` with a ``mask`` tensor (its kind,
    ``"none"`` without; a bool mask as ``"bits"``, never ``"bool"``): a row of its table for that
    mask (an override's, inside one) names exactly that bucket, and ``keys`` reaches its
    ``min_keys``."""
    return arch in WGMMA_ARCHS and mask != "bool" and any(
        r.max_head_dim == head_dim and keys >= r.min_keys for r in table_rows(ATTN_FWD_TMA, _table("", 0, mask), arch))


def tma_serves_short(arch: str, head_dim: int, keys: int, mask: str = "none", alibi: bool = False,
                     causal: bool = False) -> bool:
    """Whether attn_fwd_tma's "short" table (spec ``q_tiles=1``) runs a call of ``keys`` keys at
    bucket ``head_dim`` with a ``mask`` tensor kind (as :func:`tma_serves`), ``alibi`` and
    ``causal``: a row names exactly that bucket, ``keys`` is below its :func:`short_limit`, and the
    mask rides the dense rows (none, packed bits or one row a stage)."""
    return (arch in WGMMA_ARCHS and _table("", 0, mask) == "dense" and mask != "bool" and any(
        r.max_head_dim == head_dim and keys < short_limit(r, _wide_mods(mask, alibi), causal)
        for r in table_rows(ATTN_FWD_TMA, "short", arch)))


def short_limit(row: WgmmaTile, mods: bool, causal: bool) -> int:
    """The keys below which a "short" table ``row`` serves a call: ``max_keys_mods`` with a mask
    tensor or ALiBi (``mods``, where the row names it), else ``max_keys_causal`` for a causal call
    (where it names it), else ``max_keys``."""
    if mods and row.max_keys_mods:
        return row.max_keys_mods
    return row.max_keys_causal if causal and not mods and row.max_keys_causal else row.max_keys

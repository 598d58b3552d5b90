"""attn_fwd_wgmma: the sm_90a warpgroup-MMA attention kernel (16-bit inputs, every score modifier);
its row type, traits and shared-memory formula, which attn_fwd_tma (``tma.py``: the same kernel
with its ring filled by TMA) and the fp8 / paged prefill families share.

64 query rows per warpgroup, K/V in a ``stages``-deep ring of 128-byte swizzled tiles.
``shapes.py`` lists the instruction shapes its tiles use, from which
``pyattn.jit.wgmma_gen`` generates ``kernels_src/wgmma.cuh``.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

from typing import NamedTuple

from ..params import ATTN_FWD_PARAMS
from .base import CTYPES, TENSOR_CORE_ALIGNMENT, TMA_MASK_KINDS, WGMMA_ARCHS, Family, TileConfig, score_mods

__all__ = ["WgmmaTile", "WGMMA_ARCHS", "ATTN_FWD_WGMMA"]

_TAKES = f"f16/bf16, a head-dim bucket that is a multiple of 64 and arch in {WGMMA_ARCHS}"


class WgmmaTile(NamedTuple):
    """A tile-table row of the wgmma kernel (see ``FixedTile`` for the common fields)."""

    max_head_dim: int
    block_n: int
    warpgroups: int  # one m64 row block each: block_m = 64 * warpgroups
    stages: int  # K/V ring depth
    overlap: bool  # issue P V of tile j-1 behind Q K^T of tile j (needs 3 stages)
    min_blocks: int
    reason: str
    ws: bool = False  # warp-specialized: a producer warpgroup (the last) fills the ring
    min_keys: int = 0  # attn_fwd_tma: the row serves calls of at least this many keys (seqlen_k)
    max_keys: int = 0  # attn_fwd_tma's "short" table: the row serves calls of fewer keys than this
    max_keys_mods: int = 0  # ... and this many with a mask tensor or ALiBi (0: max_keys)
    max_keys_causal: int = 0  # ... and this many for causal calls without those (0: max_keys)
    persistent: bool = False  # attn_fwd_tma: one block per SM walks the query tiles
    # attn_fwd_tma: with a mask tensor or ALiBi, this many warpgroups instead (0: the row's): three
    # warpgroups run at 160 registers a thread, where those modifiers spill (spec_tiles applies it)
    warpgroups_mods: int = 0
    # attn_fwd_tma: K and V tiles complete and are freed on barriers of their own (overlap on a
    # 2-stage ring: K_j's slot refills while V_{j-1} is still read)
    split_kv: bool = False
    # attn_fwd_tma's short table: with a mask tensor or ALiBi, this row (a WgmmaTile) instead of this
    # one (their own measured best; the three-warpgroup row spills with them)
    mods_row: tuple = ()
    # attn_fwd_tma's short table: the speed of its mods_row on a row of query work relative to this
    # row's (and the dense table's row of the bucket), both filling the GPU; with it small_grid.short_small_grid
    # picks, for plain calls, the row whose work units end first on the call's grid (0: never the
    # mods_row for plain calls)
    small_grid_rate: float = 0.0
    # attn_fwd_tma, soft-capped calls only: of every 8 key pairs of the softmax's exp2s, this many
    # on the FMA pipe (poly_exp2 in kernels_src/mma.cuh) instead of the SFU, which the soft-cap's tanh
    # also loads; poly_exp with the bounded soft-cap (KernelSpec.softcap 2: no row max), poly_exp_max
    # with a row max (softcap 1: fp16, caps over 51), whose softmax has more instructions to issue
    # (_tma_spec_tiles puts the one that applies into TileConfig.poly_exp)
    poly_exp: int = 0
    poly_exp_max: int = 0
    # attn_fwd_tma: O leaves through a staging tile in shared memory (stmatrix, then 16-byte rows)
    # instead of a quad transpose by shuffles: rows with the shared memory to spare (block_m x
    # head_dim x 2 bytes more) where it measured faster (the d = 64 short row)
    o_stage: bool = False
    # attn_fwd_tma, a bool mask packed to bits (mask "bits"): its words ride the ring with K and V
    # (block_m x block_n / 8 bytes a stage, block_n 128) instead of the consumers' loads from L2
    stage_bits: bool = False
    # attn_fwd_tma: each consumer thread holds its warp's 16 query rows as wgmma A fragments (head_dim
    # / 4 registers, loaded once a query tile), so Q K^T reads only K from shared memory: the d = 64
    # mask-tile rows, whose 64-key steps re-read the query tile every step (not the dense row: it
    # spills there at three warpgroups)
    q_regs: bool = False

    def config(self) -> TileConfig:
        return TileConfig(64 * self.warpgroups, self.block_n, 4 * (self.warpgroups + self.ws), self.reason,
                          self.min_blocks, 1, self.stages, self.overlap, self.ws, self.persistent, self.split_kv,
                          o_stage=self.o_stage, q_regs=self.q_regs)


# Head-dim buckets are multiples of 64. Measured on H200 (dev/wgmma_dev.py, later dev/probe_ws.py,
# same run as torch SDPA; TFLOP/s non-causal / causal). Warp-specialized rows need 1 block/SM
# (384 threads): at d = 64 they lose to two 256-thread blocks per SM (0.80-0.94x, dev/probe_ws.py).
_SM90 = (
    WgmmaTile(64, 64, 2, 4, True, 2, "B4 S4096 H16: 356 / 304 TFLOP/s = 1.21 / 1.19x FA2; 128 registers, "
                                     "2 blocks/SM"),
    WgmmaTile(128, 128, 2, 3, True, 1, "warp-specialized (producer warpgroup, ping-pong): bf16 S4k/16k "
                                       "516/514 TFLOP/s, causal 466/535 = 1.05-1.18x the all-threads-load row "
                                       "(dev/probe_ws.py, H200); consumers 224 registers, no spill", ws=True),
    WgmmaTile(192, 64, 2, 2, False, 1, "unmeasured: compiles to 221 registers, 145 KiB (no overlap: registers)"),
    WgmmaTile(256, 64, 2, 2, False, 1, "B2 S4096 H16: 392 / 309 = 1.23 / 1.12x FA2; 246 registers, 193 KiB"),
)
# With a mask tensor its tiles ride in the ring, BLOCK_M x (BLOCK_N * element + 16) bytes per
# stage: 64-key tiles, and as deep a ring as 227 KiB allows for the mask's element size (a
# 2-stage ring could not hide the mask's scattered DRAM reads: bool mask 2.19x the dense time at
# (1, 16k, 16, 128) bf16, H200). Tables "mask1" (bool), "mask2" (f16 / bf16), "mask4" (f32).
_SM90_MASK1 = (
    WgmmaTile(64, 64, 2, 4, True, 1, "bool mask: 121 KiB; 2 blocks/SM would cap registers at 128 (spills)"),
    WgmmaTile(128, 64, 2, 4, True, 1, "bool mask, warp-specialized: 201 KiB; (1, 16k, 16) bf16 5.22 ms = 1.31x "
                                      "dense, against 6.58 all threads loading (dev/probe_mask_cost.py)", ws=True),
    WgmmaTile(192, 64, 2, 2, False, 1, "bool mask: 165 KiB (no overlap: registers, as dense)"),
    WgmmaTile(256, 64, 1, 2, False, 1, "bool mask: 171 KiB with one warpgroup"),
)
_SM90_MASK2 = (
    WgmmaTile(64, 64, 2, 4, True, 1, "16-bit mask: 153 KiB"),
    WgmmaTile(128, 64, 2, 3, True, 1, "16-bit mask, warp-specialized as the bool row: 183 KiB (4 stages: 233 KiB, "
                                      "over 227)", ws=True),
    WgmmaTile(192, 64, 2, 2, False, 1, "16-bit mask: 181 KiB"),
    WgmmaTile(256, 64, 1, 2, False, 1, "16-bit mask: 179 KiB with one warpgroup"),
)
_SM90_MASK4 = (
    WgmmaTile(64, 64, 2, 4, True, 1, "f32 mask: 217 KiB"),
    WgmmaTile(128, 64, 2, 2, False, 1, "f32 mask: 165 KiB (3 stages with overlap: 231 KiB, over 227)"),
    WgmmaTile(192, 64, 2, 2, False, 1, "f32 mask: 213 KiB"),
    WgmmaTile(256, 64, 1, 2, False, 1, "f32 mask: 195 KiB with one warpgroup (two: 261 KiB)"),
)
# Block-sparse layouts of small blocks (sparse=2): 64 x 64 tiles, one warpgroup (see mma.py).
_SM90_SPARSE64 = (
    WgmmaTile(64, 64, 1, 4, True, 2, "74 KiB: 3 blocks/SM; unmeasured"),
    WgmmaTile(128, 64, 1, 2, False, 2, "82 KiB: 2 blocks/SM (3 stages: 115 KiB, 1 block); see BENCHMARKS.md"),
    WgmmaTile(192, 64, 1, 2, False, 1, "123 KiB; unmeasured"),
    WgmmaTile(256, 64, 1, 2, False, 1, "164 KiB; unmeasured"),
)


# Bytes per element of each mask kind (AttnFwdWgmmaTraits' MASK_BYTES; 0: no mask tensor, or one
# packed to bits, whose words the consumers load themselves and which takes no ring space).
_MASK_BYTES = {"none": 0, "bool": 1, "f16": 2, "bf16": 2, "f32": 4, "bits": 0, "f16_row": 2, "bf16_row": 2,
               "f32_row": 4}


# The kernel of attention_fwd_tma.cuh, and the paged prefill's TMA rows (attention_prefill_wgmma.cuh
# on TMA traits): their traits spell the TMA flags
_TMA_FAMILIES = ("attn_fwd_tma", "attn_fwd_fp8", "attn_prefill_tma")
_ELEM_BYTES = {"f16": 2, "bf16": 2, "e4m3": 1}


def _traits(spec, t) -> str:
    # Trailing defaults (MASK_BYTES 0, WS false, TMA false, PERSIST false) left out: the units of
    # older rows stay as they were.
    mb = _MASK_BYTES[spec.mask]
    if spec.family in _TMA_FAMILIES:
        # (PERSIST, MASK_ROW, SPLIT_KV, POLY_EXP, O_STAGE, MASK_BITS, Q_REGS, TAIL_SPLIT): spelled up to
        # the last that is set
        flags = [str(f).lower() for f in (t.persistent, spec.mask.endswith("_row"), t.split_kv)] + [str(t.poly_exp)]
        flags += [str(f).lower() for f in (t.o_stage, t.mask_bits, t.q_regs, t.tail_split)]
        while flags and flags[-1] in ("false", "0"):
            flags.pop()
        tail = f", {mb}, true, true" + "".join(f", {f}" for f in flags)
    else:
        tail = f", {mb}, true" if t.ws else f", {mb}" if spec.mask != "none" else ""
    return (f"pyattn::AttnFwdWgmmaTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {t.block_m}, {t.block_n}, "
            f"{t.warps // 4 - t.ws}, {t.stages}, {str(t.overlap).lower()}{tail}>")


def _smem_bytes(spec, t) -> int:
    """Swizzled tiles, unpadded, mask tiles with rows padded by 16 bytes (swizzled instead when TMA
    copies them; ``mask_bits``: block_m rows of block_n / 8 bytes), O's staging tile (``o_stage``:
    block_m x head_dim of 16-bit outputs), two 8-byte mbarriers per stage when warp-specialized
    (four with K and V split) and two for the query tile when persistent; +1024 to align the
    swizzle atoms (AttnFwdWgmmaTraits::kSmemBytes)."""
    mb = _MASK_BYTES[spec.mask]
    pad = 0 if spec.family in _TMA_FAMILIES else 16
    rows = 1 if spec.mask.endswith("_row") else t.block_m  # a key-padding row: one row a stage
    mask_tile = rows * (t.block_n * mb + pad) if mb else t.block_m * t.block_n // 8 if t.mask_bits else 0
    # two a stage (SPLIT_KV: four), PERSIST: the query tile's two
    barriers = (16 * t.stages * (2 if t.split_kv else 1) if t.ws else 0) + (16 if t.persistent else 0)
    tiles = (t.block_m + 2 * t.stages * t.block_n) * spec.head_dim * _ELEM_BYTES[spec.dtype]
    o_tile = t.block_m * spec.head_dim * 2 if t.o_stage else 0
    return tiles + t.stages * mask_tile + o_tile + barriers + 1024


def _table(kv: str, sparse: int, mask: str = "none") -> str:
    """``sparse=2`` reads the 64 x 64 block-sparse tiles; a mask tensor ``mask<element bytes>``; a
    packed bool mask or a float mask's one row (attn_fwd_tma) the dense rows (they take no or
    little ring space)."""
    if sparse == 2:
        return "sparse64"
    return "dense" if mask == "none" or mask in TMA_MASK_KINDS else f"mask{_MASK_BYTES[mask]}"


def _check(spec) -> None:
    if spec.head_dim % 64 or spec.arch not in WGMMA_ARCHS:
        raise ValueError(f"family: {spec.family} takes {_TAKES}; got {spec}")


ATTN_FWD_WGMMA = Family(
    name="attn_fwd_wgmma", label="the wgmma family", header="attention_fwd_wgmma.cuh", params=ATTN_FWD_PARAMS,
    tables={"dense": {arch: _SM90 for arch in WGMMA_ARCHS}, "sparse64": {arch: _SM90_SPARSE64 for arch in WGMMA_ARCHS},
            **{f"mask{n}": {arch: rows for arch in WGMMA_ARCHS}
               for n, rows in ((1, _SM90_MASK1), (2, _SM90_MASK2), (4, _SM90_MASK4))}},
    template_id=lambda spec, t: (f"pyattn::attn_fwd_wgmma<{_traits(spec, t)}, {score_mods(spec)}, "
                                 f"{str(bool(spec.sparse)).lower()}>"),
    dtypes=("f16", "bf16"), mods=("mask", "softcap", "alibi", "softcap_bounded"), alignment=TENSOR_CORE_ALIGNMENT,
    traits=_traits, smem_bytes=_smem_bytes,
    table_for=_table, takes=_TAKES, check=_check, sparse=True,
)

"""attn_fwd_wgmma: the sm_90a warpgroup-MMA attention kernel (16-bit inputs, no score modifiers).

64 query rows per warpgroup, K/V in a ``stages``-deep cp.async ring of 128-byte swizzled tiles.
:func:`wgmma_shapes` lists the instruction shapes its tiles use, from which
``pyattn.jit.wgmma_gen`` generates ``kernels_src/wgmma.cuh``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..params import ATTN_FWD_PARAMS
from .base import CTYPES, HEAD_DIM_BUCKETS, Family, TileConfig, score_mods
from .mma import TENSOR_CORE_ALIGNMENT, sparse64_table

__all__ = ["WgmmaTile", "WGMMA_ARCHS", "ATTN_FWD_WGMMA", "wgmma_shapes"]

WGMMA_ARCHS = ("sm_90a",)  # wgmma exists on sm_90a only (Blackwell's tcgen05 is another instruction set)
_TAKES = (f"f16/bf16, a head-dim bucket that is a multiple of 64, arch in {WGMMA_ARCHS} and no score "
          f"modifiers")


@dataclass(frozen=True)
class WgmmaTile:
    """A tile-table row of the wgmma kernel (see ``FixedTile`` for the common fields)."""

    max_head_dim: int
    block_n: int
    warpgroups: int  # one m64 row block each: block_m = 64 * warpgroups
    stages: int  # K/V ring depth
    overlap: bool  # issue P V of tile j-1 behind Q K^T of tile j (needs 3 stages)
    min_blocks: int
    reason: str

    def config(self) -> TileConfig:
        return TileConfig(64 * self.warpgroups, self.block_n, 4 * self.warpgroups, self.reason, self.min_blocks, 1,
                          self.stages, self.overlap)


# Head-dim buckets are multiples of 64. Measured on H200 (dev/wgmma_dev.py, same run as torch
# SDPA; TFLOP/s non-causal / causal, fp16).
_SM90 = (
    WgmmaTile(64, 64, 2, 4, True, 2, "B4 S4096 H16: 356 / 304 TFLOP/s = 1.21 / 1.19x FA2; 128 registers, "
                                     "2 blocks/SM"),
    WgmmaTile(128, 128, 2, 3, True, 1, "B4 S2048 H16: 348 / 268 = 1.03 / 1.09x FA2; no overlap 335/263, "
                                       "3 warpgroups 318/251, block_n 64 338/261; 252 registers, no spill, 225 KiB"),
    WgmmaTile(192, 64, 2, 2, False, 1, "unmeasured: compiles to 221 registers, 145 KiB (no overlap: registers)"),
    WgmmaTile(256, 64, 2, 2, False, 1, "B2 S4096 H16: 392 / 309 = 1.23 / 1.12x FA2; 246 registers, 193 KiB"),
)
# Block-sparse layouts of small blocks (sparse=2): 64 x 64 tiles, one warpgroup (see mma.py).
_SM90_SPARSE64 = (
    WgmmaTile(64, 64, 1, 4, True, 2, "74 KiB: 3 blocks/SM; unmeasured"),
    WgmmaTile(128, 64, 1, 2, False, 2, "82 KiB: 2 blocks/SM (3 stages: 115 KiB, 1 block); see BENCHMARKS.md"),
    WgmmaTile(192, 64, 1, 2, False, 1, "123 KiB; unmeasured"),
    WgmmaTile(256, 64, 1, 2, False, 1, "164 KiB; unmeasured"),
)


def _traits(spec, t) -> str:
    return (f"pyattn::AttnFwdWgmmaTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {t.block_m}, {t.block_n}, "
            f"{t.warps // 4}, {t.stages}, {str(t.overlap).lower()}>")


def _smem_bytes(spec, t) -> int:
    """Swizzled tiles, unpadded; +1024 to align the swizzle atoms (AttnFwdWgmmaTraits::kSmemBytes)."""
    return (t.block_m + 2 * t.stages * t.block_n) * spec.head_dim * 2 + 1024


def _check(spec) -> None:
    if spec.head_dim % 64 or spec.arch not in WGMMA_ARCHS:
        raise ValueError(f"family: attn_fwd_wgmma takes {_TAKES}; got {spec}")


ATTN_FWD_WGMMA = Family(
    name="attn_fwd_wgmma", label="the wgmma family", header="attention_fwd_wgmma.cuh", params=ATTN_FWD_PARAMS,
    tables={"dense": {arch: _SM90 for arch in WGMMA_ARCHS}, "sparse64": {arch: _SM90_SPARSE64 for arch in WGMMA_ARCHS}},
    template_id=lambda spec, t: (f"pyattn::attn_fwd_wgmma<{_traits(spec, t)}, {score_mods(spec)}, "
                                 f"{str(bool(spec.sparse)).lower()}>"),
    dtypes=("f16", "bf16"), alignment=TENSOR_CORE_ALIGNMENT, traits=_traits, smem_bytes=_smem_bytes,
    table_for=sparse64_table, takes=_TAKES, check=_check, sparse=True,
)


def wgmma_shapes(tables=None) -> tuple:
    """The N of every ``m64nNk16`` instruction the wgmma kernel instantiates, ascending.

    Q K^T runs at N = block_n, P V at N = head_dim (each bucket the family takes).

    Parameters
    ----------
    tables : mapping, optional
        Tile tables as :attr:`Family.tables` (default: the family's own).
    """
    tables = ATTN_FWD_WGMMA.tables if tables is None else tables
    block_ns = {row.block_n for by_arch in tables.values() for rows in by_arch.values() for row in rows}
    return tuple(sorted(block_ns | {d for d in HEAD_DIM_BUCKETS if d % 64 == 0}))

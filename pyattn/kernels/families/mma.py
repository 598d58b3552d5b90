"""attn_fwd_mma and attn_fwd_tf32: the mma.sync tensor-core attention kernels (sm_80 and later).

Both keep 16 * m_tiles query rows per warp and double-buffer K/V tiles in shared memory; the TF32
kernel (fp32 inputs with ``allow_tf32=True``) holds fp32 tiles, so half the keys per stage.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

from typing import NamedTuple

from ..params import ATTN_FWD_PARAMS
from .base import CTYPES, TENSOR_CORE_ALIGNMENT, Family, TileConfig, every_arch, score_mods

__all__ = ["MmaTile", "ATTN_FWD_MMA", "ATTN_FWD_TF32", "TENSOR_CORE_ALIGNMENT", "sparse64_table"]


class MmaTile(NamedTuple):
    """A tile-table row of the mma.sync kernels (see ``FixedTile`` for the common fields)."""

    max_head_dim: int
    block_n: int
    warps: int
    m_tiles: int  # m16 row tiles per warp
    min_blocks: int
    reason: str

    def config(self) -> TileConfig:
        return TileConfig(16 * self.m_tiles * self.warps, self.block_n, self.warps, self.reason, self.min_blocks,
                          self.m_tiles)


# Smem = (16*m_tiles*warps + 4*block_n) * (head_dim + 8) * 2 bytes (see _mma_smem_bytes).
_MMA_BIG_SMEM = (  # sm_80 (163 KiB per block), sm_90a / sm_100a (227 KiB); measured on H200 (dev/tune_mma.py)
    MmaTile(64, 64, 4, 2, 1, "best of 5 variants at d=64: 260 / 220 TFLOP/s (non-causal / causal); "
                             "8 warps x 1 tile: 231"),
    MmaTile(128, 64, 8, 2, 1, "best of 5 variants at d=128: 281 / 190 TFLOP/s; 8 warps x 1 row tile: 244 "
                              "(smem-bound); 255 registers, 52 B spill; 139 KiB"),
    MmaTile(256, 32, 8, 1, 1, "2 row tiles would need 256 accumulator registers at d=256; 32-key tiles keep "
                              "135 KiB, under sm_80's 163 KiB; 242 registers, no spill"),
)
_MMA_SMALL_SMEM = (  # sm_86 / sm_89: 99 KiB per block
    MmaTile(64, 64, 4, 2, 1, "55 KiB at d=64; unmeasured (no sm_86/89 machine here)"),
    MmaTile(128, 32, 4, 2, 1, "70 KiB at d=128, under 99 KiB; unmeasured"),
    MmaTile(256, 16, 4, 1, 1, "68 KiB at d=256 (32 keys x 4 warps would need exactly the 99 KiB limit); "
                              "unmeasured"),
)
# Block-sparse layouts of small blocks (sparse=2): 64 x 64 tiles, so that a 64-row/64-column block
# is exactly one tile instead of a quarter of a 128 x 128 one (a random 10% layout of 64 blocks
# touched 34% of the 128-tiles). 4 warps x 1 row tile.
_MMA_SPARSE64 = (  # fits every arch's shared memory (99 KiB on sm_86/89)
    MmaTile(128, 64, 4, 1, 1, "87 KiB at d=128; unmeasured"),
    MmaTile(256, 16, 4, 1, 1, "68 KiB at d=256 (16-key stages fit 99 KiB); unmeasured"),
)
# Smem = 4 * ((block_m + 2 block_n)(d + 4) + 2 block_n (d + 8)) (see _tf32_smem_bytes).
_TF32_BIG_SMEM = (  # sm_80 / sm_90a / sm_100a
    MmaTile(128, 32, 4, 1, 1, "100 KiB at d=128; unmeasured (written for correctness first: 178 registers, "
                              "no spill)"),
    MmaTile(256, 16, 4, 1, 1, "130.5 KiB at d=256, under sm_80's 163 KiB; unmeasured"),
)
_TF32_SMALL_SMEM = (  # sm_86 / sm_89: 99 KiB per block
    MmaTile(96, 32, 4, 1, 1, "76 KiB at d=96; unmeasured"),
    MmaTile(192, 16, 4, 1, 1, "98.5 KiB at d=192 (32 keys would need 100 KiB at d=128, over 99); unmeasured"),
    MmaTile(256, 16, 2, 1, 1, "98 KiB at d=256 with 2 warps; unmeasured"),
)


def _by_smem(big: tuple, small: tuple) -> dict:
    """Per-arch table: sm_86 / sm_89 have 99 KiB of shared memory per block, the others 163-227."""
    return {"sm_80": big, "sm_86": small, "sm_89": small, "sm_90a": big, "sm_100a": big}


def sparse64_table(kv: str, sparse: int, mask: str = "none") -> str:
    """``table_for`` of the block-sparse capable kernels: ``sparse=2`` reads the 64 x 64 tiles."""
    return "sparse64" if sparse == 2 else "dense"


def _mma_traits(spec, t) -> str:
    # BLOCK_M is derived by the traits (16 * M_TILES * WARPS), not passed.
    return (f"pyattn::AttnFwdMmaTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {t.block_n}, {t.warps}, "
            f"{t.m_tiles}>")


def _mma_smem_bytes(spec, t) -> int:
    """Q tile and two stages of K and V tiles, 16-bit, rows padded by 8 elements."""
    return 2 * (t.block_m + 4 * t.block_n) * (spec.head_dim + 8)


def _tf32_traits(spec, t) -> str:
    return f"pyattn::AttnFwdTf32Traits<{spec.head_dim}, {t.block_n}, {t.warps}, {t.m_tiles}>"


def _tf32_smem_bytes(spec, t) -> int:
    """fp32 Q and two K stages with rows padded by 4 floats, two V stages padded by 8."""
    d = spec.head_dim
    return 4 * ((t.block_m + 2 * t.block_n) * (d + 4) + 2 * t.block_n * (d + 8))


ATTN_FWD_MMA = Family(
    name="attn_fwd_mma", label="the tensor-core family", header="attention_fwd_mma.cuh", params=ATTN_FWD_PARAMS,
    tables={"dense": _by_smem(_MMA_BIG_SMEM, _MMA_SMALL_SMEM), "sparse64": every_arch(_MMA_SPARSE64)},
    template_id=lambda spec, t: (f"pyattn::attn_fwd_mma<{_mma_traits(spec, t)}, {score_mods(spec)}, "
                                 f"{str(bool(spec.sparse)).lower()}>"),
    dtypes=("f16", "bf16"), mods=("mask", "softcap", "alibi"), alignment=TENSOR_CORE_ALIGNMENT,
    traits=_mma_traits, smem_bytes=_mma_smem_bytes, table_for=sparse64_table, sparse=True,
)

ATTN_FWD_TF32 = Family(
    name="attn_fwd_tf32", label="the TF32 family", header="attention_fwd_tf32.cuh", params=ATTN_FWD_PARAMS,
    tables={"dense": _by_smem(_TF32_BIG_SMEM, _TF32_SMALL_SMEM)},
    template_id=lambda spec, t: f"pyattn::attn_fwd_tf32<{_tf32_traits(spec, t)}, {score_mods(spec)}>",
    dtypes=("f32",), mods=("mask", "softcap", "alibi"), alignment=TENSOR_CORE_ALIGNMENT,
    traits=_tf32_traits, smem_bytes=_tf32_smem_bytes,
)

"""attn_fwd_simt: the CUDA-core attention kernel (fp32 FMA; correct for every dtype)."""

from __future__ import annotations

from ..params import ATTN_FWD_PARAMS
from .base import CTYPES, MAX_HEAD_DIM, Family, FixedTile, every_arch, score_mods

__all__ = ["ATTN_FWD_SIMT"]

# One key per lane (block_n = 32) makes the score row a warp-wide register vector; 4 rows per warp
# keep the output accumulator at <= 32 floats per lane at head_dim 256. Not tuned per arch: the
# same shape everywhere until measurements say otherwise.
_TILES = (FixedTile(MAX_HEAD_DIM, block_m=16, block_n=32, warps=4,
                    reason="baseline SIMT: 1 key/lane, 4 rows/warp; unmeasured, same on every arch"),)


def _traits(spec, t) -> str:
    return (f"pyattn::AttnFwdSimtTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {t.block_m}, {t.block_n}, "
            f"{t.warps}>")


def _smem_bytes(spec, t) -> int:
    """fp32 Q tile, K tile padded by one word per row, V tile (AttnFwdSimtTraits::kSmemBytes)."""
    d = spec.head_dim
    return 4 * (t.block_m * d + t.block_n * (d + 1) + t.block_n * d)


ATTN_FWD_SIMT = Family(
    name="attn_fwd_simt", label="the SIMT family", header="attention_fwd.cuh", params=ATTN_FWD_PARAMS,
    tables={"dense": every_arch(_TILES)},
    template_id=lambda spec, t: f"pyattn::attn_fwd_simt<{_traits(spec, t)}, {score_mods(spec)}>",
    mods=("mask", "softcap", "alibi"), traits=_traits, smem_bytes=_smem_bytes,
)

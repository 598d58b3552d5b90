"""attn_fwd_fp8: attn_fwd_tma (``tma.py``) on fp8 e4m3 inputs, bf16 out.

Its own module only for length: the kernel, traits and shared-memory formula are attn_fwd_tma's.
:func:`wgmma_fp8_shapes` lists the e4m3 instruction shapes its tiles use, for
``pyattn.jit.wgmma_gen``.
"""

# No ``from __future__ import annotations`` here, as in wgmma.py (NamedTuple rows).

from ..params import ATTN_FWD_TMA_PARAMS
from .base import TENSOR_CORE_ALIGNMENT, WGMMA_ARCHS, Family, score_mods
from .wgmma import WgmmaTile, _smem_bytes, _traits

__all__ = ["ATTN_FWD_FP8", "wgmma_fp8_shapes"]

# attn_fwd_fp8: attn_fwd_tma on fp8 e4m3 inputs (k32 wgmmas at twice the 16-bit rate), bf16 out.
# V comes transposed (the fp8_vt pass: 8-bit wgmma reads both operands K-major), in tiles of whole
# 128-key rows, so key tiles are 128 keys; head dims are whole 128-byte rows (buckets 128, 256).
# No mask tiles in the ring (bool masks as bits only).
# Measured on H200 (dev/probe_fp8_rows.py, batch 16k / S, hidden 2048, best of 3 alternating rounds, ms):
_SM90_FP8 = (
    WgmmaTile(128, 128, 2, 3, True, 1, "the bf16 d=128 row's shape at half the bytes, 113 KiB: S 1k/4k/16k "
                                       "0.239/0.689/2.517 ms (causal 0.176/0.402/1.353); a 4-stage ring ties "
                                       "(0.237/0.688/2.584), a block a tile ties at 4k/16k, loses 5% at 1k",
              ws=True, persistent=True),
    WgmmaTile(256, 128, 2, 3, True, 1, "3 stages with overlap and ping-pong, 225 KiB (ptxas: 12 bytes of spill): "
                                       "S 4k/16k 0.499/1.922 ms (causal 0.303/1.040) against 0.549/2.120 "
                                       "(0.326/1.117) for 2 stages without overlap", ws=True, persistent=True),
)
_FP8_TAKES = f"fp8 e4m3 inputs, head-dim buckets 128 / 256, no mask tensor but a bool one packed to bits, arch in " \
             f"{WGMMA_ARCHS}"


def _check_fp8(spec) -> None:
    if spec.head_dim not in (128, 256) or spec.arch not in WGMMA_ARCHS or spec.mask not in ("none", "bits"):
        raise ValueError(f"family: {spec.family} takes {_FP8_TAKES}; got {spec}")


ATTN_FWD_FP8 = Family(
    name="attn_fwd_fp8", label="the fp8 TMA-fed wgmma family", header="attention_fwd_tma.cuh",
    params=ATTN_FWD_TMA_PARAMS, tables={"dense": {arch: _SM90_FP8 for arch in WGMMA_ARCHS}},
    template_id=lambda spec, t: f"pyattn::attn_fwd_tma<{_traits(spec, t)}, {score_mods(spec)}>",
    dtypes=("e4m3",), mods=("mask", "softcap", "alibi", "tma_masks"), alignment=TENSOR_CORE_ALIGNMENT,
    traits=_traits, smem_bytes=_smem_bytes, takes=_FP8_TAKES, check=_check_fp8,
)



def wgmma_fp8_shapes(tables=None) -> tuple:
    """The N of every ``m64nNk32`` e4m3 instruction attn_fwd_fp8 instantiates, ascending: its rows'
    ``block_n`` (Q K^T) and head-dim buckets (P V).

    Parameters
    ----------
    tables : mapping, optional
        Tile tables as :attr:`Family.tables` (default: the family's own).
    """
    tables = ATTN_FWD_FP8.tables if tables is None else tables
    rows = [row for by_arch in tables.values() for rows in by_arch.values() for row in rows]
    return tuple(sorted({r.block_n for r in rows} | {r.max_head_dim for r in rows}))

"""The backward pass's kernel families (issue 14): attn_bwd_pre, attn_bwd_mma, attn_bwd_simt, attn_bwd_convert.

A backward call is three launches (``pyattn.ops._bwd``): ``attn_bwd_pre`` (per query row:
rowsum(dO * O), the LSE in log2 units, dq_acc zeroed), the main kernel (``attn_bwd_mma`` on tensor
cores for fp16/bf16, ``attn_bwd_simt`` on CUDA cores for float32: dK/dV in registers, dQ added to
the fp32 dq_acc), and ``attn_bwd_convert`` (dq_acc * scale -> dq). One parameter struct serves all
three (``pyattn.kernels.params.ATTN_BWD_PARAMS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..params import ATTN_BWD_PARAMS
from .base import CTYPES, MAX_HEAD_DIM, TENSOR_CORE_ALIGNMENT, Family, FixedTile, TileConfig, every_arch
from .tables import row as _table_row

__all__ = ["BwdTile", "ATTN_BWD_PRE", "ATTN_BWD_MMA", "ATTN_BWD_SIMT", "ATTN_BWD_CONVERT", "bwd_row"]


@dataclass(frozen=True)
class BwdTile:
    """A tile-table row of attn_bwd_mma (see ``FixedTile`` for the common fields).

    ``block_n`` keys per block (resident K, V, dK, dV), ``block_m`` query rows per step; ``split``
    warps share each key slice (1: P and dS stay in registers; 2 for large head dims, whose dK + dV
    would not fit one warp's registers); ``dq_warps_m`` warps along the query rows of dQ (the rest
    along its head dim); ``stages`` Q/dO buffers (2: the next tile loads during this one).
    """

    max_head_dim: int
    block_m: int
    block_n: int
    warps: int
    split: int
    dq_warps_m: int
    stages: int
    reason: str

    def config(self) -> TileConfig:
        return TileConfig(self.block_m, self.block_n, self.warps, self.reason, 1, 1, self.stages)


# Smem = 2 (2 BN (d + 8) + 2 stages BM (d + 8) + (1 or 2) BN (BM + 8)) + 8 stages BM (see _mma_smem_bytes).
_BIG = (  # sm_80 (163 KiB per block)
    BwdTile(64, 64, 128, 8, 1, 4, 2, "FA2's hdim-64/128 shape (64 x 128, 8 warps), P and dS in registers; 91 KiB"),
    BwdTile(96, 64, 128, 8, 1, 4, 2, "as d=128; dQ as 4 x 2 warps (96 / 4 is no multiple of 16); 123 KiB"),
    BwdTile(128, 64, 128, 8, 1, 2, 2, "16 keys x 128 dims of dK + dV per warp (128 registers); dQ 2 x 4 warps "
                                      "(32 x 32: the fewest fragment loads); 155 KiB"),
    BwdTile(256, 64, 64, 8, 2, 4, 1, "d=256: dK + dV split over 2 warps per key slice (128 registers each); one "
                                     "Q/dO stage fits sm_80's 163 KiB (150.5 KiB)"),
)
# sm_90a / sm_100a (227 KiB per block). Measured on an H200 (BENCHMARKS.md, issue 14; dev/tune_backward.py,
# bf16 (4, 4096, 32 or 16 heads), ms non-causal / causal, device run 3 of the session):
_HOPPER = (
    BwdTile(32, 64, 128, 8, 1, 4, 2, "the d=64 shape of sm_80 (dQ as 4 x 2 warps: 16-dim slices); unmeasured"),
    BwdTile(64, 128, 128, 8, 1, 4, 2, "128-query steps: 6.91 / 3.85 ms; 64-query 7.22 / 3.99; 16 warps (4 or 2 per "
                                      "key slice, 128 registers) 7.07 / 3.91 and 7.47 / 4.12; 147 KiB"),
    _BIG[1],  # d=96: unmeasured
    BwdTile(128, 64, 128, 8, 2, 2, 2, "2 warps per 32-key slice (P, dS via shared memory, 16% fewer shared bytes): "
                                      "5.53 / 3.11 ms; 1 per 16-key slice 6.31 / 3.53; 16 warps 6.46 / 3.61 "
                                      "(latency-bound at 8 warps, shared-memory-bound at 16); 173 KiB"),
    BwdTile(256, 64, 64, 8, 2, 4, 2, "as sm_80 with two Q/dO stages (217 KiB); unmeasured"),
)
_SMALL = (  # sm_86 / sm_89 (99 KiB per block)
    BwdTile(64, 64, 128, 8, 1, 4, 2, "91 KiB at d=64, as on sm_80; unmeasured"),
    BwdTile(96, 64, 64, 4, 1, 4, 2, "64 keys x 4 warps: 88 KiB at d=96; unmeasured"),
    BwdTile(128, 64, 64, 4, 1, 4, 1, "one Q/dO stage: 77.5 KiB at d=128; unmeasured"),
    BwdTile(256, 32, 32, 4, 2, 2, 1, "32 x 32 tiles, 2 warps per key slice: 71 KiB at d=256; unmeasured"),
)
_MMA_TABLE = {"sm_80": _BIG, "sm_86": _SMALL, "sm_89": _SMALL, "sm_90a": _HOPPER, "sm_100a": _HOPPER}

# One key per lane (block_n = 32), 4 warps; block_m query rows per step: 16 up to d=128, 8 above, so
# that K and V (fp32, padded) plus the Q/dO tiles fit 99 KiB (82 KiB at d=256).
_SIMT = every_arch((
    FixedTile(128, block_m=16, block_n=32, warps=4, reason="fp32 exact path: 1 key per lane, 4 rows per warp; "
                                                           "52.5 KiB at d=128; unmeasured"),
    FixedTile(MAX_HEAD_DIM, block_m=8, block_n=32, warps=4, reason="8-row steps keep d=256 at 82 KiB (16 rows: "
                                                                   "100.5 KiB, over sm_86/89's 99); unmeasured"),
))
# One warp per query row, 8 rows per block (memory-bound: two row reads, one row of zeros or one write).
_ROWS = every_arch((FixedTile(MAX_HEAD_DIM, block_m=8, block_n=0, warps=8,
                              reason="memory-bound row pass: one warp per row, 8 rows per block; unmeasured"),))


def bwd_row(spec) -> BwdTile:
    """The attn_bwd_mma table row of ``spec`` (override_tiles included)."""
    return _table_row(ATTN_BWD_MMA, "dense", spec.arch, spec.head_dim)


def _mma_traits(spec, t) -> str:
    r = bwd_row(spec)
    return (f"pyattn::AttnBwdMmaTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {r.block_m}, {r.block_n}, {r.warps}, "
            f"{r.split}, {r.dq_warps_m}, {r.stages}>")


def _mma_smem_bytes(spec, t) -> int:
    """K, V and the Q/dO stages, 16-bit, rows padded by 8; dS^T (and P^T when split) padded by 8;
    the stages' LSE and dsum in fp32."""
    r, d = bwd_row(spec), spec.head_dim
    p_tiles = 1 if r.split == 1 else 2
    return 2 * (2 * r.block_n * (d + 8) + 2 * r.stages * r.block_m * (d + 8) + p_tiles * r.block_n * (r.block_m + 8)) \
        + 8 * r.stages * r.block_m


def _mods(spec) -> str:
    return f"pyattn::BwdMods<{str(spec.softcap).lower()}, {str(spec.alibi).lower()}>"


def _simt_traits(spec, t) -> str:
    return (f"pyattn::AttnBwdSimtTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {t.block_m}, {t.block_n}, "
            f"{t.warps}>")


def _simt_smem_bytes(spec, t) -> int:
    """fp32 K and V padded by one word, Q and dO tiles, P and dS padded by one word, LSE and dsum."""
    d = spec.head_dim
    return 4 * (2 * t.block_n * (d + 1) + 2 * t.block_m * d + 2 * t.block_m * (t.block_n + 1) + 2 * t.block_m)


def _one_variant(spec) -> None:
    if spec.head_dim != 32:
        raise ValueError(f"head_dim: {spec.family} reads the head dim at run time; its one variant is bucket 32, "
                         f"got {spec.head_dim}")


ATTN_BWD_MMA = Family(
    name="attn_bwd_mma", label="the tensor-core backward", header="attention_bwd_mma.cuh", params=ATTN_BWD_PARAMS,
    tables={"dense": _MMA_TABLE},
    template_id=lambda spec, t: f"pyattn::attn_bwd_mma<{_mma_traits(spec, t)}, {_mods(spec)}>",
    dtypes=("f16", "bf16"), mods=("softcap", "alibi"), alignment=TENSOR_CORE_ALIGNMENT,
    traits=_mma_traits, smem_bytes=_mma_smem_bytes,
)

ATTN_BWD_SIMT = Family(
    name="attn_bwd_simt", label="the SIMT backward", header="attention_bwd_simt.cuh", params=ATTN_BWD_PARAMS,
    tables={"dense": _SIMT},
    template_id=lambda spec, t: f"pyattn::attn_bwd_simt<{_simt_traits(spec, t)}, {_mods(spec)}>",
    mods=("softcap", "alibi"), traits=_simt_traits, smem_bytes=_simt_smem_bytes,
)

ATTN_BWD_PRE = Family(  # the head dim is a launch parameter: one variant (bucket 32) per dtype
    name="attn_bwd_pre", label="attn_bwd_pre", header="attention_bwd_rows.cuh", params=ATTN_BWD_PARAMS,
    tables={"dense": _ROWS},
    template_id=lambda spec, t: f"pyattn::attn_bwd_pre<{CTYPES[spec.dtype]}, {t.warps}>", check=_one_variant,
)

ATTN_BWD_CONVERT = Family(
    name="attn_bwd_convert", label="attn_bwd_convert", header="attention_bwd_rows.cuh", params=ATTN_BWD_PARAMS,
    tables={"dense": _ROWS},
    template_id=lambda spec, t: f"pyattn::attn_bwd_convert<{CTYPES[spec.dtype]}, {t.warps}>", check=_one_variant,
)

"""The backward pass's kernel families (issue 14): attn_bwd_pre, attn_bwd_mma, attn_bwd_wgmma, attn_bwd_simt,
attn_bwd_convert.

A backward call is three launches (``pyattn.ops._bwd``): ``attn_bwd_pre`` (per query row:
rowsum(dO * O), the LSE in log2 units, dq_acc zeroed), the main kernel (``attn_bwd_wgmma`` on
sm_90a's warpgroup tensor cores for fp16/bf16 up to head dim 128, ``attn_bwd_mma`` on mma.sync
tensor cores for the other 16-bit cases, ``attn_bwd_simt`` on CUDA cores for float32: dK/dV in
registers, dQ added to the fp32 dq_acc), and ``attn_bwd_convert`` (dq_acc * scale -> dq). One
parameter struct serves all of them (``pyattn.kernels.params.ATTN_BWD_PARAMS``).
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (issue 16).

from typing import NamedTuple

from ..params import ATTN_BWD_PARAMS
from .base import (CTYPES, MAX_HEAD_DIM, TENSOR_CORE_ALIGNMENT, WGMMA_ARCHS, WGMMA_BWD_MAX_HEAD_DIM, Family, FixedTile,
                   TileConfig, every_arch)
from .tables import row as _table_row

__all__ = ["BwdTile", "BwdWgmmaTile", "ATTN_BWD_PRE", "ATTN_BWD_MMA", "ATTN_BWD_WGMMA", "ATTN_BWD_SIMT",
           "ATTN_BWD_CONVERT", "bwd_row", "bwd_wgmma_shapes", "row_pass_rows_per_warp"]


class BwdTile(NamedTuple):
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
    BwdTile(224, 64, 64, 8, 2, 4, 2, "as sm_80 with two Q/dO stages; dQ as 4 x 2 warps (224 / 4 is no multiple "
                                     "of 16); unmeasured"),
    BwdTile(256, 64, 64, 8, 2, 2, 2, "as sm_80 with two Q/dO stages (217 KiB), dQ as 2 x 4 warps: 7.69 / 4.09 "
                                     "ms; 4 x 2 warps 7.81 / 4.20, one stage 8.30 / 4.29, 16 warps (4 per key "
                                     "slice) 8.36 / 4.44, 64 keys x 32 queries 11.75 / 5.94 (fifth session)"),
)
_SMALL = (  # sm_86 / sm_89 (99 KiB per block)
    BwdTile(64, 64, 128, 8, 1, 4, 2, "91 KiB at d=64, as on sm_80; unmeasured"),
    BwdTile(96, 64, 64, 4, 1, 4, 2, "64 keys x 4 warps: 88 KiB at d=96; unmeasured"),
    BwdTile(128, 64, 64, 4, 1, 4, 1, "one Q/dO stage: 77.5 KiB at d=128; unmeasured"),
    BwdTile(256, 32, 32, 4, 2, 2, 1, "32 x 32 tiles, 2 warps per key slice: 71 KiB at d=256; unmeasured"),
)
_MMA_TABLE = {"sm_80": _BIG, "sm_86": _SMALL, "sm_89": _SMALL, "sm_90a": _HOPPER, "sm_100a": _HOPPER}

class BwdWgmmaTile(NamedTuple):
    """A tile-table row of attn_bwd_wgmma (see ``FixedTile`` for the common fields).

    ``warpgroups`` of 64 keys each (block_n = 64 * warpgroups: resident K, V, and dK, dV in
    registers), ``block_m`` query rows per step (64 or 128; with block_m = block_n the warpgroups
    split dQ by rows, with 64 by head-dim blocks), ``stages`` Q/dO buffers.
    """

    max_head_dim: int
    block_m: int
    warpgroups: int
    stages: int
    reason: str

    def config(self) -> TileConfig:
        return TileConfig(self.block_m, 64 * self.warpgroups, 4 * self.warpgroups, self.reason, 1, 1, self.stages)


# dK + dV of 64 keys x head_dim sit in one warpgroup's registers (head_dim / 2 each per thread):
# up to WGMMA_BWD_MAX_HEAD_DIM = 128; larger head dims keep attn_bwd_mma (its d=256 row splits them
# over two warps).
_WGMMA = (
    # H200, bf16 (4, 4096, 32 or 16 heads), ms non-causal / causal (BENCHMARKS.md, issue 14, fifth
    # session; the one-warpgroup alternatives from the fourth session's kernel)
    BwdWgmmaTile(64, 128, 2, 2, "128 keys x 128 queries per step, dQ split by rows; 130 KiB: 4.26 / 2.37 ms "
                                "(1.16 / 1.18x FA2); one warpgroup of 64 keys x 64 queries 6.69 / 3.63"),
    BwdWgmmaTile(128, 64, 2, 2, "128 keys x 64 queries per step (FA3's d=128 shape), dQ split by head-dim "
                                "halves; 146 KiB: 3.75 / 2.16 ms (1.21 / 1.16x FA2); one warpgroup 5.88 / 3.17"),
)


# One key per lane (block_n = 32), 4 warps; block_m query rows per step: 16 up to d=128, 8 above, so
# that K and V (fp32, padded) plus the Q/dO tiles fit 99 KiB (82 KiB at d=256).
_SIMT = every_arch((
    FixedTile(128, block_m=16, block_n=32, warps=4, reason="fp32 exact path: 1 key per lane, 4 rows per warp; "
                                                           "52.5 KiB at d=128; unmeasured"),
    FixedTile(MAX_HEAD_DIM, block_m=8, block_n=32, warps=4, reason="8-row steps keep d=256 at 82 KiB (16 rows: "
                                                                   "100.5 KiB, over sm_86/89's 99); unmeasured"),
))
# The row passes: 16-byte chunks, a row on W lanes (W = the power of two >= its chunks, at most 32),
# 8 warps per block (memory-bound: two row reads and a row of zeros, or one read and one write).
_ROWS = every_arch((FixedTile(MAX_HEAD_DIM, block_m=8, block_n=0, warps=8,
                              reason="memory-bound row passes: 16-byte chunks on W lanes, 32 / W rows per warp; bf16 "
                                     "d=64 at 16k rows x 32 heads (ncu): pre 276 -> 100 us, convert 111 -> 46 us "
                                     "(one warp per row with 2-byte loads before; FA2's passes 73 / 62 us)"),))


def row_pass_rows_per_warp(head_dim: int, itemsize: int) -> int:
    """Rows per warp of attn_bwd_pre / attn_bwd_convert: 32 / W, W the power of two >= the row's
    16-byte chunks, at most 32 (kernels_src/attention_bwd_rows.cuh ``row_lanes`` computes the same)."""
    chunks, w = head_dim * itemsize // 16, 1
    while w < chunks and w < 32:
        w *= 2
    return 32 // w


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


def _wgmma_row(spec) -> BwdWgmmaTile:
    return _table_row(ATTN_BWD_WGMMA, "dense", spec.arch, spec.head_dim)


def _wgmma_traits(spec, t) -> str:
    r = _wgmma_row(spec)
    return (f"pyattn::AttnBwdWgmmaTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {r.block_m}, {r.warpgroups}, "
            f"{r.stages}>")


def _wgmma_smem_bytes(spec, t) -> int:
    """K and V (block_n rows), the Q/dO stages, dS^T (block_n x block_m), 128-byte swizzled and
    unpadded; the stages' LSE and dsum in fp32; +1024 to align the swizzle atoms."""
    r, d = _wgmma_row(spec), spec.head_dim
    bn = 64 * r.warpgroups
    return 2 * (2 * bn * d + 2 * r.stages * r.block_m * d + bn * r.block_m) + 8 * r.stages * r.block_m + 1024


def _wgmma_check(spec) -> None:
    if spec.arch not in WGMMA_ARCHS or spec.head_dim % 64 or spec.head_dim > WGMMA_BWD_MAX_HEAD_DIM:
        raise ValueError(f"family: attn_bwd_wgmma takes f16/bf16, head dim 64 or 128 and arch in {WGMMA_ARCHS}; "
                         f"got {spec}")


def bwd_wgmma_shapes() -> set:
    """The N of the ``m64nNk16`` wgmmas attn_bwd_wgmma instantiates: block_m (S^T, dP^T), the head
    dim (dK, dV) and dQ's width (the head dim, or 64 when split by head-dim blocks)."""
    shapes = set()
    for rows in ATTN_BWD_WGMMA.tables["dense"].values():
        for r in rows:
            d = r.max_head_dim
            shapes |= {r.block_m, d, d if r.block_m == 64 * r.warpgroups else d // r.warpgroups}
    return shapes


def _mods(spec) -> str:
    return f"pyattn::BwdMods<{str(bool(spec.softcap)).lower()}, {str(spec.alibi).lower()}>"


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

ATTN_BWD_WGMMA = Family(
    name="attn_bwd_wgmma", label="the wgmma backward", header="attention_bwd_wgmma.cuh", params=ATTN_BWD_PARAMS,
    tables={"dense": {arch: _WGMMA for arch in WGMMA_ARCHS}},
    template_id=lambda spec, t: f"pyattn::attn_bwd_wgmma<{_wgmma_traits(spec, t)}, {_mods(spec)}>",
    dtypes=("f16", "bf16"), mods=("softcap", "alibi"), alignment=TENSOR_CORE_ALIGNMENT,
    traits=_wgmma_traits, smem_bytes=_wgmma_smem_bytes, check=_wgmma_check,
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

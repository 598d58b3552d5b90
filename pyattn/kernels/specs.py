"""Kernel specs: which compiled variant serves a problem, and everything derived from it.

A :class:`KernelSpec` is frozen and hashable. It alone derives a variant's C++ template
instantiation, its ``extern "C"`` entry name, its launch shape, its compile options and its
cache key; no other module assembles kernel names or options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass

from ..runtime.device import SUPPORTED_ARCHS
from .params import ATTN_FWD_PARAMS, DECODE_PARAMS, KV_APPEND_PARAMS, MERGE_STATES_PARAMS, SPARSE_PARAMS

__all__ = ["KernelSpec", "TileConfig", "DTYPES", "HEAD_DIM_BUCKETS", "MAX_HEAD_DIM", "MASK_KINDS",
           "select_attention_spec", "standard_specs", "warmup_specs", "decode_specs", "decode_max_q_tiles",
           "tile_config"]

# NumPy dtype name -> (spec dtype tag, C++ type)
DTYPES = {"float32": ("f32", "float"), "float16": ("f16", "__half"), "bfloat16": ("bf16", "__nv_bfloat16")}
_CTYPE = {tag: ctype for tag, ctype in DTYPES.values()}

# head_dim is compiled in (register arrays need compile-time sizes); a problem uses the
# smallest bucket >= its head_dim and masks the padding. Steps of 32 = one element per lane.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
FAMILIES = ("attn_fwd_mma", "attn_fwd_simt", "attn_fwd_tf32", "attn_fwd_wgmma", "merge_states", "attn_decode",
            "decode_combine", "kv_append", "attn_sparse")
_ATTN_FAMILIES = ("attn_fwd_mma", "attn_fwd_simt", "attn_fwd_tf32", "attn_fwd_wgmma")
_DECODE_FAMILIES = ("attn_decode", "decode_combine", "kv_append")  # the paged-cache kernels: fp16/bf16 only
WGMMA_ARCHS = ("sm_90a",)  # wgmma exists on sm_90a only (Blackwell's tcgen05 is another instruction set)
# Mask tensor element type -> kernels_src/attention_mask.cuh MaskKind; "none" = no mask tensor.
MASK_KINDS = {"none": 0, "bool": 1, "f16": 2, "bf16": 3, "f32": 4}
# Paged-cache element kinds (attn_decode / kv_append ``kv``): "" = the query dtype, else 8-bit codes
# with per-(slot, kv head) fp32 scales -> kernels_src KvKind.
KV_KINDS = {"": 0, "int8": 1, "fp8e4m3": 2}
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of one kernel family on one arch, with the reason it was chosen."""

    block_m: int
    block_n: int
    warps: int
    reason: str
    min_blocks: int = 1  # __launch_bounds__ blocks per SM: caps registers so that many fit
    m_tiles: int = 1  # MMA kernel: m16 row tiles per warp (block_m = 16 * m_tiles * warps)
    stages: int = 2  # wgmma kernel: K/V shared-memory ring depth
    overlap: bool = False  # wgmma kernel: issue P V of tile j-1 behind Q K^T of tile j


# The SIMT kernel (fp32 FMA; correct for every dtype, tensor cores come with the prefill work).
# One key per lane (block_n = 32) makes the score row a warp-wide register vector;
# 4 rows per warp keep the output accumulator at <= 32 floats per lane at head_dim 256.
# Not yet tuned per arch: the same shape everywhere until measurements say otherwise.
_SIMT = TileConfig(16, 32, 4, "baseline SIMT: 1 key/lane, 4 rows/warp; unmeasured, same on every arch")

# The tensor-core kernel: 16 * m_tiles query rows per warp, K/V double-buffered in shared memory,
# so a block needs (16*m_tiles*warps + 4*block_n) * (head_dim + 8) * 2 bytes. Per arch, by
# head-dim bucket (the first entry whose bound >= head_dim).
# Entries: (max head_dim, block_n, warps, m_tiles, min_blocks, reason).
_MMA_BIG_SMEM = (  # sm_80 (163 KiB per block), sm_90a / sm_100a (227 KiB); measured on H200 (scripts/tune_mma.py)
    (64, 64, 4, 2, 1, "best of 5 variants at d=64: 260 / 220 TFLOP/s (non-causal / causal); 8 warps x 1 tile: 231"),
    (128, 64, 8, 2, 1, "best of 5 variants at d=128: 281 / 190 TFLOP/s; 8 warps x 1 row tile: 244 (smem-bound); "
                       "255 registers, 52 B spill; 139 KiB"),
    (256, 32, 8, 1, 1, "2 row tiles would need 256 accumulator registers at d=256; 32-key tiles keep 135 KiB, "
                       "under sm_80's 163 KiB; 242 registers, no spill"),
)
_MMA_SMALL_SMEM = (  # sm_86 / sm_89: 99 KiB per block
    (64, 64, 4, 2, 1, "55 KiB at d=64; unmeasured (no sm_86/89 machine here)"),
    (128, 32, 4, 2, 1, "70 KiB at d=128, under 99 KiB; unmeasured"),
    (256, 16, 4, 1, 1, "68 KiB at d=256 (32 keys x 4 warps would need exactly the 99 KiB limit); unmeasured"),
)
# merge_states: one warp per row, 4 warps per block (memory-bound; rows are independent).
_MERGE = TileConfig(4, 0, 4, "memory-bound elementwise combine: one warp per row, 4 rows per block")

# The TF32 kernel (fp32 inputs with allow_tf32=True): fp32 tiles, so half the keys per stage of
# the 16-bit kernel. Entries as _MMA's; smem = 4 * ((block_m + 2 block_n)(d + 4) + 2 block_n (d + 8)).
_TF32_BIG_SMEM = (  # sm_80 / sm_90a / sm_100a
    (128, 32, 4, 1, 1, "100 KiB at d=128; unmeasured (written for correctness first: 178 registers, no spill)"),
    (256, 16, 4, 1, 1, "130.5 KiB at d=256, under sm_80's 163 KiB; unmeasured"),
)
_TF32_SMALL_SMEM = (  # sm_86 / sm_89: 99 KiB per block
    (96, 32, 4, 1, 1, "76 KiB at d=96; unmeasured"),
    (192, 16, 4, 1, 1, "98.5 KiB at d=192 (32 keys would need 100 KiB at d=128, over 99); unmeasured"),
    (256, 16, 2, 1, 1, "98 KiB at d=256 with 2 warps; unmeasured"),
)
# The wgmma kernel (sm_90a): 64 query rows per warpgroup, K/V in a `stages`-deep cp.async ring,
# 128-byte swizzled tiles; smem = (block_m + 2 stages block_n) * d * 2 + 1024. Head-dim buckets are
# multiples of 64. Entries: (max head_dim, block_n, warpgroups, stages, overlap, min_blocks, reason).
# Measured on H200 (scripts/wgmma_dev.py, same run as torch SDPA; TFLOP/s non-causal / causal, fp16).
_WGMMA_SM90 = (
    (64, 64, 2, 4, True, 2, "B4 S4096 H16: 356 / 304 TFLOP/s = 1.21 / 1.19x FA2; 128 registers, 2 blocks/SM"),
    (128, 128, 2, 3, True, 1, "B4 S2048 H16: 348 / 268 = 1.03 / 1.09x FA2; no overlap 335/263, 3 warpgroups "
                              "318/251, block_n 64 338/261; 252 registers, no spill, 225 KiB"),
    (192, 64, 2, 2, False, 1, "unmeasured: compiles to 221 registers, 145 KiB (no overlap: registers)"),
    (256, 64, 2, 2, False, 1, "B2 S4096 H16: 392 / 309 = 1.23 / 1.12x FA2; 246 registers, 193 KiB"),
)

# The decode kernel (attention_decode.cuh): 16 * q_tiles query rows (a GQA group x q_len), warps
# split each stage's keys; shared memory = max(ring, warp merge) with
# ring = (16 q_tiles + 2 stages block_n) (d + 8) * 2 and merge = warps * 16 q_tiles * (d + 10) * 4.
# Entries: (max head_dim, keys per warp, warps, stages, max q_tiles, min blocks per SM, reason).
_DECODE_227K = (  # sm_90a / sm_100a
    (128, 32, 2, 3, 2, 2, "v3, H200 (scripts/tune_decode.py, bf16 Hq32 Hkv8): 3.50-3.60 TB/s at B8 L32k / B64 L4k; "
                          "2 warps x 32 keys, 3 stages, 2 blocks/SM (106 KiB); 4 warps x 16 keys at 3 blocks/SM: "
                          "3.45-3.55; v1 (4 warps, 4 stages, 1 block/SM) 2.0 TB/s, latency-bound at 6% occupancy"),
    (256, 16, 4, 2, 1, 1, "143 KiB at d=256; one row tile (the accumulator is 128 registers); unmeasured"),
)
_DECODE_163K = (  # sm_80
    (128, 16, 4, 2, 2, 2, "74 KiB at d=128: 2 blocks in sm_80's 164 KiB; unmeasured (no sm_80 machine here)"),
    (256, 16, 4, 2, 1, 1, "143 KiB at d=256; unmeasured"),
)
_DECODE_99K = (  # sm_86 / sm_89
    (128, 16, 4, 2, 2, 1, "74 KiB at d=128, under 99 KiB; unmeasured"),
    (256, 16, 2, 2, 1, 1, "71 KiB at d=256 with 2 warps; unmeasured"),
)
# 8-bit caches (kv = "int8" / "fp8e4m3"): ring = (16 q_tiles (d + 8) * 2) + stages * block_n * 2 (d + 4)
# (codes and scales); head-dim buckets 64 / 128 / 256. More warps than the 16-bit kernel: the
# code -> fp16/bf16 conversion adds ~3 instructions per element, so more warps hide latency.
_DECODE_Q8_227K = (  # sm_90a / sm_100a
    (128, 32, 4, 2, 1, 2, "H200, bf16 q, Hq32 Hkv8, B8 L32k (scripts/tune_decode.py --kv): fp8 190 us (2.91 TB/s "
                          "of codes + scales), int8 198; 3 stages 199 / 205; 3 blocks/SM (170 regs) 185 at B8 L32k "
                          "but 197 at B64 L4k; 16 keys x 4 warps 201-214; 2 or 8 warps 231-249 (70 KiB)"),
    (256, 16, 4, 3, 1, 1, "108 KiB at d=256; unmeasured"),
)
_DECODE_Q8_163K = (  # sm_80
    (128, 16, 4, 4, 2, 2, "72 KiB at d=128: 2 blocks in 164 KiB; unmeasured"),
    (256, 16, 4, 3, 1, 1, "108 KiB at d=256; unmeasured"),
)
_DECODE_Q8_99K = (  # sm_86 / sm_89
    (128, 16, 4, 4, 2, 1, "72 KiB at d=128, under 99 KiB; unmeasured"),
    (256, 16, 4, 2, 1, 1, "75 KiB at d=256 with 2 stages; unmeasured"),
)
_DECODE_Q8 = {"sm_80": _DECODE_Q8_163K, "sm_86": _DECODE_Q8_99K, "sm_89": _DECODE_Q8_99K,
              "sm_90a": _DECODE_Q8_227K, "sm_100a": _DECODE_Q8_227K}
KV_HEAD_DIM_BUCKETS = (64, 128, 256)  # 8-bit caches: whole 64-byte fragment groups
_DECODE = {"sm_80": _DECODE_163K, "sm_86": _DECODE_99K, "sm_89": _DECODE_99K, "sm_90a": _DECODE_227K,
           "sm_100a": _DECODE_227K}
# Block-sparse layouts of small blocks (sparse=2): 64 x 64 tiles, so that a 64-row/64-column block
# is exactly one tile instead of a quarter of a 128 x 128 one (a random 10% layout of 64 blocks
# touched 34% of the 128-tiles). Entries as _WGMMA_SM90's (one warpgroup) / _MMA's (4 warps, 1 tile).
_WGMMA_SM90_SPARSE64 = (
    (64, 64, 1, 4, True, 2, "74 KiB: 3 blocks/SM; unmeasured"),
    (128, 64, 1, 2, False, 2, "82 KiB: 2 blocks/SM (3 stages: 115 KiB, 1 block); see BENCHMARKS.md"),
    (192, 64, 1, 2, False, 1, "123 KiB; unmeasured"),
    (256, 64, 1, 2, False, 1, "164 KiB; unmeasured"),
)
_MMA_SPARSE64 = (  # fits every arch's shared memory (99 KiB on sm_86/89)
    (128, 64, 4, 1, 1, "87 KiB at d=128; unmeasured"),
    (256, 16, 4, 1, 1, "68 KiB at d=256 (16-key stages fit 99 KiB); unmeasured"),
)

# attn_sparse (CSR lists of keys per query): one warp per query row, 8 keys per step; 4 rows per block.
_SPARSE = TileConfig(4, 8, 4, "gather kernel: one warp per query row (rows have their own key lists); unmeasured")
# kv_append: a grid-stride copy, one thread per 16-byte chunk of a (token, kv head) row.
_APPEND = TileConfig(0, 0, 8, "memory-bound scatter: 256 threads, grid-stride over 16-byte chunks")


def decode_max_q_tiles(arch: str, head_dim: int, kv: str = "") -> int:
    """The most m16 row tiles one decode block takes at ``head_dim`` (a bucket) on ``arch``."""
    return _decode_entry(arch, head_dim, kv)[4]


def _decode_entry(arch: str, head_dim: int, kv: str = "") -> tuple:
    for entry in (_DECODE_Q8 if kv else _DECODE)[arch]:
        if head_dim <= entry[0]:
            return entry
    raise ValueError(f"head_dim: no attn_decode tile for {head_dim} on {arch}")


_TF32 = {"sm_80": _TF32_BIG_SMEM, "sm_86": _TF32_SMALL_SMEM, "sm_89": _TF32_SMALL_SMEM,
         "sm_90a": _TF32_BIG_SMEM, "sm_100a": _TF32_BIG_SMEM}

_MMA = {"sm_80": _MMA_BIG_SMEM, "sm_86": _MMA_SMALL_SMEM, "sm_89": _MMA_SMALL_SMEM,
        "sm_90a": _MMA_BIG_SMEM, "sm_100a": _MMA_BIG_SMEM}


def tile_config(family: str, arch: str, head_dim: int, kv: str = "", sparse: int = 0) -> TileConfig:
    """Return the tile table entry for ``family`` on ``arch`` at ``head_dim`` (a bucket); ``kv``:
    the cache's element kind (decode); ``sparse`` 2: the 64 x 64 block-sparse tiles."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: no tile config for {family} on {arch!r}; supported: {SUPPORTED_ARCHS}")
    if family == "attn_fwd_simt":
        return _SIMT
    if family in ("merge_states", "decode_combine"):
        return _MERGE
    if family == "kv_append":
        return _APPEND  # (kv: the same launch shape)
    if family == "attn_sparse":
        return _SPARSE
    if family == "attn_decode":
        _, keys_per_warp, warps, stages, _, min_blocks, reason = _decode_entry(arch, head_dim, kv)
        return TileConfig(16, keys_per_warp * warps, warps, reason, min_blocks, 1, stages)
    if family == "attn_fwd_wgmma":
        if arch not in WGMMA_ARCHS:
            raise ValueError(f"arch: the wgmma family needs one of {WGMMA_ARCHS}, got {arch!r}")
        for bound, block_n, wgs, stages, overlap, min_blocks, reason in (
                _WGMMA_SM90_SPARSE64 if sparse == 2 else _WGMMA_SM90):
            if head_dim <= bound:
                return TileConfig(64 * wgs, block_n, 4 * wgs, reason, min_blocks, 1, stages, overlap)
        raise ValueError(f"head_dim: no {family} tile for {head_dim} on {arch}")
    if family not in ("attn_fwd_mma", "attn_fwd_tf32"):
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    table = (_MMA_SPARSE64 if sparse == 2 else _MMA[arch]) if family == "attn_fwd_mma" else _TF32[arch]
    for bound, block_n, warps, m_tiles, min_blocks, reason in table:
        if head_dim <= bound:
            return TileConfig(16 * m_tiles * warps, block_n, warps, reason, min_blocks, m_tiles)
    raise ValueError(f"head_dim: no {family} tile for {head_dim} on {arch}")


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel variant.

    Parameters
    ----------
    family : str
        ``"attn_fwd_mma"`` (tensor cores, fp16/bf16) or ``"attn_fwd_simt"`` (CUDA cores, any dtype).
    dtype : str
        Element type tag: ``"f32"``, ``"f16"`` or ``"bf16"``.
    head_dim : int
        Compiled head-dim bucket (see :data:`HEAD_DIM_BUCKETS`).
    arch : str
        Target arch, one of :data:`SUPPORTED_ARCHS`.
    ptx : bool
        Emit PTX for ``compute_XX`` instead of a cubin (the opt-in fallback; see ``pyattn.jit.nvrtc``).
    mask : str
        Attention only: element type of the mask tensor, one of :data:`MASK_KINDS` (``"none"``).
    softcap, alibi : bool
        Attention and decode: compile in the soft-cap / ALiBi score modifiers.
    q_tiles : int
        Decode only: m16 row tiles per block (1 or 2), the bucket of group * q_len query rows.
    sparse : int
        Tensor-core attention only: 0 dense; 1 visit the key tiles of a block-sparse tile list (see
        ``AttnFwdParams``) at the standard tiles; 2 the same at 64 x 64 tiles (small blocks).
    kv : str
        attn_decode / kv_append only: the cache's element kind, one of :data:`KV_KINDS` (``""`` =
        the query dtype; ``"int8"`` / ``"fp8e4m3"`` = 8-bit codes with fp32 scales).
    """

    family: str
    dtype: str
    head_dim: int
    arch: str
    ptx: bool = False
    mask: str = "none"
    softcap: bool = False
    alibi: bool = False
    q_tiles: int = 0
    sparse: int = 0
    kv: str = ""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        if self.family == "attn_fwd_mma" and self.dtype == "f32":
            raise ValueError("dtype: the tensor-core family takes f16 or bf16, got 'f32'")
        if self.family == "attn_fwd_tf32" and self.dtype != "f32":
            raise ValueError(f"dtype: the TF32 family takes f32, got {self.dtype!r}")
        if self.family == "attn_fwd_wgmma":
            if self.dtype == "f32" or self.head_dim % 64 or self.arch not in WGMMA_ARCHS or self.has_mods:
                raise ValueError(f"family: attn_fwd_wgmma takes f16/bf16, a head-dim bucket that is a multiple "
                                 f"of 64, arch in {WGMMA_ARCHS} and no score modifiers; got {self}")
        if self.dtype not in _CTYPE:
            raise ValueError(f"dtype: expected one of {sorted(_CTYPE)}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(f"head_dim: expected one of {HEAD_DIM_BUCKETS}, got {self.head_dim}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {self.arch!r}")
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask: expected one of {tuple(MASK_KINDS)}, got {self.mask!r}")
        if self.family not in _ATTN_FAMILIES and self.has_mods and not (
                self.family == "attn_decode" and self.mask == "none"):
            raise ValueError(f"mask/softcap/alibi: only attention families take score modifiers (decode: "
                             f"softcap/alibi), got {self}")
        if self.family in _DECODE_FAMILIES and self.dtype == "f32":
            raise ValueError(f"dtype: {self.family} takes f16 or bf16, got 'f32'")
        if self.family == "attn_decode":
            if self.kv and self.head_dim not in KV_HEAD_DIM_BUCKETS:
                raise ValueError(f"head_dim: 8-bit caches decode at head-dim buckets {KV_HEAD_DIM_BUCKETS}, "
                                 f"got {self.head_dim}")
            if not 1 <= self.q_tiles <= decode_max_q_tiles(self.arch, self.head_dim, self.kv):
                raise ValueError(f"q_tiles: attn_decode at head_dim {self.head_dim} on {self.arch} takes 1 to "
                                 f"{decode_max_q_tiles(self.arch, self.head_dim, self.kv)}, got {self.q_tiles}")
        elif self.q_tiles:
            raise ValueError(f"q_tiles: only attn_decode takes q_tiles, got {self.q_tiles} for {self.family}")
        if self.sparse not in (0, 1, 2):
            raise ValueError(f"sparse: expected 0 (dense), 1 or 2 (64 x 64 tiles), got {self.sparse!r}")
        if self.sparse and self.family not in ("attn_fwd_mma", "attn_fwd_wgmma"):
            raise ValueError(f"sparse: block-sparse tile lists are read by attn_fwd_mma / attn_fwd_wgmma, "
                             f"got {self.family}")
        if self.kv not in KV_KINDS:
            raise ValueError(f"kv: expected one of {tuple(KV_KINDS)}, got {self.kv!r}")
        if self.kv and self.family not in ("attn_decode", "kv_append"):
            raise ValueError(f"kv: only attn_decode / kv_append read quantized caches, got {self.family}")

    @property
    def has_mods(self) -> bool:
        return self.mask != "none" or self.softcap or self.alibi

    # -- derived facts -------------------------------------------------------------------
    @property  # not cached: tests patch the tables; launch paths keep what they need in their plans
    def tiles(self) -> TileConfig:
        t = tile_config(self.family, self.arch, self.head_dim, self.kv, self.sparse)
        if self.family == "attn_decode":
            t = dataclasses.replace(t, block_m=16 * self.q_tiles, m_tiles=self.q_tiles)
        return t

    @property
    def header(self) -> str:
        return {"attn_fwd_simt": "attention_fwd.cuh", "attn_fwd_mma": "attention_fwd_mma.cuh",
                "attn_fwd_tf32": "attention_fwd_tf32.cuh", "attn_fwd_wgmma": "attention_fwd_wgmma.cuh",
                "merge_states": "merge_states.cuh", "decode_combine": "merge_states.cuh",
                "attn_decode": "attention_decode.cuh", "kv_append": "kv_append.cuh",
                "attn_sparse": "attention_sparse.cuh"}[self.family]

    @property
    def params(self):
        return {"merge_states": MERGE_STATES_PARAMS, "decode_combine": MERGE_STATES_PARAMS,
                "attn_decode": DECODE_PARAMS, "kv_append": KV_APPEND_PARAMS,
                "attn_sparse": SPARSE_PARAMS}.get(self.family, ATTN_FWD_PARAMS)

    @property
    def threads(self) -> int:
        return self.tiles.warps * 32

    @property
    def entry_name(self) -> str:
        """The ``extern "C"`` symbol: readable in profilers, no name mangling to look up."""
        t = self.tiles
        mods = (f"_mask{self.mask}" if self.mask != "none" else "") + ("_softcap" if self.softcap else "") \
            + ("_alibi" if self.alibi else "")
        mods += ("", "_sparse", "_sparse64")[self.sparse] + (f"_kv{self.kv}" if self.kv else "")
        stages = f"s{t.stages}" if self.family == "attn_decode" else ""
        return f"pyattn_{self.family}_{self.dtype}_d{self.head_dim}_m{t.block_m}n{t.block_n}w{t.warps}{stages}{mods}"

    @property
    def template_id(self) -> str:
        t, ctype = self.tiles, _CTYPE[self.dtype]
        if self.family == "merge_states":
            return f"pyattn::merge_states<{ctype}, {ctype}, {self.head_dim}, {t.warps}>"
        if self.family == "decode_combine":  # fp32 split partials -> the output type
            return f"pyattn::merge_states<float, {ctype}, {self.head_dim}, {t.warps}>"
        kv = KV_KINDS[self.kv]
        if self.family == "kv_append":
            return f"pyattn::kv_append<{ctype}, {kv}>"
        if self.family == "attn_sparse":
            return f"pyattn::attn_sparse<{ctype}, {self.head_dim}, {t.warps}>"
        if self.family == "attn_decode":
            return (f"pyattn::attn_decode<pyattn::AttnDecodeTraits<{ctype}, {self.head_dim}, {t.block_n // t.warps}, "
                    f"{t.warps}, {t.m_tiles}, {t.stages}, {kv}>, {str(self.softcap).lower()}, "
                    f"{str(self.alibi).lower()}>")
        mods = (f"pyattn::ScoreMods<{MASK_KINDS[self.mask]}, {str(self.softcap).lower()}, "
                f"{str(self.alibi).lower()}>")
        if self.family == "attn_fwd_simt":
            return (f"pyattn::attn_fwd_simt<pyattn::AttnFwdSimtTraits<{ctype}, "
                    f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.warps}>, {mods}>")
        sparse = str(bool(self.sparse)).lower()
        if self.family == "attn_fwd_wgmma":
            return (f"pyattn::attn_fwd_wgmma<pyattn::AttnFwdWgmmaTraits<{ctype}, {self.head_dim}, {t.block_m}, "
                    f"{t.block_n}, {t.warps // 4}, {t.stages}, {str(t.overlap).lower()}>, {mods}, {sparse}>")
        if self.family == "attn_fwd_tf32":
            return (f"pyattn::attn_fwd_tf32<pyattn::AttnFwdTf32Traits<{self.head_dim}, {t.block_n}, {t.warps}, "
                    f"{t.m_tiles}>, {mods}>")
        return (f"pyattn::attn_fwd_mma<pyattn::AttnFwdMmaTraits<{ctype}, {self.head_dim}, {t.block_n}, "
                f"{t.warps}, {t.m_tiles}>, {mods}, {sparse}>")

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory per block.

        SIMT: fp32 Q tile, K tile padded by one word per row, V tile. MMA: Q tile and two
        stages of K and V tiles in the input type, rows padded by 8 elements.
        """
        t, d = self.tiles, self.head_dim
        if self.family in ("merge_states", "decode_combine", "kv_append", "attn_sparse"):
            return 0
        if self.family == "attn_decode":  # AttnDecodeTraits::kSmemBytes (the kernel traps on a mismatch)
            ring = (t.block_m + 2 * t.stages * t.block_n) * (d + 8) * 2
            if self.kv:  # Q, then 8-bit K and V codes and their fp32 scales per stage
                ring = t.block_m * (d + 8) * 2 + t.stages * t.block_n * 2 * (d + 4)
            return max(ring, t.warps * t.block_m * (d + 10) * 4)
        if self.family == "attn_fwd_simt":
            return 4 * (t.block_m * d + t.block_n * (d + 1) + t.block_n * d)
        if self.family == "attn_fwd_wgmma":  # swizzled tiles, unpadded; +1024 to align the swizzle atoms
            return (t.block_m + 2 * t.stages * t.block_n) * d * 2 + 1024
        if self.family == "attn_fwd_tf32":  # Q and K rows padded by 4 floats, V rows by 8
            return 4 * ((t.block_m + 2 * t.block_n) * (d + 4) + 2 * t.block_n * (d + 8))
        return 2 * (t.block_m + 4 * t.block_n) * (d + 8)

    def grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple:
        """Launch grid: query tiles x query heads x batch."""
        return (-(-seqlen_q // self.tiles.block_m), heads_q, batch)

    def compile_options(self, include_dirs=()) -> tuple:
        """NVRTC options. ``-arch=sm_XX`` makes NVRTC emit SASS for exactly that arch."""
        target = ("compute_" + self.arch[3:]) if self.ptx else self.arch
        opts = [f"-arch={target}", "-std=c++17", "-lineinfo", "-DNDEBUG"]
        opts += [f"-I{d}" for d in include_dirs]
        return tuple(opts)

    def cache_key(self, toolchain: str) -> str:
        """Disk-cache key: the spec, its options and the toolchain fingerprint.

        Parameters
        ----------
        toolchain : str
            From ``pyattn.jit.toolchain_fingerprint``: NVRTC and header versions, the digest of
            every kernel source, and the pyattn version.
        """
        from ..jit.source import render

        # The rendered unit covers what the spec fields alone do not: the tile table, the
        # template id and the parameter struct layout.
        unit = hashlib.sha256(render(self).encode()).hexdigest()
        doc = {"spec": asdict(self), "options": self.compile_options(), "unit": unit, "toolchain": toolchain}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        mods = "".join(f", {m}" for m, on in ((f"mask={self.mask}", self.mask != "none"),
                                               ("softcap", self.softcap), ("alibi", self.alibi),
                                               (f"q_tiles={self.q_tiles}", self.q_tiles),
                                               (f"sparse={self.sparse}", self.sparse), (f"kv={self.kv}", self.kv)) if on)
        return f"{self.family}[{self.dtype}, d={self.head_dim}, {self.arch}{mods}{', ptx' if self.ptx else ''}]"


def select_attention_spec(dtype_name: str, head_dim: int, arch: str, *, ptx: bool = False, mask: str = "none",
                          softcap: bool = False, alibi: bool = False, allow_tf32: bool = False) -> KernelSpec:
    """Choose the kernel spec for an attention problem.

    Parameters
    ----------
    dtype_name : str
        NumPy dtype name of q/k/v (``float32``, ``float16``, ``bfloat16``).
    head_dim : int
        The problem's head dim (a multiple of 8, at most :data:`MAX_HEAD_DIM`).
    arch : str
    ptx : bool
    mask : str
        Mask tensor element type (:data:`MASK_KINDS`), ``"none"`` without a mask tensor.
    softcap, alibi : bool
        Whether the call uses a soft-cap / ALiBi slopes.
    allow_tf32 : bool
        float32 inputs may run on TF32 tensor cores (10-bit mantissa products) instead of exact FMA.
    """
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype_name!r}")
    bucket = next((b for b in HEAD_DIM_BUCKETS if b >= head_dim), None)
    if bucket is None:
        raise ValueError(f"head_dim: at most {MAX_HEAD_DIM} is supported, got {head_dim}")
    tag = DTYPES[dtype_name][0]
    # fp32 stays exact (CUDA-core FMA) unless TF32 is allowed; 16-bit inputs go to the tensor cores:
    # warpgroup MMA on sm_90a (its buckets are multiples of 64), except with score modifiers.
    mods = mask != "none" or softcap or alibi
    if tag == "f32":
        family = "attn_fwd_tf32" if allow_tf32 else "attn_fwd_simt"
    elif arch in WGMMA_ARCHS and not mods:
        family, bucket = "attn_fwd_wgmma", -(-head_dim // 64) * 64
    else:
        family = "attn_fwd_mma"
    return KernelSpec(family, tag, bucket, arch, ptx, mask, bool(softcap), bool(alibi))


# Decode variants warmed by default: the common head dims, one row tile (a GQA group of up to 16
# query heads at q_len 1). Others (speculative q_len, rarer head dims) compile on first use.
_WARM_DECODE_DIMS = (64, 128, 256)


def decode_specs(arch: str, head_dims=_WARM_DECODE_DIMS, q_tiles=(1,), ptx: bool = False) -> list:
    """The paged-cache kernels without modifiers: decode, its split combine, and append."""
    specs = []
    for tag in ("f16", "bf16"):
        for d in head_dims:
            specs += [KernelSpec("attn_decode", tag, d, arch, ptx, q_tiles=mt)
                      for mt in q_tiles if mt <= decode_max_q_tiles(arch, d)]
            specs.append(KernelSpec("decode_combine", tag, d, arch, ptx))
        specs.append(KernelSpec("kv_append", tag, HEAD_DIM_BUCKETS[0], arch, ptx))
    return specs


def standard_specs(arch: str) -> list:
    """Every variant ``attention`` can select on ``arch`` without score modifiers."""
    plain = [select_attention_spec(name, d, arch) for name in DTYPES for d in HEAD_DIM_BUCKETS]
    plain += [select_attention_spec("float32", d, arch, allow_tf32=True) for d in HEAD_DIM_BUCKETS]
    return list(dict.fromkeys(plain))  # wgmma's 64-wide buckets serve two 32-wide ones


def warmup_specs(arch: str) -> list:
    """What ``pyattn warmup`` precompiles for ``arch``: :func:`standard_specs` and :func:`decode_specs`."""
    return standard_specs(arch) + decode_specs(arch)

"""Kernel specs: which compiled variant serves a problem, and everything derived from it.

A :class:`KernelSpec` is frozen and hashable. It alone derives a variant's C++ template
instantiation, its ``extern "C"`` entry name, its launch shape, its compile options and its
cache key; no other module assembles kernel names or options.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ..runtime.device import SUPPORTED_ARCHS
from .params import ATTN_FWD_PARAMS

__all__ = ["KernelSpec", "TileConfig", "DTYPES", "HEAD_DIM_BUCKETS", "MAX_HEAD_DIM",
           "select_attention_spec", "standard_specs", "tile_config"]

# NumPy dtype name -> (spec dtype tag, C++ type)
DTYPES = {"float32": ("f32", "float"), "float16": ("f16", "__half"), "bfloat16": ("bf16", "__nv_bfloat16")}
_CTYPE = {tag: ctype for tag, ctype in DTYPES.values()}

# head_dim is compiled in (register arrays need compile-time sizes); a problem uses the
# smallest bucket >= its head_dim and masks the padding. Steps of 32 = one element per lane.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of one kernel family on one arch, with the reason it was chosen."""

    block_m: int
    block_n: int
    warps: int
    reason: str


# The SIMT kernel (fp32 FMA; correct for every dtype, tensor cores come with the prefill work).
# One key per lane (block_n = 32) makes the score row a warp-wide register vector;
# 4 rows per warp keep the output accumulator at <= 32 floats per lane at head_dim 256.
# Not yet tuned per arch: the same shape everywhere until measurements say otherwise.
_SIMT = TileConfig(16, 32, 4, "baseline SIMT: 1 key/lane, 4 rows/warp; unmeasured, same on every arch")
_TILES = {("attn_fwd_simt", arch): _SIMT for arch in SUPPORTED_ARCHS}


def tile_config(family: str, arch: str) -> TileConfig:
    """Return the tile table entry for ``family`` on ``arch``."""
    try:
        return _TILES[(family, arch)]
    except KeyError:
        raise ValueError(f"arch: no tile config for {family} on {arch!r}; supported: {SUPPORTED_ARCHS}") from None


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel variant.

    Parameters
    ----------
    family : str
        Kernel family (``"attn_fwd_simt"``); names the template header and the parameter struct.
    dtype : str
        Element type tag: ``"f32"``, ``"f16"`` or ``"bf16"``.
    head_dim : int
        Compiled head-dim bucket (see :data:`HEAD_DIM_BUCKETS`).
    arch : str
        Target arch, one of :data:`SUPPORTED_ARCHS`.
    ptx : bool
        Emit PTX for ``compute_XX`` instead of a cubin (the opt-in fallback; see ``pyattn.jit.nvrtc``).
    """

    family: str
    dtype: str
    head_dim: int
    arch: str
    ptx: bool = False

    def __post_init__(self):
        if self.family != "attn_fwd_simt":
            raise ValueError(f"family: unknown kernel family {self.family!r}")
        if self.dtype not in _CTYPE:
            raise ValueError(f"dtype: expected one of {sorted(_CTYPE)}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(f"head_dim: expected one of {HEAD_DIM_BUCKETS}, got {self.head_dim}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {self.arch!r}")

    # -- derived facts -------------------------------------------------------------------
    @property
    def tiles(self) -> TileConfig:
        return tile_config(self.family, self.arch)

    @property
    def header(self) -> str:
        return "attention_fwd.cuh"

    @property
    def params(self):
        return ATTN_FWD_PARAMS

    @property
    def threads(self) -> int:
        return self.tiles.warps * 32

    @property
    def entry_name(self) -> str:
        """The ``extern "C"`` symbol: readable in profilers, no name mangling to look up."""
        t = self.tiles
        return f"pyattn_{self.family}_{self.dtype}_d{self.head_dim}_m{t.block_m}n{t.block_n}w{t.warps}"

    @property
    def template_id(self) -> str:
        t = self.tiles
        return (f"pyattn::attn_fwd_simt<pyattn::AttnFwdSimtTraits<{_CTYPE[self.dtype]}, "
                f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.warps}>>")

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory per block: fp32 Q tile, K tile padded by one word per row, V tile."""
        t, d = self.tiles, self.head_dim
        return 4 * (t.block_m * d + t.block_n * (d + 1) + t.block_n * d)

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
        return f"{self.family}[{self.dtype}, d={self.head_dim}, {self.arch}{', ptx' if self.ptx else ''}]"


def select_attention_spec(dtype_name: str, head_dim: int, arch: str, *, ptx: bool = False) -> KernelSpec:
    """Choose the kernel spec for an attention problem.

    Parameters
    ----------
    dtype_name : str
        NumPy dtype name of q/k/v (``float32``, ``float16``, ``bfloat16``).
    head_dim : int
        The problem's head dim (a multiple of 8, at most :data:`MAX_HEAD_DIM`).
    arch : str
    ptx : bool
    """
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype_name!r}")
    bucket = next((b for b in HEAD_DIM_BUCKETS if b >= head_dim), None)
    if bucket is None:
        raise ValueError(f"head_dim: at most {MAX_HEAD_DIM} is supported, got {head_dim}")
    return KernelSpec("attn_fwd_simt", DTYPES[dtype_name][0], bucket, arch, ptx)


def standard_specs(arch: str) -> list:
    """Every variant ``attention`` can select on ``arch``: what ``pyattn warmup`` precompiles."""
    return [KernelSpec("attn_fwd_simt", tag, d, arch) for tag, _ in DTYPES.values() for d in HEAD_DIM_BUCKETS]

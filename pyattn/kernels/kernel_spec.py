"""The :class:`KernelSpec` type: one compiled kernel variant, and everything derived from it.

A :class:`KernelSpec` is frozen and hashable. It alone derives a variant's C++ template
instantiation, its ``extern "C"`` entry name, its launch shape, its compile options and its
cache key; no other module assembles kernel names or options. What differs between kernel
families (headers, tile tables, formulas, constraints) is data in :mod:`pyattn.kernels.families`,
which a spec looks up by its ``family`` field.

Which spec serves a problem is chosen in :mod:`pyattn.kernels.specs`, the class's public home:
that module imports :class:`KernelSpec` from here, and this one never imports it.
"""

from __future__ import annotations

from .families import check_spec, get_family, tile_config
from .families.base import PDL_ARCHS, TileConfig

__all__ = ["KernelSpec"]

_FIELDS = ("family", "dtype", "head_dim", "arch", "ptx", "mask", "softcap", "alibi", "q_tiles", "sparse", "kv",
           "key_channel", "gather")


class KernelSpec:
    """One compiled kernel variant.

    Parameters
    ----------
    family : str
        A kernel family, one of :data:`FAMILIES` (e.g. ``"attn_fwd_mma"``: tensor cores, fp16/bf16;
        ``"attn_fwd_simt"``: CUDA cores, any dtype); what each takes is in its record.
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
    softcap : int
        Attention and decode: 0 without a soft-cap, 1 with one (a bool is taken as 0 / 1), 2 a
        bounded one (:func:`softcap_kind`: the wgmma kernels' softmax without a row max).
    alibi : bool
        Attention and decode: compile in the ALiBi score modifier.
    q_tiles : int
        Decode: m16 row tiles per block (1 or 2), the bucket of group * q_len query rows.
        attn_fwd_tma: 1 for its short row (calls of few keys; its own tiles), 2 for that row's
        small-grid row (its ``mods_row``: plain calls on small grids, ``short_small_grid``), 3 for
        its table's row with the last round split by keys (``pyattn.ops._fwd_tail``), else 0.
    sparse : int
        Tensor-core attention only: 0 dense; 1 visit the key tiles of a block-sparse tile list (see
        ``AttnFwdParams``) at the standard tiles; 2 the same at 64 x 64 tiles (small blocks).
    kv : str
        attn_decode / kv_append only: the cache's element kind, one of :data:`KV_KINDS` (``""`` =
        the query dtype; ``"int8"`` / ``"fp8e4m3"`` = 8-bit codes with fp32 scales).
    key_channel : bool
        attn_decode over an 8-bit cache only: the keys carry per-(page, channel) scales
        (``PagedKVCache(..., key_scales="channel")``) instead of one scale per token.
    gather : bool
        attn_decode_tma / attn_decode_swap only, where the family's row has a gathered variant
        (8-bit caches with per-token scales; 16-bit ones on attn_decode_swap): the producer warps
        gather the ring's rows by cp.async (pages that TMA boxes do not take) instead of loading
        page boxes; the row names its own keys, stages and producers for it.
    """

    # A read-only slotted class, not a frozen dataclass: the dataclass's generated methods cost
    # ~0.5 ms of a fresh process's first call at import (issue 16). Value semantics as before:
    # equal and hashable by its fields, ``replace`` / ``asdict`` for dataclasses.replace / asdict.
    __slots__ = _FIELDS + ("_key",)
    FIELDS = _FIELDS

    def __init__(self, family: str, dtype: str, head_dim: int, arch: str, ptx: bool = False, mask: str = "none",
                 softcap: int = 0, alibi: bool = False, q_tiles: int = 0, sparse: int = 0, kv: str = "",
                 key_channel: bool = False, gather: bool = False):
        softcap = int(softcap) if isinstance(softcap, bool) else softcap
        key = (family, dtype, head_dim, arch, ptx, mask, softcap, alibi, q_tiles, sparse, kv, key_channel, gather)
        for name, value in zip(_FIELDS, key):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_key", key)
        check_spec(self)

    def __setattr__(self, name, value):
        raise AttributeError(f"KernelSpec is read-only (cannot set {name!r})")

    __delattr__ = __setattr__

    def __eq__(self, other):
        return type(other) is KernelSpec and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self) -> str:
        return "KernelSpec(" + ", ".join(f"{n}={v!r}" for n, v in zip(_FIELDS, self._key)) + ")"

    def __reduce__(self):
        return KernelSpec, self._key

    def asdict(self) -> dict:
        """The fields by name, in declaration order."""
        return dict(zip(_FIELDS, self._key))

    def replace(self, **changes) -> "KernelSpec":
        """A copy with ``changes`` to some fields (checked like a new spec)."""
        return KernelSpec(**{**self.asdict(), **changes})

    @property
    def has_mods(self) -> bool:
        return self.mask != "none" or self.softcap or self.alibi

    # -- derived facts: the family record's, for this spec ------------------------------------
    @property
    def record(self):
        """The :class:`~pyattn.kernels.families.base.Family` record of :attr:`family`."""
        return get_family(self.family)

    @property  # not cached: override_tiles changes the tables; launch paths keep what they need in plans
    def tiles(self) -> TileConfig:
        t = tile_config(self.family, self.arch, self.head_dim, self.kv, self.sparse, self.mask)
        return self.record.spec_tiles(self, t)

    @property
    def header(self) -> str:
        return self.record.header

    @property
    def params(self):
        return self.record.params

    @property
    def alignment(self):
        """What the kernel's loads and stores need of the arrays (``families.base.Alignment``)."""
        return self.record.alignment

    @property
    def dependent_launch(self) -> bool:
        """Whether the kernel launches as the stream's previous kernel's programmatic dependent
        (``pyattn.runtime.launch``): on the archs that have programmatic dependent launch, where
        every kernel's entry point waits for that kernel first (``pyattn.jit.source.render``)."""
        return self.arch in PDL_ARCHS

    @property
    def threads(self) -> int:
        return self.tiles.warps * 32

    @property
    def entry_name(self) -> str:
        """The ``extern "C"`` symbol: readable in profilers, no name mangling to look up."""
        return self.record.entry_name(self, self.tiles)

    @property
    def template_id(self) -> str:
        return self.record.template_id(self, self.tiles)

    @property
    def traits(self) -> str | None:
        """The C++ traits type whose ``kSmemBytes`` must equal :attr:`shared_bytes` (the rendered
        unit asserts it); None for a family without dynamic shared memory."""
        return None if self.record.traits is None else self.record.traits(self, self.tiles)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory per block (the family's formula; see :attr:`traits`)."""
        return self.record.smem_bytes(self, self.tiles)

    def grid(self, batch: int, heads_q: int, seqlen_q: int, slots: int = 0) -> tuple:
        """Launch grid: query tiles x query heads x batch; a persistent tile's, ``slots`` blocks
        (the blocks the GPU holds at once) or fewer when there are fewer query tiles."""
        t = self.tiles
        m_tiles = -(-seqlen_q // t.block_m)
        if t.persistent:
            if slots < 1:
                raise ValueError(f"slots: a persistent tile ({self.describe()}) needs the blocks the GPU holds at "
                                 f"once, >= 1; got {slots}")
            return (max(1, min(m_tiles * heads_q * batch, slots)), 1, 1)
        return (m_tiles, heads_q, batch)

    def compile_options(self, include_dirs=()) -> tuple:
        """NVRTC options. ``-arch=sm_XX`` makes NVRTC emit SASS for exactly that arch.

        ``--no-cache``: where a CUDA driver is installed, NVRTC 13 (12.9+) otherwise looks each
        program up in the driver's compute cache and stores it there, and to do so it initialises
        the driver in the compiling process. A process that only compiled (``python -m pyattn
        warmup --arch ...`` in a parent that then forks GPU workers) left its forked children unable
        to use CUDA (``cuInit``: CUDA_ERROR_NOT_INITIALIZED), and every variant landed a second time
        in the user's compute cache (0.8 MB for an 8-bit decode), crowding out other programs' JIT
        entries. pyattn's own cache (:mod:`pyattn.jit.cache`) already keeps the cubins
        (``dev/probe_nvrtc_cache.py``; BENCHMARKS.md, forty-seventh session).
        """
        target = ("compute_" + self.arch[3:]) if self.ptx else self.arch
        opts = [f"-arch={target}", "-std=c++17", "-lineinfo", "-DNDEBUG", "--no-cache"]
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
        from ..jit import digest
        from ..jit.source import render

        # The rendered unit covers what the spec fields alone do not: the tile table, the
        # template id and the parameter struct layout.
        unit = digest.hexdigest(render(self).encode())
        # repr of str/int/bool tuples is exact and stable: no json import on a warm start.
        doc = (tuple(self.asdict().items()), self.compile_options(), unit, toolchain)
        return digest.hexdigest(repr(doc).encode())

    def describe(self) -> str:
        mods = "".join(f", {m}" for m, on in ((f"mask={self.mask}", self.mask != "none"),
                                               ("softcap" + ("<=51" if self.softcap == 2 else ""), self.softcap),
                                               ("alibi", self.alibi),
                                               (f"q_tiles={self.q_tiles}", self.q_tiles),
                                               (f"sparse={self.sparse}", self.sparse),
                                               (f"kv={self.kv}", self.kv),
                                               ("key_channel", self.key_channel),
                                               ("gather", self.gather)) if on)
        return f"{self.family}[{self.dtype}, d={self.head_dim}, {self.arch}{mods}{', ptx' if self.ptx else ''}]"

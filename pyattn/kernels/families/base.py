"""What every kernel family record is made of: the record type, tile rows and shared vocabulary.

A :class:`Family` holds everything that differs between kernel families (header, parameter
struct, template id, shared-memory formula, tile table, constraints, alignment); the family
modules beside this one each define one or a few records, and ``families/__init__.py`` collects
them into the registry that :class:`~pyattn.kernels.specs.KernelSpec` looks up.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

from ...runtime.device import SUPPORTED_ARCHS

__all__ = ["DTYPES", "FP8_DTYPES", "CTYPES", "HEAD_DIM_BUCKETS", "MAX_HEAD_DIM", "MASK_KINDS", "TMA_MASK_KINDS", "KV_KINDS",
           "KV_HEAD_DIM_BUCKETS", "WGMMA_ARCHS", "PDL_ARCHS", "WGMMA_BWD_MAX_HEAD_DIM", "TileConfig", "FixedTile",
           "Alignment", "TENSOR_CORE_ALIGNMENT", "PAGED_ALIGNMENT", "Family", "tma_page_boxes",
           "every_arch", "score_mods", "entry_name", "no_shared_memory", "dense_table", "table_tiles"]

# The records and tile rows below are NamedTuples or plain classes, not frozen dataclasses: a
# frozen dataclass builds its methods with ``exec`` when its module is imported (~0.45 ms each),
# and a fresh process's first call imports the records it needs (issue 16: <= 15 ms in all).

# NumPy dtype name -> (spec dtype tag, C++ type)
DTYPES = {"float32": ("f32", "float"), "float16": ("f16", "__half"), "bfloat16": ("bf16", "__nv_bfloat16")}
# fp8 e4m3 inputs (ml_dtypes / torch float8_e4m3fn): attention's forward on sm_90a only (attn_fwd_fp8),
# so kept apart from DTYPES, which every op and warm-up list walks.
FP8_DTYPES = {"float8_e4m3fn": ("e4m3", "pyattn::fp8e4m3")}
CTYPES = {tag: ctype for tag, ctype in (*DTYPES.values(), *FP8_DTYPES.values())}  # spec dtype tag -> C++ type
# head_dim is compiled in (register arrays need compile-time sizes); a problem uses the
# smallest bucket >= its head_dim and masks the padding. Steps of 32 = one element per lane.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
# Mask tensor element type -> kernels_src/attention_mask.cuh MaskKind; "none" = no mask tensor;
# "bits": a bool mask packed by the mask_bits kernel; "<float>_row": a float mask broadcast over
# the query rows (a key-padding mask), one row a stage (both attn_fwd_tma only: TMA_MASK_KINDS).
MASK_KINDS = {"none": 0, "bool": 1, "f16": 2, "bf16": 3, "f32": 4, "bits": 5, "f16_row": 2, "bf16_row": 3,
              "f32_row": 4}
TMA_MASK_KINDS = ("bits", "f16_row", "bf16_row", "f32_row")
# Paged-cache element kinds (attn_decode / kv_append ``kv``): "" = the query dtype, else 8-bit codes
# with per-(slot, kv head) fp32 scales -> kernels_src KvKind.
KV_KINDS = {"": 0, "int8": 1, "fp8e4m3": 2}
KV_HEAD_DIM_BUCKETS = (64, 128, 256)  # 8-bit caches: whole 64-byte fragment groups
WGMMA_ARCHS = ("sm_90a",)  # wgmma exists on sm_90a only (Blackwell's tcgen05 is another instruction set)
# Programmatic dependent launch (griddepcontrol, cuLaunchKernelEx's programmatic stream
# serialization): compute capability 9.0 and later. Every kernel launches so there (its entry waits
# first: pyattn.jit.source.render, kernels_src/pdl.cuh).
PDL_ARCHS = ("sm_90a", "sm_100a")
# attn_bwd_wgmma holds a warpgroup's dK + dV (64 keys x head_dim each) in registers: head dims up to 128.
WGMMA_BWD_MAX_HEAD_DIM = 128


class TileConfig(NamedTuple):
    """Tile shape of one kernel family on one arch, with the reason it was chosen."""

    block_m: int
    block_n: int
    warps: int
    reason: str
    min_blocks: int = 1  # __launch_bounds__ blocks per SM: caps registers so that many fit
    m_tiles: int = 1  # MMA kernel: m16 row tiles per warp (block_m = 16 * m_tiles * warps)
    stages: int = 2  # wgmma kernel: K/V shared-memory ring depth
    overlap: bool = False  # wgmma kernel: issue P V of tile j-1 behind Q K^T of tile j
    ws: int = 0  # producers fill the ring (counted in ``warps``): wgmma, a warpgroup (1); decode, this many warps
    persistent: bool = False  # one block an SM walks the query tiles (grid: ``KernelSpec.grid``'s slots)
    split_kv: bool = False  # wgmma kernel with TMA: K and V tiles on barriers of their own
    poly_exp: int = 0  # wgmma kernel with TMA, soft-capped: of 8 key pairs' exp2s, this many on the FMA pipe
    o_stage: bool = False  # wgmma kernel with TMA: O leaves through shared memory (stmatrix), not shuffles
    mask_bits: bool = False  # wgmma kernel with TMA, a bool mask packed to bits: its words ride the ring
    q_regs: bool = False  # wgmma kernel with TMA: Q K^T takes the query tile from registers (wgmma RS)
    # attn_fwd_tma, persistent: the last, partial round's query tiles split by keys over every block
    # (kernels_src/fwd_tail_split.cuh; spec q_tiles 3, the plan's pyattn/ops/_fwd_tail.py rule)
    tail_split: bool = False


class FixedTile(NamedTuple):
    """A tile-table row of a family with one launch shape for every head dim up to ``max_head_dim``.

    Every row type has ``max_head_dim`` (a row serves the head-dim buckets up to it, the first
    such row of a table wins), ``reason`` (the measurement behind it) and :meth:`config`.
    """

    max_head_dim: int
    block_m: int
    block_n: int
    warps: int
    reason: str
    min_blocks: int = 1  # __launch_bounds__ blocks per SM

    def config(self) -> TileConfig:
        return TileConfig(self.block_m, self.block_n, self.warps, self.reason, self.min_blocks)


class Alignment(NamedTuple):
    """What a family's memory accesses need of the arrays they touch (1 = nothing): multiples of
    so many bytes (``out_elems``: elements).

    The ops check these before a launch, so a misaligned array is a ``ValueError``, never a fault.
    """

    qkv: int = 1  # q, k, v: data address and every stride but the contiguous head_dim axis
    out: int = 1  # out: data address and strides
    out_elems: int = 1  # out: address and strides in elements (stores of element pairs)
    pool: int = 1  # paged K/V pools and decode's q: row address and strides


# The tensor-core kernels read q/k/v in 16-byte chunks (cp.async) and store pairs of elements.
TENSOR_CORE_ALIGNMENT = Alignment(qkv=16, out_elems=2)
# The paged-cache kernels copy 16-byte chunks of pool rows (and of decode's query rows).
PAGED_ALIGNMENT = Alignment(pool=16)


def tma_page_boxes(page_size: int) -> bool:
    """Whether the TMA-fed paged kernels (attn_decode_tma, attn_prefill_tma) take pages of
    ``page_size`` slots: a power of two from 16, so that a box of min(page, block_n) slots never
    straddles a page; smaller pages would make boxes too small for TMA to pay."""
    return page_size >= 16 and page_size & (page_size - 1) == 0


def every_arch(rows: tuple) -> dict:
    """One table for every supported arch (families not tuned per arch)."""
    return {arch: rows for arch in SUPPORTED_ARCHS}


def no_shared_memory(spec, t) -> int:
    """``smem_bytes`` of a family whose kernel declares no dynamic shared memory."""
    return 0


def dense_table(kv: str, sparse: int, mask: str = "none") -> str:
    """``table_for`` of a family with one tile table."""
    return "dense"


def table_tiles(spec, t: TileConfig) -> TileConfig:
    """``spec_tiles`` of a family whose spec fields do not change its table's tile."""
    return t


def score_mods(spec) -> str:
    """The ``pyattn::ScoreMods<mask kind, softcap, alibi>`` argument of the attention kernels."""
    return f"pyattn::ScoreMods<{MASK_KINDS[spec.mask]}, {spec.softcap}, {str(spec.alibi).lower()}>"


def entry_name(spec, t: TileConfig, stages: bool = False) -> str:
    """The ``extern "C"`` symbol: readable in profilers, no name mangling to look up.

    ``stages``: name the ring depth too (decode, whose tables differ in it at equal tiles), and
    a producer warp's bulk copies (``tma``).
    """
    mods = (f"_mask{spec.mask}" if spec.mask != "none" else "") + ("", "_softcap", "_softcapb")[spec.softcap] \
        + ("_alibi" if spec.alibi else "")
    mods += ("", "_sparse", "_sparse64")[spec.sparse] + (f"_kv{spec.kv}" if spec.kv else "")
    mods += "_kch" if spec.key_channel else ""
    mods += "_gather" if spec.gather else ""
    ring = f"s{t.stages}" + ("tma" if t.ws else "") if stages else ""
    ring += "p" if t.persistent else ""
    ring += "kv" if t.split_kv else ""
    ring += f"e{t.poly_exp}" if t.poly_exp else ""
    ring += "o" if t.o_stage else ""
    ring += "q" if t.q_regs else ""
    ring += "t" if t.tail_split else ""
    return f"pyattn_{spec.family}_{spec.dtype}_d{spec.head_dim}_m{t.block_m}n{t.block_n}w{t.warps}{ring}{mods}"


class Family:
    """One kernel family: everything :class:`~pyattn.kernels.specs.KernelSpec` derives, as data.

    Parameters
    ----------
    name : str
        The family's name (``KernelSpec.family``; part of every entry name).
    label : str
        How error messages name it (``"the tensor-core family"``).
    header : str
        The ``kernels_src/`` template header the rendered unit includes.
    params : ParamStruct
        The kernel's parameter struct.
    tables : mapping of str to (mapping of str to tuple of rows)
        Tile tables by name (``"dense"``; ``"sparse64"``: 64 x 64 block-sparse tiles; ``"kv8"``:
        8-bit caches; ``"mask1"``/``"mask2"``/``"mask4"``: with a mask tensor of so many bytes per
        element), each by arch; rows are typed (:class:`FixedTile` or the family module's
        row type) and ordered by ``max_head_dim``. An arch missing from a table is one the family
        does not run on. Kept as read-only mappings; ``override_tiles`` replaces one for a while.
    template_id : callable
        ``template_id(spec, tiles) -> str``: the C++ function template the entry point calls.
    dtypes : tuple of str
        The dtype tags it takes.
    mods : tuple of str
        Score modifiers it compiles in: some of ``"mask"``, ``"softcap"``, ``"alibi"``,
        ``"tma_masks"`` when it also reads the :data:`TMA_MASK_KINDS` (bool masks packed by the
        ``mask_bits`` kernel, float masks broadcast over the query rows as one row a stage), and
        ``"softcap_bounded"`` when it takes ``KernelSpec.softcap`` 2 (``specs.softcap_kind``).
    alignment : Alignment
        What its loads and stores need of the caller's arrays.
    traits : callable, optional
        ``traits(spec, tiles) -> str``: the C++ traits type whose ``kSmemBytes`` the rendered
        unit ``static_assert``s equal to :attr:`smem_bytes`; None for families without dynamic
        shared memory (their ``smem_bytes`` is 0 and nothing is asserted).
    smem_bytes : callable
        ``smem_bytes(spec, tiles) -> int``: dynamic shared memory per block.
    table_for : callable
        ``table_for(kv, sparse, mask) -> str``: which of ``tables`` a spec reads.
    spec_tiles : callable
        ``spec_tiles(spec, tiles) -> TileConfig``: the table's tile adjusted by the spec's own
        fields (decode's row tiles); the identity for most families.
    entry_name : callable
        ``entry_name(spec, tiles) -> str``: the ``extern "C"`` symbol.
    takes : str
        When set, what the family takes, in one line: a spec that breaks its ``dtypes``, ``mods``
        or ``check`` is refused with ``family: <name> takes <takes>; got <spec>`` (one message
        for a family whose constraints go together); else each names its own field.
    check : callable, optional
        ``check(spec)``: raise ``ValueError`` for a spec the family cannot compile beyond what
        the fields above say (run after the modifier and dtype checks, before the ``q_tiles`` /
        ``sparse`` / ``kv`` ones).
    sparse, kv, q_tiles : bool
        Whether it reads block-sparse tile lists, 8-bit caches, and takes ``q_tiles``.
    key_channel : bool
        Whether it reads 8-bit caches whose keys have per-(page, channel) scales.
    gather : bool
        Whether its producer warps can gather a cache's rows by cp.async (``KernelSpec.gather``).
    """

    __slots__ = ("name", "label", "header", "params", "tables", "template_id", "dtypes", "mods", "alignment",
                 "traits", "smem_bytes", "table_for", "spec_tiles", "entry_name", "takes", "check", "sparse", "kv",
                 "q_tiles", "key_channel", "gather")

    def __init__(self, *, name: str, label: str, header: str, params, tables: Mapping[str, Mapping[str, tuple]],
                 template_id: Callable, dtypes: tuple = ("f32", "f16", "bf16"), mods: tuple = (),
                 alignment: Alignment = Alignment(), traits: Callable | None = None,
                 smem_bytes: Callable = no_shared_memory, table_for: Callable = dense_table,
                 spec_tiles: Callable = table_tiles, entry_name: Callable = entry_name, takes: str = "",
                 check: Callable | None = None, sparse: bool = False, kv: bool = False, q_tiles: bool = False,
                 key_channel: bool = False, gather: bool = False):
        # Read-only views: a table changes through override_tiles only, never by patching.
        frozen = MappingProxyType({n: MappingProxyType(dict(by_arch)) for n, by_arch in tables.items()})
        values = dict(name=name, label=label, header=header, params=params, tables=frozen, template_id=template_id,
                      dtypes=dtypes, mods=mods, alignment=alignment, traits=traits, smem_bytes=smem_bytes,
                      table_for=table_for, spec_tiles=spec_tiles, entry_name=entry_name, takes=takes, check=check,
                      sparse=sparse, kv=kv, q_tiles=q_tiles, key_channel=key_channel, gather=gather)
        for field, value in values.items():
            object.__setattr__(self, field, value)

    def __setattr__(self, field, value):
        raise AttributeError(f"Family records are read-only (cannot set {field!r})")

    __delattr__ = __setattr__

    def __repr__(self) -> str:
        return f"Family(name={self.name!r}, header={self.header!r})"

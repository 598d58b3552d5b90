"""Kernel families as data: one :class:`~.base.Family` record per kernel family, and the registry.

:data:`FAMILIES` maps a family name to its record (header, parameter struct, template-id builder,
shared-memory formula, typed per-arch tile tables with their measured reasons, constraints and
alignment needs). :class:`~pyattn.kernels.specs.KernelSpec` looks its family up here; adding a
kernel is a record in a module beside this one plus a line in ``_WHERE`` (records are built when
first asked for).

Tuning scripts replace a tile table for a while with :func:`override_tiles`, never by patching
the tables themselves.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from ...runtime.device import SUPPORTED_ARCHS
from . import tables
from .base import (CTYPES, HEAD_DIM_BUCKETS, KV_HEAD_DIM_BUCKETS, KV_KINDS, MASK_KINDS, TMA_MASK_KINDS, WGMMA_ARCHS,
                   Family, TileConfig)

__all__ = ["FAMILIES", "Family", "TileConfig", "MmaTile", "WgmmaTile", "DecodeTile", "BwdTile", "BwdWgmmaTile",
           "KV_HEAD_DIM_BUCKETS",
           "WGMMA_ARCHS", "get_family", "check_spec", "takes_bounded_softcap", "tile_config", "tile_table",
           "override_tiles",
           "decode_row", "wgmma_shapes", "wgmma_fp8_shapes"]

# family name -> (module beside this one, record name in it). A record's module is imported when
# the family is first asked for: a process that only runs attention on sm_90a never builds the
# decode or mma.sync records (issue 16: the first call of a fresh process <= 15 ms).
_WHERE = {
    "attn_fwd_mma": ("mma", "ATTN_FWD_MMA"),
    "attn_fwd_simt": ("simt", "ATTN_FWD_SIMT"),
    "attn_fwd_tf32": ("mma", "ATTN_FWD_TF32"),
    "attn_fwd_wgmma": ("wgmma", "ATTN_FWD_WGMMA"),
    "attn_fwd_tma": ("tma", "ATTN_FWD_TMA"),
    "attn_fwd_fp8": ("fp8", "ATTN_FWD_FP8"),
    "fp8_vt": ("fixed", "FP8_VT"),
    "merge_states": ("fixed", "MERGE_STATES"),
    "split_combine": ("fixed", "SPLIT_COMBINE"),
    "attn_decode": ("decode", "ATTN_DECODE"),
    "attn_decode_tma": ("decode", "ATTN_DECODE_TMA"),
    "attn_decode_swap": ("decode", "ATTN_DECODE_SWAP"),
    "kv_append": ("fixed", "KV_APPEND"),
    "attn_sparse": ("fixed", "ATTN_SPARSE"),
    "mask_bits": ("fixed", "MASK_BITS"),
    "attn_prefill_mma": ("prefill", "ATTN_PREFILL_MMA"),
    "attn_prefill_wgmma": ("prefill", "ATTN_PREFILL_WGMMA"),
    "attn_prefill_tma": ("prefill", "ATTN_PREFILL_TMA"),
    "attn_tree_mma": ("prefill", "ATTN_TREE_MMA"),
    "attn_tree_wgmma": ("prefill", "ATTN_TREE_WGMMA"),
    "attn_bwd_pre": ("backward", "ATTN_BWD_PRE"),
    "attn_bwd_mma": ("backward", "ATTN_BWD_MMA"),
    "attn_bwd_wgmma": ("backward", "ATTN_BWD_WGMMA"),
    "attn_bwd_simt": ("backward", "ATTN_BWD_SIMT"),
    "attn_bwd_convert": ("backward", "ATTN_BWD_CONVERT"),
    "kv_key_pages": ("paged", "KV_KEY_PAGES"),
    "kv_sparq": ("paged", "KV_SPARQ"),
    "sparq_score": ("paged", "SPARQ_SCORE"),
    "sparq_select": ("paged", "SPARQ_SELECT"),
}
# Names this package re-exports from the family modules, imported on first access (PEP 562).
_LAZY = {"MmaTile": "mma", "WgmmaTile": "wgmma", "DecodeTile": "decode", "decode_row": "decode",
         "wgmma_shapes": "shapes", "wgmma_fp8_shapes": "fp8", "BwdTile": "backward",
         "BwdWgmmaTile": "backward"}


class _Registry(Mapping):
    """The read-only registry: family name -> :class:`Family`, each record built on first lookup."""

    __slots__ = ("_records",)

    def __init__(self):
        self._records = {}

    def __getitem__(self, name: str) -> Family:
        record = self._records.get(name)
        if record is None:
            module, attr = _WHERE[name]  # KeyError for an unknown name, as a mapping should
            record = getattr(importlib.import_module(f".{module}", __name__), attr)
            self._records[name] = record
        return record

    def __iter__(self):
        return iter(_WHERE)

    def __len__(self) -> int:
        return len(_WHERE)

    def __contains__(self, name) -> bool:
        return name in _WHERE

    def __repr__(self) -> str:
        return f"<pyattn kernel families: {', '.join(_WHERE)}>"


FAMILIES = _Registry()
_NAMES = tuple(_WHERE)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_family(name: str) -> Family:
    """The record of family ``name``; ``ValueError`` naming the known families otherwise."""
    if name not in _WHERE:
        raise ValueError(f"family: expected one of {_NAMES}, got {name!r}")
    return FAMILIES[name]


def _able(flag: str) -> str:
    return " / ".join(f.name for f in FAMILIES.values() if getattr(f, flag))


def takes_bounded_softcap(family: str, dtype: str, mask: str = "none", alibi: bool = False,
                          q_tiles: int = 0) -> bool:
    """Whether ``KernelSpec.softcap`` 2 (a bounded soft-cap: the wgmma forward's softmax against a
    fixed reference) compiles for these spec fields: a family with ``"softcap_bounded"`` in its mods,
    bf16, nothing added to the capped score (no ALiBi, no float mask; a bool mask is a predicate),
    and not attn_fwd_tma's short row (``q_tiles`` 1: its three warpgroups spilled 244 bytes with it,
    NVRTC 13.0). ``specs.softcap_kind`` selects by it and :func:`check_spec` checks by it."""
    return ("softcap_bounded" in get_family(family).mods and dtype == "bf16" and not alibi
            and mask in ("none", "bool", "bits") and not q_tiles)


def check_spec(spec) -> None:
    """Raise ``ValueError`` (naming the field) unless ``spec``'s family can compile it.

    The fields' domains first, then the family's modifiers and dtypes, its own ``check``, and
    whether it takes ``q_tiles``, block-sparse lists and 8-bit caches.
    """
    record = get_family(spec.family)
    if spec.dtype not in CTYPES:
        raise ValueError(f"dtype: expected one of {sorted(CTYPES)}, got {spec.dtype!r}")
    if spec.head_dim not in HEAD_DIM_BUCKETS:
        raise ValueError(f"head_dim: expected one of {HEAD_DIM_BUCKETS}, got {spec.head_dim}")
    if spec.arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {spec.arch!r}")
    if spec.mask not in MASK_KINDS:
        raise ValueError(f"mask: expected one of {tuple(MASK_KINDS)}, got {spec.mask!r}")
    if spec.sparse not in (0, 1, 2):
        raise ValueError(f"sparse: expected 0 (dense), 1 or 2 (64 x 64 tiles), got {spec.sparse!r}")
    if spec.kv not in KV_KINDS:
        raise ValueError(f"kv: expected one of {tuple(KV_KINDS)}, got {spec.kv!r}")
    if spec.mask in TMA_MASK_KINDS and "mask" in record.mods and "tma_masks" not in record.mods:
        takers = " / ".join(f.name for f in FAMILIES.values() if "tma_masks" in f.mods)
        raise ValueError(f"mask: {spec.mask} masks (bool packed to bits, float rows broadcast over queries) are "
                         f"read by {takers} only, got {spec.family}")
    if spec.softcap not in (0, 1, 2):
        raise ValueError(f"softcap: expected 0 (none), 1 or 2 (bounded), got {spec.softcap!r}")
    if spec.softcap == 2 and not takes_bounded_softcap(spec.family, spec.dtype, spec.mask, spec.alibi, spec.q_tiles):
        takers = " / ".join(f.name for f in FAMILIES.values() if "softcap_bounded" in f.mods)
        raise ValueError(f"softcap: the bounded soft-cap (2) is read by {takers} on bf16 without ALiBi, a float "
                         f"mask or the short row (q_tiles), got {spec}")
    bad_mods = ((spec.mask != "none" and "mask" not in record.mods) or (spec.softcap and "softcap" not in record.mods)
                or (spec.alibi and "alibi" not in record.mods))
    bad_dtype = spec.dtype not in record.dtypes
    if record.takes and (bad_mods or bad_dtype):
        raise ValueError(f"family: {record.name} takes {record.takes}; got {spec}")
    if bad_mods:
        raise ValueError(f"mask/softcap/alibi: only attention families take score modifiers (decode: "
                         f"softcap/alibi), got {spec}")
    if bad_dtype:
        raise ValueError(f"dtype: {record.label} takes {' or '.join(record.dtypes)}, got {spec.dtype!r}")
    if record.check is not None:
        record.check(spec)
    if spec.q_tiles and not record.q_tiles:
        raise ValueError(f"q_tiles: only {_able('q_tiles')} takes q_tiles, got {spec.q_tiles} for {spec.family}")
    if spec.sparse and not record.sparse:
        raise ValueError(f"sparse: block-sparse tile lists are read by {_able('sparse')}, got {spec.family}")
    if spec.kv and not record.kv:
        raise ValueError(f"kv: only {_able('kv')} read quantized caches, got {spec.family}")
    if spec.gather and not (record.gather and not spec.key_channel):
        raise ValueError(f"gather: gathered rows are read by {_able('gather')} (per-token key scales), got "
                         f"{spec.family} with key_channel={spec.key_channel}")
    if spec.key_channel and not (record.key_channel and spec.kv):
        raise ValueError(f"key_channel: per-channel key scales are read by {_able('key_channel')} over an 8-bit "
                         f"cache (kv set), got {spec.family} with kv={spec.kv!r}")


def tile_table(family: str, arch: str, table: str = "dense") -> tuple:
    """The rows of ``family``'s tile table ``table`` on ``arch`` now (an override's, in one).

    Raises
    ------
    ValueError
        For an unknown family, table or arch, or an arch the family does not run on.
    """
    if arch not in SUPPORTED_ARCHS:  # before the family: the message the old tile_config gave
        raise ValueError(f"arch: no tile config for {family} on {arch!r}; supported: {SUPPORTED_ARCHS}")
    return tables.rows(get_family(family), table, arch)


def tile_config(family: str, arch: str, head_dim: int, kv: str = "", sparse: int = 0,
                mask: str = "none") -> TileConfig:
    """The tile of ``family`` on ``arch`` at ``head_dim`` (a bucket); ``kv``: the cache's element
    kind (decode); ``sparse`` 2: the 64 x 64 block-sparse tiles; ``mask``: the mask tensor's kind."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: no tile config for {family} on {arch!r}; supported: {SUPPORTED_ARCHS}")
    record = get_family(family)
    return tables.row(record, record.table_for(kv, sparse, mask), arch, head_dim).config()


def override_tiles(family: str, arch: str, rows, table: str = "dense"):
    """Replace one tile table while the ``with`` block runs: the hook for tuning scripts.

    Parameters
    ----------
    family : str
        A name in :data:`FAMILIES`.
    arch : str
        The arch whose table is replaced (others keep theirs).
    rows : iterable of rows
        The new table: rows of the table's own type (e.g. :class:`MmaTile`), ascending in
        ``max_head_dim``. Start from :func:`tile_table` to change one row only.
    table : str
        Which of the family's tables (``"dense"``, ``"sparse64"``, ``"kv8"``; see ``Family.tables``).

    Returns
    -------
    context manager
        Yields the new rows; the previous table is back when the block ends, however it ends.

    Notes
    -----
    Specs derive their tiles, template id, shared memory and cache key from the table as it is
    when asked, so a spec built inside the block compiles the new tiles into its own cache entry.
    Loaded kernels are forgotten on entry and exit (their spec is the same, their tiles are not),
    and the ops' cached plans are rebuilt (``pipeline.plans.get_plan`` keys them on the kernels'
    generation). Blocks nest (the innermost wins). Not thread-safe: for tuning runs, not for
    serving.

    Examples
    --------
    >>> from pyattn.kernels.families import MmaTile, override_tiles, tile_table
    >>> rows = (MmaTile(128, 32, 4, 2, 2, "tuning"),) + tile_table("attn_fwd_mma", "sm_90a")[1:]
    >>> with override_tiles("attn_fwd_mma", "sm_90a", rows):
    ...     pass  # build and time specs here
    """
    return tables.override(get_family(family), arch, rows, table)

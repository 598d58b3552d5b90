"""Tile-table lookups, and the override that tuning scripts put over a table for a while.

The tables themselves are constants in the family records; the only state here is
:data:`_overrides`, empty except inside an :func:`override` block.
"""

from __future__ import annotations

import contextlib

from ...runtime.device import SUPPORTED_ARCHS
from .base import Family

__all__ = ["rows", "row", "override"]

# (family name, table, arch) -> rows, while an override block runs.
_overrides: dict = {}


def rows(record: Family, table: str, arch: str) -> tuple:
    """The rows of ``record``'s tile table ``table`` on ``arch`` now (an override's, in one).

    Raises
    ------
    ValueError
        For an unknown arch or table, or an arch the family does not run on.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: no tile config for {record.name} on {arch!r}; supported: {SUPPORTED_ARCHS}")
    by_arch = record.tables.get(table)
    if by_arch is None:
        raise ValueError(f"table: {record.name} has tile tables {tuple(record.tables)}, got {table!r}")
    found = _overrides.get((record.name, table, arch)) or by_arch.get(arch)
    if found is None:
        raise ValueError(f"arch: {record.label} needs one of {tuple(by_arch)}, got {arch!r}")
    return found


def row(record: Family, table: str, arch: str, head_dim: int):
    """The first row of :func:`rows` whose ``max_head_dim`` covers ``head_dim``."""
    for r in rows(record, table, arch):
        if head_dim <= r.max_head_dim:
            return r
    raise ValueError(f"head_dim: no {record.name} tile for {head_dim} on {arch}")


@contextlib.contextmanager
def override(record: Family, arch: str, new_rows, table: str):
    """``pyattn.kernels.families.override_tiles`` for a record (documented there)."""
    current = rows(record, table, arch)
    new_rows = tuple(new_rows)
    row_type = type(current[0])
    if not new_rows or any(type(r) is not row_type for r in new_rows):
        raise TypeError(f"rows: expected a non-empty sequence of {row_type.__name__}, got {new_rows!r}")
    bounds = [r.max_head_dim for r in new_rows]
    if bounds != sorted(bounds):
        raise ValueError(f"rows: expected ascending max_head_dim, got {bounds}")
    from ..registry import forget_kernels  # loads the driver bindings: only when tuning

    key = (record.name, table, arch)
    saved = _overrides.get(key)
    _overrides[key] = new_rows
    forget_kernels()
    try:
        yield new_rows
    finally:
        if saved is None:
            del _overrides[key]
        else:
            _overrides[key] = saved
        forget_kernels()

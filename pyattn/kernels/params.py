"""Kernel parameter structs, defined once and rendered for both sides.

Each kernel takes one ``const __grid_constant__`` struct. Its field list lives here only: the
C++ declaration placed in the translation unit and the Python :mod:`struct` packer are both
derived from it, and the rendered source ``static_assert``s the size, so the two can never drift.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["ParamStruct", "ATTN_FWD_PARAMS"]

# kind -> (struct code, C type). '@' native alignment matches the CUDA ABI on x86-64/aarch64.
_KINDS = {
    "ptr": ("Q", "const void*"),
    "mut_ptr": ("Q", "void*"),
    "f32_ptr": ("Q", "float*"),
    "i64": ("q", "long long"),
    "i32": ("i", "int"),
    "f32": ("f", "float"),
}


@dataclass(frozen=True)
class ParamStruct:
    """A kernel parameter struct: an ordered tuple of ``(field, kind)``.

    Parameters
    ----------
    name : str
        The C++ struct name (inside ``namespace pyattn``).
    fields : tuple of (str, str)
        Field names and kinds (``ptr``, ``mut_ptr``, ``f32_ptr``, ``i64``, ``i32``, ``f32``).
    """

    name: str
    fields: tuple

    @property
    def format(self) -> str:
        return "@" + "".join(_KINDS[kind][0] for _, kind in self.fields)

    @property
    def size(self) -> int:
        # Trailing padding: C rounds the struct up to its largest member's alignment.
        align = max(struct.calcsize("@" + _KINDS[kind][0]) for _, kind in self.fields)
        return -(-struct.calcsize(self.format) // align) * align

    def c_declaration(self) -> str:
        """The C++ declaration with a size check, for the rendered translation unit."""
        body = "\n".join(f"  {_KINDS[kind][1]} {name};" for name, kind in self.fields)
        return (f"struct {self.name} {{\n{body}\n}};\n"
                f'static_assert(sizeof({self.name}) == {self.size}, "{self.name}: layout differs from Python");\n')

    def pack(self, values: dict) -> bytes:
        """Pack ``values`` (every field by name) into the struct's bytes."""
        raw = struct.pack(self.format, *[values[name] for name, _ in self.fields])
        return raw + b"\0" * (self.size - len(raw))

    def partial(self, static: dict) -> "PartialPack":
        """Pre-pack every field but a leading run of fields (the per-call pointers).

        Parameters
        ----------
        static : dict
            Values of all fields after the leading dynamic ones.

        Returns
        -------
        PartialPack
            ``.pack(*dynamic_values)`` gives the full struct bytes; per call this costs one small
            ``struct.pack`` and a concatenation instead of a pass over every field.
        """
        names = [name for name, _ in self.fields]
        n_dyn = next(i for i, name in enumerate(names) if name in static)
        if set(names[n_dyn:]) != set(static):
            raise ValueError(f"static: expected exactly the fields {names[n_dyn:]}, got {sorted(static)}")
        full = self.pack({**dict.fromkeys(names[:n_dyn], 0), **static})
        head = struct.Struct("@" + "".join(_KINDS[kind][0] for _, kind in self.fields[:n_dyn]))
        return PartialPack(head, full[head.size:])


@dataclass(frozen=True)
class PartialPack:
    """A param struct whose trailing fields are already packed (see :meth:`ParamStruct.partial`)."""

    head: struct.Struct
    tail: bytes

    def pack(self, *dynamic) -> bytes:
        """Full struct bytes for the leading field values ``dynamic``."""
        return self.head.pack(*dynamic) + self.tail


def _strides(prefix: str):
    return tuple((f"{prefix}_stride_{axis}", "i64") for axis in ("b", "s", "h"))


# Strides are in elements; the head dimension is always contiguous (stride 1).
ATTN_FWD_PARAMS = ParamStruct(
    "AttnFwdParams",
    (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "mut_ptr"), ("lse", "f32_ptr"))
    + _strides("q") + _strides("k") + _strides("v") + _strides("o")
    + (("batch", "i32"), ("heads_q", "i32"), ("heads_kv", "i32"), ("group", "i32"),
       ("seqlen_q", "i32"), ("seqlen_k", "i32"), ("head_dim", "i32"), ("causal", "i32"),
       ("scale_log2", "f32"), ("scale", "f32")),
)

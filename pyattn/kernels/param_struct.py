"""The parameter-struct type: a field list, its C++ declaration and its Python packer.

:class:`ParamStruct` turns an ordered ``(field, kind)`` list into both sides of a kernel's
``const __grid_constant__`` argument: the C++ declaration (with a ``static_assert`` of its size)
and the :mod:`struct` packing, so the two can never drift. :class:`NestedParamStruct` is the form
whose first member is another struct. The field lists themselves live in
:mod:`pyattn.kernels.params`, which imports these classes from here.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

import struct
from typing import NamedTuple

__all__ = ["ParamStruct", "PartialPack", "NestedParamStruct"]

# kind -> (struct code, C type). '@' native alignment matches the CUDA ABI on x86-64/aarch64.
_KINDS = {
    "ptr": ("Q", "const void*"),
    "mut_ptr": ("Q", "void*"),
    "f32_ptr": ("Q", "float*"),
    "f32_cptr": ("Q", "const float*"),
    "i32_cptr": ("Q", "const int*"),
    "i32_ptr": ("Q", "int*"),
    "u64_cptr": ("Q", "const unsigned long long*"),
    "i64": ("q", "long long"),
    "i32": ("i", "int"),
    "f32": ("f", "float"),
    "tmap": ("128s", "pyattn::TmaMap"),  # a TMA tensor map (CUtensorMap), 64-byte aligned
}
# Kinds whose alignment the native '@' packing does not know ('s' aligns to 1): padded explicitly.
_ALIGN = {"tmap": 64}


class ParamStruct:
    """A kernel parameter struct: an ordered tuple of ``(field, kind)`` (read-only).

    A plain class rather than a frozen dataclass, whose generated methods cost ~0.45 ms of a fresh
    process's first call at import (issue 16); its packing format is computed once, here.

    Parameters
    ----------
    name : str
        The C++ struct name (inside ``namespace pyattn``).
    fields : tuple of (str, str)
        Field names and kinds (``ptr``, ``mut_ptr``, ``f32_ptr``, ``f32_cptr``, ``i32_cptr``, ``i32_ptr``,
        ``u64_cptr``, ``i64``, ``i32``, ``f32``, ``tmap``: a 128-byte TMA tensor map, 64-byte
        aligned, packed from ``bytes``).
    """

    __slots__ = ("name", "fields", "format", "size")

    def __init__(self, name: str, fields: tuple):
        fmt = "@"
        for _, kind in fields:
            if kind in _ALIGN:  # pad to the member's alignment, as C++ alignas does
                fmt += f"{-struct.calcsize(fmt) % _ALIGN[kind]}x"
            fmt += _KINDS[kind][0]
        # Trailing padding: C rounds the struct up to its largest member's alignment.
        align = max(_ALIGN.get(kind) or struct.calcsize("@" + _KINDS[kind][0]) for _, kind in fields)
        for attr, value in (("name", name), ("fields", tuple(fields)), ("format", fmt),
                            ("size", -(-struct.calcsize(fmt) // align) * align)):
            object.__setattr__(self, attr, value)

    def __setattr__(self, attr, value):
        raise AttributeError(f"ParamStruct is read-only (cannot set {attr!r})")

    __delattr__ = __setattr__

    def __eq__(self, other):
        return type(other) is type(self) and (self.name, self.fields) == (other.name, other.fields)

    def __hash__(self):
        return hash((self.name, self.fields))

    def __repr__(self) -> str:
        return f"ParamStruct(name={self.name!r}, fields={self.fields!r})"

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


class PartialPack(NamedTuple):
    """A param struct whose trailing fields are already packed (see :meth:`ParamStruct.partial`)."""

    head: struct.Struct
    tail: bytes

    def pack(self, *dynamic) -> bytes:
        """Full struct bytes for the leading field values ``dynamic``."""
        return self.head.pack(*dynamic) + self.tail


class NestedParamStruct(ParamStruct):
    """A parameter struct whose first member is another one: ``struct name { Base member; own... }``.

    The kernels take the nested form so that everything written against the base struct (in
    :mod:`pyattn.kernels.params`, ``AttnFwdParams``: sequence geometry, the band, the score
    modifiers) reads ``p.member`` as it is. :attr:`fields` is the flat list (the base's, then
    ``own``'s): with the base's size a multiple of 8 and ``own`` starting with an 8-byte field, the
    flat native packing and the C++ nested layout coincide (the rendered unit ``static_assert``s
    both structs' sizes).

    Parameters
    ----------
    name : str
    fields : tuple
        Leave empty: derived from ``base`` and ``own``.
    base : ParamStruct
    own : ParamStruct
        The fields after the base member (its ``name`` is only a label).
    member : str
        The base member's name in C++.
    """

    __slots__ = ("base", "own", "member")

    def __init__(self, name: str, fields: tuple = (), *, base: ParamStruct = None, own: ParamStruct = None,
                 member: str = "fwd"):
        if base is None or own is None:
            raise TypeError("NestedParamStruct: base and own are required")
        first = own.fields[0][1]
        if base.size % 8 or (first not in _ALIGN and struct.calcsize("@" + _KINDS[first][0]) != 8):
            raise ValueError("NestedParamStruct: the base's size must be a multiple of 8 and own's first field "
                             "8 bytes wide or explicitly aligned (else the flat and nested layouts differ)")
        super().__init__(name, base.fields + own.fields)
        for attr, value in (("base", base), ("own", own), ("member", member)):
            object.__setattr__(self, attr, value)

    def __eq__(self, other):
        return type(other) is NestedParamStruct and (self.name, self.base, self.own, self.member) == (
            other.name, other.base, other.own, other.member)

    def __hash__(self):
        return hash((self.name, self.fields, self.member))

    def c_declaration(self) -> str:
        body = "\n".join(f"  {_KINDS[kind][1]} {name};" for name, kind in self.own.fields)
        # (No offsetof assert: NVRTC 13.0 rejects __builtin_offsetof. The base's size is asserted, and
        # an 8-byte first member after an 8-aligned base of that size can only start right after it.)
        return (self.base.c_declaration()
                + f"struct {self.name} {{\n  {self.base.name} {self.member};\n{body}\n}};\n"
                f'static_assert(sizeof({self.name}) == {self.size}, "{self.name}: layout differs from Python");\n')

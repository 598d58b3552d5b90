"""Every name a function reads exists (CPU): a NameError in a GPU-only path would otherwise surface
only on a GPU machine, as one did in the decode plan builder. ``symtable`` gives each scope's free
names; each must be a module-level binding (assignment, import, def/class) or a builtin."""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p for d in ("pyattn", "scripts", "examples", "dev") for p in (ROOT / d).rglob("*.py"))
_IMPLICIT = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__builtins__", "__loader__", "__package__"}


def _undefined(path: Path) -> list:
    top = symtable.symtable(path.read_text(), str(path), "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    bound |= set(dir(builtins)) | _IMPLICIT
    bad = []

    def walk(table):
        for s in table.get_symbols():
            if s.is_referenced() and s.is_global() and not s.is_assigned() and s.get_name() not in bound:
                bad.append(f"{table.get_name()} (line {table.get_lineno()}): {s.get_name()}")
        for child in table.get_children():
            walk(child)

    for child in top.get_children():
        walk(child)
    bad += [f"module level: {s.get_name()}" for s in top.get_symbols() if s.is_referenced() and s.get_name() not in bound]
    return bad


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_undefined_names(path):
    assert not _undefined(path)


def test_the_check_finds_an_undefined_name(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef g():\n    return os.sep + undefined_thing\n")
    assert _undefined(f) == ["g (line 3): undefined_thing"]

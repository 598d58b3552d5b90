"""The README, BENCHMARKS.md and LICENSE agree with the code they describe."""

from __future__ import annotations

import pathlib
import re

import pytest

import pyattn
from pyattn.__main__ import build_parser
from pyattn.runtime.device import ARCH_GPUS, SUPPORTED_ARCHS, arch_for_capability

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def test_one_version_number():
    version = pyattn.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", version), version
    assert f"Version {version}" in README
    assert f"Current version: {version}" in BENCHMARKS


def test_license_is_the_apache_2_text_pyproject_names():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (REPO / "pyproject.toml").read_text()


def test_pyproject_lists_every_package():
    """A non-editable install ships only the packages pyproject names: every folder of pyattn with an
    __init__.py must be among them (an editable install, as CI's, would not notice one missing)."""
    text = (REPO / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(pyattn(?:\.[a-z_]+)*)"', text[text.index("packages = ["):text.index("]", text.index("packages = ["))]))
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "pyattn").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


@pytest.mark.parametrize("command", [
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pyattn demo",
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -q",
])
def test_quick_start_commands_are_unchanged(command):
    assert f"```bash\n{command}\n```" in _section("Quick start")


def test_supported_gpu_table_matches_the_code():
    rows = re.findall(r"^\| `(sm_\w+)` \| (\d+)\.(\d+) \| ([^|]+) \|", _section("Supported GPUs and drivers"), re.M)
    assert tuple(r[0] for r in rows) == SUPPORTED_ARCHS
    for arch, major, minor, gpus in rows:
        assert arch_for_capability(int(major), int(minor)) == arch
        assert gpus.strip() == ARCH_GPUS[arch]
    with pytest.raises(pyattn.PyattnError) as info:
        arch_for_capability(12, 0)
    quoted = " ".join(_section("Supported GPUs and drivers").split())
    assert f"`pyattn.PyattnError: {info.value}`" in quoted, "the README quotes the real message"


def test_cli_section_runs_without_an_activated_venv():
    commands = re.findall(r"^\.venv/bin/python -m pyattn (\w+)", _section("Command line"), re.M)
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == set(subcommands)
    assert "BENCHMARKS.md](BENCHMARKS.md)" in README

"""Shared pytest setup: the ``gpu`` marker and kernel-cache directory fixtures.

Kept minimal on purpose; GPU-test fixtures may be added below.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

# Make the checkout importable however pytest is started (``pytest`` or ``python -m pytest``).
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA driver and GPU (skipped cleanly without one)")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty kernel cache directory for one test (``PYATTN_CACHE_DIR``)."""
    d = tmp_path / "kernel-cache"
    monkeypatch.setenv("PYATTN_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory):
    """One kernel cache directory shared by the whole session, so that compiling every variant
    (``test_compile``) is paid once and later users (``pyattn demo`` in ``test_cli``) hit the cache.

    Only the path is returned; users set ``PYATTN_CACHE_DIR`` themselves (in-process via
    ``monkeypatch`` or ``pytest.MonkeyPatch.context()``, or in a subprocess's environment).
    """
    return tmp_path_factory.mktemp("session-kernel-cache")

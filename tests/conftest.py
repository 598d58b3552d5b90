"""Shared pytest setup: the ``gpu`` marker and kernel-cache directory fixtures.

Kept minimal on purpose; GPU-test fixtures may be added below. ``fake_include`` serves the
header tests of test_compile_nvrtc.py and test_toolchain.py; ``blocked_driver`` the validation tests of
test_validation.py, test_validation_inputs.py and test_options.py. ``gpu``, ``full``, ``cache``
and ``full_decode`` (last in this file) serve the fake-driver repeat-call tests of
test_host_path_*.py and test_foreign_repeat.py; a module's own fixture of the same name overrides them.
"""

from __future__ import annotations

import contextlib
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
    (``test_compile_variants``) is paid once and later users (``pyattn demo`` in ``test_cli``) hit the cache.

    Only the path is returned; users set ``PYATTN_CACHE_DIR`` themselves (in-process via
    ``monkeypatch`` or ``pytest.MonkeyPatch.context()``, or in a subprocess's environment).
    """
    return tmp_path_factory.mktemp("session-kernel-cache")


@pytest.fixture
def fake_include(tmp_path, monkeypatch):
    """An empty ``PYATTN_CUDA_INCLUDE`` directory for one test; the header and toolchain lookups
    (cached per process) are cleared around it."""
    from pyattn import jit
    from pyattn.jit.headers import cuda_include_dir

    d = tmp_path / "include"
    d.mkdir()
    monkeypatch.setenv("PYATTN_CUDA_INCLUDE", str(d))
    cuda_include_dir.cache_clear()
    jit.toolchain_fingerprint.cache_clear()
    yield d
    monkeypatch.delenv("PYATTN_CUDA_INCLUDE")
    cuda_include_dir.cache_clear()
    jit.toolchain_fingerprint.cache_clear()


@pytest.fixture
def blocked_driver(monkeypatch):
    """Any driver initialisation raises a recognisable NoDeviceError, GPU or not (its message is
    ``_validation_helpers.BLOCKED``): a call that passes validation stops at the driver. Modules with
    a ``blocked_driver`` of their own use theirs."""
    import pyattn
    import pyattn.runtime.device as device_mod
    from _validation_helpers import BLOCKED

    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


@pytest.fixture
def deviceless_cache(monkeypatch):
    """Make ``pyattn.PagedKVCache`` constructible without a GPU: its pools become descriptions at a
    fake address that nothing touches (validation and bookkeeping tests)."""
    import types

    import pyattn
    import pyattn.paged.cache as cache_mod

    dev = types.SimpleNamespace(ordinal=0, arch="sm_90a", activate=lambda: None)

    def empty(shape, dtype, device=None):
        return pyattn.DeviceArray(0x200000, shape, dtype, dev, stream=types.SimpleNamespace(
            ptr=1, synchronize=lambda: None))

    monkeypatch.setattr(cache_mod, "get_device", lambda ordinal=None: dev)
    monkeypatch.setattr(cache_mod, "empty", empty)
    return pyattn.PagedKVCache


@pytest.fixture
def poison_allocations(monkeypatch):
    """Every pyattn allocation poisoned (``memory.POISON_ALLOC``: NaN bytes) for the test, so an output
    element no kernel writes fails its check. The GPU test modules use it through ``pytestmark``."""
    from pyattn.runtime import memory

    monkeypatch.setattr(memory, "POISON_ALLOC", True)


@contextlib.contextmanager
def _short_rows(**fields):
    """attn_fwd_tma's short rows on sm_90a with ``fields`` replaced, for a fixture's life."""
    from pyattn.kernels.families import override_tiles, tile_table

    rows = tuple(r._replace(**fields) for r in tile_table("attn_fwd_tma", "sm_90a", table="short"))
    with override_tiles("attn_fwd_tma", "sm_90a", rows, table="short"):
        yield


@pytest.fixture
def short_row_on_any_grid():
    """attn_fwd_tma's short rows without their small-grid switch (``small_grid_rate`` 0): for GPU
    tests that name the three-warpgroup short row and call it with few query tiles, which would
    otherwise run its one-warpgroup ``mods_row`` (``short_small_grid``)."""
    with _short_rows(small_grid_rate=0):
        yield


@pytest.fixture
def no_causal_short_row():
    """attn_fwd_tma's short rows serve causal calls below their max_keys only, as others (not up to
    max_keys_causal: d = 64's 8192 keys), so that a GPU test's causal calls run the dense-table row
    it checks."""
    with _short_rows(max_keys_causal=0):
        yield


@pytest.fixture
def launched(monkeypatch):
    """The entry names of the kernels a test launches, in launch order (``cuLaunchKernel`` and
    ``cuLaunchKernelEx`` wrapped, each function's name read back with ``cuFuncGetName``): GPU
    tests assert that the row they check is the one that ran. A spec selected beside the call,
    with other arguments than the call's, has twice named a row that never ran (the causal short
    row; the small-grid row). Request it after a fake driver's fixture, which replaces the
    driver's functions."""
    from cuda.bindings import driver

    names: list = []
    real, real_ex = driver.cuLaunchKernel, driver.cuLaunchKernelEx

    def name_of(fn):
        err, name = driver.cuFuncGetName(fn)
        names.append(name.decode() if err == driver.CUresult.CUDA_SUCCESS else f"<{err}>")

    def record(fn, *args):
        name_of(fn)
        return real(fn, *args)

    def record_ex(config, fn, *args):  # sm_90+ launches (programmatic dependents)
        name_of(fn)
        return real_ex(config, fn, *args)

    monkeypatch.setattr(driver, "cuLaunchKernel", record)
    monkeypatch.setattr(driver, "cuLaunchKernelEx", record_ex)
    return names


# -- the fake-driver repeat-call tests (test_host_path_*.py, test_foreign_repeat.py) ---------------------
@pytest.fixture
def gpu(monkeypatch):
    """The fake CUDA driver of ``fake_driver.py`` (with its torch stand-in) installed for the test."""
    import fake_driver

    with fake_driver.installed(monkeypatch, torch=True) as fake:
        yield fake


@pytest.fixture
def full(monkeypatch):
    """Counts the calls that took the full path (read into Args, signature, validation)."""
    from pyattn.ops import attention as op

    calls = []
    real = op._full

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(op, "_full", spy)
    return calls


@pytest.fixture
def cache(gpu):
    """A bfloat16 paged cache on the fake driver (64 pages of 16 slots, 2 KV heads of 64) and the ids
    of its two sequences of 256 tokens."""
    import ml_dtypes
    import numpy as np

    import pyattn

    c = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16")
    ids = [c.add_sequence() for _ in range(2)]
    kv = np.zeros((2, 256, 2, 64), ml_dtypes.bfloat16)
    c.append(ids, kv, kv)
    return c, ids


@pytest.fixture
def full_decode(monkeypatch):
    """Counts the decode calls that took the full path."""
    from pyattn.ops import decode as op

    return _spy_full(monkeypatch, op)


@pytest.fixture
def full_contig(monkeypatch):
    """Counts the contiguous_decode calls that took the full path."""
    from pyattn.ops import contiguous as op

    return _spy_full(monkeypatch, op)


def _spy_full(monkeypatch, op) -> list:
    """Wrap ``op._full`` (an op module's full path): each call's positional arguments go to the list."""
    calls = []
    real = op._full
    monkeypatch.setattr(op, "_full", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls

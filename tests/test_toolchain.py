"""The cache key's toolchain part (``pyattn.jit.toolchain``): NVRTC named by the file cuda.bindings
uses, found the way cuda.pathfinder finds it but without loading it; headers named by their files;
and a compile under a toolchain other than the key's is never stored."""

from __future__ import annotations

import logging
import os
import site
import subprocess
import sys
import textwrap

import pytest

import pyattn.jit as jit
from pyattn.jit import toolchain
from pyattn.jit.headers import nvrtc_version
from pyattn.kernels.specs import KernelSpec

SPEC = KernelSpec("attn_fwd_simt", "f32", 64, "sm_80")


def _lib(root, *parts, soname="libnvrtc.so.13", data=b"fake nvrtc"):
    d = root.joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    (d / soname).write_bytes(data)
    return str(d / soname)


@pytest.fixture
def sites(tmp_path, monkeypatch):
    """Two empty site-packages directories standing for the process's, NVRTC not loaded."""
    dirs = [tmp_path / "site-a", tmp_path / "site-b"]
    for d in dirs:
        d.mkdir()
    monkeypatch.setattr(toolchain, "_site_packages", lambda: [str(d) for d in dirs])
    monkeypatch.setattr(toolchain, "_nvrtc_already_loaded", lambda: False)
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    return dirs


def test_nvrtc_search_order_is_pathfinders(sites, tmp_path, monkeypatch):
    a, b = sites
    late = _lib(b, "nvidia", "cu13", "lib")
    assert toolchain.nvrtc_path() == late
    # the wheel directory comes first, then the site-packages order, then the soname order
    cu12_name = _lib(a, "nvidia", "cuda_nvrtc", "lib")
    assert toolchain.nvrtc_path() == late
    first = _lib(a, "nvidia", "cu13", "lib", soname="libnvrtc.so.12")
    assert toolchain.nvrtc_path() == first
    assert _lib(a, "nvidia", "cu13", "lib") == toolchain.nvrtc_path()
    assert cu12_name != toolchain.nvrtc_path()
    # conda only when no wheel has it
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path / "conda"))
    conda = _lib(tmp_path / "conda", "lib")
    assert toolchain.nvrtc_path() != conda
    monkeypatch.setattr(toolchain, "_site_packages", lambda: [])
    assert toolchain.nvrtc_path() == conda


def test_search_matches_cuda_pathfinder(tmp_path, monkeypatch):
    """Our mirror of pathfinder's file search against pathfinder's own (private functions of
    cuda-pathfinder: skipped when they move; the compile-time check still guards then)."""
    try:
        from cuda.pathfinder._dynamic_libs.lib_descriptor import LIB_DESCRIPTORS
        from cuda.pathfinder._dynamic_libs.search_steps import EARLY_FIND_STEPS, SearchContext, run_find_steps
    except ImportError:
        pytest.skip("cuda.pathfinder's search steps moved")
    monkeypatch.setattr(site, "ENABLE_USER_SITE", False)
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    cu13, cu12 = ("nvidia", "cu13", "lib"), ("nvidia", "cuda_nvrtc", "lib")
    layouts = [[("b", cu13, "libnvrtc.so.13")],
               [("b", cu13, "libnvrtc.so.13"), ("a", cu12, "libnvrtc.so.13")],
               [("a", cu13, "libnvrtc.so.12"), ("b", cu13, "libnvrtc.so.13")],
               [("a", cu13, "libnvrtc.so.12"), ("a", cu13, "libnvrtc.so.13")]]
    for i, layout in enumerate(layouts):  # new directories each time: pathfinder caches its listings
        a, b = tmp_path / f"{i}a", tmp_path / f"{i}b"
        a.mkdir(), b.mkdir()
        monkeypatch.setattr(site, "getsitepackages", lambda a=a, b=b: [str(a), str(b)])
        for root, parts, soname in layout:
            _lib({"a": a, "b": b}[root], *parts, soname=soname)
        found = run_find_steps(SearchContext(LIB_DESCRIPTORS["nvrtc"]), EARLY_FIND_STEPS)
        assert found is not None and os.path.samefile(found.abs_path, toolchain._nvrtc_on_disk()), layout


def test_a_loaded_nvrtc_wins_over_the_files(sites, monkeypatch):
    _lib(sites[0], "nvidia", "cu13", "lib")
    monkeypatch.setattr(toolchain, "_nvrtc_already_loaded", lambda: True)
    monkeypatch.setattr(toolchain, "loaded_nvrtc_path", lambda: "/elsewhere/libnvrtc.so.13")
    assert toolchain.nvrtc_path() == "/elsewhere/libnvrtc.so.13"


def test_a_replaced_nvrtc_changes_the_key(sites):
    path = _lib(sites[0], "nvidia", "cu13", "lib")
    before = toolchain.fingerprint()
    os.replace(_lib(sites[1], "new", soname="x", data=b"fake nvrtc"), path)  # same size, a reinstall
    after = toolchain.fingerprint()
    assert before != after and before.split(";")[1:] == after.split(";")[1:]
    assert SPEC.cache_key(before) != SPEC.cache_key(after)


@pytest.fixture
def include(fake_include):
    """``fake_include`` (conftest) holding headers of the real NVRTC's version."""
    major, minor = nvrtc_version()
    (fake_include / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {major * 1000 + minor * 10}\n")
    for name in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h"):
        (fake_include / name).write_text("// v1\n")
    return fake_include


def test_headers_replaced_with_the_same_version_change_the_key(include):
    before = toolchain.fingerprint()
    tmp = include / "new.hpp"
    tmp.write_text("// v2\n")  # same size and CUDART_VERSION: another build of one release
    os.replace(tmp, include / "cuda_fp16.hpp")
    assert toolchain.fingerprint() != before
    before = toolchain.fingerprint()
    (include / "cuda_fp8.h").write_text("")  # a header the kernels include appears
    assert toolchain.fingerprint() != before


def test_check_unchanged_passes_for_this_process():
    toolchain.check_unchanged(jit.toolchain_fingerprint())


def test_a_compile_under_another_toolchain_is_not_stored(cache_dir, monkeypatch, caplog):
    real = jit.toolchain_fingerprint()
    named = real.replace(real.split(";")[0], "nvrtc=1:2:3:4")  # an NVRTC this process does not use
    monkeypatch.setattr(jit, "toolchain_fingerprint", lambda: named)
    with caplog.at_level(logging.WARNING, logger="pyattn.jit"):
        image, meta, compiled = jit.build(SPEC)
    assert compiled and image[:4] == b"\x7fELF" and meta["entry"] == SPEC.entry_name
    assert jit.get_cache().entries() == []  # nothing filed under the wrong toolchain
    assert "without caching it" in caplog.text and "NVRTC loaded from" in caplog.text
    monkeypatch.setattr(jit, "toolchain_fingerprint", lambda: real)
    assert jit.build(SPEC)[2] and [e.key for e in jit.get_cache().entries()] == [SPEC.cache_key(real)]
    assert not jit.build(SPEC)[2]


WARM = textwrap.dedent(r"""
    import sys
    import numpy, pyattn
    from pyattn import jit
    from pyattn.jit import toolchain
    from pyattn.kernels.specs import KernelSpec
    image, meta, compiled = jit.build(KernelSpec("attn_fwd_simt", "f32", 64, "sm_80"))
    with open("/proc/self/maps") as f:
        loaded = "libnvrtc" in f.read()
    print(compiled, loaded, toolchain._nvrtc_on_disk() is not None,
          any(m in sys.modules for m in ("pyattn.jit.nvrtc", "cuda.bindings.nvrtc")))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_a_warm_start_loads_no_nvrtc(tmp_path):
    env = dict(os.environ, PYATTN_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", WARM], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(p.returncode == 0 for p in runs), [p.stderr[-2000:] for p in runs]
    cold, warm = (p.stdout.split() for p in runs)
    assert cold[:2] == ["True", "True"]  # compiled, with NVRTC
    if warm[2] != "True":
        pytest.skip("NVRTC is not in a wheel or conda here: the key needs the dynamic loader to find it")
    assert warm == ["False", "False", "True", "False"], "a warm start loaded NVRTC or its bindings"

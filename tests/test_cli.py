"""``python -m pyattn`` as a user runs it: subprocesses, no GPU, a private kernel cache."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from pyattn.jit.cache import KernelCache
from pyattn.jit.headers import nvrtc_version
from pyattn.kernels.specs import warmup_specs
from pyattn.runtime.device import device_count

REPO = pathlib.Path(__file__).resolve().parents[1]
ALL_ARCHS = "sm_80, sm_86, sm_89, sm_90a, sm_100a"

needs_no_gpu = pytest.mark.skipif(device_count() > 0, reason="checks the no-GPU behaviour")


def run_cli(*args, cache, timeout=300, extra_env=None):
    env = dict(os.environ)
    env.update(extra_env or {})
    env["PYATTN_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("PYATTN_PTX", None)
    return subprocess.run([sys.executable, "-m", "pyattn", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _cache_count(text):
    m = re.search(r"^cache: (.+) \((\d+) kernels, [\d.]+ MiB\)$", text, re.M)
    assert m, text
    return m.group(1), int(m.group(2))


@needs_no_gpu
def test_demo_without_gpu_compiles_every_arch(session_cache_dir):
    """Shares the session cache with test_compile: whichever runs first pays for the 222 compiles."""
    r = run_cli("demo", "--quiet", cache=session_cache_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "fp64 NumPy reference:" in out
    assert "no GPU: CUDA_ERROR_NO_DEVICE" in out
    assert f"pyattn warmup: 222 kernels for {ALL_ARCHS} into {session_cache_dir}" in out
    m = re.search(r"^done in [\d.]+ s: (\d+) compiled \(slowest [\d.]+ s\), (\d+) already cached$", out, re.M)
    assert m, out
    assert int(m.group(1)) + int(m.group(2)) == 222
    assert "[#" not in out  # --quiet: no progress bar
    assert len(KernelCache(session_cache_dir).entries()) == 222


@needs_no_gpu
def test_info_without_gpu(cache_dir):
    r = run_cli("info", cache=cache_dir)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^pyattn \S+, numpy \S+, python 3\.\d+", out, re.M)
    assert re.search(r"^GPU: none \(.*CUDA_ERROR_NO_DEVICE", out, re.M)
    major, minor = nvrtc_version()
    assert re.search(rf"^NVRTC: {major}\.{minor}$", out, re.M)
    assert re.search(rf"^CUDA headers: {major}\.\d+ at \S+", out, re.M)
    assert _cache_count(out) == (str(cache_dir), 0)


def test_warmup_info_cache_clear_cycle(cache_dir):
    n = len(warmup_specs("sm_90a"))
    assert n == 38  # 24 attention variants + 14 paged-cache kernels

    r = run_cli("warmup", "--arch", "sm_90a", "--quiet", cache=cache_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"pyattn warmup: {n} kernels for sm_90a into {cache_dir}" in r.stdout
    assert re.search(rf"^done in [\d.]+ s: {n} compiled \(slowest [\d.]+ s\), 0 already cached$", r.stdout, re.M)
    assert "[#" not in r.stdout

    info = run_cli("info", cache=cache_dir)
    assert info.returncode == 0
    assert _cache_count(info.stdout) == (str(cache_dir), n)
    assert len(KernelCache(cache_dir).entries()) == n

    # again, with the progress bar: everything comes from the cache
    again = run_cli("warmup", "--arch", "sm_90a", cache=cache_dir)
    assert again.returncode == 0
    assert re.search(rf"^done in [\d.]+ s: 0 compiled \(slowest 0\.00 s\), {n} already cached$", again.stdout, re.M)
    assert f"] {n}/{n} cached" in again.stdout

    clear = run_cli("cache", "clear", cache=cache_dir)
    assert clear.returncode == 0
    assert clear.stdout.strip() == f"removed {n} cached kernels from {cache_dir}"
    assert KernelCache(cache_dir).entries() == []
    assert _cache_count(run_cli("info", cache=cache_dir).stdout) == (str(cache_dir), 0)

    clear = run_cli("cache", "clear", cache=cache_dir)
    assert clear.stdout.strip() == f"removed 0 cached kernels from {cache_dir}"


@pytest.mark.parametrize("archs", [["sm_75"], ["sm_90a", "sm_90"], ["sm_120"]])
def test_warmup_unsupported_arch_fails_with_usage_error(cache_dir, archs):
    r = run_cli("warmup", "--arch", *archs, cache=cache_dir)
    assert r.returncode == 2
    assert "--arch: unsupported" in r.stderr and repr(archs[-1]) in r.stderr
    assert "sm_90a" in r.stderr  # lists the supported archs
    assert not cache_dir.exists() or KernelCache(cache_dir).entries() == []  # nothing was built


@needs_no_gpu
def test_warmup_without_arch_and_without_gpu_asks_for_arch(cache_dir):
    r = run_cli("warmup", cache=cache_dir)
    assert r.returncode == 2
    assert "no usable GPU" in r.stderr and "--arch" in r.stderr


@pytest.mark.parametrize("args", [[], ["cache"], ["cache", "purge"], ["frobnicate"]])
def test_bad_command_lines_exit_2(cache_dir, args):
    r = run_cli(*args, cache=cache_dir)
    assert r.returncode == 2
    assert "usage: python -m pyattn" in r.stderr


@pytest.fixture
def misfit_headers(tmp_path):
    """PYATTN_CUDA_INCLUDE pointing at headers far newer than any NVRTC 13.x."""
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 99000\n")
    (inc / "cuda_fp16.h").write_text("")
    return {"PYATTN_CUDA_INCLUDE": str(inc)}


def test_warmup_refuses_headers_that_do_not_fit_nvrtc(cache_dir, misfit_headers):
    r = run_cli("warmup", "--arch", "sm_80", "--quiet", cache=cache_dir, extra_env=misfit_headers)
    assert r.returncode != 0
    assert "CUDA headers 99.0" in r.stderr and "do not fit NVRTC" in r.stderr
    assert not cache_dir.exists() or KernelCache(cache_dir).entries() == []


def test_info_reports_headers_that_do_not_fit_nvrtc(cache_dir, misfit_headers):
    info = run_cli("info", cache=cache_dir, extra_env=misfit_headers)
    assert info.returncode == 0  # info keeps going: it is the diagnosis tool
    assert re.search(r"^CUDA headers: PROBLEM: .*do not fit NVRTC", info.stdout, re.M), info.stdout

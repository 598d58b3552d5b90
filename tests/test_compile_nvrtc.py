"""NVRTC outside the warm-up set (CPU only, no GPU): a build then a cache hit in a fresh cache
directory, the PTX fallback, compile errors (log, numbered source, a broken kernel header, a
virtual arch without the PTX flag), the toolchain fingerprint, and header discovery with its
version check against NVRTC (``PYATTN_CUDA_INCLUDE`` overrides)."""

from __future__ import annotations

import io
import logging
import os
import re

import pytest

import pyattn.jit as jit
from pyattn import CompileError, PyattnError
from pyattn.jit.headers import cuda_include_dir, header_version, nvrtc_version
from pyattn.jit.nvrtc import compile_source
from pyattn.jit.source import kernel_headers, render, sources_digest
from pyattn.kernels.specs import KernelSpec


def test_build_then_cache_hit_in_a_fresh_dir(cache_dir):
    specs = [KernelSpec("attn_fwd_simt", "f16", 64, "sm_89"), KernelSpec("attn_fwd_simt", "bf16", 256, "sm_100a")]
    first = [jit.build(s) for s in specs]
    assert [b for *_, b in first] == [True, True]
    assert jit.get_cache().directory == cache_dir
    assert len(jit.get_cache().entries()) == 2
    second = [jit.build(s) for s in specs]
    assert [b for *_, b in second] == [False, False]
    assert [img for img, *_ in second] == [img for img, *_ in first]
    progress = []
    res = jit.build_many(specs, progress=lambda done, total, spec, b: progress.append((done, total, spec, b)))
    assert [b for *_, b in res] == [False, False]
    assert progress == [(1, 2, specs[0], False), (2, 2, specs[1], False)]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_ptx_spec_yields_nul_terminated_ptx(arch, cache_dir, caplog):
    spec = KernelSpec("attn_fwd_simt", "f16", 64, arch, ptx=True)
    with caplog.at_level(logging.WARNING, logger="pyattn.jit"):
        image, meta, was_built = jit.build(spec)
    assert was_built and meta["format"] == "ptx"
    assert image.endswith(b"\0") and image.count(b"\0") == 1
    text = image[:-1].decode()
    assert re.search(rf"^\.target {arch}$", text, re.M), text[:400]
    assert re.search(r"^\.version \d+\.\d+$", text, re.M)
    assert re.search(rf"\.visible \.entry {spec.entry_name}\(", text)
    assert any("emitting PTX" in r.getMessage() for r in caplog.records)  # PTX is a warned fallback
    assert spec.cache_key(jit.toolchain_fingerprint()) != KernelSpec("attn_fwd_simt", "f16", 64, arch).cache_key(
        jit.toolchain_fingerprint())


BROKEN = """// a deliberately broken kernel
extern "C" __global__ void broken_kernel(int* out) {
  out[0] = undefined_symbol;
}
"""


def test_compile_error_carries_log_and_numbered_source():
    with pytest.raises(CompileError) as info:
        compile_source(BROKEN, (), ("-arch=sm_90a", "-std=c++17"), name="broken")
    e = info.value
    assert e.name == "NVRTC_ERROR_COMPILATION"
    assert re.search(r"broken\.cu\(3\): error: .*undefined_symbol", e.log), e.log
    assert e.source == BROKEN and e.options == ("-arch=sm_90a", "-std=c++17") and e.kernel == "broken"
    numbered = e.numbered_source().splitlines()
    assert numbered[0] == "1 | // a deliberately broken kernel"
    assert numbered[2] == "3 |   out[0] = undefined_symbol;"
    assert len(numbered) == len(BROKEN.splitlines())
    assert "NVRTC_ERROR_COMPILATION while compiling broken" in str(e) and "undefined_symbol" in str(e)
    buf = io.StringIO()
    e.dump(buf)
    dumped = buf.getvalue()
    assert "options: -arch=sm_90a -std=c++17" in dumped and "3 |   out[0] = undefined_symbol;" in dumped
    assert isinstance(e, PyattnError)


def test_compile_error_in_a_kernel_header_names_the_header():
    spec = KernelSpec("attn_fwd_simt", "f32", 32, "sm_80")
    inc, _ = cuda_include_dir()
    headers = [(n, t + "\n#error deliberately broken header\n" if n == spec.header else t)
               for n, t in kernel_headers()]
    with pytest.raises(CompileError) as info:
        compile_source(render(spec), headers, spec.compile_options((str(inc),)), name=spec.describe())
    assert re.search(rf"{re.escape(spec.header)}\(\d+\): .*error.*deliberately broken header", info.value.log)


def test_virtual_arch_without_ptx_flag_is_refused():
    with pytest.raises(CompileError) as info:
        compile_source('extern "C" __global__ void k() {}', (), ("-arch=compute_90a",), name="virt")
    assert info.value.name == "NO_CUBIN"


def test_toolchain_fingerprint_names_its_inputs():
    from cuda.bindings import nvrtc
    from cuda.pathfinder import load_nvidia_dynamic_lib

    err, major, minor = nvrtc.nvrtcVersion()  # loads NVRTC the way a compile does
    assert int(err) == 0
    assert nvrtc_version() == (major, minor)
    fp = jit.toolchain_fingerprint()
    inc, hv = cuda_include_dir()
    # NVRTC is named by the library file cuda.bindings loaded (size and mtime: not device and inode,
    # which differ where an image's files are mounted), found without loading it; the headers by
    # directory, version and files.
    st = os.stat(load_nvidia_dynamic_lib("nvrtc").abs_path)
    assert fp.startswith(f"nvrtc={st.st_size}:{st.st_mtime_ns};")
    fp16 = os.stat(inc / "cuda_fp16.h")
    assert f";headers={hv[0]}.{hv[1]}@{inc}|{fp16.st_size}:{fp16.st_mtime_ns}," in fp
    assert f";src={sources_digest()};" in fp
    assert fp.endswith(f"pyattn={jit.__version__}")
    assert hv[0] == major and hv <= (major, minor)  # the installed headers fit this NVRTC


# --------------------------------------------------------------------------------------------
# Header discovery / version check
# --------------------------------------------------------------------------------------------
def _write_headers(d, cudart_version, fp16=True):
    (d / "cuda_runtime_api.h").write_text(f"#pragma once\n#define CUDART_VERSION {cudart_version}\n")
    if fp16:
        (d / "cuda_fp16.h").write_text("")


@pytest.mark.parametrize("which", ["newer major", "older major", "newer minor"])
def test_headers_that_do_not_fit_nvrtc_are_refused_before_compiling(fake_include, cache_dir, which):
    major, minor = nvrtc_version()
    version = {"newer major": 99000, "older major": (major - 1) * 1000,
               "newer minor": major * 1000 + (minor + 1) * 10}[which]
    _write_headers(fake_include, version)
    spec = KernelSpec("attn_fwd_simt", "f16", 64, "sm_90a")
    for attempt in (lambda: jit.compile_spec(spec), lambda: jit.build(spec)):
        with pytest.raises(PyattnError, match=r"CUDA headers \d+\.\d+ in .* do not fit NVRTC") as info:
            attempt()
        assert str(fake_include) in str(info.value)
        assert f"nvidia-cuda-runtime=={major}.{minor}.*" in str(info.value)  # the fix, spelled out
    assert not cache_dir.exists() or jit.get_cache().entries() == []


def test_fitting_override_headers_are_used(fake_include):
    major, _ = nvrtc_version()
    _write_headers(fake_include, major * 1000)  # same major, minor 0: older is fine
    assert cuda_include_dir() == (fake_include, (major, 0))
    assert f"headers={major}.0@{fake_include}|" in jit.toolchain_fingerprint()


def test_override_without_cuda_fp16_is_refused(fake_include):
    major, minor = nvrtc_version()
    _write_headers(fake_include, major * 1000 + minor * 10, fp16=False)
    with pytest.raises(PyattnError, match=r"has no cuda_fp16\.h"):
        cuda_include_dir()


def test_override_without_cudart_version_is_refused(fake_include):
    (fake_include / "cuda_runtime_api.h").write_text("/* no version here */\n")
    (fake_include / "cuda_fp16.h").write_text("")
    with pytest.raises(PyattnError, match=r"cannot read CUDART_VERSION"):
        cuda_include_dir()


def test_header_version_parses_cudart_version(tmp_path):
    (tmp_path / "cuda_runtime_api.h").write_text("#define  CUDART_VERSION   12080\n")
    assert header_version(tmp_path) == (12, 8)


def test_include_dir_cache_is_restored_after_override_tests():
    """Runs after the override tests in file order: the real headers are found again."""
    inc, hv = cuda_include_dir()
    assert (inc / "cuda_fp16.h").is_file() and (inc / "cuda_bf16.h").is_file()
    assert hv[0] == nvrtc_version()[0]

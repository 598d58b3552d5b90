"""The JIT side of a warm start stays light: a cache hit imports no logging, json or hashlib (its
metadata is parsed only when looked at; keys and checksums are BLAKE2b), the first call on device
arrays imports neither the NumPy path nor the compiler, and the header version is read from the
head of cuda_runtime_api.h (falling back to the whole file)."""

from __future__ import annotations

import os
import subprocess
import textwrap
import sys

from pyattn.jit.headers import header_version

CHILD = r"""
import sys
import pyattn
before = "logging" in sys.modules
from pyattn import jit
from pyattn.kernels.specs import KernelSpec
image, meta, compiled = jit.build(KernelSpec("attn_fwd_simt", "f32", 64, "sm_80"))
print(compiled, not before and "logging" in sys.modules, "json" in sys.modules, "hashlib" in sys.modules)
"""


def test_a_cache_hit_imports_no_logging(tmp_path):
    env = dict(os.environ, PYATTN_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]  # the first compiles (and logs that), the second hits the cache
    assert all(p.returncode == 0 for p in runs), [p.stderr for p in runs]
    assert runs[0].stdout.split()[0] == "True"
    assert runs[1].stdout.split() == ["False"] * 4, "a warm start imported logging, json or hashlib"


# What a first call on device arrays with a warm cache never needs: the NumPy path (its worker
# threads bring concurrent.futures and logging) and everything that compiles. Each was ~0.3-4 ms of
# the 15 ms start-up budget.
_NOT_ON_THE_WARM_DEVICE_PATH = ("pyattn.pipeline.chunks", "pyattn.pipeline.host", "pyattn.pipeline.transfer",
                                "concurrent.futures", "logging", "json", "hashlib", "pyattn.kernels.families.decode",
                                "pyattn.kernels.families.mma", "pyattn.jit.nvrtc", "pyattn.jit._keylock", "pyattn.jit._litter",
                                "cuda.bindings.nvrtc")


def test_the_first_device_call_imports_no_numpy_path_and_no_compiler():
    code = ("import sys, numpy, pyattn\npyattn.asarray, pyattn.attention\nfrom pyattn import jit\n"
            "import pyattn.kernels.registry\n"
            f"print(sorted(m for m in {_NOT_ON_THE_WARM_DEVICE_PATH!r} if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_header_version_past_the_first_64_kib(tmp_path):
    (tmp_path / "cuda_runtime_api.h").write_text("/* filler */\n" * 6000 + "#define CUDART_VERSION 13020\n")
    assert (tmp_path / "cuda_runtime_api.h").stat().st_size > 1 << 16
    assert header_version(tmp_path) == (13, 2)
    # a define straddling the 64 KiB boundary is found too
    text = "x" * ((1 << 16) - 20) + "\n#define CUDART_VERSION 12080\n"
    (tmp_path / "cuda_runtime_api.h").write_text(text)
    assert header_version(tmp_path) == (12, 8)


def test_a_compile_leaves_the_interpreters_shared_bytes_alone():
    # An empty NVRTC log is 1 byte; a buffer made as b" " * 1 is CPython's shared b" ", and NVRTC's
    # NUL written there turned every later space printed through a pipe into "\0".
    code = ('from pyattn.jit.nvrtc import compile_source\n'
            'image, log = compile_source(\'extern "C" __global__ void k() {}\', (), ("-arch=sm_80",), name="k")\n'
            'assert image[:4] == b"\\x7fELF" and isinstance(image, bytes) and log == "", (image[:4], log)\n'
            'print("a", "b", b" ".strip() == b"")\n')
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "a b True\n", repr(p.stdout)


def test_a_compile_leaves_locale_and_text_handling_as_they_were():
    """The 'import torch after a compile' failure (torch's schema parser saw ``annotate(strtag)``
    without its spaces) came from the shared ``b" "`` above, not from NVRTC's locale handling: a
    compile, with a failing one too, leaves the process and thread locale, and the encoding of
    strings with spaces, as they were."""
    code = textwrap.dedent('''
        import locale
        from pyattn import CompileError
        from pyattn.jit.nvrtc import compile_source
        before = (locale.setlocale(locale.LC_ALL), locale.getlocale(), locale.localeconv()["decimal_point"])
        compile_source('extern "C" __global__ void k(float* x) { x[0] = 1.5f; }', (), ("-arch=sm_90a",), name="k")
        try:
            compile_source("garbage", (), ("-arch=sm_80",), name="bad")
        except CompileError as e:
            assert "error" in e.log
        after = (locale.setlocale(locale.LC_ALL), locale.getlocale(), locale.localeconv()["decimal_point"])
        assert before == after, (before, after)
        s = "aten::annotate(str type, Any(a) item) -> Any(a)"
        assert s.encode() == bytes(s, "ascii") and b" " in s.encode() and float("1.5") == 1.5
        print("ok")
    ''')
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr[-2000:]

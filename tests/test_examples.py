"""``examples/`` as a user without a GPU (or without the example's libraries) runs them.

Each example compiles; run with no visible GPU, or with the libraries it needs made unimportable,
it prints ``skipped: <why>`` and exits 0, fast, before compiling any kernel (its private kernel
cache directory is never created). The examples themselves check pyattn on a GPU machine.
"""

from __future__ import annotations

import os
import pathlib
import py_compile
import subprocess
import re
import sys

import pytest

import pyattn

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# example -> the optional libraries it needs beyond pyattn and its dependencies
NEEDS = {"numpy_attention.py": (), "cupy_attention.py": ("cupy",), "hf_llama.py": ("torch", "transformers"),
         "train_tiny.py": ("torch",), "fp8_prefill.py": ("torch",), "serving_loop.py": ("torch",),
         "engine_pools.py": ("torch",)}
# Runs the example with the named modules made unimportable (``None`` in sys.modules: an import
# raises ImportError and importlib.util.find_spec returns None), as on a machine without them.
_BLOCKED_RUN = ("import runpy, sys\n"
                "for name in sys.argv[2].split(','):\n"
                "    sys.modules[name] = None\n"
                "sys.argv = sys.argv[1:2]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _run(args, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYATTN_CACHE_DIR=str(tmp_path / "kernel-cache"),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("skipped: "), proc.stdout
    assert not (tmp_path / "kernel-cache").exists(), "an example compiled or cached something before skipping"
    return lines[0]


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(NEEDS)


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_example_compiles_and_documents_itself(name, tmp_path):
    path = EXAMPLES / name
    py_compile.compile(str(path), cfile=str(tmp_path / "example.pyc"), doraise=True)
    text = path.read_text()
    assert text.startswith('"""') and f"python examples/{name}" in text  # what it shows, how to run it
    assert len(text.splitlines()) <= 140
    used = set(re.findall(r"\bpyattn\.(\w+)", text))  # pyattn.<name>, from pyattn.<name> import ...
    for names in re.findall(r"^\s*from pyattn import ([\w, ]+)", text, re.M):
        used |= {n.strip() for n in names.split(",")}
    assert used <= set(pyattn.__all__), f"{name} uses names outside pyattn's public API: {used - set(pyattn.__all__)}"


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_example_without_gpu_skips(name, tmp_path):
    line = _run([str(EXAMPLES / name)], tmp_path)
    # Whichever comes first on this machine: a missing library, or no GPU.
    assert "no CUDA GPU" in line or "not installed" in line, line


@pytest.mark.parametrize("name", [n for n, libs in sorted(NEEDS.items()) if libs])
def test_example_without_its_libraries_skips(name, tmp_path):
    libs = NEEDS[name]
    line = _run(["-c", _BLOCKED_RUN, str(EXAMPLES / name), ",".join(libs)], tmp_path)
    assert "not installed" in line and all(lib in line for lib in libs), line


def test_numpy_example_imports_no_torch_or_cupy():
    text = (EXAMPLES / "numpy_attention.py").read_text()
    assert "import torch" not in text and "import cupy" not in text

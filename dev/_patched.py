"""Not a tool: what the timeline probes (``probe_decode_timeline``, ``probe_prefill_timeline``) share:
run a probe's child process on a temporary copy of ``pyattn/`` and ``kernels_src/`` that
``patch(dst)`` edited (clock stamps in the kernels), with a kernel cache of its own, and print
its output (its stderr's tail when it failed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_patched(script: str, patch, child_args: list) -> int:
    """``python script --child *child_args`` on the patched copy; returns its exit status."""
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp)
        shutil.copytree(ROOT / "pyattn", dst / "pyattn", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(ROOT / "kernels_src", dst / "kernels_src")
        patch(dst)
        env = dict(os.environ, PYTHONPATH=str(dst), PYATTN_CACHE_DIR=str(dst / "cache"), PYTHONUNBUFFERED="1")
        run = subprocess.run([sys.executable, script, "--child", *child_args], env=env, capture_output=True,
                             text=True, cwd=ROOT)
        print(run.stdout, run.stderr[-3000:] if run.returncode else "", end="")
        return run.returncode

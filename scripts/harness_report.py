"""The harness's environment and output half: what every benchmark prints and saves.

Split out of ``harness.py`` to keep each file short; ``harness`` imports every name here back, so
scripts keep calling ``harness.fmt``, ``harness.environment`` and the rest (``from harness import
fmt`` too). Nothing here touches the GPU at import; :func:`environment` reads the driver only when
given a :class:`harness.Bench`.

- :func:`environment` and :func:`env_line`: GPU, driver and package versions (the JSON's
  ``environment`` and the first line printed).
- :func:`save_json`, :func:`attempt` (a failure noted in the row, the run goes on), :func:`fmt`,
  :func:`md_table`, :func:`unheld_note`, :func:`end_run` and :func:`print_targets`.
- ``_cu``, the cuda.bindings result check that :func:`environment` and ``harness.Bench`` share.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import time
import traceback
from typing import TYPE_CHECKING

import numpy as np

import pyattn

if TYPE_CHECKING:  # annotations only: importing harness here at run time would be circular
    from harness import Bench

_VERSIONS = ("cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "ml_dtypes", "torch",
             "triton", "cupy-cuda13x", "matplotlib")


# Here rather than in harness (which imports it back for Bench): environment() needs it, and this
# module must not import harness at run time (harness imports this one while it loads).
def _cu(result):
    """The value of a cuda.bindings call, or RuntimeError naming the error."""
    from cuda.bindings import driver

    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA error {err.name}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def environment(bench: Bench | None = None) -> dict:
    """GPU, driver and package versions, for the JSON and the first line printed."""
    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
           "pyattn": pyattn.__version__, "numpy": np.__version__,
           "versions": {n: v for n in _VERSIONS if (v := version(n))}}
    if bench is not None:
        from cuda.bindings import driver

        dev, v = bench.device, _cu(driver.cuDriverGetVersion())
        env.update(gpu=dev.name, arch=dev.arch, sm_count=dev.sm_count, l2_bytes=bench.l2,
                   cuda_driver_api=f"{v // 1000}.{v % 1000 // 10}", preroll=bench.preroll_kind)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.split()
            env["driver"] = smi[dev.ordinal] if len(smi) > dev.ordinal else None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def env_line(env: dict) -> str:
    where = (f"{env['gpu']} ({env['arch']}, {env['sm_count']} SMs), driver {env.get('driver')} / CUDA "
             f"{env['cuda_driver_api']}; ") if "gpu" in env else ""
    pkgs = [f"Python {env['python']}", f"pyattn {env['pyattn']}", f"numpy {env['numpy']}"]
    pkgs += [f"{k} {v}" for k, v in env["versions"].items()]
    return f"{where}{', '.join(pkgs)}; {env['date']}"


def save_json(path: str | None, result: dict) -> None:
    """Write ``result`` to ``path`` (no-op for None) atomically: a reader never sees half a file."""
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"could not write {path}: {exc}")


def attempt(row: dict, what: str, fn):
    """``fn()``, or None with the error noted in ``row["errors"]`` and printed: the run goes on."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        msg = f"{what}: {type(exc).__name__}: {str(exc)[:300]}"
        row.setdefault("errors", []).append(msg)
        print(f"    FAILED {msg}", flush=True)
        traceback.print_exc(limit=6)
        return None


def fmt(x, spec: str) -> str:
    """``format(x, spec)`` for a real number, "n/a" for anything else (None, NaN, an error)."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
    return format(x, spec) if ok else "n/a"


def md_table(title: str, cols, rows) -> list:
    """A markdown table: a title line, the header, one ``| ... |`` line per row."""
    return [title, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def unheld_note(bench: Bench) -> str:
    """A warning line naming the GPU timings whose pre-roll ran out, or ""."""
    if not bench.unheld:
        return ""
    return (f"WARNING: the pre-roll ran out before {len(bench.unheld)} timing(s) were queued, so host gaps "
            f"may be in them: {', '.join(bench.unheld[:10])}\n")


def end_run(bench: Bench, result: dict, path: str | None, failures: int, note: str = "") -> int:
    """A benchmark's ending: its failures, seconds (since ``result["t0"]``, popped) and unheld
    pre-rolls into ``result``, the pre-roll warning and run time printed, the JSON written; the
    exit code (1 when anything failed)."""
    result.update(failures=failures, seconds=time.perf_counter() - result.pop("t0"), preroll_ran_out=bench.unheld)
    print(unheld_note(bench) + f"{note}({result['seconds']:.0f} s)")
    save_json(path, result)
    return 1 if failures else 0


def print_targets(targets: list) -> int:
    """Print ``[{"pass": True/False/None, "text": ...}]`` as PASS/MISS lines; returns how many passed."""
    print("\n== targets")
    for t in targets:
        print(f"  {'PASS' if t['pass'] else 'MISS' if t['pass'] is False else 'n/a '}  {t['text']}")
    met = sum(t["pass"] is True for t in targets)
    print(f"  {met} of {len(targets)} targets met")
    return met

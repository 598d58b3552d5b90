"""scripts/ without a GPU: every script imports and answers --help, none uses pyattn's private names,
the harness's timing logic on a simulated GPU, and the headline plot from synthetic benchmark JSON."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

import pyattn

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PY_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py"))
# Modules the benchmarks import, not scripts to run (no --help of their own).
HELPERS = {"harness.py", "harness_report.py", "harness_arrays.py", "quant_caches.py"}
MAINS = [n for n in PY_SCRIPTS if n not in HELPERS]
# What scripts may use: pyattn's exports, pyattn.kernels.specs' public names, pyattn.jit's public functions.
PUBLIC_MODULES = {"pyattn", "pyattn.kernels.specs", "pyattn.jit", "pyattn.quant", "pyattn.reference",
                  "pyattn.patterns"}
PUBLIC_ATTRS = set(pyattn.__all__) | {"quant", "reference", "patterns", "jit", "kernels"}

sys.path.insert(0, str(SCRIPTS))
import harness  # noqa: E402


@pytest.mark.parametrize("name", MAINS)
def test_script_imports_and_answers_help_without_a_gpu(name):
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(SCRIPTS / name), "--help"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage:") and len(p.stdout) > 200, p.stdout


def _pyattn_uses(tree):
    """(line, dotted name) of every pyattn module imported and every pyattn.<attr> read."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "pyattn")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pyattn":
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pyattn":
            yield node.lineno, f"pyattn.{node.attr}"


@pytest.mark.parametrize("name", PY_SCRIPTS)
def test_scripts_use_public_pyattn_names_only(name):
    # Scripts, child-process code in strings included (parsed too), reach pyattn through its public API.
    text = (SCRIPTS / name).read_text()
    trees = [ast.parse(text)]
    for node in ast.walk(trees[0]):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import pyattn" in node.value:
            try:
                trees.append(ast.parse(node.value))
            except SyntaxError:  # prose (a docstring), not code
                pass
    bad = []
    for tree in trees:
        for line, dotted in _pyattn_uses(tree):
            parts = dotted.split(".")
            if any(p.startswith("_") and p != "__version__" for p in parts):
                bad.append((line, dotted))
            elif len(parts) == 2 and parts[1] not in PUBLIC_ATTRS and dotted not in PUBLIC_MODULES:
                bad.append((line, dotted))
            elif len(parts) > 2 and ".".join(parts[:-1]) not in PUBLIC_MODULES and dotted not in PUBLIC_MODULES:
                bad.append((line, dotted))
    assert not bad, f"{name} uses private or internal pyattn names: {bad}"


# -- the harness's timing logic on a simulated GPU ------------------------------------------------


class SimGPU:
    """A host clock and one stream: calls cost host time, then queue GPU time behind earlier work."""

    def __init__(self):
        self.now = 0.0  # host ms
        self.free = 0.0  # when the stream's queued work ends

    def perf_counter(self):
        return self.now / 1e3

    def call(self, host_ms, gpu_ms, sync_first=False):
        def fn():
            if sync_first:  # a call that waits for the stream's earlier work (a device table copied back)
                self.now = max(self.now, self.free)
            self.now += host_ms
            self.free = max(self.now, self.free) + gpu_ms
        return fn


class SimBench(harness.Bench):
    def __init__(self, gpu):  # no device: the GPU-facing methods below stand in
        self.gpu, self.unheld, self.torch, self.l2 = gpu, [], None, 50 << 20

    def mark(self):
        return max(self.gpu.now, self.gpu.free)  # when the stream reaches the event

    def elapsed_ms(self, a, b):
        self.gpu.now = max(self.gpu.now, b)
        return b - a

    def reached(self, e):
        return self.gpu.now >= e

    def sync(self):
        self.gpu.now = max(self.gpu.now, self.gpu.free)

    def sleep(self, ms):
        self.gpu.free = max(self.gpu.now, self.gpu.free) + min(ms, harness.MAX_PREROLL_MS)


@pytest.fixture
def sim(monkeypatch):
    gpu = SimGPU()
    monkeypatch.setattr(harness.time, "perf_counter", gpu.perf_counter)
    return gpu, SimBench(gpu)


def test_preroll_times_small_kernels_back_to_back(sim):
    gpu, bench = sim
    fn = gpu.call(host_ms=0.015, gpu_ms=0.004)  # a tiny call: the host is the bottleneck
    assert bench.gpu_ms(fn, preroll=False).ms == pytest.approx(0.015, rel=0.05)  # host gaps without the pre-roll
    t = bench.gpu_ms([fn, fn], loop=20, reps=3)
    assert t.ms == pytest.approx(0.004) and t.held and t.host_ms == pytest.approx(0.015)
    assert bench.wall_ms(fn, loop=100) == pytest.approx(0.015, rel=0.01)
    assert not bench.unheld


def test_a_call_that_synchronises_is_reported_not_hidden(sim):
    gpu, bench = sim
    t = bench.gpu_ms(gpu.call(0.3, 0.05, sync_first=True), loop=5, reps=2, label="syncing call")
    assert not t.held and bench.unheld == ["syncing call"]
    assert t.ms == pytest.approx(0.35)  # host and GPU in series: what the flag warns about


def test_per_call_mode_times_one_call_behind_its_own_preroll(sim):
    gpu, bench = sim
    t = bench.gpu_ms(gpu.call(2.0, 0.05), loop=4, reps=2, per_call=True)
    assert t.ms == pytest.approx(0.05) and t.held


def test_replicas_cover_four_times_the_l2(sim):
    _, bench = sim
    assert bench.replicas(1 << 30) == 1
    assert bench.replicas(100 << 20) == 2
    assert bench.replicas(1 << 20) == 8 and bench.replicas(1 << 20, cap=4) == 4


def test_alternating_rounds_reverse_every_other_pass():
    """Benchmarks time their items in rounds whose order alternates, so that the GPU's drift as it
    heats favours none of them (harness.alternating)."""
    assert list(harness.alternating("abc", 3)) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                   (2, "a"), (2, "b"), (2, "c")]
    assert list(harness.alternating({"x": 1, "y": 2}, 2)) == [(0, "x"), (0, "y"), (1, "y"), (1, "x")]
    assert list(harness.alternating([], 3)) == [] and list(harness.alternating("ab", 0)) == []


@pytest.mark.parametrize("bad", ["", "8", "8x", "8x4096x2", "0x4096", "8x-1", "ax4096", ","])
def test_batch_lengths_parse_points_and_refuse_the_rest(bad):
    """--points / --configs (harness.batch_lengths): BATCHxLENGTH pairs, positive; a script's parser
    turns the refusal into a usage error."""
    import argparse

    import bench_decode

    assert harness.batch_lengths("8x4096,1X32768,") == [(8, 4096), (1, 32768)]
    with pytest.raises(argparse.ArgumentTypeError, match="expected BATCHxLENGTH"):
        harness.batch_lengths(bad)
    assert bench_decode.parse_args(["--configs", "64x4096"]).shapes == [(64, 4096)]
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--configs", bad or "x"])


@pytest.mark.parametrize("name", ["bench_decode", "bench_quant", "bench_sparq"])
def test_configs_override_the_default_and_quick_shapes(name):
    """--configs names the shapes, with or without --quick (a conditional expression once took the
    default shapes unless --quick was given too)."""
    mod = importlib.import_module(name)
    for extra in ([], ["--quick"]):
        assert mod.parse_args(["--configs", "2x1024,4x2048", *extra]).shapes == [(2, 1024), (4, 2048)]


def test_report_helpers():
    assert harness.fmt(None, ".1f") == harness.fmt(float("nan"), ".1f") == harness.fmt(True, ".1f") == "n/a"
    assert harness.fmt(3.14159, ".2f") == "3.14"
    assert harness.md_table("t", ("a", "b"), [(1, 2)]) == ["t", "| a | b |", "|---|---|", "| 1 | 2 |"]
    row = {}
    assert harness.attempt(row, "boom", lambda: 1 / 0) is None and "ZeroDivisionError" in row["errors"][0]
    line = harness.env_line(harness.environment())
    assert line.startswith("Python ") and f"pyattn {pyattn.__version__}" in line


# -- the headline plot --------------------------------------------------------------------------


def synthetic() -> dict:
    env = {"gpu": "NVIDIA H200", "pyattn": pyattn.__version__, "date": "2026-11-22 12:00:00",
           "versions": {"torch": "2.11.0"}}
    configs = [{"dtype": dt, "head_dim": d, "seqlen": s, "causal": c, "pyattn_tflops": 300 + s / 1e3,
                "fa2_tflops": 280.0, "cudnn_tflops": 450.0}
               for dt in ("float16", "bfloat16") for d in (64, 128) for s in (1024, 4096, 16384) for c in (False, True)]
    rows = [{"batch": b, "ctx": c, "layout": lay, "kv_bytes": b * c * 8 * 128 * 4, "pyattn_us": b * c / 100,
             "fa2_us": b * c / 90, "cudnn_us": b * c / 120}
            for b in (1, 8, 64) for c in (4096, 32768) for lay in ("p16", "contig")]
    speed = [{"batch": b, "ctx": c, "cache": k, "x_bf16": x} for b in (8, 64) for c in (4096, 32768)
             for k, x in (("bf16", 1.0), ("int8", 1.4), ("fp8", 1.5))]
    block = [{"case": f"random {p}%", "kind": "sparse", "block": bl, "causal": False, "visible_pct": p,
              "x_pyattn": 80 / p} for bl in ("128x128", "64x64") for p in (5, 10, 20, 50)]
    return {"bench_prefill.json": {"environment": env, "ceilings": {"matmul_bfloat16_tflops": 700.0},
                                   "configs": configs},
            "bench_decode.json": {"environment": env, "copy_gbs": 4250.0, "rows": rows},
            "bench_quant.json": {"environment": env, "speed": speed},
            "bench_sparse.json": {"environment": env, "args": {"seqlen": 16384}, "block_rows": block},
            "bench_startup.json": {"environment": env, "median": {"import_pyattn_ms": 20.0}}}


def test_plot_draws_a_png_from_the_benchmarks_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import plot_benchmarks

    paths = []
    for name, data in synthetic().items():
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "benchmarks.png"
    assert plot_benchmarks.main(["-o", str(out)] + [str(p) for p in paths]) == 0
    head = out.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and 30_000 < out.stat().st_size < 2_000_000
    said = capsys.readouterr().out
    assert "skipping" in said and "bench_startup.json" in said  # not a plottable kind, said so
    assert "prefill, decode, quant, sparse" in said


def test_plot_without_plottable_json_fails_clearly(tmp_path):
    import plot_benchmarks

    (tmp_path / "x.json").write_text("{}")
    assert plot_benchmarks.main(["-o", str(tmp_path / "x.png"), str(tmp_path / "x.json")]) in (1, 2)
    assert not (tmp_path / "x.png").exists()


def test_reports_print_from_results_with_gaps(capsys):
    # What a GPU run reports, from made-up results with figures missing (failed or n/a): no GPU needed.
    import bench_decode
    import bench_prefill
    import bench_quant
    import bench_sparse

    env = {"gpu": "GPU", "arch": "sm_90a", "sm_count": 132, "cuda_driver_api": "13.0", "driver": "580",
           "python": "3.12", "pyattn": "0", "numpy": "2", "versions": {}, "date": "today"}
    rows = [dict(batch=b, ctx=c, layout=lay, kv_bytes=bench_decode.kv_bytes(b, c), pyattn_us=50.0, held=True,
                 pd_us=55.0, cudnn_us=40.0, fa2_expanded=True) for b, c in ((1, 32768), (8, 4096))
            for lay in ("p16", "contig")] + [dict(batch=64, ctx=4096, layout="p16", kv_bytes=1, errors=["x"])]
    for r in rows:
        bench_decode.derive(r, 4000.0)
    assert len(bench_decode.table(rows)) == len(rows) + 2
    passed = [t["pass"] for t in bench_decode.targets(rows)]
    # x cuDNN 0.8 (B1, B8), n/a (the failed B64 row), paged / contiguous 1.0 (B1, B8), each followed by
    # the NumPy-table ratio, which has no target
    assert passed == [False, False, None, True, None, True, None], passed
    bench_prefill.print_report({"environment": env, "ceilings": {"matmul_float16_tflops": 700.0}, "configs": [
        {"dtype": "float16", "head_dim": 64, "seqlen": 1024, "causal": False, "batch": 16, "heads": 32,
         "pyattn_ms": 1.0, "pyattn_tflops": 300.0, "fa2_ms": 1.1}, {"dtype": "bfloat16", "head_dim": 64,
         "seqlen": 1024, "causal": True, "batch": 16, "heads": 32, "errors": ["boom"]}],
        "small_grids": [{"dtype": "bfloat16", "head_dim": 64, "seqlen": 2048, "causal": True, "batch": 2, "heads": 8,
                         "pyattn_ms": 0.03, "pyattn_tflops": 150.0, "cudnn_ms": 0.036}],
        "numpy_e2e": {"floor_ms": 1.0, "floor_h2d_ms": 0.7, "floor_d2h_ms": 0.3, "h2d_gbs": 50.0, "d2h_gbs": 50.0,
                      "pyattn_ms": 5.0}})
    block = [{"case": "dense pyattn", "kind": "pyattn", "causal": False, "ms": 5.0, "flops": 1e12},
             {"case": "random 10%", "kind": "sparse", "block": "128x128", "causal": False, "ms": 0.6, "flops": 1e11,
              "visible_pct": 10.0}]
    bench_sparse.derive_block(block)
    result = {"args": {"seqlen": 16384}, "block_rows": block, "csr_rows": [{"case": "c", "dtype": "bfloat16"}]}
    assert "\n".join(bench_sparse.tables(result)).count("| random 10% |") == 1
    assert [t["pass"] for t in bench_sparse.targets(result)] == [True, None]
    speed = [{"batch": 8, "ctx": 32768, "cache": k, "bytes": bench_quant.read_bytes(8, 32768, k), "us": us, "held": 1}
             for k, us in (("bf16", 300.0), ("int8", 200.0), ("fp8", None))]
    quant = {"speed": speed, "accuracy": [{"dataset": "random", "cache": "int8"}], "roundtrip": [], "copy_gbs": 4e3}
    bench_quant.derive(quant)
    assert "\n".join(bench_quant.tables(quant)).count("FAILED") == 1
    assert [t["pass"] for t in bench_quant.targets(quant)] == [False, None]
    out = capsys.readouterr().out
    assert "PYATTN FAILED: boom" in out and "5.00x the floor" in out
    small = out.split("small grids:")[1].splitlines()[1]  # the small grids' heading, then their rows
    assert small.startswith("bfloat16  64   2048 True     2   8 |") and small.split("|")[4].split()[1] == "1.20", small


def test_sparq_and_per_channel_reports_from_results_with_gaps():
    """bench_sparq's tables and targets, and bench_quant's per-channel targets, from made-up results."""
    import bench_quant
    import bench_sparq

    speed = [{"batch": 8, "ctx": 32768, "page": 64, "sparq_us": 100.0, "exact_us": 330.0, "x_exact": 3.3},
             {"batch": 1, "ctx": 131072, "errors": ["x"]}, {"batch": 1, "ctx": 4096, "x_exact": 1.0}]
    result = {"speed": speed, "accuracy": [{"dataset": "needles", "r": 32, "k": 512, "max_err": 0.01},
                                           {"dataset": "gaussian", "r": 16, "k": 128}], "copy_gbs": 4e3}
    assert "\n".join(bench_sparq.tables(result)).count("| needles |") == 1
    assert [t["pass"] for t in bench_sparq.targets(result)] == [True, None]
    assert bench_sparq.sparq_bytes(8, 32768, 32, 4096, 64) < bench_sparq.exact_bytes(8, 32768) / 3
    rows = [{"batch": 8, "ctx": 32768, "cache": k, "bytes": bench_quant.read_bytes(8, 32768, k), "us": us, "held": 1}
            for k, us in (("int8", 200.0), ("int8c", 215.0), ("fp8", 200.0), ("fp8c", None))]
    import numpy as np

    acc = [{"dataset": "outliers", "cache": "bf16", "max_err": np.float64(0.008)},
           {"dataset": "outliers", "cache": "int8c", "max_err": np.float64(0.03)}]
    quant = {"speed": rows, "accuracy": acc, "roundtrip": [], "copy_gbs": 4e3}
    bench_quant.derive(quant)
    assert bench_quant.read_bytes(8, 32768, "int8c") > bench_quant.read_bytes(8, 32768, "int8")
    assert [t["pass"] for t in bench_quant.targets(quant)] == [True, None, False, None, None]
    assert type(bench_quant.targets(quant)[2]["pass"]) is bool

"""``python -m pyattn`` as a user runs it: subprocesses, no GPU, a private kernel cache.

Kernel counts are derived from ``warmup_specs`` / ``select_attention_spec``, never written down.
Warmups that fill ``session_cache_dir`` cost nothing overall: ``test_compile_variants`` builds every
standard kernel of every arch into it anyway.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pty
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import pyattn.jit as jit
from pyattn.__main__ import Progress, build_parser, main
from pyattn.jit.cache import KernelCache
from pyattn.jit.headers import nvrtc_version
from pyattn.kernels.specs import select_attention_spec, warmup_specs
from pyattn.runtime import device
from pyattn.runtime.errors import NoDeviceError

REPO = pathlib.Path(__file__).resolve().parents[1]
ARCH = "sm_90a"

needs_no_gpu = pytest.mark.skipif(device.device_count() > 0, reason="checks the no-GPU behaviour")


def _env(cache, extra_env=None):
    env = dict(os.environ)
    env.update(extra_env or {})
    env["PYATTN_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("PYATTN_PTX", None)
    return env


def run_cli(*args, cache, timeout=300, extra_env=None):
    return subprocess.run([sys.executable, "-m", "pyattn", *args], cwd=REPO, env=_env(cache, extra_env),
                          capture_output=True, text=True, timeout=timeout)


def _cache_count(text):
    m = re.search(r"^cache: (.+) \((\d+) kernels, [\d.]+ MiB\)$", text, re.M)
    assert m, text
    return m.group(1), int(m.group(2))


def _no_gpu_headline() -> str:
    """The headline this machine's NoDeviceError carries (no driver library, no GPU...)."""
    try:
        device.get_device()
    except NoDeviceError as exc:
        return NoDeviceError.REASONS[exc.reason]
    pytest.skip("a GPU is present")


def _keys(specs):
    fp = jit.toolchain_fingerprint()
    return {s.cache_key(fp) for s in specs}


# -- demo, info, warmup, cache clear -----------------------------------------------------------


@needs_no_gpu
def test_demo_without_gpu_compiles_one_kernel_per_arch_and_says_how_to_warm(session_cache_dir):
    specs = [select_attention_spec("float16", 128, a) for a in device.SUPPORTED_ARCHS]
    t0 = time.monotonic()
    r = run_cli("demo", "--quiet", cache=session_cache_dir)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "fp64 NumPy reference:" in out
    assert f"GPU: none ({_no_gpu_headline()}" in out
    for spec in specs:
        assert re.search(rf"^  {spec.arch} +{re.escape(spec.describe())} +(compiled in [\d.]+ s|cached)$",
                         out, re.M), out
    assert re.search(rf"^done in [\d.]+ s: {len(specs)} kernels$", out, re.M), out
    for arch in device.SUPPORTED_ARCHS:
        assert f"{arch}: {len(warmup_specs(arch))}" in out
    assert "-m pyattn warmup --arch ARCH" in out
    assert "\r" not in out and "[#" not in out  # --quiet, and not a terminal anyway
    assert _keys(specs) <= {e.key for e in KernelCache(session_cache_dir).entries()}
    assert elapsed < 120, f"the no-GPU demo must be quick, took {elapsed:.0f} s"


@needs_no_gpu
def test_info_without_gpu(cache_dir):
    r = run_cli("info", cache=cache_dir)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^pyattn \S+, numpy \S+, python 3\.\d+", out, re.M)
    assert f"GPU: none ({_no_gpu_headline()}" in out
    major, minor = nvrtc_version()
    assert re.search(rf"^NVRTC: {major}\.{minor}$", out, re.M)
    assert re.search(rf"^CUDA headers: {major}\.\d+ at \S+", out, re.M)
    assert _cache_count(out) == (str(cache_dir), 0)


def test_warmup_info_cache_clear_cycle(cache_dir, session_cache_dir):
    specs = warmup_specs(ARCH)
    n = len(specs)
    r = run_cli("warmup", "--arch", ARCH, "--quiet", cache=session_cache_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"pyattn warmup: {n} kernels for {ARCH} into {session_cache_dir}" in r.stdout
    m = re.search(r"^done in [\d.]+ s: (\d+) compiled \(slowest [\d.]+ s\), (\d+) already cached$",
                  r.stdout, re.M)
    assert m and int(m.group(1)) + int(m.group(2)) == n, r.stdout
    assert "kernels (" not in r.stdout  # --quiet: no progress lines

    # A private copy of exactly those entries: `cache clear` must not empty the shared cache.
    cache_dir.mkdir(mode=0o700)
    for key in _keys(specs):
        shutil.copy2(session_cache_dir / f"{key}.pyattnk", cache_dir)
    info = run_cli("info", cache=cache_dir)
    assert info.returncode == 0
    assert _cache_count(info.stdout) == (str(cache_dir), n)

    # Again with progress, into a pipe: plain lines, no \r frames; everything is cached.
    again = run_cli("warmup", "--arch", ARCH, cache=cache_dir)
    assert again.returncode == 0
    assert re.search(rf"^done in [\d.]+ s: 0 compiled \(slowest 0\.00 s\), {n} already cached$",
                     again.stdout, re.M), again.stdout
    assert "\r" not in again.stdout
    progress = re.findall(r"^  (\d+)/(\d+) kernels \((\d+)%\), (\d+) compiled$", again.stdout, re.M)
    assert progress[-1] == (str(n), str(n), "100", "0")
    assert len(progress) <= 11, "at most one line per tenth (the run is far shorter than 5 s)"

    clear = run_cli("cache", "clear", cache=cache_dir)
    assert clear.returncode == 0
    assert clear.stdout.strip() == f"removed {n} cached kernels from {cache_dir}"
    assert KernelCache(cache_dir).entries() == []
    assert _cache_count(run_cli("info", cache=cache_dir).stdout) == (str(cache_dir), 0)
    clear = run_cli("cache", "clear", cache=cache_dir)
    assert clear.stdout.strip() == f"removed 0 cached kernels from {cache_dir}"


def test_progress_bar_only_on_a_terminal(session_cache_dir):
    n = len(warmup_specs(ARCH))
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pyattn", "warmup", "--arch", ARCH], cwd=REPO,
                            env=_env(session_cache_dir, {"COLUMNS": "120"}), stdout=follower,
                            stderr=subprocess.PIPE)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(300) == 0, proc.stderr.read()
    out = b"".join(chunks).decode()
    assert f"[{'#' * 30}] {n}/{n} " in out
    assert out.count("\r") >= n, "the bar is redrawn in place"
    assert "kernels (" not in out, "no plain progress lines on a terminal"


# -- interruptions and closed pipes ------------------------------------------------------------


def test_ctrl_c_exits_130_without_traceback(cache_dir):
    # SIGINT back to its default in the child: a shell runs background jobs with it ignored,
    # and Python then installs no KeyboardInterrupt handler.
    proc = subprocess.Popen([sys.executable, "-m", "pyattn", "warmup", "--arch", "sm_80"], cwd=REPO,
                            env=_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    header = proc.stdout.readline()
    assert header.startswith("pyattn warmup:"), header
    time.sleep(0.5)  # compiling now
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert err.strip() == "interrupted", err
    assert time.monotonic() - t0 < 10, "queued compiles must be dropped, not run first"
    assert len(KernelCache(cache_dir).entries()) < len(warmup_specs("sm_80"))


def test_closed_stdout_exits_quietly(cache_dir):
    proc = subprocess.Popen([sys.executable, "-m", "pyattn", "info"], cwd=REPO, env=_env(cache_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything is written: every write is EPIPE
    err = proc.stderr.read()
    assert proc.wait(120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("archs", [["sm_75"], ["sm_90a", "sm_90"], ["sm_120"]])
def test_warmup_unsupported_arch_fails_with_usage_error(cache_dir, archs):
    r = run_cli("warmup", "--arch", *archs, cache=cache_dir)
    assert r.returncode == 2
    assert "invalid choice" in r.stderr and repr(archs[-1]) in r.stderr
    assert all(a in r.stderr for a in device.SUPPORTED_ARCHS)  # lists the valid values
    assert not cache_dir.exists()  # nothing was built


@needs_no_gpu
def test_warmup_without_arch_and_without_gpu_asks_for_arch(cache_dir):
    r = run_cli("warmup", cache=cache_dir)
    assert r.returncode == 2
    assert f"no usable GPU ({_no_gpu_headline()}" in r.stderr and "--arch" in r.stderr


def test_every_subcommand_and_option_has_help(capsys):
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = {a.dest: a.help for a in subparsers._choices_actions}
    assert set(commands) == set(subparsers.choices) == {"demo", "info", "warmup", "cache"}
    for name, sub in subparsers.choices.items():
        assert commands[name] and sub.description, name
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: python -m pyattn {name}")
    (arch,) = [a for a in subparsers.choices["warmup"]._actions if a.dest == "arch"]
    assert tuple(arch.choices) == device.SUPPORTED_ARCHS
    assert all(f"{a}: {gpus}" in arch.help for a, gpus in device.ARCH_GPUS.items())


def test_info_names_a_refused_cache(cache_dir, capsys):
    cache_dir.mkdir(mode=0o700)
    cache_dir.chmod(0o777)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^cache: {re.escape(str(cache_dir))} REFUSED \(.*mode 0777.*PYATTN_CACHE_DIR", out, re.M), out


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
    assert r.returncode == 1
    assert "CUDA headers 99.0" in r.stderr and "do not fit NVRTC" in r.stderr
    assert "Traceback" not in r.stderr
    assert not cache_dir.exists() or KernelCache(cache_dir).entries() == []


def test_demo_reports_headers_that_do_not_fit_nvrtc_without_traceback(cache_dir, misfit_headers):
    # With or without a GPU the demo compiles (a fresh cache), and the header check refuses first.
    r = run_cli("demo", "--quiet", cache=cache_dir, extra_env=misfit_headers)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "do not fit NVRTC" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_info_reports_headers_that_do_not_fit_nvrtc(cache_dir, misfit_headers):
    info = run_cli("info", cache=cache_dir, extra_env=misfit_headers)
    assert info.returncode == 0  # info keeps going: it is the diagnosis tool
    assert re.search(r"^CUDA headers: PROBLEM: .*do not fit NVRTC", info.stdout, re.M), info.stdout


# -- Progress, in-process ----------------------------------------------------------------------


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


class _Spec:
    def describe(self):
        return "attn_fwd_mma[f16, d=128, sm_80]"


def test_progress_plain_lines_every_tenth_or_interval():
    stream = _Stream(tty=False)
    progress = Progress(stream, interval=1e9, clock=iter(range(1000)).__next__)
    for done in range(1, 101):
        progress(done, 100, _Spec(), built=done % 2 == 0)
    lines = stream.getvalue().splitlines()
    assert lines == [f"  {d}/100 kernels ({d}%), {d // 2} compiled" for d in range(10, 101, 10)]

    slow = _Stream(tty=False)
    ticks = iter([0.0, 1.0, 7.0, 8.0, 20.0])  # construction, then one per kernel
    progress = Progress(slow, interval=5.0, clock=lambda: next(ticks))
    for done in range(1, 5):
        progress(done, 1000, _Spec(), built=True)
    assert slow.getvalue().splitlines() == ["  2/1000 kernels (0%), 2 compiled",
                                            "  4/1000 kernels (0%), 4 compiled"]


def test_progress_bar_on_a_terminal_redraws_one_line():
    stream = _Stream(tty=True)
    progress = Progress(stream)
    for done in range(1, 4):
        progress(done, 3, _Spec(), built=True)
    out = stream.getvalue()
    assert out.count("\r") == 3 and out.endswith("\n") and out.count("\n") == 1
    assert f"[{'#' * 30}] 3/3 compiled attn_fwd_mma" in out

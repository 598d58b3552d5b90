"""The benchmarks' one timing harness: a plain module the scripts import (``import harness``).

Scripts run as ``PYTHONPATH=. python scripts/bench_x.py``; importing this touches no GPU and no
torch, so ``--help`` works anywhere. Public pyattn names only.

- :class:`Bench`: the run's device and stream (with torch, torch's current stream, also given to
  pyattn, so torch events time both), and :meth:`Bench.gpu_ms`: warm-up, then the median of
  repeats, each a loop of calls between two events, rotating among input sets
  (:meth:`Bench.replicas`) so that calls do not find their data in L2, queued behind a pre-roll (a
  device wait longer than the host needs to queue the loop: ``torch.cuda._sleep``, else large
  pyattn launches) so small kernels are timed back to back, not with the host's launch gaps. A
  pre-roll that ran out (a call synchronised) is reported; ``per_call=True`` puts each call behind
  its own, for calls that wait on earlier work (pinned staging of host arguments).
- :meth:`Bench.wall_ms` for host paths; ceilings of the same run (copy GB/s, matmul TFLOP/s,
  pinned copies); :func:`sdpa` (torch SDPA on its FA2 or cuDNN backend); :func:`environment`,
  :func:`save_json` and the report helpers every script prints with (defined in harness_report.py,
  imported here: callers use ``harness.<name>`` for all of them); the array helpers likewise from
  harness_arrays.py (``to_pyattn``, ``to_torch``, ``replica_views``, ``paged_replicas``, ...).
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from typing import NamedTuple

import numpy as np

import pyattn
# The environment and output helpers live in harness_report.py (beside this file, so on the same
# sys.path); imported back so that every caller keeps one module to import: harness.fmt, harness.environment...
from harness_report import (_cu, attempt, end_run, env_line, environment, fmt, md_table, print_targets, save_json,
                            unheld_note)
# The array helpers likewise (harness_arrays.py).
from harness_arrays import (DlpackOnly, batch_lengths, paged_replicas, random_kv, replica_views, tiny_decode,
                            to_pyattn, to_torch)

# The names scripts, dev/ and tests use; listing the re-exported ones here also tells pyflakes they are not unused.
__all__ = ["SDPA_BACKENDS", "MAX_PREROLL_MS", "load_torch", "open_bench", "over_budget", "parser", "Timing", "Bench",
           "sdpa", "to_pyattn", "to_torch", "tiny_decode", "DlpackOnly", "batch_lengths", "replica_views",
           "paged_replicas", "random_kv", "environment", "env_line", "save_json", "attempt", "fmt", "md_table",
           "unheld_note", "end_run", "print_targets"]

SDPA_BACKENDS = {"fa2": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
MAX_PREROLL_MS = 2000.0  # the longest device wait queued before a loop


def load_torch():
    """torch, or None (not installed, or it cannot see a GPU). Called before pyattn compiles or
    launches anything, so that every benchmark runs in the same order (torch first); the reverse
    order works too (bench_boundary.py checks it in a fresh process)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def open_bench(need_torch: bool = False):
    """The run's :class:`Bench`, torch loaded first; None (having said why) without a GPU, or
    without torch where ``need_torch``."""
    torch = load_torch()
    if torch is None:
        print("this benchmark needs torch with a visible GPU" if need_torch else
              "torch is missing or cannot see the GPU: pyattn alone")
        if need_torch:
            return None
    try:
        return Bench(torch)
    except pyattn.NoDeviceError as exc:
        print(f"no GPU: {exc}")
        return None


def over_budget(result: dict, budget: float, what: str) -> bool:
    """Whether the run is past ``budget`` seconds since ``result["t0"]``; if so ``what`` is noted
    as skipped (``result["skipped"]``) and said."""
    if time.perf_counter() - result["t0"] <= budget:
        return False
    print(f"  {what}: skipped (past the --budget of {budget:.0f} s)")
    result.setdefault("skipped", []).append(what)
    return True


def alternating(items, rounds: int):
    """``(round, item)`` over ``rounds`` passes of ``items``, every other pass in reverse order.

    Under sustained load the GPU's times drift up as it heats (the same d = 128 4k prefill 0.85 ->
    0.90-0.97 ms within a minute: ``dev/probe_order.py``), so in one fixed order the first of
    several identical calls read 4-9% faster than those after it (BENCHMARKS.md, twenty-seventh
    session). Alternating the order, and keeping each item's best round, leaves no item the
    favoured one."""
    items = list(items)
    for r in range(rounds):
        for item in items if r % 2 == 0 else items[::-1]:
            yield r, item


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes (--json, --quick)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], epilog=doc.split("\n", 1)[-1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (a smoke run)")
    return p


class Timing(NamedTuple):
    ms: float  # median GPU (or wall) milliseconds per call
    host_ms: float  # host milliseconds to queue one call (no pre-roll, no sync)
    held: bool  # every loop was queued before the GPU reached it (GPU time, no host gaps)


class Bench:
    """One benchmark run's device, streams, timer and pre-roll (see the module docstring).

    Raises ``pyattn.NoDeviceError`` without a GPU.
    """

    def __init__(self, torch=None):
        self.torch = torch
        self.device = pyattn.get_device()
        self.device.activate()
        if torch is not None:
            self.tstream = torch.cuda.Stream()
            torch.cuda.synchronize()
            torch.cuda.set_stream(self.tstream)  # every torch op of the run queues here too
            self.stream = pyattn.Stream(self.device, handle=self.tstream.cuda_stream, owner=self.tstream)
        else:
            self.tstream, self.stream = None, pyattn.Stream(self.device)
        self.l2 = self.device.l2_bytes
        self._sleep, self.preroll_kind = None, None
        self.unheld: list = []  # labels of GPU timings whose pre-roll ran out (host gaps may be in them)

    # -- events ------------------------------------------------------------------------------
    def mark(self):
        """A timing event recorded on the run's stream now."""
        if self.torch is not None:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record(self.tstream)
            return e
        return self.stream.record(timing=True)

    def elapsed_ms(self, a, b) -> float:
        if self.torch is not None:
            b.synchronize()
            return a.elapsed_time(b)
        return a.elapsed_ms(b)

    def reached(self, e) -> bool:
        """Whether the GPU has passed event ``e``."""
        if self.torch is not None:
            return e.query()
        from cuda.bindings import driver

        return driver.cuEventQuery(e.handle)[0] == driver.CUresult.CUDA_SUCCESS

    def sync(self) -> None:
        self.device.synchronize()

    # -- the pre-roll ------------------------------------------------------------------------
    def sleep(self, ms: float) -> None:
        """Queue a device wait of about ``ms`` on the run's stream (calibrated on first use)."""
        if self._sleep is None:
            self._sleep = self._torch_sleep() if self.torch is not None else self._attention_sleep()
        self._sleep(min(ms, MAX_PREROLL_MS))

    def _torch_sleep(self):
        torch, cycles = self.torch, 2_000_000
        for _ in range(2):  # the first includes loading the sleep kernel
            a = self.mark()
            torch.cuda._sleep(cycles)
            ms = self.elapsed_ms(a, self.mark())
        per_ms = cycles / max(ms, 1e-3)
        self.preroll_kind = "torch.cuda._sleep"
        return lambda wait: torch.cuda._sleep(int(per_ms * wait))

    def _attention_sleep(self):
        """Without torch: a queue of large pyattn attention launches (fp16, 1 x 8192 x 16 x 128)."""
        q = pyattn.asarray(np.zeros((1, 8192, 16, 128), np.float16), stream=self.stream)
        launch = lambda: pyattn.attention(q, q, q, stream=self.stream)  # noqa: E731
        launch()
        a = self.mark()
        for _ in range(5):
            launch()
        per = self.elapsed_ms(a, self.mark()) / 5
        self.preroll_kind = "pyattn.attention launches"

        def wait(ms):
            for _ in range(min(math.ceil(ms / per), 4000)):
                launch()
        return wait

    # -- timing ------------------------------------------------------------------------------
    def gpu_ms(self, fns, *, loop: int = 20, reps: int = 7, warmup: int = 2, preroll: bool = True,
               per_call: bool = False, label: str = "") -> Timing:
        """GPU time per call of ``fns`` (one callable or several, called round robin).

        ``loop`` calls per timed repeat (``per_call``: ``loop`` single calls, each behind its own
        pre-roll), median over ``reps`` repeats. ``preroll=False`` for calls long enough that host
        gaps do not matter (large copies and matmuls). A pre-roll that did not hold adds ``label``
        to :attr:`unheld`, which the scripts print.
        """
        fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
        n = len(fns)
        for f in fns * warmup:  # compile, load, fill caches and the allocator
            f()
        self.sync()
        t = time.perf_counter()
        for i in range(loop):
            fns[i % n]()
        host = (time.perf_counter() - t) * 1e3 / loop
        self.sync()
        times, held = [], True
        for r in range(reps):
            calls = [fns[(r * loop + i) % n] for i in range(loop)]
            if per_call:
                ms, ok = zip(*(self._timed([f], host, preroll) for f in calls))
                ms, ok = float(np.median(ms)), all(ok)
            else:
                ms, ok = self._timed(calls, host * loop, preroll)
            held &= ok
            times.append(ms)
        if preroll and not held:
            self.unheld.append(label or getattr(fns[0], "__name__", "?"))
        return Timing(float(np.median(times)), host, held and preroll)

    def _timed(self, calls, host_ms: float, preroll: bool) -> tuple:
        """(ms per call, pre-roll held) of one timed run of ``calls``; a pre-roll that ran out
        before the host had queued them all is retried twice as long, twice."""
        wait = 1.5 * host_ms + 0.2
        for _ in range(3):
            if preroll:
                self.sleep(wait)
            a = self.mark()
            for f in calls:
                f()
            ok = preroll and not self.reached(a)
            ms = self.elapsed_ms(a, self.mark()) / len(calls)
            if ok or not preroll or wait >= MAX_PREROLL_MS:
                return ms, ok
            wait *= 2
        return ms, False

    def wall_ms(self, fn, *, loop: int = 20, reps: int = 7, warmup: int = 2) -> float:
        """Median wall milliseconds per call of a Python loop of ``loop`` calls and one sync."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(loop):
                fn()
            self.sync()
            times.append((time.perf_counter() - t) * 1e3 / loop)
        return float(np.median(times))

    def replicas(self, nbytes: int, cap: int = 8) -> int:
        """Input sets to rotate among so that a loop's data exceeds 4x the L2 (1 when one does)."""
        return 1 if nbytes >= 4 * self.l2 else min(cap, math.ceil(4 * self.l2 / max(nbytes, 1)))

    # -- ceilings ----------------------------------------------------------------------------
    def copy_gbs(self, nbytes: int = 1 << 29, reps: int = 5) -> float:
        """Device-to-device copy GB/s, bytes read + written (cuMemcpyDtoDAsync, 2 x 512 MiB)."""
        from cuda.bindings import driver

        src, dst = (pyattn.empty((nbytes,), np.uint8, stream=self.stream) for _ in range(2))
        h = self.stream.handle
        t = self.gpu_ms(lambda: _cu(driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, h)), loop=10, reps=reps,
                        preroll=False)
        return 2 * nbytes / t.ms / 1e6

    def matmul_tflops(self, dtype: str = "bfloat16", n: int = 8192, reps: int = 5) -> float:
        """Dense n^3 matrix product TFLOP/s through torch (random data)."""
        torch = self.torch
        a, b = (torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype)) for _ in range(2))
        c = torch.empty_like(a)
        t = self.gpu_ms(lambda: torch.matmul(a, b, out=c), loop=10, reps=reps, preroll=False)
        return 2 * n ** 3 / t.ms / 1e9

    def ceilings(self, *, matmul=("bfloat16",), reps: int = 5) -> dict:
        """The copy ceiling and (with torch) the matmul ones; a ceiling that fails is None."""
        res: dict = {}
        res["d2d_copy_gbs"] = attempt(res, "copy ceiling", lambda: self.copy_gbs(reps=reps))
        for dt in matmul if self.torch is not None else ():
            res[f"matmul_{dt}_tflops"] = attempt(res, f"matmul {dt}", lambda: self.matmul_tflops(dt, reps=reps))
        return res

    def pinned_copies(self, n_h2d: int, n_d2h: int, reps: int = 7) -> dict:
        """Pinned-memory H2D of ``n_h2d`` and D2H of ``n_d2h`` bytes: ms and GB/s each."""
        from cuda.bindings import driver

        h_in, h_out = _cu(driver.cuMemHostAlloc(n_h2d, 0)), _cu(driver.cuMemHostAlloc(n_d2h, 0))
        try:
            d_in, d_out = (pyattn.empty((n,), np.uint8, stream=self.stream) for n in (n_h2d, n_d2h))
            h = self.stream.handle
            up = self.gpu_ms(lambda: _cu(driver.cuMemcpyHtoDAsync(d_in.ptr, h_in, n_h2d, h)), loop=5, reps=reps)
            down = self.gpu_ms(lambda: _cu(driver.cuMemcpyDtoHAsync(h_out, d_out.ptr, n_d2h, h)), loop=5, reps=reps)
        finally:
            self.sync()
            driver.cuMemFreeHost(h_in)
            driver.cuMemFreeHost(h_out)
        return {"h2d_ms": up.ms, "d2h_ms": down.ms, "h2d_gbs": n_h2d / up.ms / 1e6, "d2h_gbs": n_d2h / down.ms / 1e6}


# -- torch interop --------------------------------------------------------------------------------


def sdpa(torch, backend: str, q, k, v, **kw):
    """A call of torch SDPA on (B, H, S, D) tensors under ``sdpa_kernel`` of one backend, ``"fa2"``
    (FlashAttention-2) or ``"cudnn"``; it raises RuntimeError where the backend cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be, f = getattr(SDPBackend, SDPA_BACKENDS[backend]), torch.nn.functional.scaled_dot_product_attention

    def run():
        with warnings.catch_warnings(), sdpa_kernel(be):
            warnings.simplefilter("ignore")  # e.g. the enable_gqa notices
            return f(q, k, v, **kw)
    return run

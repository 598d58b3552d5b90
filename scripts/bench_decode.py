"""Decode benchmark: pyattn paged / contiguous decode against torch SDPA (FA2, cuDNN), one GPU, one run.

Usage: PYTHONPATH=. python scripts/bench_decode.py [--json out.json] [--quick] [--splits N]
       [--configs 8x4096,64x32768] [--layouts p16,p128,contig] [--budget 240]

- Shapes (the decode issue's): bf16, D 128, Hq 32, Hkv 8, q_len 1, batch 1/8/64, context 4096/32768.
  KV layouts: paged NHD pools, page_size 16 and 128, each sequence's pages a random permutation of
  the pool; and contiguous (batch, ctx, Hkv, D) K/V, given to the same kernel as one page per sequence.
- Time per call: CUDA events on one torch stream around a loop of back-to-back calls, median of
  several loops. Kernel figures (pyattn us, FA2 us, cuDNN us) start each loop behind a
  torch.cuda._sleep pre-roll long enough for the host to queue the whole loop: GPU time, host
  overhead left out. pyattn's kernel figure calls pyattn.ops.decode.run_decode with page tables
  uploaded once (the launches paged_decode makes, without its per-call table checks and upload).
  "API us" times pyattn.paged_decode itself (NumPy page tables, no pre-roll): a Python loop's cost.
- KV bytes = batch * ctx * Hkv * D * 2 (K and V) * 2 bytes; GB/s = KV bytes / time; % of copy is
  against the device copy bandwidth measured at start (torch copy_ of 1 GiB, read + write counted,
  as bench_prefill.py). Inputs under 4x the L2 size are replicated and the loop cycles through the
  replicas, so back-to-back calls do not find their KV in L2.
- torch: scaled_dot_product_attention(q (B, Hq, 1, D), K/V (B, Hkv, ctx, D), enable_gqa=True) under
  sdpa_kernel(FLASH_ATTENTION) and sdpa_kernel(CUDNN_ATTENTION); a backend that rejects enable_gqa is
  timed on K/V expanded to Hq heads (repeat_interleave: 4x the bytes), marked '*'.
- Every pyattn result is checked against an fp32 reference (max abs error; flagged above 2e-2,
  absolute or relative to max |ref|).
- Detail for batch 8, ctx 4096, page 16: block table vs CSR, NumPy vs device page tables, and
  pyattn.decode on a PagedKVCache filled by append(): GPU time vs wall time per call of a Python
  loop with one sync at the end (the host overhead of each path).
- PASS/MISS against the issue's targets at the end. A failing configuration prints its error and
  the run goes on; exit code 1 when a pyattn measurement failed or a result was flagged.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
import warnings

import numpy as np

try:  # torch before pyattn: importing torch after pyattn had loaded NVRTC failed once
    import torch
except ImportError:
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import pyattn  # noqa: E402

HQ, HKV, D = 32, 8, 128
SHAPES = [(b, c) for b in (1, 8, 64) for c in (4096, 32768)]
LAYOUTS = {"p16": 16, "p128": 128, "contig": None}  # page size; None = one ctx-token page per sequence
DETAIL = (8, 4096, "p16")
TOL = 2e-2


def kv_bytes(batch: int, ctx: int) -> int:
    """Bytes of K and V one decode step reads: batch * ctx * Hkv * D * 2 (K, V) * 2 (bf16)."""
    return batch * ctx * HKV * D * 2 * 2


def _f(x, spec: str) -> str:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
    return format(x, spec) if ok else "n/a"


# -- timing ------------------------------------------------------------------------------------------


class Clock:
    """CUDA events on ``stream``, with an optional torch.cuda._sleep pre-roll before each loop."""

    def __init__(self, stream):
        self.stream, self.cycles_per_ms = stream, None
        try:
            for _ in range(2):  # the first includes the sleep kernel's load
                a = self.mark()
                torch.cuda._sleep(2_000_000)
                ms = self.elapsed(a, self.mark())
            self.cycles_per_ms = 2e6 / max(ms, 1e-3)
        except Exception as exc:  # noqa: BLE001 - no pre-roll: host gaps may enter small kernel times
            print(f"no pre-roll (torch.cuda._sleep: {exc}); host gaps may enter the kernel times")

    def mark(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record(self.stream)
        return e

    @staticmethod
    def elapsed(a, b) -> float:
        b.synchronize()
        return a.elapsed_time(b)

    def time(self, fns, loop: int, reps: int, preroll: bool = True) -> tuple:
        """(median GPU ms per call, host ms per call to queue a loop) of calling ``fns`` round robin."""
        n = len(fns)
        for f in fns * 2:  # warmup: compile, caches, allocator
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(loop):
            fns[i % n]()
        host = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            if preroll and self.cycles_per_ms:
                torch.cuda._sleep(int(self.cycles_per_ms * min(1.5 * host + 0.1, 2000.0)))
            a = self.mark()
            for i in range(loop):
                fns[i % n]()
            times.append(self.elapsed(a, self.mark()) / loop)
        return float(np.median(times)), host / loop


def wall_us(fn, loop: int, reps: int) -> float:
    """Median wall microseconds per call of a Python loop of ``loop`` calls with one sync at the end."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(loop):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6 / loop)
    return float(np.median(times))


def copy_gbs(clock, reps: int) -> float:
    """Device-to-device copy GB/s (bytes read + written) of a 1 GiB torch copy_."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms, _ = clock.time([lambda: dst.copy_(src)], 20, reps, preroll=False)
    return 2 * n / ms / 1e6


# -- helpers -----------------------------------------------------------------------------------------


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


def to_pyattn(t, ps):
    """A torch tensor as a zero-copy DeviceArray (bf16 through int16 bits when DLPack refuses it)."""
    try:
        return pyattn.asarray(t, stream=ps)
    except Exception:  # noqa: BLE001
        if t.dtype != torch.bfloat16:
            raise
        import ml_dtypes
        return pyattn.asarray(t.view(torch.int16), stream=ps).view(ml_dtypes.bfloat16)


def dev_i32(x, ps):
    return pyattn.asarray(np.ascontiguousarray(x, dtype=np.int32), stream=ps)


def predicted_splits(batch: int, ctx: int, forced):
    """num_splits as run_decode chooses it (same helpers), or the forced value."""
    if forced:
        return forced
    from pyattn.ops._paged import choose_num_splits
    from pyattn.ops._plan import ptx_requested
    from pyattn.kernels.registry import get_kernel
    from pyattn.ops.decode import _blocks_per_sm, _specs

    dev, rows = pyattn.get_device(), HQ // HKV  # rows = group * q_len
    spec, _ = _specs("bfloat16", D, dev.arch, ptx_requested(), rows, False, False)
    t = spec.tiles
    units = batch * HKV * -(-rows // t.block_m)
    return choose_num_splits(units, -(-ctx // t.block_n), dev.sm_count * _blocks_per_sm(spec, get_kernel(spec, dev)))


def kernel_fn(q_d, k_d, v_d, tables, max_len: int, splits, ps):
    """run_decode with prevalidated inputs and device tables: the paged_decode launches alone."""
    from pyattn.ops._paged import check_pools, check_query
    from pyattn.ops.decode import run_decode

    pool = check_pools(k_d, v_d, "nhd")
    P = check_query(q_d, pool, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None,
                    num_splits=splits)
    k_d.device.activate()
    return lambda: run_decode(P, pool, q_d, k_d, v_d, tables, max_len, None, ps, False)[0]


def reference(q, k, v):
    """fp32 attention of q (B, 1, Hq, D) over k, v (B, Hkv, ctx, D): (B, Hq, D), one sequence at a time."""
    out = torch.empty(q.shape[0], HQ, D, device=q.device, dtype=torch.float32)
    for b in range(q.shape[0]):
        qb = q[b, 0].float().view(HKV, HQ // HKV, D)
        p = torch.softmax(qb @ k[b].float().transpose(1, 2) / math.sqrt(D), dim=-1)
        out[b] = (p @ v[b].float()).reshape(HQ, D)
    return out


def errors(out, ref, ps=None) -> tuple:
    """(max abs error, that / max |ref|) of a pyattn DeviceArray or torch tensor against ``ref`` (B, Hq, D)."""
    if not torch.is_tensor(out):
        out = torch.from_numpy(out.numpy(ps).astype(np.float32)).to(ref.device)
    err = (out.float().reshape(ref.shape) - ref).abs().max().item()
    return err, err / max(ref.abs().max().item(), 1e-30)


def check(row: dict, outs, refs, ps) -> None:
    """Errors of pyattn's outputs (DeviceArrays) against the fp32 reference and torch SDPA's output."""
    ref, sdpa = refs
    for name, fn in outs:
        out = attempt(row, f"check {name}", lambda: fn())
        e = out is not None and attempt(row, f"check {name}", lambda: errors(out, ref, ps))
        if not e:
            continue
        row["max_err"], row["rel_err"] = max(row.get("max_err", 0.0), e[0]), max(row.get("rel_err", 0.0), e[1])
        if sdpa is not None:
            row["err_vs_sdpa"] = max(row.get("err_vs_sdpa", 0.0), errors(out, sdpa, ps)[0])
        if not (e[0] <= TOL and e[1] <= TOL and row.get("err_vs_sdpa", 0.0) <= TOL):  # also catches NaN
            row["flagged"] = True
            print(f"!!!!! WARNING: pyattn ({name}) differs from the fp32 reference by {e[0]:.3e} (relative {e[1]:.3e}; "
                  f"from torch SDPA by {_f(row.get('err_vs_sdpa'), '.3e')}) for B={row['batch']} ctx={row['ctx']} "
                  f"{row['layout']} !!!!!")


# -- torch SDPA --------------------------------------------------------------------------------------


def bench_torch(q, k, v, B: int, n_rep: int, clock, args) -> dict:
    """FA2 and cuDNN times; enable_gqa first, K/V expanded to Hq heads where a backend rejects it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa, qs, res = torch.nn.functional.scaled_dot_product_attention, q.view(B, HQ, 1, D), {}
    for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        for expanded in (False, True):
            kk = vv = None
            try:
                if expanded:
                    need = 4 * 2 * k.numel() * k.element_size() * 1.1 + (2 << 30)
                    if torch.cuda.mem_get_info()[0] < need:
                        raise MemoryError(f"{need / 1e9:.0f} GB free needed for expanded K/V")
                    kk, vv = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
                    kw = {}
                else:
                    kk, vv, kw = k, v, {"enable_gqa": True}
                fns = [lambda r=r: sdpa(qs, kk[r * B:(r + 1) * B], vv[r * B:(r + 1) * B], is_causal=False, **kw)
                       for r in range(n_rep)]
                with warnings.catch_warnings(), sdpa_kernel(backend):
                    warnings.simplefilter("ignore")
                    ms, _ = clock.time(fns, args.loop, args.reps)
                    res[f"{name}_out"] = fns[0]()
                res[f"{name}_us"], res[f"{name}_expanded"] = ms * 1e3, expanded
                break
            except Exception as exc:  # noqa: BLE001 - a backend torch cannot run here is "n/a"
                res[f"{name}_error" + ("_expanded" if expanded else "")] = f"{type(exc).__name__}: {str(exc)[:200]}"
            finally:
                kk = vv = fns = None
                torch.cuda.empty_cache()
    return res


# -- pyattn --------------------------------------------------------------------------------------------


def bench_layout(row, B, ctx, n_rep, q_d, k_nhd, v_nhd, refs, args, clock, ps, detail) -> None:
    """Fill ``row`` with pyattn's figures for one layout (and the detail list for DETAIL)."""
    S, page = n_rep * B, LAYOUTS[row["layout"]] or ctx
    npg = ctx // page
    if LAYOUTS[row["layout"]] is None:
        kp, vp, table = k_nhd, v_nhd, np.arange(S, dtype=np.int32).reshape(S, 1)
    else:
        perm = torch.randperm(S * npg + 7, generator=torch.Generator().manual_seed(ctx + page + B))
        kp, vp = (torch.zeros(S * npg + 7, page, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        idx = perm[: S * npg].cuda()  # 7 spare pages nobody uses
        kp[idx] = k_nhd.view(S * npg, page, HKV, D)
        vp[idx] = v_nhd.view(S * npg, page, HKV, D)
        table = perm[: S * npg].numpy().astype(np.int32).reshape(S, npg)
    k_d, v_d = to_pyattn(kp, ps), to_pyattn(vp, ps)
    lens = np.full(B, ctx, np.int32)
    tabs = [np.ascontiguousarray(table[r * B:(r + 1) * B]) for r in range(n_rep)]
    d_lens = dev_i32(lens, ps)

    def kfn(t):
        d_t = dev_i32(t, ps)
        return kernel_fn(q_d, k_d, v_d, (d_t, None, d_t.elem_strides[0], d_lens), ctx, args.splits, ps)

    def afn(t, **kw):
        kw = kw or {"block_table": t, "seq_lens": lens}
        return lambda: pyattn.paged_decode(q_d, k_d, v_d, num_splits=args.splits, stream=ps, **kw)

    afns = [afn(t) for t in tabs]
    kfns = attempt(row, "pyattn kernel path setup", lambda: [kfn(t) for t in tabs])
    r = kfns and attempt(row, "pyattn kernel path", lambda: clock.time(kfns, args.loop, args.reps))
    if not r:  # the internals moved: time the public call behind the pre-roll instead (marked '+')
        row["pyattn_path"] = "paged_decode behind the pre-roll"
        r = attempt(row, "pyattn.paged_decode (pre-roll)", lambda: clock.time(afns, args.loop, args.reps))
    if r:
        row["pyattn_us"], row["kernel_host_us"] = r[0] * 1e3, r[1] * 1e3
    r = attempt(row, "pyattn.paged_decode", lambda: clock.time(afns, args.loop, args.reps, preroll=False))
    if r:
        row["api_us"], row["api_host_us"] = r[0] * 1e3, r[1] * 1e3
    check(row, ([("kernel path", kfns[0])] if kfns else []) + [("paged_decode", afns[0])], refs, ps)
    if (B, ctx, row["layout"]) != DETAIL:
        return

    # Detail: one replica each, so every path reads the same pages.
    t0 = tabs[0]
    indptr, last = np.arange(B + 1, dtype=np.int32) * npg, np.full(B, page, np.int32)
    paths = [("kernel only, block table", lambda: kfn(t0), True),
             ("kernel only, CSR table", lambda: kernel_fn(q_d, k_d, v_d, (dev_i32(t0.ravel(), ps), dev_i32(indptr, ps),
                                                                          0, d_lens), ctx, args.splits, ps), True),
             ("paged_decode, NumPy block table", lambda: afn(t0), False),
             ("paged_decode, NumPy CSR", lambda: afn(t0, indptr=indptr, indices=t0.ravel(), last_page_len=last), False),
             ("paged_decode, device block table", lambda: afn(t0, block_table=torch.from_numpy(t0).cuda(),
                                                            seq_lens=torch.from_numpy(lens).cuda()), False)]

    def cache_fn():
        cache = pyattn.PagedKVCache(B * npg + 8, page, HKV, D, "bfloat16")
        torch.cuda.synchronize()  # its pools were allocated on pyattn's own stream, not ps
        seqs = [cache.add_sequence() for _ in range(B)]
        cache.append(seqs, k_nhd[:B], v_nhd[:B], stream=ps)
        return lambda: pyattn.decode(q_d, cache, seqs, num_splits=args.splits, stream=ps)
    paths.append(("decode(PagedKVCache)", cache_fn, True))
    for name, make, preroll in paths:
        d = {"path": name}
        fn = attempt(d, name, make)
        if fn is not None:
            r = attempt(d, name, lambda: clock.time([fn], args.loop, args.reps, preroll=preroll))
            if r:
                d["gpu_us"], d["host_us"] = r[0] * 1e3, r[1] * 1e3
            d["wall_us"] = attempt(d, name + " (wall)", lambda: wall_us(fn, args.loop, args.reps))
            e = attempt(d, name + " (check)", lambda: errors(fn(), refs[0], ps))
            if e:
                d["max_err"] = e[0]
        detail.append(d)
        fn = None
    row.setdefault("errors", []).extend(f"detail {e}" for d in detail for e in d.get("errors", []))


def bench_shape(B, ctx, layouts, args, clock, ps, l2, detail) -> list:
    nbytes = kv_bytes(B, ctx)
    n_rep = 1 if nbytes >= 4 * l2 else min(8, math.ceil(4 * l2 / nbytes))
    S = n_rep * B
    g = torch.Generator(device="cuda").manual_seed(1000 * B + ctx)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(S, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    ref = reference(q, k[:B], v[:B])
    base = {"batch": B, "ctx": ctx, "kv_bytes": nbytes, "replicas": n_rep}
    notes = {}  # torch's and the split helper's failures: reported, not counted as pyattn failures
    base["splits"] = attempt(notes, "num_splits", lambda: predicted_splits(B, ctx, args.splits))
    tres = attempt(notes, "torch SDPA", lambda: bench_torch(q, k, v, B, n_rep, clock, args)) or {}
    base["notes"] = notes.get("errors", [])
    sdpa = None  # torch SDPA's output (FA2's, else cuDNN's): pyattn is checked against it too
    for name in ("fa2", "cudnn"):
        out = tres.pop(f"{name}_out", None)
        if out is not None:
            base[f"{name}_err"] = errors(out, ref)[0]
            sdpa = out.float().reshape(ref.shape) if sdpa is None else sdpa
    base.update(tres)
    k_nhd, v_nhd = (x.transpose(1, 2).contiguous() for x in (k, v))  # (S, ctx, Hkv, D)
    k = v = None
    torch.cuda.empty_cache()
    q_d = to_pyattn(q, ps)
    rows = []
    for name in layouts:
        row = dict(base, layout=name, page_size=LAYOUTS[name] or ctx)
        attempt(row, f"pyattn {name}", lambda: bench_layout(row, B, ctx, n_rep, q_d, k_nhd, v_nhd, (ref, sdpa), args,
                                                            clock, ps, detail))
        rows.append(row)
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  B={B} ctx={ctx} {name}: pyattn {_f(row.get('pyattn_us'), '.1f')} us (API "
              f"{_f(row.get('api_us'), '.1f')}), FA2 {_f(row.get('fa2_us'), '.1f')}, cuDNN "
              f"{_f(row.get('cudnn_us'), '.1f')}; max err {_f(row.get('max_err'), '.1e')} (fp32 ref), "
              f"{_f(row.get('err_vs_sdpa'), '.1e')} (SDPA)", flush=True)
    return rows


# -- report --------------------------------------------------------------------------------------------


def derive(row: dict, copy: float | None) -> None:
    """Add GB/s, % of copy and the torch ratios to ``row``."""
    us = row.get("pyattn_us")
    if us:
        row["gbs"] = row["kv_bytes"] / us / 1e3
        row["pct_copy"] = row["gbs"] / copy * 100 if copy else None
        for name in ("fa2", "cudnn"):
            if row.get(f"{name}_us"):
                row[f"x_{name}"] = row[f"{name}_us"] / us


def table(rows: list) -> list:
    cols = ("batch", "ctx", "layout", "splits", "pyattn us", "GB/s", "% of copy", "API us", "FA2 us", "cuDNN us",
            "x FA2", "x cuDNN", "max err")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        star = {n: "*" if r.get(f"{n}_expanded") else "" for n in ("fa2", "cudnn")}
        us = _f(r.get("pyattn_us"), ".1f") + ("+" if r.get("pyattn_path") else "")
        cells = (r["batch"], r["ctx"], r["layout"], r.get("splits") or "n/a", "FAILED" if us == "n/a" else us,
                 _f(r.get("gbs"), ".0f"), _f(r.get("pct_copy"), ".0f"), _f(r.get("api_us"), ".1f"),
                 _f(r.get("fa2_us"), ".1f") + star["fa2"], _f(r.get("cudnn_us"), ".1f") + star["cudnn"],
                 _f(r.get("x_fa2"), ".2f") + star["fa2"], _f(r.get("x_cudnn"), ".2f") + star["cudnn"],
                 _f(r.get("max_err"), ".1e") + (" !" if r.get("flagged") else ""))
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def targets(rows: list) -> list:
    """[(pass: True/False/None, text)] for the issue's three targets."""
    res, by = [], {(r["batch"], r["ctx"], r["layout"]): r for r in rows}
    for r in rows:
        if r["batch"] >= 8 and r["ctx"] >= 4096 and r["layout"] in ("p16", "contig"):
            p = r.get("pct_copy")
            res.append((None if p is None else p >= 85, f"(1) B={r['batch']} ctx={r['ctx']} {r['layout']}: "
                        f"{_f(p, '.1f')}% of copy bandwidth (target >= 85%)"))
    for r in rows:
        if r["batch"] == 1 and r["ctx"] == 32768:
            us, cu = r.get("pyattn_us"), r.get("cudnn_us")
            ok = None if not (us and cu) else us <= cu / 1.2
            res.append((ok, f"(2) B=1 ctx=32768 {r['layout']}: pyattn {_f(us, '.1f')} us vs cuDNN {_f(cu, '.1f')} us "
                        f"/ 1.2 = {_f(cu / 1.2 if cu else None, '.1f')} us"
                        + (" (cuDNN ran on expanded K/V)" if r.get("cudnn_expanded") else "")))
    for (b, c, lay), r in by.items():
        if lay == "p16" and (b, c, "contig") in by:
            a, z = r.get("pyattn_us"), by[(b, c, "contig")].get("pyattn_us")
            ratio = a / z if a and z else None
            res.append((None if ratio is None else ratio <= 1.10,
                        f"(3) B={b} ctx={c}: paged p16 / contiguous time = {_f(ratio, '.3f')} (target <= 1.10)"))
    return res


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every figure to this JSON file (rewritten after each shape)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shorter loops")
    parser.add_argument("--splits", type=int, default=None, help="force pyattn's num_splits (default: its choice)")
    parser.add_argument("--configs", help="comma list of BATCHxCTX, e.g. 8x4096,64x32768 (default: all six)")
    parser.add_argument("--layouts", default="p16,p128,contig", help="comma list of p16, p128, contig")
    parser.add_argument("--budget", type=float, default=240.0, help="skip shapes not started after this many s")
    args = parser.parse_args(argv)
    args.reps, args.loop = (3, 10) if args.quick else (7, 20)
    try:
        args.layouts = [x for x in args.layouts.split(",") if x]
        args.shapes = ([tuple(int(n) for n in c.lower().split("x")) for c in args.configs.split(",") if c]
                       if args.configs else SHAPES)
        assert all(len(x) == 2 for x in args.shapes) and args.layouts and set(args.layouts) <= set(LAYOUTS)
        assert args.splits is None or 1 <= args.splits <= 256
    except (ValueError, AssertionError):
        parser.error(f"--configs: BATCHxCTX,...; --layouts: a subset of {','.join(LAYOUTS)}; --splits: 1 to 256")
    return args


def run(args, dev, result: dict, save) -> None:
    """Measure the copy ceiling, then every shape (rows into ``result``, saved after each)."""
    from pyattn.runtime.memory import get_pool

    t_start, ts = time.perf_counter(), torch.cuda.Stream()
    torch.cuda.synchronize()
    ps = pyattn.Stream(dev, handle=ts.cuda_stream, owner=ts)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = result["environment"]["l2_bytes"] = getattr(props, "L2_cache_size", 0) or (50 << 20)
    with torch.cuda.stream(ts):
        clock = Clock(ts)
        result["preroll"] = clock.cycles_per_ms is not None
        try:
            result["copy_gbs"] = copy_gbs(clock, args.reps)
        except Exception as exc:  # noqa: BLE001
            print(f"copy ceiling failed: {exc}")
        torch.cuda.empty_cache()
        print(f"== pyattn decode benchmark on {dev.name} ({dev.arch}, {dev.sm_count} SMs), torch {torch.__version__}; "
              f"d2d copy {_f(result.get('copy_gbs'), '.0f')} GB/s (read + write)", flush=True)
        for B, ctx in args.shapes:
            if time.perf_counter() - t_start > args.budget:
                print(f"  B={B} ctx={ctx}: skipped (past the --budget of {args.budget:.0f} s)")
                result.setdefault("skipped", []).append([B, ctx])
                continue
            try:
                rows = bench_shape(B, ctx, args.layouts, args, clock, ps, l2, result["detail"])
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the inputs
                traceback.print_exc()
                rows = [{"batch": B, "ctx": ctx, "layout": lay, "kv_bytes": kv_bytes(B, ctx),
                         "errors": [f"setup: {type(exc).__name__}: {exc}"]} for lay in args.layouts]
            for r in rows:
                derive(r, result.get("copy_gbs"))
            result["rows"] += rows
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            attempt({}, "pyattn pool trim", lambda: get_pool(dev).trim())
            save()


def report(result: dict, args) -> int:
    """Print the table, torch's n/a reasons, the detail table and the targets; returns the failure count."""
    rows, env = result["rows"], result["environment"]
    print(f"\n== decode: bf16, D={D}, Hq={HQ}, Hkv={HKV}, q_len 1; {env['gpu']}; d2d copy "
          f"{_f(result.get('copy_gbs'), '.0f')} GB/s; median of {args.reps} loops of {args.loop} calls")
    print("\n".join(table(rows)))
    print("(pyattn us: GPU time of the kernel path; API us: pyattn.paged_decode in a Python loop, host included; "
          "x = torch time / pyattn time, above 1: pyattn faster; * = torch on K/V expanded to Hq heads, 4x the "
          "bytes; + = run_decode failed, paged_decode timed behind the pre-roll; ! = error above 2e-2)"
          + ("" if result.get("preroll") else " [no pre-roll: host gaps may be in the GPU times]"))
    for r in rows:
        where = f"B={r['batch']} ctx={r['ctx']}"
        for e in r.get("errors", []):
            print(f"  error {where} {r['layout']}: {e}")
        if r["layout"] == rows[0]["layout"]:  # torch's figures are per shape: once
            for e in r.get("notes", []) + [f"{k}: {v[:150]}" for k, v in r.items() if "_error" in k]:
                print(f"  torch {where}: {e}")
    if result["detail"]:
        print(f"\nB={DETAIL[0]} ctx={DETAIL[1]} page {LAYOUTS[DETAIL[2]]}, one replica: GPU us per call (events; "
              "pre-roll for the kernel and cache paths) vs wall us per call (Python loop, one sync at the end)")
        print("| path | GPU us | wall us | wall - GPU | max err |\n|---|---|---|---|---|")
        for d in result["detail"]:
            g, w = d.get("gpu_us"), d.get("wall_us")
            print(f"| {d['path']} | {_f(g, '.1f')} | {_f(w, '.1f')} | {_f(w - g if g and w else None, '.1f')} | "
                  f"{_f(d.get('max_err'), '.1e')} |")
    result["targets"] = [{"pass": ok, "text": text} for ok, text in targets(rows)]
    print("\n== targets (pyattn us, the kernel path)")
    for t in result["targets"]:
        print(f"  {'PASS' if t['pass'] else 'MISS' if t['pass'] is False else 'n/a '}  {t['text']}")
    failures = sum(bool(r.get("errors")) or bool(r.get("flagged")) for r in rows)
    skipped = result.get("skipped", [])
    print(f"  {sum(t['pass'] is True for t in result['targets'])} of {len(result['targets'])} targets met; "
          f"{failures} row(s) with errors or flags" + (f"; shapes skipped (budget): {skipped}" if skipped else ""))
    return failures + len(skipped)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if torch is None or not torch.cuda.is_available():
        print("this benchmark needs torch with a visible GPU")
        return 1
    try:
        dev = pyattn.get_device()
    except pyattn.NoDeviceError as exc:
        print(f"no GPU: {exc}")
        return 1
    result = {"environment": {"gpu": dev.name, "arch": dev.arch, "sm_count": dev.sm_count, "torch": torch.__version__,
                              "pyattn": pyattn.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "args": dict(vars(args)), "copy_gbs": None, "rows": [], "detail": []}

    def save():
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1, default=str)
            except Exception as exc:  # noqa: BLE001
                print(f"could not write {args.json}: {exc}")

    try:
        run(args, dev, result, save)
    except Exception:  # noqa: BLE001 - whatever broke, report what was measured
        traceback.print_exc()
        result["rows"].append({"batch": 0, "ctx": 0, "layout": "-", "kv_bytes": 0, "errors": ["run aborted"]})
    failures = report(result, args)
    result.update(failures=failures, seconds=time.perf_counter() - t_start)
    print(f"({result['seconds']:.0f} s)")
    save()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

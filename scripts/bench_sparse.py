"""Sparse attention benchmark: pyattn.block_sparse_attention and pyattn.sparse_attention (CSR) against dense
attention (pyattn.attention, torch SDPA flash / cuDNN), one GPU, one run.

Usage: PYTHONPATH=. python scripts/bench_sparse.py [--json out.json] [--quick] [--seqlen S]
       [--sections block,patterns,csr]

- Block-sparse: B=1, S=16384 (--quick: 4096), H=16 (= kv heads), D=128, bf16, bshd. Random per-head layouts
  (seeded; each block row of each head holds round(density * Nb) blocks) at densities 5/10/20/50%, blocks 128x128
  and 64x64, non-causal; a random 10% layout (of the full square) with causal=True. Patterns: patterns.local
  window 1024 causal (blocks 128, called with causal=True, window=(1024, 0): exactly the token window) and
  patterns.bigbird (blocks 64). Dense baselines: pyattn.attention and torch SDPA (FLASH_ATTENTION,
  CUDNN_ATTENTION; is_causal top-left = bottom-right at Sq == Sk), non-causal and causal.
- blocks % = set blocks / (H Mb Nb) (before any causal cut); visible % = (row, key) pairs computed (layout
  expanded, cut by causal / window) / (H S^2). TFLOP/s = 4 B D visible pairs / time. x = dense time of the same
  causality / this time (pyattn's dense; the better of SDPA's two backends).
- GPU ms: CUDA events around a loop of calls behind a torch.cuda._sleep pre-roll (bench_decode.Clock); the
  block-sparse figure launches block_sparse_attention's plan with the tile lists converted and uploaded once,
  '+' = those internals failed and the public call was timed behind the pre-roll instead. API ms: wall time per
  call of the public function in a Python loop (layout check, conversion, uploads, launch). conv ms:
  pyattn.ops._sparse_layout.tile_lists alone at the kernel's tile shape (host, median).
- Inputs under 4x the L2 size are replicated; loops cycle through the replicas.
- Correctness: rows 0-127 and 256 rows around S/2 of the last head against an fp32 torch reference with the
  expanded mask (a row seeing no key: 0); flagged (!) above 2e-2, absolute or relative to max |ref|.
- CSR: sparse_attention at B=1, S=4096, H=16, D=128, bf16: random_k k=128 and 512 (diagonal included), local
  window (256, 256); random_k 128 also in fp32. GB/s = gathered bytes (nnz * 2 (K, V) * D * itemsize, all
  heads) / time vs the d2d copy ceiling (torch copy_ of 1 GiB, read + write); Gpairs/s = nnz / time; x dense =
  pyattn.attention (dense, same shape and dtype) time / sparse time. GPU ms: the kernel launched with the lists
  validated and uploaded once; API ms: sparse_attention per call (its host validation included).
- Target: "block-sparse 10% density >= 5x dense at seq 16384" (128x128 non-causal 10% vs pyattn dense; also
  printed vs SDPA). A failing configuration prints its error and the run goes on; exit code 1 when a pyattn
  measurement failed or a result was flagged.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import bench_decode as bd  # noqa: E402 - imports torch before pyattn (see there)
from bench_decode import _f, attempt  # noqa: E402

import pyattn  # noqa: E402

torch = bd.torch
B, H, D = 1, 16, 128
DENSITIES = (0.05, 0.10, 0.20, 0.50)
BLOCKS = (128, 64)
CSR_S = 4096
TOL = bd.TOL
SECTIONS = ("block", "patterns", "csr")


def _op(name: str, module: str):
    """``pyattn.<name>``, or from its module while the top-level export is missing."""
    return getattr(pyattn, name, None) or getattr(__import__(module, fromlist=[name]), name)


def gpu_ms(ctx, fns) -> float:
    return ctx.clock.time(fns, ctx.loop, ctx.reps)[0]


def api_ms(ctx, fn) -> float:
    return bd.wall_us(fn, ctx.api_loop, ctx.api_reps) / 1e3


def make_inputs(ctx, S, dtype, seed):
    """Replicas of (q, k, v) torch (B, S, H, D) and their pyattn views: enough to cover 4x the L2."""
    nbytes = 3 * B * S * H * D * torch.empty(0, dtype=dtype).element_size()
    n_rep = 1 if nbytes >= 4 * ctx.l2 else min(8, math.ceil(4 * ctx.l2 / nbytes))
    g = torch.Generator(device="cuda").manual_seed(seed)
    reps_t = [tuple(torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
              for _ in range(n_rep)]
    return reps_t, [tuple(bd.to_pyattn(x, ctx.ps) for x in r) for r in reps_t]


def to_torch(a, ps):
    """A pyattn DeviceArray as a torch tensor (zero-copy through DLPack; bf16 as uint16 bits)."""
    if torch.is_tensor(a):
        return a
    try:
        if a.dtype.name == "bfloat16":
            return torch.from_dlpack(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_dlpack(a)
    except Exception:  # noqa: BLE001
        return torch.from_numpy(a.numpy(ps).astype(np.float32)).cuda()


def random_layout(Mb: int, Nb: int, density: float, seed: int) -> np.ndarray:
    """(H, Mb, Nb) bool: every block row of every head holds round(density * Nb) random blocks."""
    score = np.random.default_rng(seed).random((H, Mb, Nb))
    k = max(1, round(density * Nb))
    m = np.zeros((H, Mb, Nb), bool)
    np.put_along_axis(m, np.argpartition(score, k - 1, axis=-1)[..., :k], True, axis=-1)
    return m


def band(causal: bool, window, S: int) -> tuple:
    from pyattn.ops._sparse_layout import band_limits
    return band_limits(int(causal), window or (-1, -1), S, S)


def visible_pairs(mask3, block, S: int, lohi) -> int:
    """(row, key) pairs inside set blocks and the band lo <= key - row <= hi, summed over all H heads."""
    R, C = block
    Mb, Nb = mask3.shape[1:]
    rows = np.arange(Mb * R, dtype=np.int64)[:, None]
    j0 = np.arange(Nb, dtype=np.int64)[None, :] * C
    a = np.maximum(j0, rows + max(lohi[0], -S))
    b = np.minimum(np.minimum(j0 + C, S) - 1, rows + min(lohi[1], S))
    cnt = np.where(rows < S, np.clip(b - a + 1, 0, None), 0).reshape(Mb, R, Nb).sum(1)  # (Mb, Nb)
    per = (mask3 * cnt[None]).sum()
    return int(per) * (H if mask3.shape[0] == 1 else 1)


def layout_allowed(mask3, block, lohi, S):
    """fn(h, rows) -> (len(rows), S) bool: the keys head h's rows see (mask3 None = dense)."""
    def fn(h, rows):
        d = np.arange(S)[None, :] - rows[:, None]
        ok = (d >= lohi[0]) & (d <= lohi[1])
        if mask3 is not None:
            m = mask3[h if mask3.shape[0] > 1 else 0]
            ok &= m[rows // block[0]][:, np.arange(S) // block[1]]
        return ok
    return fn


def check(row: dict, outs, qkv, allowed, ctx) -> None:
    """Max abs error of each output's check rows (last head) against an fp32 reference with ``allowed``."""
    q, k, v = qkv
    S, h = q.shape[1], H - 1
    rows = np.unique(np.concatenate([np.arange(min(128, S)), np.arange(max(S // 2 - 128, 0), min(S // 2 + 128, S))]))
    ti = torch.from_numpy(rows).cuda()
    ok = torch.from_numpy(allowed(h, rows)).cuda()
    s = (q[0, ti, h].float() @ k[0, :, h].float().T) / math.sqrt(D)
    ref = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0) @ v[0, :, h].float()
    amax = max(ref.abs().max().item(), 1e-30)
    for name, fn in outs:
        out = attempt(row, f"check {name}", fn)
        if out is None:
            continue
        err = attempt(row, f"check {name}", lambda: (to_torch(out, ctx.ps)[0, ti, h].float() - ref).abs().max().item())
        if err is None:
            continue
        row["max_err"] = max(row.get("max_err", 0.0), err)
        if not (err <= TOL and err / amax <= TOL):  # also catches NaN
            row["flagged"] = True
            print(f"!!!!! WARNING: pyattn ({name}) differs from the fp32 reference by {err:.3e} (max |ref| "
                  f"{amax:.3e}) for {row.get('case')} !!!!!")


def bench_dense(ctx, reps_t, reps_d, causal: bool, S: int, notes: list) -> list:
    """Rows for pyattn.attention and SDPA flash / cuDNN at one causality."""
    pairs = H * (S * (S + 1) // 2 if causal else S * S)
    base = {"causal": causal, "seqlen": S, "block": "-", "blocks_pct": 100.0, "visible_pct": 100 * pairs / (H * S * S),
            "flops": 4 * B * D * pairs}
    row = dict(base, case="dense pyattn", kind="pyattn")
    fns = [lambda r=r: pyattn.attention(*r, causal=causal, stream=ctx.ps) for r in reps_d]
    row["ms"] = attempt(row, "pyattn.attention", lambda: gpu_ms(ctx, fns))
    row["api_ms"] = attempt(row, "pyattn.attention (wall)", lambda: api_ms(ctx, fns[0]))
    check(row, [("attention", fns[0])], reps_t[0], layout_allowed(None, None, band(causal, None, S), S), ctx)
    rows = [row]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        fns = [lambda r=r: sdpa(*(x.transpose(1, 2) for x in r), is_causal=causal) for r in reps_t]
        try:
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")
                rows.append(dict(base, case=f"dense SDPA {name}", kind="sdpa", ms=gpu_ms(ctx, fns)))
        except Exception as exc:  # noqa: BLE001 - a backend torch cannot run here is "n/a", not a failure
            notes.append(f"SDPA {name} causal={causal} S={S}: {type(exc).__name__}: {str(exc)[:200]}")
    return rows


def bs_kernel_fns(reps_d, mask3, block, causal, window, ps):
    """Launches of block_sparse_attention's plan, tile lists converted and uploaded once (the kernel path)."""
    from pyattn.kernels.registry import get_kernel
    from pyattn.ops._plan import make_plan, run_plan
    from pyattn.ops.block_sparse import sparse_spec
    from pyattn.ops._problem import make_problem
    from pyattn.ops._sparse_layout import tile_lists

    P, _ = make_problem(*reps_d[0], causal=causal, window=window, layout="bshd")
    dev = reps_d[0][0].device
    dev.activate()
    spec = sparse_spec(P.dtype, P.head_dim, dev.arch, False, False, block)
    kernel, t = get_kernel(spec, dev), spec.tiles
    tl = tile_lists(mask3, block, t.block_m, t.block_n, P.seqlen_q, P.seqlen_k, causal=P.causal, window=P.window)
    lists = [pyattn.asarray(np.ascontiguousarray(a), stream=ps) for a in
             (tl.ptr, tl.idx if tl.nnz else np.zeros(1, np.int32), tl.bits if tl.nnz else np.zeros(1, np.uint64))]
    plan = make_plan(P, spec, kernel, reps_d[0], tile_stride_h=tl.stride_h)
    return [lambda r=r: run_plan(plan, r, (None, None, None, None, *lists), ps, return_lse=False)[0] for r in reps_d]


def bench_block(ctx, reps_t, reps_d, case, mask, block, causal, window, S) -> dict:
    from pyattn.ops._sparse_layout import tile_lists
    from pyattn.ops.block_sparse import sparse_spec

    bsa = _op("block_sparse_attention", "pyattn.ops.block_sparse")
    mask3 = mask[None] if mask.ndim == 2 else mask
    lohi = band(causal, window, S)
    pairs = visible_pairs(mask3, block, S, lohi)
    row = {"case": case, "kind": "sparse", "block": f"{block[0]}x{block[1]}", "causal": causal, "seqlen": S,
           "blocks_pct": 100 * float(mask3.mean()), "visible_pct": 100 * pairs / (H * S * S),
           "flops": 4 * B * D * pairs}
    kw = {"causal": causal} if window is None else {"causal": causal, "window": window}
    api = [lambda r=r: bsa(*r, mask, block, stream=ctx.ps, **kw) for r in reps_d]
    kfns = attempt(row, "kernel path setup", lambda: bs_kernel_fns(reps_d, mask3, block, causal, window, ctx.ps))
    ms = kfns and attempt(row, "kernel path", lambda: gpu_ms(ctx, kfns))
    if not ms:
        row["path"] = "block_sparse_attention behind the pre-roll"
        ms = attempt(row, "block_sparse_attention (pre-roll)", lambda: gpu_ms(ctx, api))
    row["ms"] = ms or None
    row["api_ms"] = attempt(row, "block_sparse_attention (wall)", lambda: api_ms(ctx, api[0]))
    t = sparse_spec("bfloat16", D, pyattn.get_device().arch, False, False, block).tiles
    row["tile"] = f"{t.block_m}x{t.block_n}"
    row["conv_ms"] = attempt(row, "tile_lists", lambda: bd.wall_us(
        lambda: tile_lists(mask3, block, t.block_m, t.block_n, S, S, causal=int(causal), window=window or (-1, -1)),
        1, ctx.reps) / 1e3)
    check(row, ([("kernel path", kfns[0])] if kfns else []) + [("block_sparse_attention", api[0])], reps_t[0],
          layout_allowed(mask3, block, lohi, S), ctx)
    return row


def run_block(ctx, result, sections, save) -> None:
    S = ctx.seqlen
    reps_t, reps_d = make_inputs(ctx, S, torch.bfloat16, 1)
    rows = result["block_rows"]
    for causal in (False, True):
        rows += bench_dense(ctx, reps_t, reps_d, causal, S, result["notes"])
        print("  dense causal=%s: " % causal + ", ".join(f"{r['case'][6:]} {_f(r.get('ms'), '.3f')} ms" for r in rows
                                                        if r["causal"] == causal), flush=True)
    cases = []
    if "block" in sections:
        for bs in BLOCKS:
            Mb = -(-S // bs)
            for dens in DENSITIES:
                cases.append((f"random {dens:.0%}", random_layout(Mb, Mb, dens, 1000 * bs + round(100 * dens)),
                              (bs, bs), False, None))
            cases.append(("random 10% causal", random_layout(Mb, Mb, 0.10, 7 * bs), (bs, bs), True, None))
    if "patterns" in sections:
        from pyattn import patterns as pt
        cases.append(("local 1024 causal", lambda: pt.local(S, window=1024, causal=True, block_size=128), (128, 128),
                      True, (1024, 0)))
        cases.append(("bigbird", lambda: pt.bigbird(S, block_size=64), (64, 64), False, None))
    for case, mask, block, causal, window in cases:
        try:
            row = bench_block(ctx, reps_t, reps_d, case, mask() if callable(mask) else mask, block, causal, window, S)
        except Exception as exc:  # noqa: BLE001 - e.g. the pattern builder failed
            traceback.print_exc()
            row = {"case": case, "kind": "sparse", "block": f"{block[0]}x{block[1]}", "causal": causal, "seqlen": S,
                   "errors": [f"{type(exc).__name__}: {exc}"]}
        rows.append(row)
        print(f"  {case} {row['block']} causal={causal}: {_f(row.get('ms'), '.3f')} ms, visible "
              f"{_f(row.get('visible_pct'), '.1f')}%, conv {_f(row.get('conv_ms'), '.2f')} ms, max err "
              f"{_f(row.get('max_err'), '.1e')}", flush=True)
        save()
    derive_block(rows)


def derive_block(rows) -> None:
    for causal in (False, True):
        dense = [r for r in rows if r.get("kind") != "sparse" and r["causal"] == causal and r.get("ms")]
        py = next((r["ms"] for r in dense if r["kind"] == "pyattn"), None)
        sd = min((r["ms"] for r in dense if r["kind"] == "sdpa"), default=None)
        for r in rows:
            if r["causal"] == causal and r.get("ms"):
                r["tflops"] = r["flops"] / r["ms"] / 1e9
                r["x_pyattn"] = py / r["ms"] if py else None
                r["x_sdpa"] = sd / r["ms"] if sd else None


def csr_kernel_fns(reps_d, indices, offsets, ps):
    """sparse_attention's launch with the lists validated and uploaded once; (fns, out, keep): keep holds
    the device index arrays, which must outlive the launches (the params carry only their pointers)."""
    from pyattn.kernels.registry import get_kernel
    from pyattn.ops import sparse as sp
    from pyattn.ops._plan import ptx_requested
    from pyattn.ops._problem import make_problem
    from pyattn.runtime.launch import launch

    P, _ = make_problem(*reps_d[0], layout="bshd")
    csr = sp.check_csr(indices, offsets, P.batch, P.heads_q, P.seqlen_q, P.seqlen_k)
    dev = reps_d[0][0].device
    dev.activate()
    spec = sp._spec_for(P.dtype, P.head_dim, dev.arch, ptx_requested())
    kernel = get_kernel(spec, dev)
    d_idx, d_off = (pyattn.asarray(a, stream=ps) for a in (csr.indices, csr.offsets))
    out = pyattn.empty(P.out_shape(), reps_d[0][0].dtype, stream=ps)
    Bq, Hq, Sq = P.batch, P.heads_q, P.seqlen_q
    fns = []
    for q, k, v in reps_d:
        vals = {"q": q.ptr, "k": k.ptr, "v": v.ptr, "o": out.ptr, "lse": 0, "indices": d_idx.ptr, "offsets": d_off.ptr,
                "off_stride_b": csr.stride_b, "off_stride_h": csr.stride_h, "lse_stride_b": Hq * Sq,
                "lse_stride_h": Sq, "batch": Bq, "heads_q": Hq, "group": P.group, "seqlen_q": Sq,
                "seqlen_k": P.seqlen_k, "head_dim": P.head_dim, "scale_log2": P.scale * 1.4426950408889634}
        for prefix, st in (("q", P.q_strides), ("k", P.k_strides), ("v", P.v_strides), ("o", out.elem_strides[:3])):
            vals.update({f"{prefix}_stride_{axis}": x for axis, x in zip("bsh", st)})
        params = spec.params.pack(vals)
        fns.append(lambda p=params: launch(kernel, spec.grid(Bq, Hq, Sq), (spec.threads, 1, 1), spec.shared_bytes,
                                           ps, p))
    return fns, out, (d_idx, d_off)


def run_csr(ctx, result, save) -> None:
    sa = _op("sparse_attention", "pyattn.ops.sparse")
    from pyattn import patterns as pt
    S, rows = CSR_S, result["csr_rows"]
    cases = [("random_k 128", "bfloat16", lambda: pt.random_k(S, k=128, seed=1)),
             ("random_k 512", "bfloat16", lambda: pt.random_k(S, k=512, seed=2)),
             ("local 256", "bfloat16", lambda: pt.local(S, window=256)),
             ("random_k 128", "float32", lambda: pt.random_k(S, k=128, seed=1))]
    inputs, dense = {}, {}
    for case, dt, make in cases:
        row = {"case": case, "dtype": dt, "seqlen": S}
        try:
            if dt not in inputs:
                inputs[dt] = make_inputs(ctx, S, getattr(torch, dt), 3)
                fns = [lambda r=r: pyattn.attention(*r, stream=ctx.ps) for r in inputs[dt][1]]
                dense[dt] = attempt(row, f"pyattn.attention {dt}", lambda: gpu_ms(ctx, fns))
            reps_t, reps_d = inputs[dt]
            idx, off = make()
            nnz = int(off[-1]) * B * H
            item = reps_t[0][0].element_size()
            row.update(nnz=nnz, keys_per_row=nnz / (B * H * S), gathered_bytes=nnz * 2 * D * item, dense_ms=dense[dt])
            api = [lambda r=r: sa(*r, idx, off, stream=ctx.ps) for r in reps_d]
            kp = attempt(row, "kernel path setup", lambda: csr_kernel_fns(reps_d, idx, off, ctx.ps))
            ms = kp and attempt(row, "kernel path", lambda: gpu_ms(ctx, kp[0]))
            if not ms:
                row["path"] = "sparse_attention behind the pre-roll"
                ms = attempt(row, "sparse_attention (pre-roll)", lambda: gpu_ms(ctx, api))
            row["ms"] = ms or None
            row["api_ms"] = attempt(row, "sparse_attention (wall)", lambda: api_ms(ctx, api[0]))
            outs = ([("kernel path", lambda: (kp[0][0](), kp[1])[1])] if kp else []) + [("sparse_attention", api[0])]
            full = pt.csr_to_mask(idx, off, S)  # (S, S) bool
            check(row, outs, reps_t[0], lambda h, r: full[r], ctx)
            if row["ms"]:
                row["gbs"] = row["gathered_bytes"] / row["ms"] / 1e6
                row["pct_copy"] = row["gbs"] / result["copy_gbs"] * 100 if result.get("copy_gbs") else None
                row["gpairs"] = nnz / row["ms"] / 1e6
                row["x_dense"] = dense[dt] / row["ms"] if dense[dt] else None
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            row.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")
        rows.append(row)
        print(f"  CSR {case} {dt}: {_f(row.get('ms'), '.3f')} ms ({_f(row.get('gbs'), '.0f')} GB/s gathered), dense "
              f"{_f(row.get('dense_ms'), '.3f')} ms, max err {_f(row.get('max_err'), '.1e')}", flush=True)
        save()


def md(title: str, cols, cells) -> list:
    """A markdown table: a title line, the header, one ``| ... |`` line per row of ``cells``."""
    return [title, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in cells]


def _ms(r) -> str:
    ms = _f(r.get("ms"), ".3f") + ("+" if r.get("path") else "")
    return "FAILED" if ms == "n/a" and r.get("kind") != "sdpa" else ms


def _err(r) -> str:
    return _f(r.get("max_err"), ".1e") + (" !" if r.get("flagged") else "")


def tables(result) -> list:
    out = md(f"\n== block-sparse: B={B}, S={result['args']['seqlen']}, H={H}, D={D}, bf16",
             ("case", "block", "causal", "blocks %", "visible %", "GPU ms", "TFLOP/s", "x pyattn dense", "x SDPA dense",
              "API ms", "conv ms", "max err"),
             [(r["case"], r.get("block", "-"), "yes" if r["causal"] else "no", _f(r.get("blocks_pct"), ".1f"),
               _f(r.get("visible_pct"), ".1f"), _ms(r), _f(r.get("tflops"), ".0f"), _f(r.get("x_pyattn"), ".2f"),
               _f(r.get("x_sdpa"), ".2f"), _f(r.get("api_ms"), ".3f"), _f(r.get("conv_ms"), ".2f"), _err(r))
              for r in result["block_rows"]])
    return out + md(f"\n== CSR sparse_attention: B={B}, S={CSR_S}, H={H}, D={D}; d2d copy "
                    f"{_f(result.get('copy_gbs'), '.0f')} GB/s",
                    ("pattern", "dtype", "keys/row", "GPU ms", "API ms", "GB/s", "% of copy", "Gpairs/s", "dense ms",
                     "x dense", "max err"),
                    [(r["case"], r["dtype"], _f(r.get("keys_per_row"), ".0f"), _ms(r), _f(r.get("api_ms"), ".3f"),
                      _f(r.get("gbs"), ".0f"), _f(r.get("pct_copy"), ".0f"), _f(r.get("gpairs"), ".1f"),
                      _f(r.get("dense_ms"), ".3f"), _f(r.get("x_dense"), ".2f"), _err(r)) for r in result["csr_rows"]])


def targets(result) -> list:
    S = result["args"]["seqlen"]
    r = next((r for r in result["block_rows"] if r["case"] == "random 10%" and r.get("block") == "128x128"
              and not r["causal"]), None)
    if r is None:
        return []
    note = "" if S >= 16384 else f" (measured at seq {S}, not 16384)"
    res = []
    for key, what in (("x_pyattn", "pyattn dense"), ("x_sdpa", "SDPA best dense")):
        x = r.get(key)
        res.append({"pass": None if x is None else x >= 5.0,
                    "text": f"block-sparse 10% density >= 5x dense at seq 16384: 128x128 non-causal {_f(x, '.2f')}x "
                            f"vs {what}{note}"})
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write every figure to this JSON file (rewritten after each row)")
    p.add_argument("--quick", action="store_true", help="seq 4096 for the block-sparse part; shorter loops")
    p.add_argument("--seqlen", type=int, default=None, help="block-sparse sequence length (default 16384; quick 4096)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        p.error(f"--sections: a subset of {','.join(SECTIONS)}")
    args.seqlen = args.seqlen or (4096 if args.quick else 16384)
    if args.seqlen % 128 or args.seqlen < 512:
        p.error("--seqlen: a multiple of 128, at least 512")
    args.reps, args.loop = (3, 10) if args.quick else (5, 20)
    args.api_reps, args.api_loop = 3, 5
    return args


def start(args, what: str):
    """(result, save) with the run's environment, or None without a GPU. Makes a new torch stream current and
    sets args.ps (its pyattn Stream), args.clock (bench_decode.Clock), args.l2; measures the copy ceiling."""
    if torch is None or not torch.cuda.is_available():
        print("this benchmark needs torch with a visible GPU")
        return None
    try:
        dev = pyattn.get_device()
    except pyattn.NoDeviceError as exc:
        print(f"no GPU: {exc}")
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    args.l2 = getattr(props, "L2_cache_size", 0) or (50 << 20)
    result = {"environment": {"gpu": dev.name, "arch": dev.arch, "sm_count": dev.sm_count, "torch": torch.__version__,
                              "pyattn": pyattn.__version__, "l2_bytes": args.l2,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "args": dict(vars(args)), "copy_gbs": None, "notes": [], "t0": time.perf_counter()}

    def save():
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1, default=str)
            except Exception as exc:  # noqa: BLE001
                print(f"could not write {args.json}: {exc}")

    ts = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda.set_stream(ts)  # every torch op of the run on ts, which pyattn's calls use too
    args.ps = pyattn.Stream(dev, handle=ts.cuda_stream, owner=ts)
    args.clock = bd.Clock(ts)
    result["preroll"] = args.clock.cycles_per_ms is not None
    try:
        result["copy_gbs"] = bd.copy_gbs(args.clock, args.reps)
    except Exception as exc:  # noqa: BLE001
        print(f"copy ceiling failed: {exc}")
    torch.cuda.empty_cache()
    print(f"== pyattn {what} benchmark on {dev.name} ({dev.arch}, {dev.sm_count} SMs), torch {torch.__version__}; "
          f"d2d copy {_f(result.get('copy_gbs'), '.0f')} GB/s (read + write)", flush=True)
    return result, save


def section(result, key: str, what: str, fn, save, blank=None) -> None:
    """``fn()``; a failure it lets through becomes a row (``blank``'s keys) of ``result[key]`` with its error."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the inputs
        traceback.print_exc()
        result[key].append(dict(blank or {"case": f"{what} setup", "kind": "setup", "dtype": "-", "causal": False},
                                errors=[f"{what}: {type(exc).__name__}: {exc}"]))
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    save()


def finish(result, rows, save) -> int:
    """Print the errors, torch's notes and the targets; save; the exit code."""
    keys = ("case", "block", "dtype", "batch", "ctx", "cache", "dataset", "tensor", "kind")
    for r in rows:
        for e in r.get("errors", []):
            print(f"  error {' '.join(str(r[k]) for k in keys if k in r)}: {e}")
    for n in result["notes"]:
        print(f"  note: {n}")
    print("\n== targets")
    for t in result["targets"]:
        print(f"  {'PASS' if t['pass'] else 'MISS' if t['pass'] is False else 'n/a '}  {t['text']}")
    failures = sum(bool(r.get("errors")) or bool(r.get("flagged")) for r in rows)
    print(f"  {sum(t['pass'] is True for t in result['targets'])} of {len(result['targets'])} targets met; "
          f"{failures} row(s) with errors or flags")
    result.update(failures=failures, seconds=time.perf_counter() - result.pop("t0"))
    print(f"({result['seconds']:.0f} s)")
    save()
    return 1 if failures else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    started = start(args, "sparse")
    if started is None:
        return 1
    result, save = started
    result.update(block_rows=[], csr_rows=[])
    if {"block", "patterns"} & set(args.sections):
        section(result, "block_rows", "block-sparse", lambda: run_block(args, result, args.sections, save), save)
    if "csr" in args.sections:
        section(result, "csr_rows", "CSR", lambda: run_csr(args, result, save), save)
    derive_block(result["block_rows"])
    print("\n".join(tables(result)))
    print("(GPU ms: kernel time behind a pre-roll; + = internals failed, the public call timed instead; API ms: the "
          "public call in a Python loop; x = dense time / sparse time, above 1: sparse faster; ! = error above 2e-2)"
          + ("" if result.get("preroll") else " [no pre-roll: host gaps may be in the GPU times]"))
    result["targets"] = targets(result)
    return finish(result, result["block_rows"] + result["csr_rows"], save)


if __name__ == "__main__":
    sys.exit(main())

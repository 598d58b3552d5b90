"""Sparse attention benchmark: pyattn.block_sparse_attention and pyattn.sparse_attention (CSR) against dense
attention (pyattn.attention, torch SDPA FA2 / cuDNN), one GPU, one run.

Usage: PYTHONPATH=. python scripts/bench_sparse.py [--json out.json] [--quick] [--seqlen S]
       [--sections block,patterns,csr]

- Block-sparse: B=1, S=16384 (--quick: 4096), H=16 (= kv heads), D=128, bf16, bshd. Random per-head layouts
  (seeded; each block row of each head holds round(density * Nb) blocks) at densities 5/10/20/50%, blocks 128x128
  and 64x64, non-causal; a random 10% layout (of the full square) with causal=True. Patterns: patterns.local
  window 1024 causal (blocks 128, called with causal=True, window=(1024, 0): exactly the token window) and
  patterns.bigbird (blocks 64). Dense baselines: pyattn.attention and torch SDPA (FA2, cuDNN; is_causal top-left =
  bottom-right at Sq == Sk), non-causal and causal.
- blocks % = set blocks / (H Mb Nb) (before any causal cut); visible % = (row, key) pairs computed (layout
  expanded, cut by causal / window) / (H S^2). TFLOP/s = 4 B D visible pairs / time. x = dense time of the same
  causality / this time (pyattn's dense; the better of SDPA's two backends).
- GPU ms: block_sparse_attention itself, a loop behind the pre-roll (harness.Bench.gpu_ms; the layout's tile lists
  are cached on the device by its bytes, so a repeated call costs a hash and the kernel). API ms: wall time per
  call of a Python loop (layout check and hash, launch). first ms: the first call with a new layout (its
  conversion to tile lists and upload, then the kernel), the kernel already loaded.
- Inputs under 4x the L2 size are replicated; loops cycle through the replicas.
- Correctness: rows 0-127 and 256 rows around S/2 of the last head against an fp32 torch reference with the
  expanded mask (a row seeing no key: 0); flagged (!) above 2e-2, absolute or relative to max |ref|.
- CSR: sparse_attention at B=1, S=4096, H=16, D=128, bf16: random_k k=128 and 512 (diagonal included), local
  window (256, 256); random_k 128 also in fp32. sparse_attention takes host (NumPy) lists and uploads them through
  pinned staging at every call, so each call is timed behind its own pre-roll: GPU ms includes the lists' upload
  (lists MB). GB/s = gathered bytes (nnz * 2 (K, V) * D * itemsize, all heads) / time vs the d2d copy ceiling;
  Gpairs/s = nnz / time; x dense = pyattn.attention (dense, same shape and dtype) time / sparse time. API ms:
  sparse_attention per call in a Python loop (its host validation of the lists included).
- Target: "block-sparse 10% density >= 5x dense at seq 16384" (128x128 non-causal 10% vs pyattn dense; also
  printed vs SDPA). A failing configuration prints its error and the run goes on; exit code 1 when a pyattn
  measurement failed or a result was flagged.
"""

from __future__ import annotations

import gc
import math
import sys
import time
import traceback

import numpy as np

import harness
import pyattn
from bench_prefill import make_qkv
from harness import attempt, fmt

B, H, D = 1, 16, 128
DENSITIES = (0.05, 0.10, 0.20, 0.50)
BLOCKS = (128, 64)
CSR_S = 4096
TOL = 2e-2
SECTIONS = ("block", "patterns", "csr")
UNBOUNDED = 2 ** 62


def inputs(bench, S: int, dtype: str, seed: int):
    """(torch replicas, pyattn replicas) of (q, k, v) (B, S, H, D): enough to cover 4x the L2."""
    n = bench.replicas(3 * B * S * H * D * (4 if dtype == "float32" else 2))
    sets, tsets = make_qkv(bench, (B, S, H, D), dtype, seed, n)
    return tsets, sets


def random_layout(Mb: int, Nb: int, density: float, seed: int) -> np.ndarray:
    """(H, Mb, Nb) bool: every block row of every head holds round(density * Nb) random blocks."""
    score = np.random.default_rng(seed).random((H, Mb, Nb))
    k = max(1, round(density * Nb))
    m = np.zeros((H, Mb, Nb), bool)
    np.put_along_axis(m, np.argpartition(score, k - 1, axis=-1)[..., :k], True, axis=-1)
    return m


def band(causal: bool, window) -> tuple:
    """(lo, hi): row i sees key j iff lo <= j - i <= hi (Sq == Sk, so bottom-right is the diagonal)."""
    lo, hi = -UNBOUNDED, (0 if causal else UNBOUNDED)
    if window is not None:
        lo = -window[0] if window[0] >= 0 else lo
        hi = min(hi, window[1]) if window[1] >= 0 else hi
    return lo, hi


def visible_pairs(mask3, block, S: int, lohi) -> int:
    """(row, key) pairs inside set blocks and the band lo <= key - row <= hi, summed over all H heads."""
    R, C = block
    Mb, Nb = mask3.shape[1:]
    rows = np.arange(Mb * R, dtype=np.int64)[:, None]
    j0 = np.arange(Nb, dtype=np.int64)[None, :] * C
    a = np.maximum(j0, rows + max(lohi[0], -S))
    b = np.minimum(np.minimum(j0 + C, S) - 1, rows + min(lohi[1], S))
    cnt = np.where(rows < S, np.clip(b - a + 1, 0, None), 0).reshape(Mb, R, Nb).sum(1)  # (Mb, Nb)
    return int((mask3 * cnt[None]).sum()) * (H if mask3.shape[0] == 1 else 1)


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


def check(row: dict, outs, qkv, allowed) -> None:
    """Max abs error of each output's check rows (last head) against an fp32 reference with ``allowed``."""
    import torch

    q, k, v = qkv
    S, h = q.shape[1], H - 1
    rows = np.unique(np.concatenate([np.arange(min(128, S)), np.arange(max(S // 2 - 128, 0), min(S // 2 + 128, S))]))
    ti, ok = torch.from_numpy(rows).cuda(), torch.from_numpy(allowed(h, rows)).cuda()
    s = (q[0, ti, h].float() @ k[0, :, h].float().T) / math.sqrt(D)
    ref = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0) @ v[0, :, h].float()
    amax = max(ref.abs().max().item(), 1e-30)
    for name, fn in outs:
        err = attempt(row, f"check {name}", lambda: (harness.to_torch(fn())[0, ti, h].float() - ref).abs().max().item())
        if err is None:
            continue
        row["max_err"] = max(row.get("max_err", 0.0), err)
        if not (err <= TOL and err / amax <= TOL):  # also catches NaN
            row["flagged"] = True
            print(f"!!!!! WARNING: pyattn ({name}) differs from the fp32 reference by {err:.3e} (max |ref| "
                  f"{amax:.3e}) for {row.get('case')} !!!!!")


def bench_dense(bench, args, reps_t, reps_d, causal: bool, S: int, notes: list) -> list:
    """Rows for pyattn.attention and SDPA FA2 / cuDNN at one causality."""
    pairs = H * (S * (S + 1) // 2 if causal else S * S)
    base = {"causal": causal, "seqlen": S, "block": "-", "blocks_pct": 100.0, "visible_pct": 100 * pairs / (H * S * S),
            "flops": 4 * B * D * pairs}
    row = dict(base, case="dense pyattn", kind="pyattn")
    fns = [lambda r=r: pyattn.attention(*r, causal=causal, stream=bench.stream) for r in reps_d]
    row["ms"] = attempt(row, "pyattn.attention", lambda: bench.gpu_ms(fns, loop=args.loop, reps=args.reps,
                                                                      label=f"dense causal={causal}").ms)
    row["api_ms"] = attempt(row, "pyattn.attention (wall)", lambda: bench.wall_ms(fns[0], loop=5, reps=3))
    check(row, [("attention", fns[0])], reps_t[0], layout_allowed(None, None, band(causal, None), S))
    rows = [row]
    for name in harness.SDPA_BACKENDS:
        tfns = [harness.sdpa(bench.torch, name, *(x.transpose(1, 2) for x in r), is_causal=causal) for r in reps_t]
        try:
            t = bench.gpu_ms(tfns, loop=args.loop, reps=args.reps, label=f"SDPA {name} causal={causal}")
            rows.append(dict(base, case=f"dense SDPA {name}", kind="sdpa", ms=t.ms))
        except Exception as exc:  # noqa: BLE001 - a backend torch cannot run here is "n/a", not a failure
            notes.append(f"SDPA {name} causal={causal} S={S}: {type(exc).__name__}: {str(exc)[:200]}")
    return rows


def bench_block(bench, args, reps_t, reps_d, case, mask, block, causal, window, S) -> dict:
    mask3 = mask[None] if mask.ndim == 2 else mask
    lohi = band(causal, window)
    pairs = visible_pairs(mask3, block, S, lohi)
    row = {"case": case, "kind": "sparse", "block": f"{block[0]}x{block[1]}", "causal": causal, "seqlen": S,
           "blocks_pct": 100 * float(mask3.mean()), "visible_pct": 100 * pairs / (H * S * S),
           "flops": 4 * B * D * pairs}
    kw = {"causal": causal} if window is None else {"causal": causal, "window": window}
    fns = [lambda r=r: pyattn.block_sparse_attention(*r, mask, block, stream=bench.stream, **kw) for r in reps_d]
    tiny = pyattn.empty((1, 2 * block[0], H, D), reps_d[0][0].dtype, stream=bench.stream)
    pyattn.block_sparse_attention(tiny, tiny, tiny, np.ones((2, 2), bool), block, stream=bench.stream)  # the kernel
    bench.sync()
    t0 = time.perf_counter()
    fns[0]()
    bench.sync()
    row["first_ms"] = (time.perf_counter() - t0) * 1e3  # the layout's conversion and upload, then the kernel
    row["ms"] = attempt(row, "block_sparse_attention", lambda: bench.gpu_ms(fns, loop=args.loop, reps=args.reps,
                                                                             label=f"{case} {row['block']}").ms)
    row["api_ms"] = attempt(row, "block_sparse_attention (wall)", lambda: bench.wall_ms(fns[0], loop=5, reps=3))
    check(row, [("block_sparse_attention", fns[0])], reps_t[0], layout_allowed(mask3, block, lohi, S))
    return row


def run_block(bench, args, result) -> None:
    S = args.seqlen
    reps_t, reps_d = inputs(bench, S, "bfloat16", 1)
    rows = result["block_rows"]
    for causal in (False, True):
        rows += bench_dense(bench, args, reps_t, reps_d, causal, S, result["notes"])
        print(f"  dense causal={causal}: " + ", ".join(f"{r['case'][6:]} {fmt(r.get('ms'), '.3f')} ms" for r in rows
                                                       if r["causal"] == causal), flush=True)
    cases = []
    if "block" in args.sections:
        for bs in BLOCKS:
            Mb = -(-S // bs)
            cases += [(f"random {d:.0%}", random_layout(Mb, Mb, d, 1000 * bs + round(100 * d)), (bs, bs), False, None)
                      for d in DENSITIES]
            cases.append(("random 10% causal", random_layout(Mb, Mb, 0.10, 7 * bs), (bs, bs), True, None))
    if "patterns" in args.sections:
        pt = pyattn.patterns
        cases.append(("local 1024 causal", lambda: pt.local(S, window=1024, causal=True, block_size=128), (128, 128),
                      True, (1024, 0)))
        cases.append(("bigbird", lambda: pt.bigbird(S, block_size=64), (64, 64), False, None))
    for case, mask, block, causal, window in cases:
        try:
            row = bench_block(bench, args, reps_t, reps_d, case, mask() if callable(mask) else mask, block, causal,
                              window, S)
        except Exception as exc:  # noqa: BLE001 - e.g. the pattern builder failed
            traceback.print_exc()
            row = {"case": case, "kind": "sparse", "block": f"{block[0]}x{block[1]}", "causal": causal, "seqlen": S,
                   "errors": [f"{type(exc).__name__}: {exc}"]}
        rows.append(row)
        print(f"  {case} {row['block']} causal={causal}: {fmt(row.get('ms'), '.3f')} ms, visible "
              f"{fmt(row.get('visible_pct'), '.1f')}%, first call {fmt(row.get('first_ms'), '.2f')} ms, max err "
              f"{fmt(row.get('max_err'), '.1e')}", flush=True)
        harness.save_json(args.json, result)


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


def run_csr(bench, args, result) -> None:
    pt, S, rows = pyattn.patterns, CSR_S, result["csr_rows"]
    cases = [("random_k 128", "bfloat16", lambda: pt.random_k(S, k=128, seed=1)),
             ("random_k 512", "bfloat16", lambda: pt.random_k(S, k=512, seed=2)),
             ("local 256", "bfloat16", lambda: pt.local(S, window=256)),
             ("random_k 128", "float32", lambda: pt.random_k(S, k=128, seed=1))]
    data, dense = {}, {}
    for case, dt, make in cases:
        row = {"case": case, "dtype": dt, "seqlen": S}
        try:
            if dt not in data:
                data[dt] = inputs(bench, S, dt, 3)
                fns = [lambda r=r: pyattn.attention(*r, stream=bench.stream) for r in data[dt][1]]
                dense[dt] = attempt(row, f"pyattn.attention {dt}", lambda: bench.gpu_ms(
                    fns, loop=args.loop, reps=args.reps, label=f"dense {dt}").ms)
            reps_t, reps_d = data[dt]
            idx, off = make()
            nnz = int(off[-1]) * B * H
            row.update(nnz=nnz, keys_per_row=nnz / (B * H * S), gathered_bytes=nnz * 2 * D * reps_t[0][0].element_size(),
                       list_bytes=idx.nbytes + off.nbytes, dense_ms=dense[dt])
            fns = [lambda r=r: pyattn.sparse_attention(*r, idx, off, stream=bench.stream) for r in reps_d]
            row["ms"] = attempt(row, "sparse_attention", lambda: bench.gpu_ms(
                fns, loop=args.loop // 2, reps=args.reps, per_call=True, label=f"CSR {case} {dt}").ms)
            row["api_ms"] = attempt(row, "sparse_attention (wall)", lambda: bench.wall_ms(fns[0], loop=3, reps=3))
            full = pt.csr_to_mask(idx, off, S)  # (S, S) bool
            check(row, [("sparse_attention", fns[0])], reps_t[0], lambda h, r: full[r])
            if row["ms"]:
                row["gbs"] = row["gathered_bytes"] / row["ms"] / 1e6
                row["pct_copy"] = row["gbs"] / result["copy_gbs"] * 100 if result.get("copy_gbs") else None
                row["gpairs"] = nnz / row["ms"] / 1e6
                row["x_dense"] = dense[dt] / row["ms"] if dense[dt] else None
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            row.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")
        rows.append(row)
        print(f"  CSR {case} {dt}: {fmt(row.get('ms'), '.3f')} ms ({fmt(row.get('gbs'), '.0f')} GB/s gathered), dense "
              f"{fmt(row.get('dense_ms'), '.3f')} ms, max err {fmt(row.get('max_err'), '.1e')}", flush=True)
        harness.save_json(args.json, result)


def ms_cell(r) -> str:
    ms = fmt(r.get("ms"), ".3f")
    return "FAILED" if ms == "n/a" and r.get("kind") != "sdpa" else ms


def err_cell(r) -> str:
    return fmt(r.get("max_err"), ".1e") + (" !" if r.get("flagged") else "")


def tables(result) -> list:
    out = harness.md_table(
        f"\n== block-sparse: B={B}, S={result['args']['seqlen']}, H={H}, D={D}, bf16",
        ("case", "block", "causal", "blocks %", "visible %", "GPU ms", "TFLOP/s", "x pyattn dense", "x SDPA dense",
         "API ms", "first ms", "max err"),
        [(r["case"], r.get("block", "-"), "yes" if r["causal"] else "no", fmt(r.get("blocks_pct"), ".1f"),
          fmt(r.get("visible_pct"), ".1f"), ms_cell(r), fmt(r.get("tflops"), ".0f"), fmt(r.get("x_pyattn"), ".2f"),
          fmt(r.get("x_sdpa"), ".2f"), fmt(r.get("api_ms"), ".3f"), fmt(r.get("first_ms"), ".2f"), err_cell(r))
         for r in result["block_rows"]])
    return out + harness.md_table(
        f"\n== CSR sparse_attention: B={B}, S={CSR_S}, H={H}, D={D}; d2d copy {fmt(result.get('copy_gbs'), '.0f')} GB/s",
        ("pattern", "dtype", "keys/row", "GPU ms", "API ms", "lists MB", "GB/s", "% of copy", "Gpairs/s", "dense ms",
         "x dense", "max err"),
        [(r["case"], r["dtype"], fmt(r.get("keys_per_row"), ".0f"), ms_cell(r), fmt(r.get("api_ms"), ".3f"),
          fmt(r.get("list_bytes", 0) / 1e6, ".1f"), fmt(r.get("gbs"), ".0f"), fmt(r.get("pct_copy"), ".0f"),
          fmt(r.get("gpairs"), ".1f"), fmt(r.get("dense_ms"), ".3f"), fmt(r.get("x_dense"), ".2f"), err_cell(r))
         for r in result["csr_rows"]])


def targets(result) -> list:
    S = result["args"]["seqlen"]
    r = next((r for r in result["block_rows"] if r["case"] == "random 10%" and r.get("block") == "128x128"
              and not r["causal"]), None)
    if r is None:
        return []
    note = "" if S >= 16384 else f" (measured at seq {S}, not 16384)"
    return [{"pass": None if r.get(key) is None else r[key] >= 5.0,
             "text": f"block-sparse 10% density >= 5x dense at seq 16384: 128x128 non-causal {fmt(r.get(key), '.2f')}x "
                     f"vs {what}{note}"} for key, what in (("x_pyattn", "pyattn dense"), ("x_sdpa", "SDPA best dense"))]


def parse_args(argv=None):
    p = harness.parser(__doc__)
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
    return args


def start(args, what: str):
    """(bench, result) with the copy ceiling measured, or None (no torch or no GPU: said why)."""
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return None
    result = {"args": dict(vars(args)), "notes": [], "t0": time.perf_counter(),
              "copy_gbs": bench.ceilings(matmul=(), reps=args.reps).get("d2d_copy_gbs")}
    bench.torch.cuda.empty_cache()
    print(f"== pyattn {what} benchmark; d2d copy {fmt(result['copy_gbs'], '.0f')} GB/s (read + write)", flush=True)
    return bench, result


def section(bench, result, key: str, what: str, fn, blank=None) -> None:
    """``fn()``; a failure it lets through becomes a row (``blank``'s keys) of ``result[key]`` with its error."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the inputs
        traceback.print_exc()
        result[key].append(dict(blank or {"case": f"{what} setup", "kind": "setup", "dtype": "-", "causal": False},
                                errors=[f"{what}: {type(exc).__name__}: {exc}"]))
    gc.collect()
    bench.sync()
    bench.torch.cuda.empty_cache()
    harness.save_json(result["args"]["json"], result)


def finish(bench, result, rows) -> int:
    """Print the errors, torch's notes and the targets; save; the exit code."""
    keys = ("case", "block", "dtype", "batch", "ctx", "cache", "dataset", "tensor", "kind")
    for r in rows:
        for e in r.get("errors", []):
            print(f"  error {' '.join(str(r[k]) for k in keys if k in r)}: {e}")
    for n in result["notes"]:
        print(f"  note: {n}")
    harness.print_targets(result["targets"])
    failures = sum(bool(r.get("errors")) or bool(r.get("flagged")) for r in rows)
    result["environment"] = harness.environment(bench)
    return harness.end_run(bench, result, result["args"]["json"], failures,
                           f"  {failures} row(s) with errors or flags ")


def main(argv=None) -> int:
    args = parse_args(argv)
    started = start(args, "sparse")
    if started is None:
        return 1
    bench, result = started
    result.update(block_rows=[], csr_rows=[])
    if {"block", "patterns"} & set(args.sections):
        section(bench, result, "block_rows", "block-sparse", lambda: run_block(bench, args, result))
    if "csr" in args.sections:
        section(bench, result, "csr_rows", "CSR", lambda: run_csr(bench, args, result))
    derive_block(result["block_rows"])
    print(f"\n{harness.env_line(harness.environment(bench))}")
    print("\n".join(tables(result)))
    print("(GPU ms: the public call behind a pre-roll (CSR: each call behind its own, the lists' upload included); "
          "API ms: the public call in a Python loop; first ms: the first call with a new layout; x = dense time / "
          "sparse time, above 1: sparse faster; ! = error above 2e-2)")
    result["targets"] = targets(result)
    return finish(bench, result, result["block_rows"] + result["csr_rows"])


if __name__ == "__main__":
    sys.exit(main())

"""Dev probe (GPU): where ``pyattn.sparq_decode``'s time goes, stage by stage.

    PYTHONPATH=. python dev/profile_sparq.py [--points 8x32768,1x32768] [--select group] [--ncu]

Fills a bf16 ``PagedKVCache(sparq=True)`` as ``scripts/bench_sparq.py`` does (Hq 32, Hkv 8, D 128,
page 64, r = D/4, k = L/8) and times each launch of a call (the sparq stages, the decode over the
chosen keys and its combine) with CUDA events, every call queued behind a ``torch.cuda._sleep``
pre-roll so that the host's launch gaps do not count; medians of 20 calls, beside the whole call and
an exact decode over the same cache. Then the decode over the chosen keys alone (its tables as the
select stage left them, the same keys sorted by position, and each row's first k keys: page-size-1
gathers against runs of rows), at forced split counts (``--splits``). ``--ncu``: one call between
``cudaProfilerStart`` / ``Stop`` for ``ncu --profile-from-start off`` (no timing loop);
``--min-blocks``: the sparq_score kernel's launch bounds (its tile row's ``min_blocks``) for the whole run;
``--decode-rows KEYSxWARPSxSTAGESxBLOCKS,...``: the decode-alone timings again with each of these
in the d <= 128 row of attn_decode's table (the cp.async kernel the chosen keys run on).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import numpy as np
import torch

sys.path.insert(0, "scripts")
import bench_sparq as bs  # noqa: E402
import harness  # noqa: E402

import pyattn  # noqa: E402
import pyattn.ops._decode as dmod  # noqa: E402
import pyattn.ops.sparq as smod  # noqa: E402
from _rows import decode_rows  # noqa: E402
from pyattn.kernels.families import override_tiles, tile_table  # noqa: E402

_marks: list = []
_decode_args: list = []  # the last sparq call's run_decode arguments


def _timed(fn, name_of):
    def wrapper(*a, **kw):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = fn(*a, **kw)
        e1.record()
        _marks.append((name_of(a), e0, e1))
        return out
    return wrapper


def gathers(bench, cache, ids, call, run_decode, splits, select, rows="") -> None:
    """Time the decode over the chosen keys alone: as chosen, sorted, and each row's first k keys."""
    _, pos = pyattn.sparq_decode(*call.args, **call.keywords, return_indices=True)
    Pd, device, qx, kp, vp, tables, k_max, alibi, s, ret, fold = _decode_args
    pos = np.sort(pos.numpy(), axis=2)
    B, rows_b, _ = pos.shape
    H, ps = cache.pool_info.heads_kv, cache.pool_info.page_size
    sel_sorted, sel_first = np.empty((B, rows_b, k_max), np.int32), np.empty((B, rows_b, k_max), np.int32)
    for b, sid in enumerate(ids):
        pages = cache.book.pages(sid).astype(np.int64)
        for r in range(rows_b):
            kvh = r if select == "group" else r // (rows_b // H)
            for out, p in ((sel_sorted, pos[b, r]), (sel_first, np.arange(k_max))):
                out[b, r] = (pages[p // ps] * ps + p % ps) * H + kvh
    variants = [("as chosen", tables)]
    for name, sel in (("sorted", sel_sorted), ("first k", sel_first)):
        dsel = pyattn.asarray(sel.reshape(-1), stream=bench.stream)
        variants.append((name, (dsel,) + tuple(tables[1:])))
    for name, tab in variants:
        cells = []
        for n in splits:
            P = dataclasses.replace(Pd, num_splits=n or None)
            fn = lambda P=P, tab=tab: run_decode(  # noqa: E731
                P, device, qx, kp, vp, tab, k_max, alibi, s, ret, sparq=fold)
            cells.append(f"{n or 'rule'}: {bench.gpu_ms([fn], loop=10, reps=5).ms * 1e3:.1f}")
        print(f"  decode alone, {name:9s} splits " + " | ".join(cells), flush=True)
    for spec, new in decode_rows(rows).items():
        cells = []
        with override_tiles("attn_decode", "sm_90a", new):
            for n in splits:
                P = dataclasses.replace(Pd, num_splits=n or None)
                fn = lambda P=P: run_decode(  # noqa: E731
                    P, device, qx, kp, vp, tables, k_max, alibi, s, ret, sparq=fold)
                try:
                    cells.append(f"{n or 'rule'}: {bench.gpu_ms([fn], loop=10, reps=5).ms * 1e3:.1f}")
                except Exception as exc:  # noqa: BLE001 - a row that does not fit is reported, not fatal
                    cells.append(f"{n or 'rule'}: {type(exc).__name__}")
        print(f"  decode alone, row {spec:9s} splits " + " | ".join(cells), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=harness.batch_lengths, default="8x32768,1x32768")
    ap.add_argument("--select", default="group")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--splits", default="0,2,4,8,16", help="decode-alone split counts (0: the rule's)")
    ap.add_argument("--min-blocks", type=int, default=0, help="the sparq_score kernel's __launch_bounds__ blocks (sm_90a)")
    ap.add_argument("--decode-rows", default="", help="attn_decode d <= 128 rows to time the decode alone on")
    args = ap.parse_args()
    if args.min_blocks:
        rows = [r._replace(min_blocks=args.min_blocks) for r in tile_table("sparq_score", "sm_90a")]
        with override_tiles("sparq_score", "sm_90a", rows):
            return run(args)
    return run(args)


def run(args) -> int:
    bench = harness.Bench(torch)
    stages = ("score", "select")  # the sparq launches of a call, in order (then the decode, which ends it)
    smod.launch = _timed(smod.launch,
                         lambda a: stages[sum(m[0].split()[0] in stages for m in _marks) % 2] + f" grid {a[1]}")
    dmod.launch = _timed(dmod.launch, lambda a: f"decode grid {a[1]}")
    run_decode = smod.run_decode

    def keep(*a, **kw):  # (kw: the call's capture, which the decode-alone timings leave out, and its fold)
        _decode_args[:] = a + (kw.get("sparq"),)
        return run_decode(*a, **kw)
    smod.run_decode = keep
    for B, L in args.points:
        r, k = bs.D // 4, L // 8
        cache = pyattn.PagedKVCache(B * -(-L // args.page) + 8, args.page, bs.HKV, bs.D, "bfloat16", sparq=True)
        ids = [cache.add_sequence() for _ in range(B)]
        bs.fill(bench, cache, ids, L, 1, keep=False)
        q = pyattn.asarray(torch.randn(B, 1, bs.HQ, bs.D, device="cuda", dtype=torch.bfloat16), stream=bench.stream)
        call = functools.partial(pyattn.sparq_decode, q, cache, ids, r=r, k=k, select=args.select, stream=bench.stream)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        if args.ncu:
            torch.cuda.profiler.start()
            call()
            pyattn.decode(q, cache, ids, stream=bench.stream)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        per: dict = {}
        for _ in range(20):
            _marks.clear()
            torch.cuda._sleep(2_000_000)
            call()
            torch.cuda.synchronize()
            for i, (name, e0, e1) in enumerate(_marks):
                per.setdefault((i, name), []).append(e0.elapsed_time(e1) * 1e3)
            span = _marks[0][1].elapsed_time(_marks[-1][2]) * 1e3
            per.setdefault((99, "whole call (first event to last)"), []).append(span)
        print(f"B{B} L{L} select={args.select} r={r} k={k} page={args.page}", flush=True)
        for (i, name), ts in sorted(per.items()):
            print(f"  {name:40s} {np.median(ts):8.1f} us")
        t_s = bench.gpu_ms([call], loop=10, reps=5).ms * 1e3
        t_e = bench.gpu_ms([lambda: pyattn.decode(q, cache, ids, stream=bench.stream)], loop=10, reps=5).ms * 1e3
        print(f"  harness: sparq {t_s:.1f} us, exact decode {t_e:.1f} us, x {t_e / t_s:.2f}", flush=True)
        gathers(bench, cache, ids, call, run_decode, [int(x) for x in args.splits.split(",")], args.select,
                args.decode_rows)
        del cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""8-bit KV-cache benchmark: pyattn.decode over bf16, int8 and fp8 e4m3 PagedKVCaches (keys scaled per token or,
int8c / fp8c, per page and channel), speed and accuracy, one GPU.

Usage: PYTHONPATH=. python scripts/bench_quant.py [--json out.json] [--quick] [--configs 8x4096,64x32768]
       [--kinds bf16,int8,fp8,int8c,fp8c] [--sections speed,accuracy] [--budget 420]

- Speed: Hq=32, Hkv=8, D=128, q_len 1, bf16 queries, page 16, batch 1/8/64 x ctx 4096/32768 (--quick: 8x4096 and
  8x32768). Each cache is filled by append() of random bf16 K/V made on the device with torch, 2048 tokens at a
  time (host memory stays small); every kind holds the same data. GPU us: pyattn.decode over the cache, a loop of
  back-to-back calls behind the pre-roll (harness.Bench.gpu_ms; the cache keeps its device page table between
  calls, so this is the decode kernel and its split combine). decode() wall us: pyattn.decode per call of a Python
  loop, one sync at the end. Data under 4x the L2 is replicated (one cache per replica) and the calls rotate
  among the replicas.
- bytes read = K and V of every token: bf16 2 bytes an element; 8-bit 1 byte an element plus one float32 scale per
  (token, kv head). GB/s = bytes / GPU time; % of copy: against the device copy ceiling measured at start (read +
  write); x bf16 = bf16 GPU time / this GPU time.
- Checks: batch row 0 against an fp32 reference over the K/V the cache holds (bf16: the data; 8-bit: the data as
  pyattn.quant quantizes and dequantizes it), flagged above 2e-2, absolute or relative to max |ref| ("max err");
  reported: row 0 against the fp32 reference over the bf16 data ("vs bf16 data", the quantization's effect too) and
  all rows against the bf16 cache's output ("vs bf16 cache").
- Accuracy: B=4, ctx 4096; (a) random: K, V, q N(0,1); (b) outliers: K with 4 of 128 channels x30 per kv head, 0.1%
  of the tokens with V x50; all bf16. Each cache's output against fp64 attention over the bf16 K/V (max, mean,
  max / max |ref|) and against the bf16 cache's output; 8-bit caches also against fp64 attention over the K/V as
  pyattn.quant quantizes them (the kernel's own error; flagged above 2e-2 * max(1, max |ref|)), and their stored
  codes and scales against pyattn.quant.quantize_rows bit for bit (a mismatch is flagged). Round trip of the
  quantizer: max / mean of |x - dequantize(quantize_rows(x))| / row amax per dataset, tensor and kind.
- Per-channel key scales (issue 13; int8c / fp8c: PagedKVCache(..., key_scales="channel")): keys quantized per
  (page, kv head, channel) by pyattn.quant.quantize_page, each page's 4 largest channels kept apart in float16,
  values per token as before. Bytes read add one record per page and kv head (16 + 2 D + 8 x page bytes). Their
  "quantized ref" and code checks use quantize_page over each page (codes, scales, kept channels and values).
- Targets: "8-bit KV decode at ctx >= 32k >= 1.8x faster than bf16 (issue 12)", per 8-bit kind and batch at ctx 32768;
  per-channel (issue 13): the outliers error of int8c within 3x the bf16 cache's, and int8c / fp8c decode no more
  than 10% slower than int8 / fp8 (per-token) in the same run, per configuration.
  A failing configuration prints its error and the run goes on; exit code 1 when a pyattn measurement failed or a
  result was flagged.
"""

from __future__ import annotations

import math
import sys
import traceback

import numpy as np

import bench_sparse as bs
import harness
import pyattn
from bench_decode import TOL, reference
from harness import attempt, fmt
# The shape, cache kinds and cache helpers live in quant_caches.py; imported back, so bench_quant.HQ,
# bench_quant.new_cache, bench_quant.fill... still work for dev/ probes and tests.
from quant_caches import (AB, ACTX, CHANNEL, D, HKV, HQ, KINDS, PAGE, QKIND, TOKEN_OF, dequant_keys, drop, fill,
                          new_cache, read_bytes)

SHAPES = [(b, c) for b in (1, 8, 64) for c in (4096, 32768)]
QUICK = [(8, 4096), (8, 32768)]


def bench_kind(bench, args, row, B, ctx, n_rep, q, q_d, base):
    """Fill ``row`` for one cache kind (one cache per replica, the same data in each kind); returns its output
    (B, Hq, D) as fp32 torch, or None."""
    caches = [new_cache(row["cache"], B, ctx) for _ in range(n_rep)]
    bench.sync()
    k0, v0 = fill(bench, *caches[0], ctx, 1000 * B + ctx)
    for r, (cache, seqs) in enumerate(caches[1:], 1):
        fill(bench, cache, seqs, ctx, 1000 * B + ctx + r)
    fns = [lambda c=c, s=s: pyattn.decode(q_d, c, s, stream=bench.stream) for c, s in caches]
    t = attempt(row, "pyattn.decode", lambda: bench.gpu_ms(fns, loop=args.loop, reps=args.reps,
                                                           label=f"decode {row['cache']} B{B} ctx{ctx}"))
    row["us"], row["held"] = (t.ms * 1e3, t.held) if t else (None, None)
    row["wall_us"] = attempt(row, "pyattn.decode (wall)", lambda: bench.wall_ms(fns[0], loop=args.loop,
                                                                               reps=args.reps) * 1e3)
    ref = reference(q[:1], k0.transpose(0, 1)[None], v0.transpose(0, 1)[None])  # (1, Hq, D), over bf16 data
    held = ref if row["cache"] == "bf16" else attempt(row, "quantized reference",
                                                      lambda: held_ref(q, k0, v0, row["cache"]))
    out = attempt(row, "check pyattn.decode", fns[0])
    if out is None:
        return None
    o = harness.to_torch(out).float().view(B, HQ, D)
    row["err_vs_data"] = (o[:1] - ref).abs().max().item()
    if base is not None:
        row["err_vs_bf16"] = (o - base).abs().max().item()
    if held is not None:
        row["max_err"] = err = (o[:1] - held).abs().max().item()
        if not (err <= TOL and err / max(held.abs().max().item(), 1e-30) <= TOL):  # also catches NaN
            row["flagged"] = True
            print(f"!!!!! WARNING: pyattn ({row['cache']} cache) differs from the fp32 reference over the K/V the "
                  f"cache holds by {err:.3e} for B={B} ctx={ctx} !!!!!")
    return o


def held_ref(q, k0, v0, kind):
    """fp32 reference of batch row 0 over K/V as pyattn.quant quantizes and dequantizes them: (1, Hq, D)."""
    import ml_dtypes
    import torch

    from pyattn.quant import dequantize, quantize_rows

    def deq(x, keys):
        xn = x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        d = dequant_keys(xn, kind) if keys and kind in CHANNEL else dequantize(*quantize_rows(xn, QKIND[kind]))
        return torch.from_numpy(np.ascontiguousarray(d, np.float32)).cuda().transpose(0, 1)[None]
    return reference(q[:1], deq(k0, True), deq(v0, False))


def run_speed(bench, args, result) -> None:
    torch = bench.torch
    for B, ctx in args.shapes:
        if harness.over_budget(result, args.budget, f"B={B} ctx={ctx}"):
            continue
        n_rep = bench.replicas(read_bytes(B, ctx, "int8"))
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(B + ctx))
        q_d, base = harness.to_pyattn(q, bench.stream), None
        for kind in args.kinds:
            row = {"batch": B, "ctx": ctx, "cache": kind, "bytes": read_bytes(B, ctx, kind), "replicas": n_rep}
            try:
                out = bench_kind(bench, args, row, B, ctx, n_rep, q, q_d, base)
                base = out if kind == "bf16" else base
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory
                traceback.print_exc()
                row.setdefault("errors", []).append(f"{type(exc).__name__}: {str(exc)[:300]}")
            drop(bench)
            result["speed"].append(row)
            print(f"  B={B} ctx={ctx} {kind}: GPU {fmt(row.get('us'), '.1f')} us, decode() wall "
                  f"{fmt(row.get('wall_us'), '.1f')} us, max err {fmt(row.get('max_err'), '.1e')}", flush=True)
            harness.save_json(args.json, result)
        derive(result)


def derive(result) -> None:
    bf = {(r["batch"], r["ctx"]): r.get("us") for r in result["speed"] if r["cache"] == "bf16"}
    copy = result.get("copy_gbs")
    for r in result["speed"]:
        if r.get("us"):
            r["gbs"] = r["bytes"] / r["us"] / 1e3
            r["pct_copy"] = r["gbs"] / copy * 100 if copy else None
            b = bf.get((r["batch"], r["ctx"]))
            r["x_bf16"] = b / r["us"] if b else None


def attn64(q, k, v) -> np.ndarray:
    """fp64 attention of q (B, 1, Hq, D) over k, v (B, ctx, Hkv, D): (B, Hq, D)."""
    out = np.empty((q.shape[0], HQ, D))
    for b in range(q.shape[0]):
        qb = q[b, 0].astype(np.float64).reshape(HKV, HQ // HKV, D)
        kb, vb = (x[b].astype(np.float64).transpose(1, 0, 2) for x in (k, v))  # (Hkv, ctx, D)
        s = qb @ kb.transpose(0, 2, 1) / math.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = ((p / p.sum(-1, keepdims=True)) @ vb).reshape(HQ, D)
    return out


def datasets():
    """("random" | "outliers", q, k, v) as bf16 NumPy arrays, q (B, 1, Hq, D), k, v (B, ctx, Hkv, D)."""
    import ml_dtypes

    bf, rng = ml_dtypes.bfloat16, np.random.default_rng(7)
    q = rng.standard_normal((AB, 1, HQ, D), np.float32).astype(bf)
    k, v = (rng.standard_normal((AB, ACTX, HKV, D), np.float32) for _ in range(2))
    yield "random", q, k.astype(bf), v.astype(bf)
    for h in range(HKV):  # outlier channels of keys, per kv head, as in real LLMs
        k[:, :, h, rng.choice(D, 4, replace=False)] *= 30
    v[rng.random((AB, ACTX)) < 1e-3] *= 50  # 0.1% of the tokens, every head
    yield "outliers", q, k.astype(bf), v.astype(bf)


def code_mismatches(cache, seqs, kind, k, v) -> int:
    """Codes and scales in the cache that differ (bitwise) from pyattn.quant.quantize_rows of k, v (per-channel
    keys: quantize_page of each page)."""
    from pyattn.quant import quantize_page, quantize_rows

    table, _ = cache.block_table(seqs)
    n = 0
    if kind in CHANNEL:  # keys: codes, page scales and channel scales of every page
        want = quantize_page(np.moveaxis(k.reshape(AB, -1, PAGE, HKV, D), -2, -3), QKIND[kind])
        scale, chan, kidx, kept = (x[table] for x in cache.read_key_scales())
        got = (cache.k.numpy()[table], scale, chan, kidx, kept)  # codes, kept: (AB, pages, PAGE, Hkv, .)
        for i, (g, w) in enumerate(zip(got, want)):
            g = np.moveaxis(g, -2, -3) if i in (0, 4) else g  # as quantize_page's (.., Hkv, PAGE, .)
            n += int((np.ascontiguousarray(g).view(np.uint8) != np.ascontiguousarray(w).view(np.uint8)).sum())
    for pool, spool, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        if kind in CHANNEL and x is k:
            continue
        codes, scales = quantize_rows(x, QKIND[kind])
        got = pool.numpy()[table].reshape(AB, -1, HKV, D)[:, :ACTX]
        got_s = np.swapaxes(spool.numpy()[table], -1, -2).reshape(AB, -1, HKV)[:, :ACTX]  # (page, head, slot)
        n += int((got.view(np.uint8) != codes.view(np.uint8)).sum())
        n += int((got_s.view(np.uint32) != scales.view(np.uint32)).sum())
    return n


def accuracy_row(bench, row, q, k, v, ref, base):
    """Decode over one cache kind and fill ``row`` with its errors; returns the output (B, Hq, D) fp64."""
    from pyattn.quant import dequantize, quantize_rows

    kind = row["cache"]
    cache, seqs = new_cache(kind, AB, ACTX)
    cache.append(seqs, k, v, stream=bench.stream)
    out = np.asarray(pyattn.decode(q, cache, seqs, stream=bench.stream)).astype(np.float64).reshape(AB, HQ, D)
    e = np.abs(out - ref)
    row.update(max_err=e.max(), mean_err=e.mean(), rel_err=e.max() / np.abs(ref).max())
    own, own_ref = row["max_err"], np.abs(ref).max()
    if base is not None:
        d = np.abs(out - base)
        row.update(max_vs_bf16=d.max(), mean_vs_bf16=d.mean())
    if kind != "bf16":
        kd = dequant_keys(k, kind) if kind in CHANNEL else dequantize(*quantize_rows(k, QKIND[kind]))
        dref = attn64(q, kd, dequantize(*quantize_rows(v, QKIND[kind])))
        own, own_ref = np.abs(out - dref).max(), np.abs(dref).max()
        row["err_vs_quantized_ref"] = own
        row["code_mismatches"] = attempt(row, "codes", lambda: code_mismatches(cache, seqs, kind, k, v))
        if row["code_mismatches"]:
            row["flagged"] = True
            print(f"!!!!! WARNING: {row['code_mismatches']} codes/scales of the {kind} cache differ from "
                  f"pyattn.quant.quantize_rows ({row['dataset']}) !!!!!")
    if not own <= TOL * max(1.0, own_ref):  # also catches NaN
        row["flagged"] = True
        print(f"!!!!! WARNING: the {kind} cache's output differs from the fp64 reference over the K/V it holds by "
              f"{own:.3e} (max |ref| {own_ref:.3e}; {row['dataset']}) !!!!!")
    return out


def run_accuracy(bench, args, result) -> None:
    from pyattn.quant import dequantize, quantize_rows

    for name, q, k, v in datasets():
        ref, base = attn64(q, k, v), None
        for kind in args.kinds:
            row = {"dataset": name, "cache": kind}
            try:
                out = accuracy_row(bench, row, q, k, v, ref, base)
                base = out if kind == "bf16" else base
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row.setdefault("errors", []).append(f"{type(exc).__name__}: {str(exc)[:300]}")
            drop(bench)
            result["accuracy"].append(row)
            print(f"  {name} {kind}: max err {fmt(row.get('max_err'), '.2e')}, mean {fmt(row.get('mean_err'), '.2e')}",
                  flush=True)
        for kind, qk in QKIND.items():
            if kind in CHANNEL:
                continue
            for tensor, x in (("K", k), ("V", v)):
                r = {"dataset": name, "tensor": tensor, "kind": kind}
                try:
                    x32 = x.astype(np.float32)
                    amax = np.abs(x32).max(-1, keepdims=True)
                    rel = np.abs(x32 - dequantize(*quantize_rows(x, qk))) / np.where(amax > 0, amax, 1)
                    r.update(max=float(rel.max()), mean=float(rel.mean()))
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    r["errors"] = [f"quantizer: {type(exc).__name__}: {exc}"]
                result["roundtrip"].append(r)
        harness.save_json(args.json, result)


def _us(r) -> str:
    us = fmt(r.get("us"), ".1f") + ("" if r.get("held") else "~")
    return "FAILED" if us == "n/a" else us


def tables(result) -> list:
    out = harness.md_table(f"\n== decode over a PagedKVCache: Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, q_len 1, bf16 queries; "
                f"d2d copy {fmt(result.get('copy_gbs'), '.0f')} GB/s",
                ("batch", "ctx", "cache", "GPU us", "MB read", "GB/s", "% of copy", "x bf16", "decode() wall us",
                 "max err", "vs bf16 data", "vs bf16 cache"),
                [(r["batch"], r["ctx"], r["cache"], _us(r), fmt(r["bytes"] / 1e6, ".1f"), fmt(r.get("gbs"), ".0f"),
                  fmt(r.get("pct_copy"), ".0f"), fmt(r.get("x_bf16"), ".2f"), fmt(r.get("wall_us"), ".1f"), bs.err_cell(r),
                  fmt(r.get("err_vs_data"), ".1e"), fmt(r.get("err_vs_bf16"), ".1e")) for r in result["speed"]])
    out += harness.md_table(f"\n== accuracy: B={AB}, ctx {ACTX}; errors against fp64 attention over the bf16 K/V (ref), the bf16 "
                 "cache's output, and fp64 attention over the K/V as pyattn.quant quantizes them (quantized ref)",
                 ("dataset", "cache", "max err", "mean err", "max err / max abs(ref)", "max vs bf16 cache",
                  "mean vs bf16 cache", "max vs quantized ref", "code mismatches"),
                 [(r["dataset"], r["cache"], fmt(r.get("max_err"), ".2e") + (" !" if r.get("flagged") else ""),
                   fmt(r.get("mean_err"), ".2e"), fmt(r.get("rel_err"), ".2e"), fmt(r.get("max_vs_bf16"), ".2e"),
                   fmt(r.get("mean_vs_bf16"), ".2e"), fmt(r.get("err_vs_quantized_ref"), ".2e"),
                   r.get("code_mismatches", "-")) for r in result["accuracy"]])
    return out + harness.md_table("\n== quantizer round trip (pyattn.quant): |x - dequantize(quantize_rows(x))| / row amax",
                       ("dataset", "tensor", "kind", "max", "mean"),
                       [(r["dataset"], r["tensor"], r["kind"], fmt(r.get("max"), ".2e"), fmt(r.get("mean"), ".2e"))
                        for r in result["roundtrip"]])


def targets(result) -> list:
    res = []
    us = {(r["batch"], r["ctx"], r["cache"]): r.get("us") for r in result["speed"]}
    for r in result["speed"]:
        if r["cache"] in CHANNEL:
            tok = us.get((r["batch"], r["ctx"], TOKEN_OF[r["cache"]]))
            x = tok / r["us"] if tok and r.get("us") else None
            res.append({"pass": None if x is None else x >= 1 / 1.1,
                        "text": f"per-channel keys no more than 10% slower than per-token: {r['cache']} vs "
                                f"{TOKEN_OF[r['cache']]} B={r['batch']} ctx={r['ctx']}: {fmt(x, '.3f')}x"})
    acc = {(a["dataset"], a["cache"]): a.get("max_err") for a in result["accuracy"]}
    bf, ch = acc.get(("outliers", "bf16")), acc.get(("outliers", "int8c"))
    if ("outliers", "int8c") in acc:
        res.append({"pass": None if bf is None or ch is None else bool(ch <= 3 * bf),  # (NumPy floats: a plain bool)
                    "text": f"per-channel int8 within 3x the bf16 cache's error on outlier keys: {fmt(ch, '.2e')} vs "
                            f"3 x {fmt(bf, '.2e')}"})
    for r in result["speed"]:
        if r["ctx"] >= 32768 and r["cache"] in QKIND and r["cache"] not in CHANNEL:
            x = r.get("x_bf16")
            res.append({"pass": None if x is None else x >= 1.8,
                        "text": f"8-bit KV decode at ctx >= 32k >= 1.8x faster than bf16 (issue 12): {r['cache']} B={r['batch']} "
                                f"ctx={r['ctx']}: {fmt(x, '.2f')}x"})
    return res


def parse_args(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--configs", type=harness.batch_lengths, help="comma list of BATCHxCTX (default: 1/8/64 x 4096/32768)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--sections", default="speed,accuracy", help="comma list of speed, accuracy")
    p.add_argument("--budget", type=float, default=420.0, help="skip speed shapes not started after this many s")
    args = p.parse_args(argv)
    try:
        args.kinds = [k for k in args.kinds.split(",") if k]
        args.sections = [s for s in args.sections.split(",") if s]
        args.shapes = args.configs or (QUICK if args.quick else SHAPES)
        assert all(len(s) == 2 and min(s) > 0 for s in args.shapes)
        assert args.kinds and set(args.kinds) <= set(KINDS) and args.sections
        assert set(args.sections) <= {"speed", "accuracy"}
    except (ValueError, AssertionError):
        p.error(f"--configs: BATCHxCTX,...; --kinds: a subset of {','.join(KINDS)}; --sections: speed,accuracy")
    args.kinds = [k for k in KINDS if k in args.kinds]  # bf16 first: the others are compared with it
    args.reps, args.loop = (3, 10) if args.quick else (7, 20)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = bs.start(args, "8-bit KV cache")
    if started is None:
        return 1
    bench, result = started
    result.update(speed=[], accuracy=[], roundtrip=[])
    if "speed" in args.sections:
        bs.section(bench, result, "speed", "speed", lambda: run_speed(bench, args, result),
                   {"batch": 0, "ctx": 0, "cache": "-", "bytes": 0})
    if "accuracy" in args.sections:
        bs.section(bench, result, "accuracy", "accuracy", lambda: run_accuracy(bench, args, result),
                   {"dataset": "-", "cache": "-"})
    derive(result)
    print(f"\n{harness.env_line(harness.environment(bench))}")
    print("\n".join(tables(result)))
    print("(GPU us: pyattn.decode behind a pre-roll, the decode kernel and its split combine; decode() wall us: a "
          "Python loop of pyattn.decode; x bf16 above 1: faster than the bf16 cache; ~ = the pre-roll ran out; "
          "! = flagged)")
    if result.get("skipped"):
        result["notes"].append(f"speed shapes skipped (budget): {result['skipped']}")
    result["targets"] = targets(result)
    rows = result["speed"] + result["accuracy"] + result["roundtrip"]
    return bs.finish(bench, result, rows) or (1 if result.get("skipped") else 0)


if __name__ == "__main__":
    sys.exit(main())

"""8-bit KV-cache benchmark: pyattn.decode over bf16, int8 and fp8 e4m3 PagedKVCaches, speed and accuracy, one GPU.

Usage: PYTHONPATH=. python scripts/bench_quant.py [--json out.json] [--quick] [--configs 8x4096,64x32768]
       [--kinds bf16,int8,fp8] [--sections speed,accuracy] [--budget 420]

- Speed: Hq=32, Hkv=8, D=128, q_len 1, bf16 queries, page 16, batch 1/8/64 x ctx 4096/32768 (--quick: 8x4096 and
  8x32768). Each cache is filled by append() of random bf16 K/V made on the device with torch, 2048 tokens at a
  time (host memory stays small); every kind holds the same data. kernel us: GPU time per call of
  pyattn.ops.decode.run_decode (the launches pyattn.decode makes; the cache's device page table fetched once), CUDA
  events behind a torch.cuda._sleep pre-roll (bench_decode.Clock); '+' = those internals failed and pyattn.decode was
  timed behind the pre-roll. decode() wall us: pyattn.decode per call of a Python loop, one sync at the end. A cache
  under 4x the L2 holds several replicas (groups of sequences) and the loop cycles through them.
- bytes read = K and V of every token: bf16 2 bytes an element; 8-bit 1 byte an element plus one float32 scale per
  (token, kv head). GB/s = bytes / kernel time; % of copy: against the d2d copy ceiling (torch copy_ of 1 GiB, read +
  write); x bf16 = bf16 kernel time / this kernel time.
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
- Target: "8-bit KV decode at ctx >= 32k >= 1.7x faster than bf16", per 8-bit kind and batch at ctx 32768.
  A failing configuration prints its error and the run goes on; exit code 1 when a pyattn measurement failed or a
  result was flagged.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_sparse as bs  # noqa: E402 - shared run helpers (start, section, finish, md); imports bench_decode
from bench_decode import TOL, _f, attempt  # noqa: E402

import pyattn  # noqa: E402

bd, torch = bs.bd, bs.torch
HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = [(b, c) for b in (1, 8, 64) for c in (4096, 32768)]
QUICK = [(8, 4096), (8, 32768)]
KINDS = {"bf16": "bfloat16", "int8": "int8", "fp8": "fp8_e4m3"}  # PagedKVCache dtypes
QKIND = {"int8": "int8", "fp8": "fp8e4m3"}  # pyattn.quant kinds
CHUNK, AB, ACTX = 2048, 4, 4096


def read_bytes(B: int, ctx: int, kind: str) -> int:
    """Bytes of K and V one decode step reads: codes (and float32 scales per token and kv head)."""
    return B * ctx * HKV * (2 * D if kind == "bf16" else D + 4) * 2


def new_cache(kind: str, n_seqs: int, ctx: int):
    need = read_bytes(n_seqs, ctx, kind) * 1.05 + (1 << 30)
    if torch is not None and torch.cuda.mem_get_info()[0] < need:
        raise MemoryError(f"{need / 2**30:.1f} GiB free needed for the {kind} cache")
    cache = pyattn.PagedKVCache(n_seqs * -(-ctx // PAGE) + 8, PAGE, HKV, D, KINDS[kind])
    return cache, [cache.add_sequence() for _ in range(n_seqs)]


def drop(dev) -> None:
    """Give the freed caches' memory back (pyattn's pool and torch's)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    from pyattn.runtime.memory import get_pool
    attempt({}, "pyattn pool trim", lambda: get_pool(dev).trim())


def fill(cache, seqs, ctx: int, seed: int, ps):
    """Append random bf16 K/V to every sequence, CHUNK tokens at a time; sequence 0's K, V (ctx, Hkv, D)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = ([], [])
    for t0 in range(0, ctx, CHUNK):
        k, v = (torch.randn(len(seqs), min(CHUNK, ctx - t0), HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        cache.append(seqs, bd.to_pyattn(k, ps), bd.to_pyattn(v, ps), stream=ps)
        keep[0].append(k[0].clone())
        keep[1].append(v[0].clone())
    return torch.cat(keep[0]), torch.cat(keep[1])


def kernel_fn(cache, q_d, seqs, ps):
    """run_decode with the query validated and the cache's device page table fetched once."""
    from pyattn.ops._paged import check_query
    from pyattn.ops.decode import run_decode

    pool = cache.pool_info
    P = check_query(q_d, pool, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None, num_splits=None)
    tables, max_len = cache.device_tables(seqs, ps)
    extra = ((cache.k_scale, cache.v_scale),) if cache.kv else ()
    cache.device.activate()
    return lambda: run_decode(P, pool, q_d, cache.k, cache.v, tables, max_len, None, ps, False, *extra)[0]


def bench_kind(args, row, B, ctx, n_rep, q, q_d, base):
    """Fill ``row`` for one cache kind; returns its output (B, Hq, D) as fp32 torch, or None."""
    cache, seqs = new_cache(row["cache"], n_rep * B, ctx)
    torch.cuda.synchronize()
    k0, v0 = fill(cache, seqs, ctx, 1000 * B + ctx, args.ps)
    groups = [seqs[r * B:(r + 1) * B] for r in range(n_rep)]
    api = [lambda g=g: pyattn.decode(q_d, cache, g, stream=args.ps) for g in groups]
    kfns = attempt(row, "kernel path setup", lambda: [kernel_fn(cache, q_d, g, args.ps) for g in groups])
    ms = kfns and attempt(row, "kernel path", lambda: bs.gpu_ms(args, kfns))
    if not ms:
        row["path"] = "pyattn.decode behind the pre-roll"
        ms = attempt(row, "pyattn.decode (pre-roll)", lambda: bs.gpu_ms(args, api))
    row["us"] = ms * 1e3 if ms else None
    row["wall_us"] = attempt(row, "pyattn.decode (wall)", lambda: bd.wall_us(api[0], args.loop, args.reps))
    ref = bd.reference(q[:1], k0.transpose(0, 1)[None], v0.transpose(0, 1)[None])  # (1, Hq, D), over bf16 data
    held = ref if row["cache"] == "bf16" else attempt(row, "quantized reference",
                                                      lambda: held_ref(q, k0, v0, row["cache"]))
    o = None
    for name, fn in ([("kernel path", kfns[0])] if kfns else []) + [("pyattn.decode", api[0])]:
        out = attempt(row, f"check {name}", fn)
        if out is None:
            continue
        o = bs.to_torch(out, args.ps).float().view(B, HQ, D)
        row["err_vs_data"] = max(row.get("err_vs_data", 0.0), (o[:1] - ref).abs().max().item())
        if base is not None:
            row["err_vs_bf16"] = max(row.get("err_vs_bf16", 0.0), (o - base).abs().max().item())
        if held is None:
            continue
        err = (o[:1] - held).abs().max().item()
        row["max_err"] = max(row.get("max_err", 0.0), err)
        if not (err <= TOL and err / max(held.abs().max().item(), 1e-30) <= TOL):  # also catches NaN
            row["flagged"] = True
            print(f"!!!!! WARNING: pyattn ({name}, {row['cache']} cache) differs from the fp32 reference over the K/V "
                  f"the cache holds by {err:.3e} for B={B} ctx={ctx} !!!!!")
    return o


def held_ref(q, k0, v0, kind):
    """fp32 reference of batch row 0 over K/V as pyattn.quant quantizes and dequantizes them: (1, Hq, D)."""
    import ml_dtypes

    from pyattn.quant import dequantize, quantize_rows

    def deq(x):
        xn = x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return torch.from_numpy(dequantize(*quantize_rows(xn, QKIND[kind]))).cuda().transpose(0, 1)[None]
    return bd.reference(q[:1], deq(k0), deq(v0))


def run_speed(args, result, save) -> None:
    dev = pyattn.get_device()
    for B, ctx in args.shapes:
        if time.perf_counter() - result["t0"] > args.budget:
            print(f"  B={B} ctx={ctx}: skipped (past the --budget of {args.budget:.0f} s)")
            result.setdefault("skipped", []).append([B, ctx])
            continue
        b8 = read_bytes(B, ctx, "int8")
        n_rep = 1 if b8 >= 4 * args.l2 else min(8, math.ceil(4 * args.l2 / b8))
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(B + ctx))
        q_d, base = bd.to_pyattn(q, args.ps), None
        for kind in args.kinds:
            row = {"batch": B, "ctx": ctx, "cache": kind, "bytes": read_bytes(B, ctx, kind), "replicas": n_rep}
            try:
                out = bench_kind(args, row, B, ctx, n_rep, q, q_d, base)
                base = out if kind == "bf16" else base
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory
                traceback.print_exc()
                row.setdefault("errors", []).append(f"{type(exc).__name__}: {str(exc)[:300]}")
            drop(dev)
            result["speed"].append(row)
            print(f"  B={B} ctx={ctx} {kind}: kernel {_f(row.get('us'), '.1f')} us, decode() wall "
                  f"{_f(row.get('wall_us'), '.1f')} us, max err {_f(row.get('max_err'), '.1e')}", flush=True)
            save()
        base = None
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
    """Codes and scales in the cache that differ (bitwise) from pyattn.quant.quantize_rows of k, v."""
    from pyattn.quant import quantize_rows

    table, _ = cache.block_table(seqs)
    n = 0
    for pool, spool, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        codes, scales = quantize_rows(x, QKIND[kind])
        got = pool.numpy()[table].reshape(AB, -1, HKV, D)[:, :ACTX]
        got_s = spool.numpy()[table].reshape(AB, -1, HKV)[:, :ACTX]
        n += int((got.view(np.uint8) != codes.view(np.uint8)).sum())
        n += int((got_s.view(np.uint32) != scales.view(np.uint32)).sum())
    return n


def accuracy_row(args, row, q, k, v, ref, base):
    """Decode over one cache kind and fill ``row`` with its errors; returns the output (B, Hq, D) fp64."""
    from pyattn.quant import dequantize, quantize_rows

    kind = row["cache"]
    cache, seqs = new_cache(kind, AB, ACTX)
    cache.append(seqs, k, v, stream=args.ps)
    out = np.asarray(pyattn.decode(q, cache, seqs, stream=args.ps)).astype(np.float64).reshape(AB, HQ, D)
    e = np.abs(out - ref)
    row.update(max_err=e.max(), mean_err=e.mean(), rel_err=e.max() / np.abs(ref).max())
    own, own_ref = row["max_err"], np.abs(ref).max()
    if base is not None:
        d = np.abs(out - base)
        row.update(max_vs_bf16=d.max(), mean_vs_bf16=d.mean())
    if kind != "bf16":
        dref = attn64(q, *(dequantize(*quantize_rows(x, QKIND[kind])) for x in (k, v)))
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


def run_accuracy(args, result, save) -> None:
    from pyattn.quant import dequantize, quantize_rows

    dev = pyattn.get_device()
    for name, q, k, v in datasets():
        ref, base = attn64(q, k, v), None
        for kind in args.kinds:
            row = {"dataset": name, "cache": kind}
            try:
                out = accuracy_row(args, row, q, k, v, ref, base)
                base = out if kind == "bf16" else base
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row.setdefault("errors", []).append(f"{type(exc).__name__}: {str(exc)[:300]}")
            drop(dev)
            result["accuracy"].append(row)
            print(f"  {name} {kind}: max err {_f(row.get('max_err'), '.2e')}, mean {_f(row.get('mean_err'), '.2e')}",
                  flush=True)
        for kind, qk in QKIND.items():
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
        save()


def _us(r) -> str:
    us = _f(r.get("us"), ".1f") + ("+" if r.get("path") else "")
    return "FAILED" if us == "n/a" else us


def tables(result) -> list:
    out = bs.md(f"\n== decode over a PagedKVCache: Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, q_len 1, bf16 queries; "
                f"d2d copy {_f(result.get('copy_gbs'), '.0f')} GB/s",
                ("batch", "ctx", "cache", "kernel us", "MB read", "GB/s", "% of copy", "x bf16", "decode() wall us",
                 "max err", "vs bf16 data", "vs bf16 cache"),
                [(r["batch"], r["ctx"], r["cache"], _us(r), _f(r["bytes"] / 1e6, ".1f"), _f(r.get("gbs"), ".0f"),
                  _f(r.get("pct_copy"), ".0f"), _f(r.get("x_bf16"), ".2f"), _f(r.get("wall_us"), ".1f"), bs._err(r),
                  _f(r.get("err_vs_data"), ".1e"), _f(r.get("err_vs_bf16"), ".1e")) for r in result["speed"]])
    out += bs.md(f"\n== accuracy: B={AB}, ctx {ACTX}; errors against fp64 attention over the bf16 K/V (ref), the bf16 "
                 "cache's output, and fp64 attention over the K/V as pyattn.quant quantizes them (quantized ref)",
                 ("dataset", "cache", "max err", "mean err", "max err / max abs(ref)", "max vs bf16 cache",
                  "mean vs bf16 cache", "max vs quantized ref", "code mismatches"),
                 [(r["dataset"], r["cache"], _f(r.get("max_err"), ".2e") + (" !" if r.get("flagged") else ""),
                   _f(r.get("mean_err"), ".2e"), _f(r.get("rel_err"), ".2e"), _f(r.get("max_vs_bf16"), ".2e"),
                   _f(r.get("mean_vs_bf16"), ".2e"), _f(r.get("err_vs_quantized_ref"), ".2e"),
                   r.get("code_mismatches", "-")) for r in result["accuracy"]])
    return out + bs.md("\n== quantizer round trip (pyattn.quant): |x - dequantize(quantize_rows(x))| / row amax",
                       ("dataset", "tensor", "kind", "max", "mean"),
                       [(r["dataset"], r["tensor"], r["kind"], _f(r.get("max"), ".2e"), _f(r.get("mean"), ".2e"))
                        for r in result["roundtrip"]])


def targets(result) -> list:
    res = []
    for r in result["speed"]:
        if r["ctx"] >= 32768 and r["cache"] in QKIND:
            x = r.get("x_bf16")
            res.append({"pass": None if x is None else x >= 1.7,
                        "text": f"8-bit KV decode at ctx >= 32k >= 1.7x faster than bf16: {r['cache']} B={r['batch']} "
                                f"ctx={r['ctx']}: {_f(x, '.2f')}x"})
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write every figure to this JSON file (rewritten after each row)")
    p.add_argument("--quick", action="store_true", help="8x4096 and 8x32768 only; shorter loops")
    p.add_argument("--configs", help="comma list of BATCHxCTX (default: 1/8/64 x 4096/32768)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--sections", default="speed,accuracy", help="comma list of speed, accuracy")
    p.add_argument("--budget", type=float, default=420.0, help="skip speed shapes not started after this many s")
    args = p.parse_args(argv)
    try:
        args.kinds = [k for k in args.kinds.split(",") if k]
        args.sections = [s for s in args.sections.split(",") if s]
        args.shapes = ([tuple(int(n) for n in c.lower().split("x")) for c in args.configs.split(",") if c]
                       if args.configs else QUICK if args.quick else SHAPES)
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
    result, save = started
    result.update(speed=[], accuracy=[], roundtrip=[])
    if "speed" in args.sections:
        bs.section(result, "speed", "speed", lambda: run_speed(args, result, save), save,
                   {"batch": 0, "ctx": 0, "cache": "-", "bytes": 0})
    if "accuracy" in args.sections:
        bs.section(result, "accuracy", "accuracy", lambda: run_accuracy(args, result, save), save,
                   {"dataset": "-", "cache": "-"})
    derive(result)
    print("\n".join(tables(result)))
    print("(kernel us: GPU time of run_decode behind a pre-roll; + = internals failed, pyattn.decode timed instead; "
          "decode() wall us: a Python loop of pyattn.decode; x bf16 above 1: faster than the bf16 cache; ! = flagged)"
          + ("" if result.get("preroll") else " [no pre-roll: host gaps may be in the GPU times]"))
    if result.get("skipped"):
        result["notes"].append(f"speed shapes skipped (budget): {result['skipped']}")
    result["targets"] = targets(result)
    rows = result["speed"] + result["accuracy"] + result["roundtrip"]
    return bs.finish(result, rows, save) or (1 if result.get("skipped") else 0)


if __name__ == "__main__":
    sys.exit(main())

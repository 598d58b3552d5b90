"""SparQ benchmark: pyattn.sparq_decode against exact decode over the same PagedKVCache, torch SDPA beside, one GPU.

Usage: PYTHONPATH=. python scripts/bench_sparq.py [--json out.json] [--quick] [--configs 8x32768,4x131072]
       [--page 64] [--sections speed,accuracy] [--budget 300]

- Speed: bf16, Hq=32, Hkv=8, D=128, q_len 1, r = D/4, k = L/8 (the issue's point), batch x context
  1x32768, 8x32768, 1x131072, 4x131072 (--quick: 8x32768, 2x131072). One PagedKVCache(sparq=True,
  page --page) per replica, filled by append() of random bf16 K/V made on the device with torch; the
  same K/V also as contiguous torch tensors for SDPA. GPU us (harness.Bench.gpu_ms, pre-roll, median):
  pyattn.sparq_decode and pyattn.decode (exact) over the same cache, torch SDPA (FA2, cuDNN) over the
  contiguous K/V with enable_gqa. x exact = decode us / sparq us; x FA2 / x cuDNN likewise. SparQ with
  select="group" (a GQA group shares the choices; the target's mode) and, "head us", select="head" (each query
  head its own: the paper's algorithm, up to G times the bytes). "L/8 us": exact decode over a cache of L/8
  tokens per sequence, what SparQ's attention step over its k = L/8 chosen keys costs at best (contiguous pages).
- Bytes: exact = K + V (2 bytes an element). SparQ (model): the r chosen rows of the transposed keys
  (r * page * 2 bytes a page, kv head), k full K and V rows, and 8 bytes a key for its score (written,
  read); GB/s = model bytes / GPU time. "wall us": a Python loop of sparq_decode with a torch query
  (the user's side of the boundary), one sync at the end.
- Accuracy (B=2, L=4096, the speed shape's heads): SparQ's output against fp64 exact attention on
  structured data: gaussian; needles (8 keys per sequence and kv head aligned with the group's
  mean query: attention concentrates); outlier channels (4 key channels x30); llm-like (a few key
  channels with a large shared mean, log-normal channel scales, low-rank values, queries leaning on
  the mean direction). For r in D/4, D/8 and k in L/8, L/32: max and mean abs error, max error /
  max |exact|, alpha's range, for select="group" and "head", and two yardsticks: the mean of V
  alone, and exact attention over each query head's true top-k keys without the mean (an oracle). "own ref": pyattn against the fp64
  SparQ reference over pyattn's own choice (the kernel's exactness; flagged above 2e-2).
- Target: "SparQ >= 3x faster than exact decode at k = L/8, r = D/4", per configuration at L >= 32k.
"""

from __future__ import annotations

import gc
import math
import sys
import traceback

import numpy as np

import bench_sparse as bs
import harness
import pyattn
from harness import attempt, fmt

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
CONFIGS = [(1, 32768), (8, 32768), (1, 131072), (4, 131072)]
QUICK = [(8, 32768), (2, 131072)]
CHUNK, AB, ACTX = 2048, 2, 4096


def exact_bytes(B: int, ctx: int) -> int:
    return B * ctx * HKV * D * 2 * 2


def sparq_bytes(B: int, ctx: int, r: int, k: int, page: int) -> int:
    """The model of what one sparq_decode reads and writes (see the module docstring)."""
    kt = B * HKV * -(-ctx // page) * r * page * 2
    chosen = B * HKV * min(k, ctx) * D * 2 * 2
    return kt + chosen + B * HKV * ctx * 8


def fill(bench, cache, seqs, ctx: int, seed: int, keep: bool):
    """Append random bf16 K/V to every sequence; with ``keep``, the contiguous K/V (B, Hkv, ctx, D)."""
    torch = bench.torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    ks, vs = [], []
    for t0 in range(0, ctx, CHUNK):
        k, v = (torch.randn(len(seqs), min(CHUNK, ctx - t0), HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        cache.append(seqs, harness.to_pyattn(k, bench.stream), harness.to_pyattn(v, bench.stream), stream=bench.stream)
        if keep:
            ks.append(k.transpose(1, 2).contiguous())
            vs.append(v.transpose(1, 2).contiguous())
    return (torch.cat(ks, 2), torch.cat(vs, 2)) if keep else (None, None)


def speed_row(bench, args, B: int, ctx: int) -> dict:
    torch = bench.torch
    r, k = D // 4, ctx // 8
    row = {"batch": B, "ctx": ctx, "r": r, "k": k, "page": args.page, "exact_mb": exact_bytes(B, ctx) / 1e6,
           "sparq_mb": sparq_bytes(B, ctx, r, k, args.page) / 1e6}
    n_rep = bench.replicas(exact_bytes(B, ctx), cap=2)
    caches = []
    for i in range(n_rep):
        cache = pyattn.PagedKVCache(B * -(-ctx // args.page) + 8, args.page, HKV, D, "bfloat16", sparq=True)
        seqs = [cache.add_sequence() for _ in range(B)]
        kv = fill(bench, cache, seqs, ctx, 100 * B + ctx + i, keep=i == 0)
        caches.append((cache, seqs))
        if i == 0:
            k_c, v_c = kv
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(7))
    q_d = harness.to_pyattn(q, bench.stream)
    s = bench.stream
    sparq = [lambda c=c, ids=ids: pyattn.sparq_decode(q_d, c, ids, r=r, k=k, stream=s) for c, ids in caches]
    head = [lambda c=c, ids=ids: pyattn.sparq_decode(q_d, c, ids, r=r, k=k, select="head", stream=s)
            for c, ids in caches]
    exact = [lambda c=c, ids=ids: pyattn.decode(q_d, c, ids, stream=s) for c, ids in caches]
    small = pyattn.PagedKVCache(B * -(-k // args.page) + 8, args.page, HKV, D, "bfloat16")
    small_ids = [small.add_sequence() for _ in range(B)]
    fill(bench, small, small_ids, k, 5, keep=False)
    tail = [lambda: pyattn.decode(q_d, small, small_ids, stream=s)]
    for name, fns in (("sparq", sparq), ("head", head), ("exact", exact), ("l8", tail)):
        t = attempt(row, name, lambda: bench.gpu_ms(fns, loop=args.loop, reps=args.reps, label=f"{name} B{B} L{ctx}"))
        row[f"{name}_us"] = t.ms * 1e3 if t else None
    row["wall_us"] = attempt(row, "sparq wall (torch q)", lambda: bench.wall_ms(
        lambda: pyattn.sparq_decode(q, caches[0][0], caches[0][1], r=r, k=k), loop=args.loop, reps=args.reps) * 1e3)
    qs = q.view(B, HQ, 1, D)
    for be in harness.SDPA_BACKENDS:
        t = attempt(row, f"sdpa {be}", lambda: bench.gpu_ms(harness.sdpa(torch, be, qs, k_c, v_c, enable_gqa=True),
                                                             loop=args.loop, reps=args.reps, label=f"{be} B{B} L{ctx}"))
        row[f"{be}_us"] = t.ms * 1e3 if t else None
    # how far the approximation lands from exact attention on this (random) data, for the record
    out_s, out_e = (harness.to_torch(f()).float() for f in (sparq[0], exact[0]))
    row["err_vs_exact"] = (out_s - out_e).abs().max().item()
    row["max_exact"] = out_e.abs().max().item()
    del k_c, v_c, caches, small
    return row


def run_speed(bench, args, result) -> None:
    for B, ctx in args.shapes:
        if harness.over_budget(result, args.budget, f"B={B} ctx={ctx}"):
            continue
        try:
            row = speed_row(bench, args, B, ctx)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory
            traceback.print_exc()
            row = {"batch": B, "ctx": ctx, "errors": [f"{type(exc).__name__}: {str(exc)[:300]}"]}
        gc.collect()  # the caches and the contiguous copies go before the next shape
        bench.sync()
        bench.torch.cuda.empty_cache()
        if row.get("sparq_us"):
            row["gbs"] = row["sparq_mb"] * 1e6 / row["sparq_us"] / 1e3
            for ref in ("exact", "fa2", "cudnn"):
                row[f"x_{ref}"] = row[f"{ref}_us"] / row["sparq_us"] if row.get(f"{ref}_us") else None
        result["speed"].append(row)
        print(f"  B={B} L={ctx}: sparq {fmt(row.get('sparq_us'), '.1f')} us, exact {fmt(row.get('exact_us'), '.1f')} "
              f"us, x {fmt(row.get('x_exact'), '.2f')}", flush=True)
        harness.save_json(args.json, result)


# -- accuracy -----------------------------------------------------------------------------------------
def datasets(rng):
    """(name, q (B, 1, Hq, D), keys, values (B, L, Hkv, D)) float32, then made bf16 by the caller."""
    q = rng.standard_normal((AB, 1, HQ, D)).astype(np.float32)
    qg = q[:, 0].reshape(AB, HKV, G, D).mean(2)  # the group's mean query
    k, v = rng.standard_normal((2, AB, ACTX, HKV, D)).astype(np.float32)
    yield "gaussian", q, k, v
    kn = k.copy()
    for b in range(AB):
        for h in range(HKV):
            pos = rng.choice(ACTX, 8, replace=False)
            kn[b, pos, h] += 3.0 * np.sqrt(D) * qg[b, h] / np.linalg.norm(qg[b, h])
    yield "needles", q, kn, v
    ko = k.copy()
    for h in range(HKV):
        ko[:, :, h, rng.choice(D, 4, replace=False)] *= 30.0
    yield "outlier channels", q, ko, v
    scales = np.exp(rng.normal(0, 0.7, (HKV, D))).astype(np.float32)
    mean = np.zeros((HKV, D), np.float32)
    for h in range(HKV):
        mean[h, rng.choice(D, 6, replace=False)] = rng.normal(0, 6, 6)
    kl = k * scales + mean
    basis = rng.standard_normal((HKV, 8, D)).astype(np.float32)
    vl = np.einsum("blhr,hrd->blhd", rng.standard_normal((AB, ACTX, HKV, 8)).astype(np.float32), basis) / 3 + 0.3 * v
    ql = q + 0.05 * np.repeat(mean[None, None], G, axis=2).reshape(1, 1, HQ, D)
    yield "llm-like", ql.astype(np.float32), kl, vl


def run_accuracy(bench, args, result) -> None:
    import ml_dtypes

    from pyattn.reference import attention_ref, sparq_ref

    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(13)
    for name, q, k, v in datasets(rng):
        q, k, v = q.astype(bf), k.astype(bf), v.astype(bf)
        cache = pyattn.PagedKVCache(AB * ACTX // args.page + 4, args.page, HKV, D, "bfloat16", sparq=True)
        ids = [cache.add_sequence() for _ in range(AB)]
        cache.append(ids, k, v, stream=bench.stream)
        exact = attention_ref(q, k, v)
        mean_only = np.broadcast_to(v.astype(np.float64).mean(1).repeat(G, axis=1)[:, None], exact.shape)
        scores = np.einsum("bhd,blhd->bhl", q[:, 0].astype(np.float64),
                           np.repeat(k.astype(np.float64), G, axis=2)) / math.sqrt(D)  # per query head
        for select, r, kk in [(sel, r, kk) for sel in ("group", "head") for r, kk in
                              ((D // 4, ACTX // 8), (D // 8, ACTX // 8), (D // 4, ACTX // 32))]:
            row = {"dataset": name, "select": select, "r": r, "k": kk}
            try:
                out, pos = pyattn.sparq_decode(q, cache, ids, r=r, k=kk, select=select, return_indices=True,
                                               stream=bench.stream)
                out = out.astype(np.float64)
                e = np.abs(out - exact)
                row.update(max_err=e.max(), mean_err=e.mean(), rel_err=e.max() / np.abs(exact).max(),
                           mean_only_err=np.abs(mean_only - exact).max())
                chosen = [list(pos[b]) for b in range(AB)]
                own, det = sparq_ref(q, list(k), list(v), r=r, k=kk, select=select, chosen=chosen,
                                     return_details=True)
                row["own_err"] = np.abs(out - own).max()
                row["alpha_min"], row["alpha_max"] = det["alpha"].min(), det["alpha"].max()
                top = np.argsort(-scores, axis=-1)[..., :kk]  # each query head's true top-k
                oracle = np.stack([attention_ref(q[b:b + 1, :, h:h + 1], k[b:b + 1, top[b, h], h // G:h // G + 1],
                                                 v[b:b + 1, top[b, h], h // G:h // G + 1])[0, 0, 0]
                                   for b in range(AB) for h in range(HQ)]).reshape(AB, 1, HQ, D)
                row["oracle_err"] = np.abs(oracle - exact).max()
                if not row["own_err"] <= 2e-2 * max(1.0, np.abs(own).max()):
                    row["flagged"] = True
                    print(f"!!!!! WARNING: sparq_decode differs from its fp64 reference by {row['own_err']:.3e} "
                          f"({name}, {select}, r={r}, k={kk}) !!!!!")
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row.setdefault("errors", []).append(f"{type(exc).__name__}: {str(exc)[:300]}")
            result["accuracy"].append(row)
            print(f"  {name} {select} r={r} k={kk}: max err {fmt(row.get('max_err'), '.3e')} (mean only "
                  f"{fmt(row.get('mean_only_err'), '.2e')}, oracle top-k {fmt(row.get('oracle_err'), '.2e')})",
                  flush=True)
        harness.save_json(args.json, result)


def tables(result) -> list:
    out = harness.md_table(
        f"\n== SparQ vs exact decode: Hq={HQ}, Hkv={HKV}, D={D}, bf16, q_len 1, r = D/4, k = L/8; d2d copy "
        f"{fmt(result.get('copy_gbs'), '.0f')} GB/s",
        ("batch", "ctx", "page", "sparq us", "exact us", "x exact", "FA2 us", "x FA2", "cuDNN us", "x cuDNN",
         "SparQ MB (model)", "exact MB", "SparQ GB/s", "wall us (torch q)", "max err vs exact", "head us", "L/8 us"),
        [(r["batch"], r["ctx"], r.get("page", "-"), fmt(r.get("sparq_us"), ".1f"), fmt(r.get("exact_us"), ".1f"),
          fmt(r.get("x_exact"), ".2f"), fmt(r.get("fa2_us"), ".1f"), fmt(r.get("x_fa2"), ".2f"),
          fmt(r.get("cudnn_us"), ".1f"), fmt(r.get("x_cudnn"), ".2f"), fmt(r.get("sparq_mb"), ".0f"),
          fmt(r.get("exact_mb"), ".0f"), fmt(r.get("gbs"), ".0f"), fmt(r.get("wall_us"), ".1f"),
          fmt(r.get("err_vs_exact"), ".2e"), fmt(r.get("head_us"), ".1f"), fmt(r.get("l8_us"), ".1f"))
         for r in result["speed"]])
    return out + harness.md_table(
        f"\n== SparQ accuracy against fp64 exact attention: B={AB}, L={ACTX}, bf16",
        ("dataset", "select", "r", "k", "max err", "mean err", "max err / max abs(exact)", "alpha min..max", "mean(V) only",
         "oracle top-k, no mean", "own ref (kernel)"),
        [(r["dataset"], r.get("select", "-"), r["r"], r["k"], fmt(r.get("max_err"), ".2e") + (" !" if r.get("flagged") else ""),
          fmt(r.get("mean_err"), ".2e"), fmt(r.get("rel_err"), ".2e"),
          f"{fmt(r.get('alpha_min'), '.2f')}..{fmt(r.get('alpha_max'), '.2f')}", fmt(r.get("mean_only_err"), ".2e"),
          fmt(r.get("oracle_err"), ".2e"), fmt(r.get("own_err"), ".1e")) for r in result["accuracy"]])


def targets(result) -> list:
    return [{"pass": None if r.get("x_exact") is None else r["x_exact"] >= 3.0,
             "text": f"SparQ >= 3x exact decode at k = L/8, r = D/4: B={r['batch']} L={r['ctx']}: "
                     f"{fmt(r.get('x_exact'), '.2f')}x"} for r in result["speed"] if r["ctx"] >= 32768]


def parse_args(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--configs", type=harness.batch_lengths, help="comma list of BATCHxCTX")
    p.add_argument("--page", type=int, default=64, help="page size of the caches (a multiple of 8)")
    p.add_argument("--sections", default="speed,accuracy", help="comma list of speed, accuracy")
    p.add_argument("--budget", type=float, default=300.0, help="skip speed shapes not started after this many s")
    args = p.parse_args(argv)
    try:
        args.sections = [s for s in args.sections.split(",") if s]
        args.shapes = args.configs or (QUICK if args.quick else CONFIGS)
        assert all(len(s) == 2 and min(s) > 0 for s in args.shapes) and args.page % 8 == 0 and args.page > 0
        assert args.sections and set(args.sections) <= {"speed", "accuracy"}
    except (ValueError, AssertionError):
        p.error("--configs: BATCHxCTX,...; --page: a multiple of 8; --sections: speed,accuracy")
    args.reps, args.loop = (3, 10) if args.quick else (7, 20)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = bs.start(args, "SparQ")
    if started is None:
        return 1
    bench, result = started
    result.update(speed=[], accuracy=[])
    if "speed" in args.sections:
        bs.section(bench, result, "speed", "speed", lambda: run_speed(bench, args, result), {"batch": 0, "ctx": 0})
    if "accuracy" in args.sections:
        bs.section(bench, result, "accuracy", "accuracy", lambda: run_accuracy(bench, args, result),
                   {"dataset": "-", "r": 0, "k": 0})
    print(f"\n{harness.env_line(harness.environment(bench))}")
    print("\n".join(tables(result)))
    print("(GPU us behind a pre-roll; x above 1: SparQ faster; SparQ MB: the model's bytes (module docstring); "
          "own ref: pyattn vs the fp64 SparQ reference over pyattn's choice; ! = flagged)")
    result["targets"] = targets(result)
    return bs.finish(bench, result, result["speed"] + result["accuracy"])


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark (issues 13, 11): chunked prefill over pages, token-tree verification and a
decode loop's step, one GPU, one run.

Usage: PYTHONPATH=. python scripts/bench_serving.py [--json out.json] [--quick] [--parts chunk,batch,tree,step]
       [--pages 16,64] [--budget 200]

Shapes: bf16, D 128, Hq 32, Hkv 8 (GQA 4). Caches are filled by appends of several sequences at a
time, so a sequence's pages interleave with others' (the chunk's one sequence with a twin).

- chunk: one sequence, a 4096-token chunk over a 16384-token cached prefix (20480 keys), causal
  bottom-right. pyattn.prefill over the PagedKVCache (pages of 16 / 64 tokens; q a DeviceArray,
  and a torch tensor: the user's side of the boundary) against pyattn.attention (the dense
  prefill kernel) on the same keys laid out contiguously, and torch SDPA FA2 / cuDNN with a
  lower-right causal bias. Target: dense time / paged time >= 0.9.
- batch: 64 sequences x 512 new tokens over mixed cached prefixes (0 to 16384, mean ~4.3k), one
  launch; against pyattn.attention_varlen on the same keys packed contiguously; and
  pyattn.paged_prefill over the cache's pools with torch q, block table, lengths and offsets (an
  engine's own tables; must equal prefill bitwise), GPU and wall time a call, checked (the tables
  copied back) and bounded (max_seqlen_q / max_seqlen_k: read on the device only).
- tree: draft trees of n = 16 / 64 random tokens over 4096 cached tokens, batch 1 / 8 / 32:
  pyattn.verify_tree against pyattn.decode with q_len = n (causal) over the same cache (the same
  keys and queries), and torch SDPA with an explicit boolean mask (its default backend choice).
  Target: verify / decode <= 1.3.
- step: a serving loop's decode step as users write it, B = 1 / 8 / 64 sequences over ~1k-token
  prefixes: torch writes each sequence's new K / V (a model's projection stands in: ``normal_``)
  just before ``cache.append(ids, k, v)``, then ``pyattn.decode(q, cache, ids)`` handed back with
  ``torch.from_dlpack``. Host us per step (a loop of steps, one sync) against the decode alone on
  an unchanged cache, and the decode's GPU us: the step's host cost over the decode's is what an
  engine's loop pays for the cache's bookkeeping.
- GPU ms: harness.Bench.gpu_ms (pre-roll, median of repeats); caches under 4x the L2 are
  replicated and rotated. TFLOP/s count 4 * Hq * D per visible (query, key) pair. Outputs are
  checked against an fp32 torch reference on sampled rows and against the anchor's output
  (flagged above 2e-2).
"""

from __future__ import annotations

import gc
import sys
import time
import traceback

import numpy as np

import harness
import pyattn
from harness import attempt, fmt

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
TOL = 2e-2


def flops_causal(prefix: int, n: int) -> float:
    """Multiply-adds x 2 of n causal new tokens over prefix cached ones (QK^T and PV)."""
    return 4.0 * HQ * D * (n * prefix + n * (n + 1) / 2)


def fill(bench, ks, vs, page: int, twin: bool = False):
    """A PagedKVCache holding sequences ks[i] / vs[i] (torch (L_i, Hkv, D)), appended a page-sized
    round at a time for all sequences (pages interleave); ``twin`` adds an equal dummy sequence per
    sequence. Returns (cache, ids)."""
    torch = bench.torch
    lens = [x.shape[0] for x in ks]
    n_seq = len(ks) * (2 if twin else 1)
    cache = pyattn.PagedKVCache(sum(-(-n // page) + 1 for n in lens) * (2 if twin else 1) + 2, page, HKV, D,
                                "bfloat16")
    ids = [cache.add_sequence() for _ in range(n_seq)]
    step = max(page, 256 // page * page)
    for t0 in range(0, max(lens), step):
        counts = [max(0, min(step, n - t0)) for n in lens] * (2 if twin else 1)
        if not any(counts):
            continue
        src = [x[t0:t0 + step] for x in ks] * (2 if twin else 1), [x[t0:t0 + step] for x in vs] * (2 if twin else 1)
        k, v = (harness.to_pyattn(torch.cat(s).contiguous(), bench.stream) for s in src)
        cache.append(ids, k, v, counts=counts, stream=bench.stream)
    return cache, ids[:len(ks)]


def ref_rows(torch, q, k, v, rows, prefix: int, mask=None):
    """fp32 attention of q[rows] (n, Hq, D) over k / v (L, Hkv, D), causal bottom-right (or ``mask``
    rows (n, L) bool): (len(rows), Hq, D)."""
    L, n = k.shape[0], q.shape[0]
    qs = q[rows].float().view(len(rows), HKV, G, D).permute(1, 2, 0, 3)  # (Hkv, G, r, D)
    s = qs @ k.float().permute(1, 2, 0)[:, None] / D ** 0.5  # (Hkv, G, r, L)
    if mask is None:
        pos = torch.as_tensor(rows, device=q.device)[:, None] + L - n
        mask = torch.arange(L, device=q.device)[None, :] <= pos
    else:
        mask = mask[rows]
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.softmax(s, -1) @ v.float().permute(1, 0, 2)[:, None]  # (Hkv, G, r, D)
    return o.permute(2, 0, 1, 3).reshape(len(rows), HQ, D)


def err(out, ref, rows) -> float:
    t = harness.to_torch(out).float().reshape(-1, HQ, D)[rows]
    return (t - ref).abs().max().item()


def part_chunk(bench, args, result) -> None:
    torch, P, N = bench.torch, 16384, 4096
    g = torch.Generator(device="cuda").manual_seed(13)
    k, v = (torch.randn(P + N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    fl = flops_causal(P, N)
    rows = list(range(0, N, 97)) + [N - 1]
    ref = ref_rows(torch, q, k, v, rows, P)
    qd = harness.to_pyattn(q.view(1, N, HQ, D), bench.stream)
    kd, vd = (harness.to_pyattn(x.view(1, P + N, HKV, D), bench.stream) for x in (k, v))
    row = {"prefix": P, "chunk": N, "tflop": fl / 1e12}
    dense = lambda: pyattn.attention(qd, kd, vd, causal=True, stream=bench.stream)  # noqa: E731
    t = attempt(row, "dense", lambda: bench.gpu_ms(dense, loop=args.loop, reps=args.reps, label="dense chunk"))
    if t:
        row["dense_ms"], out_dense = t.ms, dense()
        row["dense_err"] = err(out_dense, ref, rows)
    from torch.nn.attention.bias import causal_lower_right
    bias = causal_lower_right(N, P + N)
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, S, D)
    for name in harness.SDPA_BACKENDS:
        fn = harness.sdpa(torch, name, qt, kt, vt, attn_mask=bias, enable_gqa=True)
        t = attempt(row, f"torch {name}", lambda: bench.gpu_ms(fn, loop=args.loop, reps=args.reps, label=name))
        if t:
            row[f"{name}_ms"] = t.ms
    for page in args.pages:
        pr = dict(row, page=page, errors=list(row.get("errors", [])))
        cache, ids = fill(bench, [k], [v], page, twin=True)
        paged = lambda: pyattn.prefill(qd, cache, ids, stream=bench.stream)  # noqa: E731
        ptorch = lambda: pyattn.prefill(q.view(1, N, HQ, D), cache, ids)  # noqa: E731
        t = attempt(pr, "paged", lambda: bench.gpu_ms(paged, loop=args.loop, reps=args.reps, label=f"paged p{page}"))
        if t:
            out = paged()
            pr.update(paged_ms=t.ms, held=t.held, paged_err=err(out, ref, rows))
            if "dense_ms" in row:
                pr["vs_dense"] = row["dense_ms"] / t.ms
                diff = harness.to_torch(out).float() - harness.to_torch(out_dense).float()
                pr["diff_dense"] = diff.abs().max().item()
        t = attempt(pr, "paged torch q", lambda: bench.gpu_ms(ptorch, loop=args.loop, reps=args.reps,
                                                              label=f"paged torch p{page}"))
        if t:
            pr["torch_q_ms"] = t.ms
            pr["torch_q_wall_ms"] = attempt(pr, "wall", lambda: bench.wall_ms(ptorch, loop=args.loop, reps=args.reps))
        pr["flagged"] = not all(pr.get(x, 1) <= TOL for x in ("paged_err", "diff_dense"))
        result["chunk"].append(pr)
        print(f"  chunk p{page}: paged {fmt(pr.get('paged_ms'), '.3f')} ms, dense {fmt(row.get('dense_ms'), '.3f')} "
              f"ms (x{fmt(pr.get('vs_dense'), '.3f')}), FA2 {fmt(row.get('fa2_ms'), '.3f')}, cuDNN "
              f"{fmt(row.get('cudnn_ms'), '.3f')}; err {fmt(pr.get('paged_err'), '.1e')}", flush=True)
        del cache
        gc.collect()


def part_batch(bench, args, result) -> None:
    torch, B, N = bench.torch, 64, 512
    g = torch.Generator(device="cuda").manual_seed(64)
    prefixes = [(0, 256, 1024, 2048, 4096, 8192, 16384, 3000)[i % 8] for i in range(B)]
    ks = [torch.randn(p + N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for p in prefixes]
    vs = [torch.randn(p + N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for p in prefixes]
    q = torch.randn(B * N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu_q = np.arange(B + 1, dtype=np.int32) * N
    cu_k = np.concatenate([[0], np.cumsum([p + N for p in prefixes])]).astype(np.int32)
    fl = sum(flops_causal(p, N) for p in prefixes)
    row = {"batch": B, "new": N, "mean_prefix": float(np.mean(prefixes)), "tflop": fl / 1e12, "page": args.pages[0]}
    qd = harness.to_pyattn(q, bench.stream)
    kp, vp = (harness.to_pyattn(torch.cat(x), bench.stream) for x in (ks, vs))
    dcu_q, dcu_k = pyattn.asarray(cu_q), pyattn.asarray(cu_k)  # on q's side, as attention_varlen asks
    var = lambda: pyattn.attention_varlen(qd, kp, vp, dcu_q, dcu_k, causal=True, max_seqlen_q=N,  # noqa: E731
                                          max_seqlen_k=max(prefixes) + N, stream=bench.stream)
    t = attempt(row, "varlen", lambda: bench.gpu_ms(var, loop=args.loop, reps=args.reps, label="varlen batch"))
    if t:
        row["varlen_ms"], out_var = t.ms, var()
    cache, ids = fill(bench, ks, vs, args.pages[0])
    paged = lambda: pyattn.prefill(qd, cache, ids, cu_q, stream=bench.stream)  # noqa: E731
    t = attempt(row, "paged", lambda: bench.gpu_ms(paged, loop=args.loop, reps=args.reps, label="paged batch"))
    if t:
        out = paged()
        row.update(paged_ms=t.ms, held=t.held, paged_tflops=fl / t.ms / 1e9)
        b = 6  # the 16384-token prefix: check its rows against the fp32 reference
        rows = list(range(0, N, 37)) + [N - 1]
        ref = ref_rows(torch, q[b * N:(b + 1) * N], ks[b], vs[b], rows, prefixes[b])
        row["paged_err"] = err(harness.to_torch(out)[b * N:(b + 1) * N], ref, rows)
        if "varlen_ms" in row:
            row["varlen_tflops"], row["vs_varlen"] = fl / row["varlen_ms"] / 1e9, row["varlen_ms"] / t.ms
            row["diff_varlen"] = (harness.to_torch(out).float() - harness.to_torch(out_var).float()).abs().max().item()
    # The same pages through an engine's own tables (paged_prefill): torch q, block table, lengths and
    # offsets, as vLLM holds them; the wall time includes the tables' copy-back for their check.
    table = np.zeros((B, max(len(cache.book.pages(i)) for i in ids)), np.int32)
    for b, i in enumerate(ids):
        table[b, :len(cache.book.pages(i))] = cache.book.pages(i)
    t_table, t_cu = torch.from_numpy(table).cuda(), torch.from_numpy(cu_q).cuda()
    t_lens = torch.from_numpy(cache.book.lengths(ids).astype(np.int32)).cuda()
    raw = lambda: pyattn.paged_prefill(q, cache.k, cache.v, t_cu, block_table=t_table, seq_lens=t_lens)  # noqa: E731
    t = attempt(row, "paged_prefill", lambda: bench.gpu_ms(raw, loop=args.loop, reps=args.reps, label="raw pools"))
    if t:
        row["raw_ms"] = t.ms
        row["raw_wall_ms"] = attempt(row, "raw wall", lambda: bench.wall_ms(raw, loop=args.loop, reps=args.reps))
        row["paged_wall_ms"] = attempt(row, "paged wall", lambda: bench.wall_ms(paged, loop=args.loop, reps=args.reps))
        if "paged_ms" in row:
            row["diff_raw"] = (harness.to_torch(raw()).float() - harness.to_torch(out).float()).abs().max().item()
    # ... and with the bounds that leave the tables unread on the host (FlashAttention's varlen contract).
    unread = lambda: pyattn.paged_prefill(q, cache.k, cache.v, t_cu, block_table=t_table, seq_lens=t_lens,  # noqa: E731
                                          max_seqlen_q=N, max_seqlen_k=table.shape[1] * args.pages[0])
    t = attempt(row, "paged_prefill bounded", lambda: bench.gpu_ms(unread, loop=args.loop, reps=args.reps,
                                                                   label="raw pools, bounded"))
    if t:
        row["unread_ms"] = t.ms
        row["unread_wall_ms"] = attempt(row, "unread wall", lambda: bench.wall_ms(unread, loop=args.loop,
                                                                                  reps=args.reps))
        if "paged_ms" in row:
            row["diff_unread"] = (harness.to_torch(unread()).float() - harness.to_torch(out).float()).abs().max().item()
    row["flagged"] = (not all(row.get(x, 1) <= TOL for x in ("paged_err", "diff_varlen"))
                      or row.get("diff_raw", 0) != 0 or row.get("diff_unread", 0) != 0)
    result["batch"].append(row)
    print(f"  batch 64 x 512: paged {fmt(row.get('paged_ms'), '.3f')} ms ({fmt(row.get('paged_tflops'), '.0f')} "
          f"TFLOP/s), varlen contiguous {fmt(row.get('varlen_ms'), '.3f')} ms; err {fmt(row.get('paged_err'), '.1e')}",
          flush=True)
    print(f"  batch 64 x 512 over the engine's tables (paged_prefill, torch arrays): "
          f"{fmt(row.get('raw_ms'), '.3f')} ms GPU, wall {fmt(row.get('raw_wall_ms'), '.3f')} ms a call (prefill on "
          f"the cache: {fmt(row.get('paged_wall_ms'), '.3f')}); max |diff| from prefill {fmt(row.get('diff_raw'), '.1e')}",
          flush=True)
    print(f"  ... with max_seqlen_q / max_seqlen_k (tables unread on the host): {fmt(row.get('unread_ms'), '.3f')} ms "
          f"GPU, wall {fmt(row.get('unread_wall_ms'), '.3f')} ms a call; max |diff| from prefill "
          f"{fmt(row.get('diff_unread'), '.1e')}", flush=True)


def random_tree(rng, n: int) -> np.ndarray:
    """A draft tree in index order: mostly chains with branches (parent among the last 4 tokens)."""
    return np.array([-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)], np.int32)


def tree_config(bench, args, B: int, n: int, L: int = 4096) -> dict:
    torch = bench.torch
    rng = np.random.default_rng(100 * B + n)
    g = torch.Generator(device="cuda").manual_seed(100 * B + n)
    kv_bytes = B * (L + n) * HKV * D * 2 * 2
    n_rep = bench.replicas(kv_bytes)
    row = {"batch": B, "n": n, "ctx": L, "replicas": n_rep, "kv_mb": kv_bytes / 1e6}
    parents = np.stack([random_tree(rng, n) for _ in range(B)])
    q = torch.randn(B, n, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qd = harness.to_pyattn(q, bench.stream)
    caches, kv0 = [], None
    for r in range(n_rep):
        ks = [torch.randn(L + n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(B)]
        vs = [torch.randn(L + n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(B)]
        caches.append(fill(bench, ks, vs, args.pages[0]))
        kv0 = kv0 or (ks, vs)
    ver = [lambda c=c, i=i: pyattn.verify_tree(qd, c, i, parents, stream=bench.stream) for c, i in caches]
    dec = [lambda c=c, i=i: pyattn.decode(qd, c, i, stream=bench.stream) for c, i in caches]
    for name, fns in (("verify", ver), ("decode", dec)):
        t = attempt(row, name, lambda: bench.gpu_ms(fns, loop=args.loop, reps=args.reps, label=f"{name} B{B} n{n}"))
        if t:
            row[f"{name}_us"], row[f"{name}_held"] = t.ms * 1e3, t.held
    if row.get("verify_us") and row.get("decode_us"):
        row["ratio"] = row["verify_us"] / row["decode_us"]
    # torch SDPA with an explicit mask (B, 1, n, L + n): the cache then the ancestors
    anc = np.zeros((B, n, n), bool)
    for b in range(B):
        for i in range(n):
            anc[b, i, i] = True
            if parents[b, i] >= 0:
                anc[b, i] |= anc[b, parents[b, i]]
    mask = torch.from_numpy(np.concatenate([np.ones((B, n, L), bool), anc], axis=2)).cuda()
    ks, vs = kv0
    kt, vt = (torch.stack(x).transpose(1, 2).contiguous() for x in (ks, vs))  # (B, Hkv, L + n, D)
    f = torch.nn.functional.scaled_dot_product_attention
    sd = lambda: f(q.transpose(1, 2), kt, vt, attn_mask=mask[:, None], enable_gqa=True)  # noqa: E731
    t = attempt(row, "torch SDPA (mask)", lambda: bench.gpu_ms(sd, loop=args.loop, reps=args.reps, label="sdpa mask"))
    if t:
        row["sdpa_us"] = t.ms * 1e3
    def check():
        out = harness.to_torch(ver[0]()).float()
        return max((out[b] - ref_rows(torch, q[b], ks[b], vs[b], list(range(n)), L, mask=mask[b])).abs().max().item()
                   for b in range(B))
    row["err"] = attempt(row, "check", check)
    row["flagged"] = not (row["err"] is not None and row["err"] <= TOL)
    print(f"  tree B={B} n={n}: verify {fmt(row.get('verify_us'), '.1f')} us, decode q_len={n} "
          f"{fmt(row.get('decode_us'), '.1f')} us (x{fmt(row.get('ratio'), '.2f')}), SDPA+mask "
          f"{fmt(row.get('sdpa_us'), '.1f')} us; err {fmt(row.get('err'), '.1e')}", flush=True)
    return row


def part_tree(bench, args, result) -> None:
    for B in args.tree_batches:
        for n in (16, 64):
            if harness.over_budget(result, args.budget, f"tree B={B} n={n}"):
                continue
            row = {"batch": B, "n": n}
            got = attempt(row, "tree", lambda: tree_config(bench, args, B, n))
            result["tree"].append(got or row)
            gc.collect()
            bench.torch.cuda.empty_cache()


def step_config(bench, args, B: int, L: int = 1024) -> dict:
    torch = bench.torch
    steps = args.reps * args.step_loop + 64
    cache = pyattn.PagedKVCache(B * (-(-(L + 64 + steps) // 16) + 1) + 8, 16, HKV, D, "bfloat16")
    ids = [cache.add_sequence() for _ in range(B)]
    lens = [L - 32 + 64 * i // max(B, 1) for i in range(B)]  # a slightly ragged batch
    for sid, n in zip(ids, lens):
        kv = torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16)
        cache.append([sid], kv, kv)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.empty(B, 1, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = []

    def step():
        k_new.normal_()  # torch writes the new token's K / V right before the call
        v_new.normal_()
        cache.append(ids, k_new, v_new)
        out.append(torch.from_dlpack(pyattn.decode(q, cache, ids)))
        del out[:-2]  # (the results are kept a little, as a model's next layer would hold them)

    decode = lambda: torch.from_dlpack(pyattn.decode(q, cache, ids))  # noqa: E731
    row = {"batch": B, "prefix": L}
    row["step_us"] = bench.wall_ms(step, loop=args.step_loop, reps=args.reps) * 1e3
    row["decode_us"] = bench.wall_ms(decode, loop=args.step_loop, reps=args.reps) * 1e3
    row["decode_gpu_us"] = bench.gpu_ms(decode, loop=args.loop, reps=args.reps).ms * 1e3
    # correct against torch SDPA over the gathered keys (one sequence, the last step's tokens)
    o = torch.from_dlpack(pyattn.decode(q, cache, ids)).float()
    ptr, idx, _ = cache.page_table(ids[:1])
    pages = torch.from_dlpack(cache.k)[torch.as_tensor(idx[ptr[0]:ptr[1]], device="cuda").long()]
    kk = pages.reshape(-1, HKV, D)[: cache.length(ids[0])].float()
    pages = torch.from_dlpack(cache.v)[torch.as_tensor(idx[ptr[0]:ptr[1]], device="cuda").long()]
    vv = pages.reshape(-1, HKV, D)[: cache.length(ids[0])].float()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:1].float().transpose(1, 2), kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], enable_gqa=True)
    row["err"] = float((o[:1].transpose(1, 2) - ref).abs().max())
    row["flagged"] = row["err"] > TOL
    return row


def part_step(bench, args, result) -> None:
    for B in (1, 8, 64):
        row = {"batch": B, "prefix": 1024}
        got = attempt(row, "step", lambda: step_config(bench, args, B))
        result["step"].append(got or row)
        gc.collect()


def targets(result) -> list:
    res = []
    for r in result["chunk"]:
        x = r.get("vs_dense")
        res.append({"pass": None if x is None else x >= 0.9, "text": f"chunk 4096 over 16384, pages of {r['page']}: "
                    f"dense / paged time = {fmt(x, '.3f')} (target >= 0.9)"})
    for r in result["batch"]:
        res.append({"pass": None if not r.get("paged_ms") else not r.get("flagged"),
                    "text": f"64 x 512 over mixed prefixes in one launch: {fmt(r.get('paged_ms'), '.3f')} ms, "
                            f"{fmt(r.get('paged_tflops'), '.0f')} TFLOP/s, x{fmt(r.get('vs_varlen'), '.2f')} of "
                            f"contiguous varlen"})
    for r in result["tree"]:
        x = r.get("ratio")
        res.append({"pass": None if x is None else x <= 1.3, "text": f"tree verify B={r['batch']} n={r['n']}: "
                    f"verify / decode(q_len={r['n']}) = {fmt(x, '.2f')} (target <= 1.3)"})
    return res


def report(result) -> int:
    print(f"\n== serving: bf16, D={D}, Hq={HQ}, Hkv={HKV}; {harness.env_line(result['environment'])}")
    print("\n".join(harness.md_table("\nchunk: one sequence, 4096 new tokens over 16384 cached (ms)",
                                     ("page", "paged", "torch q", "dense", "dense/paged", "TFLOP/s", "FA2", "cuDNN",
                                      "err"),
                                     [(r["page"], fmt(r.get("paged_ms"), ".3f") + ("" if r.get("held") else "~"),
                                       fmt(r.get("torch_q_ms"), ".3f"), fmt(r.get("dense_ms"), ".3f"),
                                       fmt(r.get("vs_dense"), ".3f"),
                                       fmt(r["tflop"] * 1e3 / r["paged_ms"] if r.get("paged_ms") else None, ".0f"),
                                       fmt(r.get("fa2_ms"), ".3f"), fmt(r.get("cudnn_ms"), ".3f"),
                                       fmt(r.get("paged_err"), ".1e") + (" !" if r.get("flagged") else ""))
                                      for r in result["chunk"]])))
    print("\n".join(harness.md_table("\nbatch: 64 sequences x 512 new tokens, mixed prefixes (ms)",
                                     ("page", "paged", "TFLOP/s", "varlen contiguous", "TFLOP/s", "varlen/paged",
                                      "err"),
                                     [(r["page"], fmt(r.get("paged_ms"), ".3f"), fmt(r.get("paged_tflops"), ".0f"),
                                       fmt(r.get("varlen_ms"), ".3f"), fmt(r.get("varlen_tflops"), ".0f"),
                                       fmt(r.get("vs_varlen"), ".3f"),
                                       fmt(r.get("paged_err"), ".1e") + (" !" if r.get("flagged") else ""))
                                      for r in result["batch"]])))
    print("\n".join(harness.md_table("\ntree: random draft trees over 4096 cached tokens (us)",
                                     ("batch", "n", "verify", "decode q_len=n", "verify/decode", "SDPA+mask", "err"),
                                     [(r["batch"], r["n"], fmt(r.get("verify_us"), ".1f"),
                                       fmt(r.get("decode_us"), ".1f"),
                                       fmt(r.get("ratio"), ".2f"), fmt(r.get("sdpa_us"), ".1f"),
                                       fmt(r.get("err"), ".1e") + (" !" if r.get("flagged") else ""))
                                      for r in result["tree"]])))
    print("\n".join(harness.md_table("\nstep: append one token a sequence (torch K / V), then decode (us)",
                                     ("batch", "prefix", "step, host", "decode alone, host", "decode, GPU",
                                      "step / decode", "err"),
                                     [(r["batch"], r["prefix"], fmt(r.get("step_us"), ".1f"),
                                       fmt(r.get("decode_us"), ".1f"), fmt(r.get("decode_gpu_us"), ".1f"),
                                       fmt(r["step_us"] / r["decode_us"] if r.get("decode_us") else None, ".2f"),
                                       fmt(r.get("err"), ".1e") + (" !" if r.get("flagged") else ""))
                                      for r in result.get("step", [])])))
    failures = 0
    for part in ("chunk", "batch", "tree", "step"):
        for r in result[part]:
            for e in r.get("errors", []):
                print(f"  error {part}: {e}")
            failures += bool(r.get("flagged")) or any("torch" not in e for e in r.get("errors", []))
    result["targets"] = targets(result)
    harness.print_targets(result["targets"])
    return failures


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--parts", default="chunk,batch,tree,step", help="comma list of chunk, batch, tree, step")
    p.add_argument("--pages", default="16,64", help="page sizes for the chunk (the first serves batch and tree)")
    p.add_argument("--budget", type=float, default=200.0, help="skip tree configurations after this many s")
    args = p.parse_args(argv)
    args.reps, args.loop = (3, 5) if args.quick else (7, 10)
    args.step_loop = 50 if args.quick else 200
    args.pages = [int(x) for x in args.pages.split(",") if x]
    args.tree_batches = (1, 8) if args.quick else (1, 8, 32)
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    result = {"args": {k: v for k, v in vars(args).items()}, "chunk": [], "batch": [], "tree": [], "step": [],
              "t0": time.perf_counter(), "ceilings": bench.ceilings(reps=args.reps)}
    print(f"== pyattn serving benchmark; ceilings {result['ceilings']}", flush=True)
    for part, fn in (("chunk", part_chunk), ("batch", part_batch), ("tree", part_tree), ("step", part_step)):
        if part in args.parts:
            try:
                fn(bench, args, result)
            except Exception as exc:  # noqa: BLE001 - report what was measured
                traceback.print_exc()
                result[part].append({"errors": [f"{part}: {type(exc).__name__}: {exc}"], "page": 0, "batch": 0,
                                     "n": 0, "tflop": 0})
            gc.collect()
            bench.torch.cuda.empty_cache()
            harness.save_json(args.json, {k: v for k, v in result.items() if k != "t0"})
    result["environment"] = harness.environment(bench)
    return harness.end_run(bench, result, args.json, report(result))


if __name__ == "__main__":
    sys.exit(main())

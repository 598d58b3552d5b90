"""Engine benchmark: attention over an engine's own page pools and block tables (issue 13), one GPU, one run.

Usage: PYTHONPATH=. python scripts/bench_engine.py [--json out.json] [--quick]

An engine that manages its own cache (vLLM's layout: one (2, blocks, 16, Hkv, D) bfloat16 torch
tensor, K and V its halves, torch int32 block tables with pages shuffled) calls pyattn per layer
and step. Hq 32, Hkv 8, D 128. Every pyattn call here reads its tables on the device only
(``max_seqlen``, ``max_seqlen_q`` / ``max_seqlen_k``): no synchronisation, as an engine calls them.

- decode rows: a batch of one new token a sequence, B 64 x 4k and B 8 x 32k. ``paged_decode`` (the
  decode kernels: keys on the M side of the MMA, split-KV) against ``paged_prefill`` with one token
  a sequence (the prefill tiles, as a mixed batch carries its decode tokens), under
  ``max_seqlen_q`` 1 and 2048 (an engine's token budget; taken down to q's rows, so the same grid).
- mixed step: 63 sequences decoding one token over 4k cached tokens plus one sequence prefilling a
  2048-token chunk over a 4k prefix. ``paged_prefill`` of all 2111 tokens in one launch against the
  split an engine could make: ``paged_decode`` of the 63 rows plus ``paged_prefill`` of the chunk.
- GPU us: harness.Bench.gpu_ms (pre-roll, median of repeats). The outputs of the two routes are
  compared (flagged above 2e-2): the same attention either way.

No anchor runs here: torch SDPA has no paged form, and FlashAttention's ``block_table`` varlen call
and FlashInfer are not installable on the GPU machine.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import harness
import pyattn
from harness import attempt, fmt

HQ, HKV, D, PAGE = 32, 8, 128, 16
TOL = 2e-2


def pools(torch, lengths, seed: int):
    """vLLM-style pools holding ``lengths`` tokens a sequence (random values), a shuffled block
    table and the lengths, all torch CUDA tensors: (k_pool, v_pool, table, lens, width)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = max(-(-n // PAGE) for n in lengths)
    n_blocks = sum(-(-n // PAGE) for n in lengths) + 1
    kv = torch.randn(2, n_blocks, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = np.random.default_rng(seed).permutation(n_blocks)
    table, at = np.zeros((len(lengths), width), np.int32), 0
    for b, n in enumerate(lengths):
        m = -(-n // PAGE)
        table[b, :m] = perm[at:at + m]
        at += m
    t = torch.from_numpy(table).cuda()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return kv[0], kv[1], t, lens, width


def decode_rows(bench, args, B: int, L: int) -> dict:
    torch = bench.torch
    kp, vp, table, lens, width = pools(torch, [L] * B, B)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    row = {"batch": B, "ctx": L, "kv_gb": B * L * HKV * D * 4 / 1e9}
    dec = lambda: pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=lens,  # noqa: E731
                                      max_seqlen=width * PAGE)
    pre = lambda: pyattn.paged_prefill(q.view(B, HQ, D), kp, vp, cu, block_table=table, seq_lens=lens,  # noqa: E731
                                       max_seqlen_q=1, max_seqlen_k=width * PAGE)
    # The same rows under a chunk-sized bound, as an engine passes its token budget. paged_prefill takes
    # the bound down to q's B rows, so this grid is the one-token rows' own; the mixed step below is
    # where a long chunk sizes the grid (the fifty-fifth session read this row as that case: it is not).
    wide = lambda: pyattn.paged_prefill(q.view(B, HQ, D), kp, vp, cu, block_table=table, seq_lens=lens,  # noqa: E731
                                        max_seqlen_q=2048, max_seqlen_k=width * PAGE)
    for name, fn in (("decode", dec), ("prefill", pre), ("wide", wide)):
        t = attempt(row, name, lambda: bench.gpu_ms(fn, loop=args.loop, reps=args.reps, label=f"{name} {B}x{L}"))
        if t:
            row[f"{name}_us"] = t.ms * 1e3
            row[f"{name}_tbs"] = row["kv_gb"] / t.ms
    if "decode_us" in row and "prefill_us" in row:
        a, b = harness.to_torch(dec()).float().view(B, HQ, D), harness.to_torch(pre()).float()
        row["diff"] = (a - b).abs().max().item()
        row["ratio"] = row["prefill_us"] / row["decode_us"]
    row["flagged"] = not row.get("diff", 1) <= TOL
    print(f"  decode rows B{B} x {L}: paged_decode {fmt(row.get('decode_us'), '.1f')} us "
          f"({fmt(row.get('decode_tbs'), '.2f')} TB/s), paged_prefill {fmt(row.get('prefill_us'), '.1f')} us "
          f"({fmt(row.get('ratio'), '.2f')}x), with max_seqlen_q 2048 {fmt(row.get('wide_us'), '.1f')} us; "
          f"max |diff| {fmt(row.get('diff'), '.1e')}", flush=True)
    return row


def mixed_step(bench, args) -> dict:
    torch = bench.torch
    n_dec, L, chunk, prefix = 63, 4096, 2048, 4096
    lengths = [L] * n_dec + [prefix + chunk]
    kp, vp, table, lens, width = pools(torch, lengths, 5)
    total = n_dec + chunk
    q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor(list(range(n_dec + 1)) + [total], dtype=torch.int32, device="cuda")
    cu_chunk = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    top = width * PAGE
    one = lambda: pyattn.paged_prefill(q, kp, vp, cu, block_table=table, seq_lens=lens,  # noqa: E731
                                       max_seqlen_q=chunk, max_seqlen_k=top)

    def split():
        a = pyattn.paged_decode(q[:n_dec].view(n_dec, 1, HQ, D), kp, vp, block_table=table[:n_dec],
                                seq_lens=lens[:n_dec], max_seqlen=top)
        b = pyattn.paged_prefill(q[n_dec:], kp, vp, cu_chunk, block_table=table[n_dec:], seq_lens=lens[n_dec:],
                                 max_seqlen_q=chunk, max_seqlen_k=top)
        return a, b

    # The same step with the chunk's sequence first in the batch (its rows first in q, its table row first).
    order = [n_dec] + list(range(n_dec))
    q_f, t_f, l_f = torch.cat([q[n_dec:], q[:n_dec]]), table[order].contiguous(), lens[order].contiguous()
    cu_f = torch.tensor([0] + list(range(chunk, total + 1)), dtype=torch.int32, device="cuda")
    first = lambda: pyattn.paged_prefill(q_f, kp, vp, cu_f, block_table=t_f, seq_lens=l_f,  # noqa: E731
                                         max_seqlen_q=chunk, max_seqlen_k=top)
    row = {"decode_rows": n_dec, "ctx": L, "chunk": chunk, "prefix": prefix}
    for name, fn in (("one", one), ("split", split), ("first", first)):
        t = attempt(row, name, lambda: bench.gpu_ms(fn, loop=args.loop, reps=args.reps, label=f"mixed {name}"))
        if t:
            row[f"{name}_us"] = t.ms * 1e3
    if "one_us" in row and "split_us" in row:
        a, b = split()
        both = torch.cat([harness.to_torch(a).view(n_dec, HQ, D), harness.to_torch(b)]).float()
        row["diff"] = (harness.to_torch(one()).float() - both).abs().max().item()
        row["ratio"] = row["one_us"] / row["split_us"]
    row["flagged"] = not row.get("diff", 1) <= TOL
    print(f"  mixed step ({n_dec} decode rows x {L} + a {chunk}-token chunk over {prefix}): one paged_prefill "
          f"{fmt(row.get('one_us'), '.1f')} us, paged_decode + paged_prefill {fmt(row.get('split_us'), '.1f')} us "
          f"({fmt(row.get('ratio'), '.2f')}x); one paged_prefill with the chunk first in the batch "
          f"{fmt(row.get('first_us'), '.1f')} us; max |diff| {fmt(row.get('diff'), '.1e')}", flush=True)
    return row


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    args = p.parse_args(argv)
    args.reps, args.loop = (3, 5) if args.quick else (7, 10)
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    result = {"t0": time.perf_counter(), "rows": []}
    print("== pyattn over an engine's pools", flush=True)
    for B, L in ((64, 4096), (8, 32768)):
        result["rows"].append(decode_rows(bench, args, B, L))
    result["mixed"] = mixed_step(bench, args)
    result["environment"] = harness.environment(bench)
    print(harness.env_line(result["environment"]))
    failures = sum(bool(r.get("flagged")) for r in result["rows"] + [result["mixed"]])
    return harness.end_run(bench, result, args.json, failures)


if __name__ == "__main__":
    sys.exit(main())

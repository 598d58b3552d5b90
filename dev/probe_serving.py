"""Dev probe: tile and split alternatives of the paged prefill / tree kernels on the issue-13 shapes.

Usage: PYTHONPATH=. python dev/probe_serving.py [--quick] [--chunk-only] [--dims 64,128,256]

bf16, D 128, Hq 32, Hkv 8. Times (harness.Bench.gpu_ms, one run):
- the 4096-token chunk over 16384 cached tokens (pages of 16) with attn_prefill_tma rows (TMA page
  boxes: its table's row, 64-key rows of 4 and 6 stages) and attn_prefill_wgmma rows (the cp.async
  gather: its table's row, a 64-key row of 4 stages) put in through ``override_tiles``, beside
  pyattn.attention on the same keys contiguous (dense / paged, and the largest difference of the
  outputs); ``--dims``: at those head dims instead (d = 64 / 256: candidate attn_prefill_tma rows
  beside the cp.async table's row);
- draft trees (n = 16 / 64 over 4096 tokens, batch 1 / 8) with attn_tree_wgmma rows (one warpgroup
  of 64 rows at 64 / 128 keys, 2 / 3 stages; the two-warpgroup warp-specialized row), and forced
  split counts; pyattn.decode with q_len = n beside them.
Prints one line per variant; the chosen rows go into pyattn/kernels/families/prefill.py.
"""

from __future__ import annotations

import sys

import numpy as np

sys.path.insert(0, "scripts")
import harness  # noqa: E402
from _rows import rows_with  # noqa: E402
import pyattn  # noqa: E402
from pyattn.kernels.families import WgmmaTile, override_tiles, tile_table  # noqa: E402

HQ, HKV, D = 32, 8, 128


def cache_of(bench, lens, page=16, kv=None, d=D):
    """A cache holding sequences of ``lens`` tokens, each with a twin (pages interleave); ``kv``: one
    sequence's (K, V) torch tensors (L, HKV, d), else random keys that double as values."""
    torch = bench.torch
    cache = pyattn.PagedKVCache(sum(-(-n // page) + 1 for n in lens) * 2 + 2, page, HKV, d, "bfloat16")
    ids = [cache.add_sequence() for _ in range(2 * len(lens))]
    for t0 in range(0, max(lens), 256):
        counts = [max(0, min(256, n - t0)) for n in lens] * 2
        if kv is not None:
            k, v = (torch.cat([x[t0:t0 + 256]] * 2).contiguous() for x in kv)
        else:
            k = v = torch.randn(sum(counts), HKV, d, device="cuda", dtype=torch.bfloat16)
        cache.append(ids, harness.to_pyattn(k, bench.stream), harness.to_pyattn(v, bench.stream), counts=counts,
                     stream=bench.stream)
    return cache, ids[:len(lens)]


def _rows(d: int) -> tuple:
    """(name, attn_prefill_tma rows, attn_prefill_wgmma rows) timed for the chunk at head dim ``d``:
    at d = 128 the TMA table's row, 64-key TMA rows and the cp.async rows; at other buckets TMA
    candidate rows beside the cp.async table's row."""
    base = tile_table("attn_prefill_wgmma", "sm_90a")
    tbase = tile_table("attn_prefill_tma", "sm_90a")
    # attn_prefill_tma's table left without a row for d: the chunk takes the cp.async gather
    no_tma = tuple(r for r in tbase if r.max_head_dim != d) or \
        (WgmmaTile(64 if d != 64 else 192, 128, 2, 3, True, 1, "probe: d on the cp.async gather", ws=True),)
    ws = lambda *a: WgmmaTile(d, *a, 1, "probe", ws=True)  # noqa: E731
    with_tma = lambda row: tuple(sorted(no_tma + (row,), key=lambda r: r.max_head_dim))  # noqa: E731
    if d == 128:
        return (("tma 128x128 s3 (table)", tbase, base),
                ("tma 128x64 s4", rows_with(tbase, 128, ws(64, 2, 4, True)), base),
                ("tma 128x64 s6", rows_with(tbase, 128, ws(64, 2, 6, True)), base),
                ("cp.async 128x128 s3 (table)", no_tma, base),
                ("cp.async 128x64 s4", no_tma, rows_with(base, 128, ws(64, 2, 4, True))))
    if d == 64:
        cands = (("tma 128x128 s3", ws(128, 2, 3, True)), ("tma 128x128 s4", ws(128, 2, 4, True)),
                 ("tma 128x64 s4", ws(64, 2, 4, True)))
    else:  # 256: overlap needs a third stage, which does not fit (no wgmma of N = 32 for smaller tiles)
        cands = (("tma 128x64 s2", ws(64, 2, 2, False)),)
    return tuple((name, with_tma(row), base) for name, row in cands) + (("cp.async (table)", no_tma, base),)


def chunk(bench, d: int, loop: int, reps: int) -> None:
    """The 4096-token chunk over 16384 cached tokens at head dim ``d``: the rows of :func:`_rows`
    against pyattn.attention on the same keys laid out contiguously."""
    torch = bench.torch
    P, N = 16384, 4096
    k = torch.randn(P + N, HKV, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(P + N, HKV, d, device="cuda", dtype=torch.bfloat16)
    cache, ids = cache_of(bench, [P + N], kv=(k, v), d=d)
    qt = torch.randn(1, N, HQ, d, device="cuda", dtype=torch.bfloat16)
    q = harness.to_pyattn(qt, bench.stream)
    kd, vd = (harness.to_pyattn(x.view(1, P + N, HKV, d), bench.stream) for x in (k, v))
    dense = lambda: pyattn.attention(q, kd, vd, causal=True, stream=bench.stream)  # noqa: E731
    td = harness.attempt({}, "dense", lambda: bench.gpu_ms(dense, loop=loop, reps=reps))
    ref = harness.to_torch(dense()).float()
    print(f"chunk d={d} dense (attention, contiguous): {harness.fmt(td.ms if td else None, '.3f')} ms", flush=True)
    for name, tma_rows, cp_rows in _rows(d):
        with override_tiles("attn_prefill_tma", "sm_90a", tma_rows), \
                override_tiles("attn_prefill_wgmma", "sm_90a", cp_rows):
            call = lambda: pyattn.prefill(q, cache, ids, stream=bench.stream)  # noqa: E731
            t = harness.attempt({}, name, lambda: bench.gpu_ms(call, loop=loop, reps=reps))
            diff = (harness.to_torch(call()).float() - ref).abs().max().item() if t else float("nan")
        ratio = td.ms / t.ms if t and td else None
        print(f"chunk d={d} {name}: {harness.fmt(t.ms if t else None, '.3f')} ms (dense / paged "
              f"{harness.fmt(ratio, '.3f')}); max |paged - dense| {diff:.1e}", flush=True)


def main() -> int:
    quick = "--quick" in sys.argv
    loop, reps = (5, 3) if quick else (10, 5)
    bench = harness.open_bench(need_torch=True)
    if bench is None:
        return 1
    torch = bench.torch
    dims = [128]
    if "--dims" in sys.argv:
        dims = [int(x) for x in sys.argv[sys.argv.index("--dims") + 1].split(",")]
    for d in dims:
        chunk(bench, d, loop, reps)
    if "--chunk-only" in sys.argv:
        return 0
    # -- trees
    tbase = tile_table("attn_tree_wgmma", "sm_90a")
    variants = (("1wg 64x64 s2", None), ("1wg 64x128 s2", WgmmaTile(128, 128, 1, 2, False, 1, "probe")),
                ("1wg 64x64 s3 ov", WgmmaTile(128, 64, 1, 3, True, 1, "probe")),
                ("2wg ws 128x128", WgmmaTile(128, 128, 2, 3, True, 1, "probe", ws=True)))
    for B in (1, 8):
        for n in (16, 64):
            cache, ids = cache_of(bench, [4096 + n] * B)
            rng = np.random.default_rng(n)
            par = np.stack([np.array([-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)], np.int32)
                            for _ in range(B)])
            qt = harness.to_pyattn(torch.randn(B, n, HQ, D, device="cuda", dtype=torch.bfloat16), bench.stream)
            t = harness.attempt({}, "decode", lambda: bench.gpu_ms(
                lambda: pyattn.decode(qt, cache, ids, stream=bench.stream), loop=loop, reps=reps))
            line = [f"B={B} n={n}: decode {harness.fmt(t.ms * 1e3 if t else None, '.1f')} us"]
            for name, row in variants:
                table = tbase if row is None else rows_with(tbase, 128, row)
                for splits in (None, 1, 4, 16):
                    with override_tiles("attn_tree_wgmma", "sm_90a", table):
                        t = harness.attempt({}, name, lambda: bench.gpu_ms(
                            lambda: pyattn.verify_tree(qt, cache, ids, par, num_splits=splits, stream=bench.stream),
                            loop=loop, reps=reps))
                    line.append(f"{name} s{splits or 'auto'} {harness.fmt(t.ms * 1e3 if t else None, '.1f')}")
            print("; ".join(line), flush=True)
            del cache
    return 0


if __name__ == "__main__":
    sys.exit(main())

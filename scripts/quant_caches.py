"""bench_quant's caches: the decode shape, the cache kinds, and making, filling and modelling the caches.

Split out of ``bench_quant.py`` to keep each file short; bench_quant imports these names back, so
``bench_quant.new_cache``, ``bench_quant.fill``, ``bench_quant.HQ`` and the rest work as before
(dev/probe_q8_rows.py and dev/probe_decode_qtiles.py use them that way). Nothing here touches the
GPU at import.

- The shape (Hq, Hkv, D, page), the cache kinds (``KINDS``: cache dtypes; ``QKIND``: pyattn.quant's
  names for them; ``CHANNEL``: the per-channel-key kinds) and the accuracy section's B and ctx.
- :func:`read_bytes` (bytes one decode step reads), :func:`new_cache`, :func:`fill`,
  :func:`dequant_keys` (keys as a per-channel cache holds them) and :func:`drop`.
"""

from __future__ import annotations

import numpy as np

import harness
import pyattn

HQ, HKV, D, PAGE = 32, 8, 128, 16
KINDS = {"bf16": "bfloat16", "int8": "int8", "fp8": "fp8_e4m3", "int8c": "int8", "fp8c": "fp8_e4m3"}  # cache dtypes
QKIND = {"int8": "int8", "fp8": "fp8e4m3", "int8c": "int8", "fp8c": "fp8e4m3"}  # pyattn.quant kinds
CHANNEL = ("int8c", "fp8c")  # key_scales="channel"
TOKEN_OF = {"int8c": "int8", "fp8c": "fp8"}  # the per-token kind each is compared with
CHUNK, AB, ACTX = 2048, 4, 4096


def read_bytes(B: int, ctx: int, kind: str) -> int:
    """Bytes of K and V one decode step reads: codes (and float32 scales per token and kv head; per-channel
    keys: one (16 + 2 D + 2 x 4 x page)-byte record per page and kv head instead of the keys' per-token scales)."""
    if kind in CHANNEL:
        return B * ctx * HKV * (2 * D + 4) + B * -(-ctx // PAGE) * HKV * (16 + 2 * D + 8 * PAGE)
    return B * ctx * HKV * (2 * D if kind == "bf16" else D + 4) * 2


def new_cache(kind: str, n_seqs: int, ctx: int):
    import torch

    need = read_bytes(n_seqs, ctx, kind) * 1.05 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        raise MemoryError(f"{need / 2**30:.1f} GiB free needed for the {kind} cache")
    cache = pyattn.PagedKVCache(n_seqs * -(-ctx // PAGE) + 8, PAGE, HKV, D, KINDS[kind],
                                key_scales="channel" if kind in CHANNEL else "token")
    return cache, [cache.add_sequence() for _ in range(n_seqs)]


def fill(bench, cache, seqs, ctx: int, seed: int):
    """Append random bf16 K/V to every sequence, CHUNK tokens at a time; sequence 0's K, V (ctx, Hkv, D)."""
    torch = bench.torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = ([], [])
    for t0 in range(0, ctx, CHUNK):
        k, v = (torch.randn(len(seqs), min(CHUNK, ctx - t0), HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        cache.append(seqs, harness.to_pyattn(k, bench.stream), harness.to_pyattn(v, bench.stream), stream=bench.stream)
        keep[0].append(k[0].clone())
        keep[1].append(v[0].clone())
    return torch.cat(keep[0]), torch.cat(keep[1])


def dequant_keys(k, kind) -> np.ndarray:
    """Keys (..., ctx, Hkv, D) as a per-channel cache holds them: each page of PAGE tokens (a sequence's pages
    are whole here: ctx is a multiple of PAGE) quantized by pyattn.quant.quantize_page (kept channels included),
    dequantized."""
    from pyattn.quant import dequantize_page, quantize_page

    x = np.asarray(k)
    pages = x.reshape(x.shape[:-3] + (-1, PAGE) + x.shape[-2:])  # (..., pages, PAGE, Hkv, D)
    per_head = np.moveaxis(pages, -2, -3)  # (..., pages, Hkv, PAGE, D)
    d = dequantize_page(*quantize_page(per_head, QKIND[kind]))
    return np.moveaxis(d, -3, -2).reshape(x.shape)


def drop(bench) -> None:
    """Give freed caches' memory back to torch's allocator too (pyattn's pool reuses its own)."""
    import gc

    gc.collect()
    bench.sync()
    bench.torch.cuda.empty_cache()

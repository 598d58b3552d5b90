"""The benchmarks' array helpers (imported back by harness.py: callers use ``harness.<name>``):
torch <-> pyattn views, replicas of inputs for L2-cold timing, paged caches filled from torch
tensors, the tiny decode of bench_boundary, a DLPack-only stand-in for JAX arrays, and the
(batch, length) points of ``--points`` / ``--configs``."""

from __future__ import annotations

import argparse

import numpy as np

import pyattn


def to_pyattn(t, stream):
    """A torch tensor as a zero-copy pyattn array (bf16 through its int16 bits if DLPack refuses it)."""
    try:
        return pyattn.asarray(t, stream=stream)
    except Exception:  # noqa: BLE001
        if str(t.dtype) != "torch.bfloat16":
            raise
        import ml_dtypes
        import torch
        return pyattn.asarray(t.view(torch.int16), stream=stream).view(ml_dtypes.bfloat16)


def batch_lengths(text: str) -> list:
    """``"8x32768,1x4096"`` as [(8, 32768), (1, 4096)]: the (batch, length) points of ``--points``
    and ``--configs`` (an argparse ``type``; raises ArgumentTypeError on anything else)."""
    try:
        out = [tuple(int(n) for n in c.lower().split("x")) for c in text.split(",") if c]
    except ValueError:
        out = []
    if not out or not all(len(x) == 2 and min(x) > 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH,... with positive numbers, got {text!r}")
    return out


def replica_views(arrays, B: int, n_rep: int) -> list:
    """Per replica r, views of sequences [r B, (r + 1) B) of each pyattn array in ``arrays``
    (axis 0 the sequence): ``[(view of arrays[0], view of arrays[1], ...), ...]``, zero-copy."""
    return [tuple(pyattn.DeviceArray(x.ptr + r * B * x.strides[0], (B, *x.shape[1:]), x.dtype, x.device,
                                     strides=x.strides, owner=x, stream=x.stream) for x in arrays)
            for r in range(n_rep)]


def random_kv(bench, B: int, L: int, heads_kv: int, head_dim: int) -> tuple:
    """Random bf16 torch K and V of ``n_rep`` replicas of B sequences, (n_rep B, L, heads_kv,
    head_dim), ``n_rep`` covering 4x the L2 (``Bench.replicas``), from a generator seeded by (B, L):
    ``(n_rep, generator, k, v)`` (the generator then makes the call's other inputs)."""
    import torch

    n_rep = bench.replicas(B * L * heads_kv * head_dim * 4)
    g = torch.Generator(device="cuda").manual_seed(B + L)
    k, v = (torch.randn(n_rep * B, L, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    return n_rep, g, k, v


def paged_replicas(bench, k, v, B: int, n_rep: int, page: int, chunk: int) -> list:
    """One bf16 ``pyattn.PagedKVCache`` (pages of ``page`` slots) per replica r, holding sequences
    [r B, (r + 1) B) of the torch K / V (n_rep B, L, Hkv, D), appended ``chunk`` tokens at a time for
    the whole batch (``chunk = page``: a sequence's pages interleave with the others', as in serving):
    ``[(cache, seq_ids), ...]``."""
    L, H, D = k.shape[1:]
    out = []
    for r in range(n_rep):
        cache = pyattn.PagedKVCache(B * -(-L // page) + 1, page, H, D, "bfloat16")
        ids = [cache.add_sequence() for _ in range(B)]
        for t0 in range(0, L, chunk):
            cache.append(ids, *(to_pyattn(x[r * B:(r + 1) * B, t0:t0 + chunk].contiguous(), bench.stream)
                                for x in (k, v)), stream=bench.stream)
        out.append((cache, ids))
    return out


def to_torch(a):
    """A pyattn array (or a torch tensor, returned as is) as a torch tensor, zero-copy (bf16 as its
    uint16 bits through DLPack, as the README says)."""
    import torch

    if torch.is_tensor(a):
        return a
    if a.dtype.name == "bfloat16":
        return torch.from_dlpack(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def tiny_decode(rng, dtype=None) -> tuple:
    """bench_boundary's tiny decode: a paged cache (64 pages of 16 tokens, 2 KV heads, head_dim 64)
    holding 2 sequences of 256 random tokens, and a one-token query of 8 heads for them, as a host
    array. Returns ``(cache, ids, q)``. ``dtype``: bfloat16 (the default) or float16 (for CuPy,
    which has no bfloat16)."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16 if dtype is None else dtype)
    cache = pyattn.PagedKVCache(64, 16, 2, 64, dt.name)
    ids = [cache.add_sequence() for _ in range(2)]
    kv = rng.standard_normal((2, 256, 2, 64)).astype(dt)
    cache.append(ids, kv, kv)
    return cache, ids, rng.standard_normal((2, 1, 8, 64)).astype(dt)


class DlpackOnly:
    """A torch tensor seen through DLPack only, as a JAX array is (shape, dtype, strides and
    ``__dlpack__``, no array interface): JAX's stand-in where JAX is not installed."""

    def __init__(self, t):
        self.t, self.shape, self.dtype = t, tuple(t.shape), str(t.dtype)

    def stride(self):
        return self.t.stride()

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

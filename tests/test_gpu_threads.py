"""pyattn's ops called from several threads at once on one GPU (marked ``gpu``; skipped without a
driver), as a threaded server calls them: each thread its own inputs (shapes, dtypes, masks) or its
own paged cache, every result checked against the fp64 reference. The host path shares caches
(quick keys, problems, plans, loaded kernels), the memory pool and pyattn's stream between the
threads; a result computed from another thread's inputs, or a block reused too early, fails here.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pyattn
from test_gpu_attention import _check, _has_gpu
from test_gpu_decode import _check_decode, _rand

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")]


def _run_threads(work, n):
    """``work(i)`` on n threads started together; the first error of any thread is raised."""
    errors, start = [], threading.Barrier(n)

    def body(i):
        try:
            start.wait()
            work(i)
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_attention_from_six_threads():
    """Six threads, each a shape, dtype and mask of its own, 12 calls each with fresh inputs (first
    and repeat calls of each signature interleaved with the other threads')."""
    def work(i):
        rng = np.random.default_rng(100 + i)
        dtype = ("float16", "bfloat16")[i % 2]
        shape_q, shape_kv = (1, 64 + 40 * i, 4, (64, 128)[i % 2]), (1, 96 + 24 * i, 2, (64, 128)[i % 2])
        opts = dict(causal=bool(i % 3 == 0), window=(32, 0) if i == 4 else None, softcap=20.0 if i == 5 else None)
        for _ in range(12):
            q, k, v = _rand(rng, shape_q, dtype), _rand(rng, shape_kv, dtype), _rand(rng, shape_kv, dtype)
            out, lse = pyattn.attention(pyattn.asarray(q), pyattn.asarray(k), pyattn.asarray(v), return_lse=True, **opts)
            _check(out.numpy(), lse.numpy(), q, k, v, **opts)

    _run_threads(work, 6)


def test_decode_loops_from_four_threads():
    """Four serving loops, a bf16 paged cache each (pages of 16, 8, 1 and 32 slots: the TMA boxes and
    the gathered rows), appending one token a sequence and decoding, 6 steps, at once."""
    def work(i):
        rng = np.random.default_rng(200 + i)
        Hkv, D, group, dtype = 2, 128, 4, "bfloat16"
        page = (16, 8, 1, 32)[i]
        cache = pyattn.PagedKVCache(2 * -(-(50 + 30 * i + 6) // page) + 2, page, Hkv, D, dtype)
        ids = [cache.add_sequence() for _ in range(2)]
        k0, v0 = _rand(rng, (2, 50 + 30 * i, Hkv, D), dtype), _rand(rng, (2, 50 + 30 * i, Hkv, D), dtype)
        cache.append(ids, k0, v0)
        ks, vs = [k0[0], k0[1]], [v0[0], v0[1]]
        for _ in range(6):
            k1, v1 = _rand(rng, (2, 1, Hkv, D), dtype), _rand(rng, (2, 1, Hkv, D), dtype)
            cache.append(ids, pyattn.asarray(k1), pyattn.asarray(v1))
            for b in range(2):
                ks[b], vs[b] = np.concatenate([ks[b], k1[b]]), np.concatenate([vs[b], v1[b]])
            q = _rand(rng, (2, 1, Hkv * group, D), dtype)
            out = pyattn.decode(pyattn.asarray(q), cache, ids)
            _check_decode(out.numpy(), None, q, ks, vs, causal=True)

    _run_threads(work, 4)

"""A serving loop on the GPU: one-token appends then a decode, step after step, with sequences that
cross page boundaries, fork (copy-on-write), join and leave, on every cache kind (8-bit with per-token
and per-channel key scales, and SparQ's, whose appends read the same items). The decode's page table is patched by
the appends' own launches (pyattn.paged.decode_table): each step's output must match the fp64
reference over the tokens the loop appended, and be bit-identical to the same decode over a table
built fresh from the book (every cache kind, 8-bit ones included). Marked ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

import pyattn

ml_dtypes = pytest.importorskip("ml_dtypes")
from test_gpu_attention import DTYPES, _has_gpu  # noqa: E402
from test_gpu_decode import _check_decode  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]

H, HKV, D = 8, 2, 64


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "int8", "fp8_e4m3", "int8 channel", "bfloat16 sparq"])
@pytest.mark.parametrize("page", [1, 16])
def test_a_serving_loop_decodes_over_the_patched_table(kind, page):
    kind, _, extra = kind.partition(" ")
    if page == 1 and extra:
        pytest.skip("per-channel key scales and SparQ state need pages of 16 / 8 tokens")
    rng = np.random.default_rng(page)
    tok = "bfloat16" if kind in ("int8", "fp8_e4m3") else kind
    dt = DTYPES[tok]
    c = pyattn.PagedKVCache(4096 // page * 4, page, HKV, D, kind, sparq=extra == "sparq",
                            key_scales="channel" if extra == "channel" else "token")
    ks, vs = {}, {}  # the host model: every token appended to each sequence

    def append(ids, k, v, counts=None, device=False):
        c.append(ids, pyattn.asarray(k) if device else k, pyattn.asarray(v) if device else v, counts=counts)
        at = 0
        for i, sid in enumerate(ids):
            if counts is None:
                kk, vv = k[i], v[i]
            else:
                kk, vv = k[at:at + counts[i]], v[at:at + counts[i]]
                at += counts[i]
            ks[sid] = np.concatenate([ks[sid], kk]) if sid in ks else kk
            vs[sid] = np.concatenate([vs[sid], vv]) if sid in vs else vv

    ids = [c.add_sequence() for _ in range(3)]
    for sid, n in zip(ids, (37, 5, 100)):
        append([sid], *(rng.standard_normal((1, n, HKV, D)).astype(dt) for _ in range(2)))
    patched = 0
    for step in range(40):
        changed = step in (12, 25)
        if step == 12:  # a fork joins: its first append copies the shared last page
            child = c.fork(ids[0])
            ks[child], vs[child] = ks[ids[0]].copy(), vs[ids[0]].copy()
            ids.append(child)
        if step == 25:  # a sequence leaves
            c.free(ids.pop(1))
        table = c._dtab
        if step % 7 == 3:  # some sequences get no token this step (packed tokens, counts 0 / 1)
            counts = [int(x) for x in rng.integers(0, 2, len(ids))]
            append(ids, *(rng.standard_normal((sum(counts), HKV, D)).astype(dt) for _ in range(2)), counts)
        else:
            append(ids, *(rng.standard_normal((len(ids), 1, HKV, D)).astype(dt) for _ in range(2)), device=True)
        if table is not None and not changed:  # the last decode's table followed the append
            assert c._dtab is table and table.version == c.book.version
            patched += 1
        q = rng.standard_normal((len(ids), 1, H, D)).astype(dt)
        out = pyattn.decode(pyattn.asarray(q), c, ids).numpy()
        c._dtab = None  # the same decode over a table built fresh from the book
        again = pyattn.decode(pyattn.asarray(q), c, ids).numpy()
        np.testing.assert_array_equal(out.view(np.uint16), again.view(np.uint16))
        if kind == tok:  # 16-bit caches: against the fp64 reference over the appended tokens
            _check_decode(out, None, q, [ks[s] for s in ids], [vs[s] for s in ids])
    assert patched >= 35

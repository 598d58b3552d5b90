"""GPU tests of chunked prefill and token-tree verification over the paged cache (marked ``gpu``;
skipped without a driver), against the fp64 reference with the 2x rule.

Pools and outputs are allocated poisoned (NaN), so a read of a slot no sequence owns, a wrong page
or an unwritten output element shows up as NaN. Sequences are filled by appends of several
sequences at once, so their pages interleave in the pool.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import pyattn
from pyattn.reference import tree_ancestor_mask

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _check, _has_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]
# PYATTN_TEST_NO_SHRINK=1: report the first failing example as drawn (a GPU session's minutes are few).
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    phases=[p for p in Phase if p != Phase.shrink or not os.environ.get("PYATTN_TEST_NO_SHRINK")])
DT16 = ["float16", "bfloat16"]


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(DTYPES[dtype])


def _filled(rng, prefixes, news, page_size, Hkv, D, dtype, spare=2):
    """A cache whose sequences hold prefixes[b] + news[b] random tokens (appended in two packed
    calls for all sequences); returns (cache, ids, per-sequence K list, V list)."""
    need = sum(-(-(p + n) // page_size) + 1 for p, n in zip(prefixes, news)) + spare
    cache = pyattn.PagedKVCache(need, page_size, Hkv, D, dtype)
    ids = [cache.add_sequence() for _ in prefixes]
    ks = [_rand(rng, (p + n, Hkv, D), dtype) for p, n in zip(prefixes, news)]
    vs = [_rand(rng, (p + n, Hkv, D), dtype) for p, n in zip(prefixes, news)]
    for prefix in (True, False):
        cuts = [(0, p) if prefix else (p, p + n) for p, n in zip(prefixes, news)]
        k = np.concatenate([x[a:b] for x, (a, b) in zip(ks, cuts)])
        v = np.concatenate([x[a:b] for x, (a, b) in zip(vs, cuts)])
        cache.append(ids, k, v, counts=[b - a for a, b in cuts])
    return cache, ids, ks, vs


def _check_prefill(out, lse, q, cu, ks, vs, packed, **opts):
    """Each sequence against dense attention over its keys (the new tokens are the last ones)."""
    out = np.asarray(out)
    lse = None if lse is None else np.asarray(lse)
    slopes = opts.pop("alibi_slopes", None)
    for b in range(len(cu) - 1):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        if slopes is not None:
            opts["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        if packed:
            ob, qb, lb = out[lo:hi][None], q[lo:hi][None], None if lse is None else lse[:, lo:hi][None]
        else:
            ob, qb, lb = out[b:b + 1], q[b:b + 1], None if lse is None else lse[b:b + 1]
        _check(ob, lb, qb, ks[b][None], vs[b][None], **opts)


@SETTINGS
@given(data=st.data(), n_seqs=st.integers(1, 3), page_size=st.sampled_from([1, 3, 16, 64, 256]),
       Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), D=st.sampled_from([64, 128, 40, 256]),
       dtype=st.sampled_from(DT16), causal=st.sampled_from([True, True, False]),
       window=st.sampled_from([None, None, (100, 0), (300, -1)]), mods=st.sampled_from(["", "", "softcap", "alibi"]),
       packed=st.booleans(), on_device=st.booleans(), splits=st.sampled_from([None, None, 1, 3]),
       seed=st.integers(0, 2**31 - 1))
def test_prefill_matches_reference(data, n_seqs, page_size, Hkv, group, D, dtype, causal, window, mods, packed,
                                   on_device, splits, seed):
    rng = np.random.default_rng(seed)
    prefixes = data.draw(st.lists(st.integers(0, 700) | st.sampled_from([0, 1, 255, 256]), min_size=n_seqs,
                                  max_size=n_seqs))
    if packed:
        news = data.draw(st.lists(st.integers(0, 300) | st.sampled_from([1, 64, 129]), min_size=n_seqs,
                                  max_size=n_seqs))
    else:
        news = [data.draw(st.integers(1, 200))] * n_seqs
    Hq = Hkv * group
    cache, ids, ks, vs = _filled(rng, prefixes, news, page_size, Hkv, D, dtype)
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = _rand(rng, (int(cu[-1]), Hq, D) if packed else (n_seqs, news[0], Hq, D), dtype)
    opts = dict(causal=causal, window=window)
    if mods == "softcap":
        opts["softcap"] = 3.0
    if mods == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (n_seqs, Hq) if n_seqs > 1 else (Hq,)).astype(np.float32)
    qa = pyattn.asarray(q) if on_device else q
    kw = dict(cu_seqlens_q=pyattn.asarray(cu) if on_device else cu) if packed else {}
    out, lse = pyattn.prefill(qa, cache, ids, num_splits=splits, return_lse=True, **kw, **opts)
    if on_device:
        assert isinstance(out, pyattn.DeviceArray)
        out, lse = out.numpy(), lse.numpy()
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == np.float32
    assert lse.shape == ((Hq, int(cu[-1])) if packed else (n_seqs, Hq, news[0]))
    _check_prefill(out, lse, q, cu, ks, vs, packed, **opts)


@pytest.mark.parametrize("page_size", [1, 2, 7, 16, 64, 128, 256])
def test_every_page_size(page_size):
    rng = np.random.default_rng(page_size)
    prefixes, news = [300, 0, 517], [200, 77, 130]
    cache, ids, ks, vs = _filled(rng, prefixes, news, page_size, 2, 128, "bfloat16")
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = _rand(rng, (int(cu[-1]), 8, 128), "bfloat16")
    out, lse = pyattn.prefill(q, cache, ids, cu, return_lse=True)
    _check_prefill(out, lse, q, cu, ks, vs, True, causal=True)


@pytest.mark.parametrize("D, page_size", [(64, 16), (256, 16), (40, 128), (128, 32)])
def test_page_box_rows(D, page_size):
    """Each of attn_prefill_tma's rows (the head-dim buckets 64 / 128 / 256, pages of a power of two
    from 16: the page boxes, the partly filled last pages' V copied by the producer) on ragged
    chunks, with the soft-cap."""
    rng = np.random.default_rng(D + page_size)
    prefixes, news = [300, 0, 517], [200, 77, 130]
    cache, ids, ks, vs = _filled(rng, prefixes, news, page_size, 2, D, "bfloat16")
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = _rand(rng, (int(cu[-1]), 8, D), "bfloat16")
    out, lse = pyattn.prefill(q, cache, ids, cu, softcap=20.0, return_lse=True)
    _check_prefill(out, lse, q, cu, ks, vs, True, causal=True, softcap=20.0)


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_long_chunk(splits):
    """A 1500-token chunk over a 2000-token cached prefix (many tiles, every diagonal case)."""
    rng = np.random.default_rng(7)
    cache, ids, ks, vs = _filled(rng, [2000], [1500], 16, 2, 128, "bfloat16")
    q = _rand(rng, (1, 1500, 8, 128), "bfloat16")
    out, lse = pyattn.prefill(pyattn.asarray(q), cache, ids, num_splits=splits, return_lse=True)
    _check_prefill(out.numpy(), lse.numpy(), q, np.array([0, 1500]), ks, vs, False, causal=True)


def test_forks_share_the_prefix():
    """A prompt shared by three forks (full pages shared, the partial last page copied on write),
    each with its own chunk, and the parent with another: one prefill over all four."""
    rng = np.random.default_rng(3)
    Hkv, D, dtype = 2, 128, "float16"
    cache = pyattn.PagedKVCache(200, 16, Hkv, D, dtype)
    root = cache.add_sequence()
    k0, v0 = _rand(rng, (1, 333, Hkv, D), dtype), _rand(rng, (1, 333, Hkv, D), dtype)
    cache.append([root], k0, v0)
    forks = [cache.fork(root) for _ in range(3)]
    ids = [root] + forks
    news = [40, 1, 130, 77]
    k1, v1 = _rand(rng, (sum(news), Hkv, D), dtype), _rand(rng, (sum(news), Hkv, D), dtype)
    cache.append(ids, k1, v1, counts=news)
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    ks = [np.concatenate([k0[0], k1[cu[b]:cu[b + 1]]]) for b in range(4)]
    vs = [np.concatenate([v0[0], v1[cu[b]:cu[b + 1]]]) for b in range(4)]
    pages = [cache.book.pages(s) for s in ids]
    assert all(np.array_equal(p[:20], pages[0][:20]) for p in pages), "the full prompt pages are shared"
    assert len({int(p[20]) for p in pages}) == 4, "each wrote its own copy of the partial page"
    q = _rand(rng, (int(cu[-1]), 8, D), dtype)
    out, lse = pyattn.prefill(q, cache, ids, cu, return_lse=True)
    _check_prefill(out, lse, q, cu, ks, vs, True, causal=True)


# -- token trees ------------------------------------------------------------------------------------
@st.composite
def _tree(draw, max_n=64):
    n = draw(st.integers(1, max_n) | st.sampled_from([1, 16, 64]))
    return [draw(st.integers(-1, i - 1) | st.just(i - 1)) for i in range(n)]


def _check_tree(out, lse, q, ks, vs, parents, **opts):
    """q (n, Hq, D) of one tree; ks / vs the sequence's keys ending with the tree."""
    n, L = len(parents), ks.shape[0]
    mask = np.concatenate([np.ones((n, L - n), bool), tree_ancestor_mask(parents)], axis=1)
    _check(np.asarray(out)[None], None if lse is None else np.asarray(lse)[None], q[None], ks[None], vs[None],
           mask=mask, **opts)


@SETTINGS
@given(data=st.data(), n_seqs=st.integers(1, 3), page_size=st.sampled_from([1, 5, 16, 128]), Hkv=st.integers(1, 2),
       group=st.sampled_from([1, 4, 8]), D=st.sampled_from([64, 128, 96]), dtype=st.sampled_from(DT16),
       softcap=st.sampled_from([None, None, 2.0]), packed=st.booleans(), on_device=st.booleans(),
       splits=st.sampled_from([None, None, 1, 5]), seed=st.integers(0, 2**31 - 1))
def test_tree_verify_matches_reference(data, n_seqs, page_size, Hkv, group, D, dtype, softcap, packed, on_device,
                                       splits, seed):
    rng = np.random.default_rng(seed)
    if packed:
        trees = [data.draw(_tree()) for _ in range(n_seqs)]
    else:
        n = data.draw(st.integers(1, 64))
        trees = [[data.draw(st.integers(-1, i - 1)) for i in range(n)] for _ in range(n_seqs)]
    prefixes = data.draw(st.lists(st.integers(0, 600), min_size=n_seqs, max_size=n_seqs))
    news = [len(t) for t in trees]
    cache, ids, ks, vs = _filled(rng, prefixes, news, page_size, Hkv, D, dtype)
    Hq = Hkv * group
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = _rand(rng, (int(cu[-1]), Hq, D) if packed else (n_seqs, news[0], Hq, D), dtype)
    parents = np.concatenate([np.array(t, np.int32) for t in trees]) if packed else np.array(trees, np.int32)
    if on_device:
        qa, pa, ca = pyattn.asarray(q), pyattn.asarray(parents), pyattn.asarray(cu)
    else:
        qa, pa, ca = q, parents, cu
    out, lse = pyattn.verify_tree(qa, cache, ids, pa, ca if packed else None, softcap=softcap, num_splits=splits,
                                  return_lse=True)
    out, lse = (out.numpy(), lse.numpy()) if on_device else (out, lse)
    for b, t in enumerate(trees):
        lo, hi = int(cu[b]), int(cu[b + 1])
        ob, lb = (out[lo:hi], lse[:, lo:hi]) if packed else (out[b], lse[b])
        _check_tree(ob, lb, q[lo:hi] if packed else q[b], ks[b], vs[b], t, softcap=softcap)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_accept_keeps_the_branch_then_decode_sees_it(dtype):
    """Append trees, verify, accept random branches (one sequence shares its tree pages with a fork:
    copy-on-write), then the pools hold prefix + branch for each, the fork is untouched, and the
    next decode step equals dense attention over exactly those keys."""
    rng = np.random.default_rng(11)
    Hkv, D, ps = 2, 64, 16
    src = "bfloat16"
    cache = pyattn.PagedKVCache(120, ps, Hkv, D, dtype)
    prefixes, trees = [40, 70, 5], [[-1, 0, 0, 1, 2, 2, 4], [-1, 0, 1, 2], [-1, -1, 0, 1, 0, 4, 5, 6, 7]]
    ids = [cache.add_sequence() for _ in prefixes]
    cache.append(ids, _rand(rng, (sum(prefixes), Hkv, D), src), _rand(rng, (sum(prefixes), Hkv, D), src),
                 counts=prefixes)
    news = [len(t) for t in trees]
    cache.append(ids, _rand(rng, (sum(news), Hkv, D), src), _rand(rng, (sum(news), Hkv, D), src), counts=news)
    fork = cache.fork(ids[0])

    def rows(sid):  # K and V (codes, then the scales of an 8-bit cache) read back through the pages
        pages, n = cache.book.pages(sid), cache.length(sid)
        at = np.arange(n)
        pools = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if cache.kv else [])
        # (the scale pools are (page, head, slot))
        return [x.numpy()[pages[at // ps], at % ps].copy() if i < 2 else x.numpy()[pages[at // ps], :, at % ps].copy()
                for i, x in enumerate(pools)]

    before = {s: rows(s) for s in ids + [fork]}
    if dtype != "int8":
        cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
        q = _rand(rng, (int(cu[-1]), 8, D), dtype)
        out = pyattn.verify_tree(q, cache, ids, np.concatenate([np.array(t, np.int32) for t in trees]), cu)
        for b, t in enumerate(trees):
            _check_tree(out[cu[b]:cu[b + 1]], None, q[cu[b]:cu[b + 1]], *before[ids[b]][:2], t)
    paths = [[0, 2, 5], [0, 1, 2, 3], [1, 3]]  # branches: moved, in place, moved from a second root
    cache.accept(ids, paths, news)
    cache.book.check()
    for sid, p, path, n in zip(ids, prefixes, paths, news):
        keep = list(range(p)) + [p + i for i in path]
        got, want = rows(sid), before[sid]
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint8), w[keep].view(np.uint8)), f"sequence {sid} after accept"
    for g, w in zip(rows(fork), before[fork]):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), "the fork changed"
    if dtype == "int8":
        return
    k1, v1 = _rand(rng, (3, 1, Hkv, D), src), _rand(rng, (3, 1, Hkv, D), src)
    cache.append(ids, k1, v1)
    q = _rand(rng, (3, 1, 8, D), dtype)
    out = pyattn.decode(q, cache, ids)
    for b, sid in enumerate(ids):
        k, v = rows(sid)[:2]
        _check(out[b:b + 1], None, q[b:b + 1], k[None], v[None], causal=True)


try:
    import torch
except ImportError:
    torch = None


@pytest.mark.skipif(torch is None or not getattr(torch, "cuda", None) or not torch.cuda.is_available(),
                    reason="torch with CUDA not installed")
def test_torch_tensors_as_inputs():
    rng = np.random.default_rng(5)
    cache, ids, ks, vs = _filled(rng, [100, 250], [64, 30], 16, 2, 128, "bfloat16")
    cu = np.array([0, 64, 94], np.int32)
    q = _rand(rng, (94, 8, 128), "bfloat16")
    tq = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16).cuda()
    out = pyattn.prefill(tq, cache, ids, torch.from_numpy(cu).cuda())
    assert isinstance(out, pyattn.DeviceArray)
    _check_prefill(out.numpy(), None, q, cu, ks, vs, True, causal=True)
    trees = [list(range(-1, 63)), [-1] + [0] * 29]  # a chain and a star
    cache2, ids2, ks2, vs2 = _filled(rng, [100, 250], [64, 30], 16, 2, 128, "bfloat16")
    par = torch.from_numpy(np.concatenate([np.array(t, np.int32) for t in trees])).cuda()
    out = pyattn.verify_tree(tq, cache2, ids2, par, torch.from_numpy(cu).cuda())
    got = out.numpy()
    for b, t in enumerate(trees):
        _check_tree(got[cu[b]:cu[b + 1]], None, q[cu[b]:cu[b + 1]], ks2[b], vs2[b], t)


def test_empty_chunks_and_zero_new_tokens():
    rng = np.random.default_rng(9)
    cache, ids, ks, vs = _filled(rng, [10, 20], [0, 0], 16, 1, 64, "float16")
    q = np.zeros((0, 2, 64), np.float16)
    out, lse = pyattn.prefill(q, cache, ids, np.zeros(3, np.int32), return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)

"""GPU tests of quantized (int8 / fp8 e4m3) ``PagedKVCache`` appends (marked ``gpu``; skipped
without a driver).

Whatever path the tokens take (packed or padded appends, host or device inputs, page sizes 1 to
64, forks with copy-on-write, truncation, out-of-pages), the codes and scales read back from the
pools through each sequence's pages must be bit-identical to ``pyattn.quant.quantize_rows`` of the
rows appended: the kernel and the NumPy reference do the same float32 operations in the same
order. Pools are poisoned on allocation, so a row the kernel forgot shows up. Decode over these
caches is tested elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.quant import quantize_rows

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import _has_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]
CACHE_DTYPES = {"int8": "int8", "fp8_e4m3": "fp8e4m3"}  # constructor dtype -> cache.kv
SRC = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _rows(rng, n, H, D, src, outliers=True):
    """n tokens (n, H, D) of ``src``: normal rows, plus (``outliers``) loud tokens, single-element
    spikes, quiet rows, zero rows and, in bfloat16, rows tiny enough to clamp the reciprocal."""
    x = rng.standard_normal((n, H, D))
    if outliers and n:
        x[rng.random(n) < 0.2] *= 300.0  # a loud token, every head
        for _ in range(max(1, n // 4)):  # a spike in one element
            x[rng.integers(n), rng.integers(H), rng.integers(D)] = rng.choice([-1, 1]) * rng.uniform(50, 5000)
        for scale in (1e-3, 0.0, -0.0, 1e-37, 3e-39):  # quiet, +0, -0, tiny (0 in float16)
            if rng.random() < 0.5:
                x[rng.integers(n), rng.integers(H)] *= scale
    return x.astype(SRC[src])


def _pools(cache) -> tuple:
    """The four pools, read back once: K codes, V codes, K scales, V scales."""
    return cache.k.numpy(), cache.v.numpy(), cache.k_scale.numpy(), cache.v_scale.numpy()


def _read(pools, cache, sid) -> tuple:
    """Codes (n, H, D) and scales (n, H) of sequence ``sid``, through its pages (the scale pools
    are (page, head, slot))."""
    pages, n, ps = cache.book.pages(sid), cache.length(sid), cache.page_size
    idx = np.arange(n)
    p, s = pages[idx // ps], idx % ps
    return tuple(a[p, s] if i < 2 else a[p, :, s] for i, a in enumerate(pools))


def _assert_bits(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    u = np.uint8 if got.itemsize == 1 else np.uint32
    bad = np.argwhere(got.view(u) != want.view(u))
    assert not len(bad), (f"{what}: {len(bad)} element(s) differ from pyattn.quant, first at {tuple(bad[0])}: "
                          f"kernel {got[tuple(bad[0])]!r}, reference {want[tuple(bad[0])]!r}")


def _assert_seq(pools, cache, sid, k_rows, v_rows):
    kc, vc, ks, vs = _read(pools, cache, sid)
    for name, codes, scales, rows in (("K", kc, ks, k_rows), ("V", vc, vs, v_rows)):
        want_codes, want_scales = quantize_rows(rows, cache.kv)
        _assert_bits(codes, want_codes, f"sequence {sid} {name} codes")
        _assert_bits(scales, want_scales, f"sequence {sid} {name} scales")


@pytest.mark.parametrize("dtype", list(CACHE_DTYPES))
@pytest.mark.parametrize("src", list(SRC))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("H, D", [(2, 128), (1, 256), (3, 16), (2, 80)])
def test_appends_match_the_reference(dtype, src, page_size, H, D):
    """Three sequences grown by a packed host append (one count 0), a padded device append and a
    few one-token steps (a decode loop)."""
    rng = np.random.default_rng(page_size * 1000 + D)
    cache = pyattn.PagedKVCache(64, page_size, H, D, dtype)
    assert cache.kv == CACHE_DTYPES[dtype] and cache.k_scale.shape == (64, H, page_size)
    ids = [cache.add_sequence() for _ in range(3)]
    model = {sid: [np.zeros((0, H, D), SRC[src])] * 2 for sid in ids}

    def grow(counts, k, v):
        at = 0
        for sid, c in zip(ids, counts):
            model[sid] = [np.concatenate([model[sid][0], k[at:at + c]]), np.concatenate([model[sid][1], v[at:at + c]])]
            at += c

    counts = [5, 0, 37]  # packed, host arrays
    k, v = _rows(rng, sum(counts), H, D, src), _rows(rng, sum(counts), H, D, src)
    cache.append(ids, k, v, counts=counts)
    grow(counts, k, v)
    k, v = _rows(rng, 3 * 3, H, D, src), _rows(rng, 3 * 3, H, D, src)  # padded (batch, t), device arrays
    cache.append(ids, pyattn.asarray(k.reshape(3, 3, H, D)), pyattn.asarray(v.reshape(3, 3, H, D)))
    grow([3] * 3, k, v)
    for _ in range(3):  # one token per sequence per step
        k, v = _rows(rng, 3, H, D, src), _rows(rng, 3, H, D, src)
        cache.append(ids, k.reshape(3, 1, H, D), v.reshape(3, 1, H, D))
        grow([1] * 3, k, v)
    pools = _pools(cache)
    for sid in ids:
        assert cache.length(sid) == len(model[sid][0])
        _assert_seq(pools, cache, sid, *model[sid])


@pytest.mark.parametrize("dtype", list(CACHE_DTYPES))
@pytest.mark.parametrize("page_size", [16, 64])
def test_fork_copy_on_write_copies_codes_and_scales(dtype, page_size):
    """Forks share a partly filled page; writing into it copies codes and scales unchanged."""
    rng = np.random.default_rng(7)
    H, D, src = 2, 64, "bfloat16"
    cache = pyattn.PagedKVCache(32, page_size, H, D, dtype)
    a = cache.add_sequence()
    n0 = page_size + 5  # the second page is partly filled
    k0, v0 = _rows(rng, n0, H, D, src), _rows(rng, n0, H, D, src)
    cache.append([a], k0[None], v0[None])
    b, c = cache.fork(a), cache.fork(a, 3)  # c shares only a partial first page
    assert cache.book.pages(b)[-1] == cache.book.pages(a)[-1] and cache.book.pages(c)[0] == cache.book.pages(a)[0]
    counts = [2, 1, 4]
    k1, v1 = _rows(rng, sum(counts), H, D, src), _rows(rng, sum(counts), H, D, src)
    cache.append([b, c, a], k1, v1, counts=counts)  # a write into a shared page copies it first
    pa, pb, pc = (cache.book.pages(s) for s in (a, b, c))
    assert pb[-1] != pa[-1] and pc[0] != pa[0] and pb[0] == pa[0]  # full first page still shared by a, b
    pools = _pools(cache)
    _assert_seq(pools, cache, a, np.concatenate([k0, k1[3:]]), np.concatenate([v0, v1[3:]]))
    _assert_seq(pools, cache, b, np.concatenate([k0, k1[:2]]), np.concatenate([v0, v1[:2]]))
    _assert_seq(pools, cache, c, np.concatenate([k0[:3], k1[2:3]]), np.concatenate([v0[:3], v1[2:3]]))
    for x, y, n in ((b, a, n0), (c, a, 3)):  # the copied prefix: the source's bytes, wherever they live
        for got, want in zip(_read(pools, cache, x), _read(pools, cache, y)):
            _assert_bits(got[:n], want[:n], f"sequence {x}'s copy of {y}")


@pytest.mark.parametrize("dtype", list(CACHE_DTYPES))
@pytest.mark.parametrize("src", list(SRC))
def test_special_rows(dtype, src):
    """Zero, -0, NaN, +-inf, subnormal, tiny and maximal rows: bit-identical, NaN scale bits included."""
    H, D = 1, 16
    info = ml_dtypes.finfo(SRC[src])
    vals = [np.zeros(D), -np.zeros(D), np.full(D, np.nan), np.r_[np.inf, np.ones(D - 1)],
            np.r_[-np.inf, np.zeros(D - 1)], np.r_[np.nan, np.ones(D - 1)],
            np.full(D, float(info.smallest_subnormal)), np.r_[float(info.max), -float(info.max), np.ones(D - 2)],
            np.r_[float(info.tiny), np.zeros(D - 1)], np.linspace(-1e-37, 1e-37, D), np.arange(D) - 7.5]
    x = np.stack(vals)[:, None, :].astype(SRC[src])
    cache = pyattn.PagedKVCache(4, 16, H, D, dtype)
    s = cache.add_sequence()
    cache.append([s], x[None], x[::-1][None])
    _assert_seq(_pools(cache), cache, s, x, x[::-1])


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "append", "fork", "truncate", "free"]),
                         st.integers(0, 2**31 - 1)), min_size=4, max_size=14)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, page_size=st.sampled_from([1, 4, 16, 64]), num_pages=st.integers(4, 40),
       dtype=st.sampled_from(list(CACHE_DTYPES)), seed=st.integers(0, 2**31 - 1))
def test_cache_ops_keep_every_sequence_exact(ops, page_size, num_pages, dtype, seed):
    """Random add/append/fork/truncate/free, fp16 and bf16 tokens mixed in one cache, against a host model."""
    rng = np.random.default_rng(seed)
    H, D = 2, 64
    cache = pyattn.PagedKVCache(num_pages, page_size, H, D, dtype)
    model = {}  # sid -> (K rows, V rows) as float32 (exact for both source types)
    for op, r in ops:
        live = list(model)
        pick = live[r % len(live)] if live else None
        if op == "add" or not live:
            model[cache.add_sequence()] = (np.zeros((0, H, D), np.float32),) * 2
        elif op == "append":
            ids = [s for s in live if rng.random() < 0.7] or [pick]
            counts = [int(rng.integers(0, 2 * page_size + 3)) for _ in ids]
            src = list(SRC)[r % 2]
            k, v = _rows(rng, sum(counts), H, D, src), _rows(rng, sum(counts), H, D, src)
            before = _pools(cache)
            try:
                args = (pyattn.asarray(k), pyattn.asarray(v)) if r % 3 == 0 else (k, v)
                cache.append(ids, *args, counts=counts)
            except pyattn.OutOfPagesError:
                for got, want in zip(_pools(cache), before):
                    _assert_bits(got, want, "pools after OutOfPagesError")
                continue
            at = 0
            for sid, c in zip(ids, counts):
                model[sid] = tuple(np.concatenate([m, x[at:at + c].astype(np.float32)])
                                   for m, x in zip(model[sid], (k, v)))
                at += c
        elif op == "fork":
            n = int(rng.integers(0, cache.length(pick) + 1)) if r % 2 else None
            model[cache.fork(pick, n)] = tuple(m[:n].copy() for m in model[pick])
        elif op == "truncate":
            n = int(rng.integers(0, cache.length(pick) + 1))
            cache.truncate(pick, n)
            model[pick] = tuple(m[:n] for m in model[pick])
        else:
            cache.free(pick)
            del model[pick]
        cache.book.check()
    pools = _pools(cache)
    for sid, (k_rows, v_rows) in model.items():
        _assert_seq(pools, cache, sid, k_rows, v_rows)


# -- per-channel key scales (key_scales="channel") ----------------------------------------------
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, page_size=st.sampled_from([16, 32]), num_pages=st.integers(4, 30),
       dtype=st.sampled_from(list(CACHE_DTYPES)), seed=st.integers(0, 2**31 - 1))
def test_per_channel_pages_follow_the_rule(ops, page_size, num_pages, dtype, seed):
    """Random add/append/fork/truncate/free: after each append every page it wrote holds, bit for
    bit, ``quantize_page`` of the values the rule names (tests/_keypages_model.py: exact keys, a
    reopened page's kept keys as dequantized then), its open pages' staging copy holds those values,
    and values keep their per-token codes."""
    from _keypages_model import Pages

    rng = np.random.default_rng(seed)
    H, D = 2, 64
    cache = pyattn.PagedKVCache(num_pages, page_size, H, D, dtype, key_scales="channel")
    assert cache.key_scales == "channel" and cache.k_scale.shape == (num_pages, H, 4 + D // 2 + 2 * page_size)
    pages, vmodel = Pages(page_size, H, D, CACHE_DTYPES[dtype]), {}

    def key_pools():
        return (cache.k.numpy(),) + cache.read_key_scales()  # codes, S, r, kept channels, kept values

    for op, r in ops:
        live = list(vmodel)
        pick = live[r % len(live)] if live else None
        if op == "add" or not live:
            vmodel[cache.add_sequence()] = np.zeros((0, H, D), np.float32)
        elif op == "append":
            ids = [s for s in live if rng.random() < 0.7] or [pick]
            counts = [int(rng.integers(0, 2 * page_size + 3)) for _ in ids]
            src = list(SRC)[r % 2]
            k, v = _rows(rng, sum(counts), H, D, src, outliers=False), _rows(rng, sum(counts), H, D, src)
            k[..., rng.choice(D, 2, replace=False)] *= 30
            before = [(cache.length(s), int(cache.book.pages(s)[-1]) if cache.length(s) % page_size else -1)
                      for s in ids]
            snap = key_pools()
            try:
                cache.append(ids, *((pyattn.asarray(k), pyattn.asarray(v)) if r % 3 == 0 else (k, v)), counts=counts)
            except pyattn.OutOfPagesError:
                for got, want in zip(key_pools(), snap):
                    _assert_bits(got, want, "key pools after OutOfPagesError")
                continue
            written, at = [], 0
            for sid, c, (n0, old_page) in zip(ids, counts, before):
                if c:
                    pos = np.arange(n0, n0 + c)
                    dst = cache.book.pages(sid)[pos // page_size] * page_size + pos % page_size
                    written += pages.append(n0, old_page, dst, k[at:at + c],
                                            lambda p: tuple(x[p] for x in snap))
                    vmodel[sid] = np.concatenate([vmodel[sid], v[at:at + c].astype(np.float32)])
                at += c
            pages.check(written, *key_pools(), cache._stage.numpy() if cache._stage is not None else None,
                        cache._keys.stage_of)
        elif op == "fork":
            n = int(rng.integers(0, cache.length(pick) + 1)) if r % 2 else None
            vmodel[cache.fork(pick, n)] = vmodel[pick][:n].copy()
        elif op == "truncate":
            n = int(rng.integers(0, cache.length(pick) + 1))
            cache.truncate(pick, n)
            vmodel[pick] = vmodel[pick][:n]
        else:
            cache.free(pick)
            del vmodel[pick]
        cache.book.check()
        cache._keys.check()
    vc, vs = cache.v.numpy(), cache.v_scale.numpy()
    for sid, rows in vmodel.items():
        idx = np.arange(cache.length(sid))
        p, s = cache.book.pages(sid)[idx // page_size], idx % page_size
        want_codes, want_scales = quantize_rows(rows, cache.kv)
        _assert_bits(vc[p, s], want_codes, f"sequence {sid} V codes")
        _assert_bits(vs[p, :, s], want_scales, f"sequence {sid} V scales")

"""GPU tests of SparQ attention (``pyattn.sparq_decode``) and the cache state it reads (marked ``gpu``).

* The state: the transposed key copy equals the key pool, and each sequence's V sum is the float32
  sum of its values in token order, bit for bit, through appends, forks, truncations and frees.
* The algorithm against its own definition (``pyattn.reference_sparq``): the kernel's chosen keys
  are a top-k of the float64 selection scores up to the scores' rounding, and its output equals
  the float64 SparQ over those same keys within 2x the naive same-precision error (plus a floor).
* Limits: k >= length is exact attention; torch tensors as inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.reference import attention_lowp, attention_ref
from pyattn.reference import sparq_ref, sparq_selection_scores

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _has_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]
FLOOR = {"float16": 1e-3, "bfloat16": 8e-3}


def _structured(rng, n, Hkv, D, q_group):
    """Keys with 4 outlier channels (x10) and a few positions matching the group's query strongly;
    values N(0, 1). ``q_group``: (Hkv, G, D) float."""
    k = rng.standard_normal((n, Hkv, D))
    k[:, :, rng.choice(D, min(4, D), replace=False)] *= 10.0
    for h in range(Hkv):
        for pos in rng.choice(n, min(n, 3), replace=False):
            k[pos, h] += 4.0 * q_group[h].mean(0) / (np.linalg.norm(q_group[h].mean(0)) + 1e-9) * np.sqrt(D)
    return k, rng.standard_normal((n, Hkv, D))


def _fill(cache, seqs, dt):
    ids = []
    for k, v in seqs:
        sid = cache.add_sequence()
        ids.append(sid)
        at = 0
        for step in (1, 5, 300, len(k)):
            take = min(step, len(k) - at)
            if take > 0:
                cache.append([sid], k[None, at:at + take].astype(dt), v[None, at:at + take].astype(dt))
                at += take
    return ids


def _check(q, seqs, out, pos, r, k, dtype, select="group"):
    """The kernel's choice is a top-k up to rounding; its output is SparQ over that choice."""
    t = DTYPES[dtype]
    ks, vs = [s[0].astype(t) for s in seqs], [s[1].astype(t) for s in seqs]
    chosen = []
    for b, (sc, mag) in enumerate(sparq_selection_scores(q, ks, r, rounding=t, select=select)):
        L = sc.shape[1]
        k_eff = min(k, L)
        rows = []
        for h in range(sc.shape[0]):
            c = np.asarray(pos[b, h, :k_eff], np.int64)
            assert len(np.unique(c)) == k_eff and c.min() >= 0 and c.max() < L, (b, h, np.sort(c))
            rest = np.setdiff1d(np.arange(L), c)
            # q~ may differ by one rounding of the query dtype from float64's (its temperature is a float32)
            tol = (2.0 * float(ml_dtypes.finfo(t).eps) + 64 * 2.0**-24) * mag[h].max()
            if len(rest):
                assert sc[h, rest].max() <= sc[h, c].min() + tol, (b, h, sc[h, rest].max(), sc[h, c].min(), tol)
            rows.append(c)
        chosen.append(rows)
    ref = sparq_ref(q, ks, vs, r=r, k=k, select=select, chosen=chosen)
    low = sparq_ref(q, ks, vs, r=r, k=k, select=select, chosen=chosen, lowp=True)
    bound = 2 * np.abs(low - ref).max() + FLOOR[dtype]
    err = np.abs(np.asarray(out).astype(np.float64) - ref)
    assert not np.isnan(err).any()
    assert err.max() <= bound, f"max error {err.max():.3e} > bound {bound:.3e} at {np.unravel_index(err.argmax(), err.shape)}"


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 2500) | st.sampled_from([1, 8, 1023, 1024, 1025]), min_size=1, max_size=3),
       page_size=st.sampled_from([8, 16, 64]), Hkv=st.integers(1, 2), group=st.sampled_from([1, 4, 8]),
       D=st.sampled_from([64, 128]), dtype=st.sampled_from(["float16", "bfloat16"]), r_frac=st.sampled_from([1, 4, 8]),
       k=st.integers(1, 700), select=st.sampled_from(["group", "head"]), seed=st.integers(0, 2**31 - 1))
def test_sparq_matches_its_reference(lengths, page_size, Hkv, group, D, dtype, r_frac, k, select, seed):
    rng = np.random.default_rng(seed)
    t = DTYPES[dtype]
    q = rng.standard_normal((len(lengths), 1, Hkv * group, D)).astype(t)
    seqs = [_structured(rng, n, Hkv, D, q[b, 0].astype(np.float64).reshape(Hkv, group, D))
            for b, n in enumerate(lengths)]
    cache = pyattn.PagedKVCache(sum(-(-n // page_size) for n in lengths) + 4, page_size, Hkv, D, dtype, sparq=True)
    ids = _fill(cache, seqs, t)
    r = max(1, D // r_frac)
    out, pos = pyattn.sparq_decode(q, cache, ids, r=r, k=k, select=select, return_indices=True)
    rows = Hkv * group if select == "head" else Hkv
    assert out.shape == q.shape and out.dtype == t and pos.shape == (len(lengths), rows, min(k, max(lengths)))
    _check(q, seqs, out, pos, r, k, dtype, select)


@pytest.mark.parametrize("group, D, r", [(16, 128, 32), (12, 64, 20), (16, 64, 64), (5, 128, 72)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_large_groups_and_uneven_channel_counts(group, D, r, dtype):
    """The score stage's tensor-core sums take 8 heads a pass and 16 channels a k step: groups past
    8 (a second pass, 12 a partly empty one), r not a multiple of 16 (zero-weighted positions) and
    more than the two k steps it loads ahead (r 64 / 72), each against the reference."""
    rng = np.random.default_rng(group * 1000 + D + r)
    t, Hkv = DTYPES[dtype], 2
    lengths = (1, 777, 3000)
    q = rng.standard_normal((len(lengths), 1, Hkv * group, D)).astype(t)
    seqs = [_structured(rng, n, Hkv, D, q[b, 0].astype(np.float64).reshape(Hkv, group, D))
            for b, n in enumerate(lengths)]
    cache = pyattn.PagedKVCache(sum(-(-n // 16) for n in lengths) + 4, 16, Hkv, D, dtype, sparq=True)
    ids = _fill(cache, seqs, t)
    out, pos = pyattn.sparq_decode(q, cache, ids, r=r, k=300, return_indices=True)
    _check(q, seqs, out, pos, r, 300, dtype)


def test_calls_leave_their_histograms_and_counters_zero():
    """The score and select stages count in the stream's zeroed counter block and leave it zero (no
    memset a call): a call repeated on one stream, after calls that choose every key (k >= length:
    the score stage's other exit) and exact decodes with split counters in the same block, chooses
    the same keys (positions come in claim order: compared as sets) and each call's output is SparQ
    over its keys (the reference check)."""
    rng = np.random.default_rng(5)
    dtype, Hkv, G, D = "bfloat16", 2, 4, 128
    t = DTYPES[dtype]
    q = rng.standard_normal((2, 1, Hkv * G, D)).astype(t)
    seqs = [_structured(rng, n, Hkv, D, q[b, 0].astype(np.float64).reshape(Hkv, G, D))
            for b, n in enumerate((5000, 3001))]
    cache = pyattn.PagedKVCache(600, 16, Hkv, D, dtype, sparq=True)
    ids = _fill(cache, seqs, t)
    dq = pyattn.asarray(q)
    first = [x.numpy() for x in pyattn.sparq_decode(dq, cache, ids, r=32, k=400, return_indices=True)]
    _check(q, seqs, first[0], first[1], 32, 400, dtype)
    for _ in range(2):
        pyattn.sparq_decode(dq, cache, ids, r=32, k=8000)
        pyattn.decode(dq, cache, ids, num_splits=7)
        again = [x.numpy() for x in pyattn.sparq_decode(dq, cache, ids, r=32, k=400, return_indices=True)]
        assert np.array_equal(np.sort(again[1], axis=-1), np.sort(first[1], axis=-1))
        _check(q, seqs, again[0], again[1], 32, 400, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_k_at_least_the_length_is_exact_attention(dtype):
    rng = np.random.default_rng(2)
    t, Hkv, G, D = DTYPES[dtype], 2, 4, 128
    seqs = [(rng.standard_normal((n, Hkv, D)), rng.standard_normal((n, Hkv, D))) for n in (1, 300, 2049)]
    cache = pyattn.PagedKVCache(200, 16, Hkv, D, dtype, sparq=True)
    ids = _fill(cache, seqs, t)
    q = rng.standard_normal((3, 1, Hkv * G, D)).astype(t)
    out = pyattn.sparq_decode(q, cache, ids, r=16, k=4096)
    for b, (k, v) in enumerate(seqs):
        kb, vb = k[None].astype(t), v[None].astype(t)
        ref = attention_ref(q[b:b + 1], kb, vb)
        bound = 2 * np.abs(attention_lowp(q[b:b + 1], kb, vb) - ref).max() + FLOOR[dtype]
        assert np.abs(out[b:b + 1].astype(np.float64) - ref).max() <= bound


def test_state_kt_and_value_sums_follow_cache_operations():
    rng = np.random.default_rng(4)
    Hkv, D, ps, t = 2, 64, 16, np.float16
    cache = pyattn.PagedKVCache(64, ps, Hkv, D, "float16", sparq=True)
    model = {}

    def add(sid, n):
        k, v = rng.standard_normal((n, Hkv, D)).astype(t), rng.standard_normal((n, Hkv, D)).astype(t)
        cache.append([sid], k[None], v[None])
        mk, mv = model[sid]
        model[sid] = (np.concatenate([mk, k]), np.concatenate([mv, v]))

    a = cache.add_sequence()
    model[a] = (np.zeros((0, Hkv, D), t),) * 2
    add(a, 37)
    b = cache.fork(a)  # whole: the sum is copied
    model[b] = model[a]
    c = cache.fork(a, 20)  # partial: rebuilt from the tokens at its next use
    model[c] = tuple(x[:20] for x in model[a])
    add(b, 5)
    add(a, 1)
    cache.truncate(a, 30)
    model[a] = tuple(x[:30] for x in model[a])
    add(a, 3)
    d = cache.fork(b)
    model[d] = model[b]
    cache.free(b)
    del model[b]
    cache.truncate(d, 7)
    model[d] = tuple(x[:7] for x in model[d])
    ids = list(model)
    q = rng.standard_normal((len(ids), 1, Hkv * 2, D)).astype(t)
    pyattn.sparq_decode(q, cache, ids, r=8, k=4)  # rebuilds the dirty sums
    kp, kt, vsum = cache.k.numpy(), cache.kt.numpy(), cache.v_sum.numpy()
    for sid, (k, v) in model.items():
        pages, n = cache.book.pages(sid), cache.length(sid)
        idx = np.arange(n)
        pg, sl = pages[idx // ps], idx % ps
        assert np.array_equal(kp[pg, sl].view(np.uint16), k.view(np.uint16))
        assert np.array_equal(kt[pg, :, :, sl].view(np.uint16), k.view(np.uint16)), f"kt of sequence {sid}"
        want = np.zeros((Hkv, D), np.float32)
        for row in v.astype(np.float32):  # token order, float32
            want = (want + row).astype(np.float32)
        got = vsum[cache._sq.row_of[sid]]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"V sum of sequence {sid}"


@pytest.mark.parametrize("n, tied", [(5000, 5000), (3000, 1500), (9000, 600), (2000, 100)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_selection_among_tied_scores(n, tied, where):
    """Keys whose selection scores tie exactly (zero keys: score 0), with the k-th largest score
    among them (at the first, middle or last tied key): the kernel takes the lowest positions among
    the tied keys. The other keys' scores are kept a quarter of the largest away from 0, past any
    rounding of the query. All 5000 keys alike puts every key in the threshold bin (candidates past
    shared memory's 4096) and takes the radix passes down to the positions' bits; 1500 or 600
    alike leave more than a block's worth after the first pass; 100 alike are ranked directly."""
    rng = np.random.default_rng(n + tied)
    Hkv, G, D, r, bf16 = 1, 4, 64, 16, ml_dtypes.bfloat16
    keys, v = rng.standard_normal((n, Hkv, D)), rng.standard_normal((n, Hkv, D))
    same = np.sort(rng.choice(n, tied, replace=False))
    keys[same] = 0.0
    q = rng.standard_normal((1, 1, Hkv * G, D)).astype(bf16)
    (sc, _), = sparq_selection_scores(q, [keys.astype(bf16)], r, rounding=bf16)
    margin, w = 0.25 * np.abs(sc).max(), int(np.abs(sc[0]).argmax())
    near = np.abs(sc[0]) < margin
    near[same] = False
    shift = (np.where(sc[0, near] < 0, -margin, margin) - sc[0, near]) / sc[0, w]
    keys[near] += shift[:, None, None] * keys[w]  # scores are linear in the key: those move to +-margin
    (sc, _), = sparq_selection_scores(q, [keys.astype(bf16)], r, rounding=bf16)
    others = np.setdiff1d(np.arange(n), same)
    assert not sc[0, same].any() and (len(others) == 0 or np.abs(sc[0, others]).min() > margin / 2)
    want = {"first": 1, "middle": tied // 2, "last": tied - 1}[where]
    k = int((sc[0] > 0).sum()) + want
    cache = pyattn.PagedKVCache(n // 16 + 4, 16, Hkv, D, "bfloat16", sparq=True)
    ids = _fill(cache, [(keys, v)], bf16)
    out, pos = pyattn.sparq_decode(q, cache, ids, r=r, k=k, return_indices=True)
    _check(q, [(keys, v)], out, pos, r, k, "bfloat16")
    tied_taken = sorted(set(pos[0, 0, :k].tolist()).intersection(same.tolist()))
    assert tied_taken == same[:want].tolist(), (len(tied_taken), want)


def test_more_than_65535_keys_taken_from_the_threshold_bin():
    """Every key alike (all scores 0: one bin holds all 135,000 candidates, none chosen above it) and
    k = 70,000: the select stage's last block takes 70,000 candidates, past the 16-bit counts a
    block's claim packs (that packing had its writes overlap here). Ties go to the lowest positions,
    so the choice is exactly positions 0 .. k - 1, and the output is SparQ over them."""
    rng = np.random.default_rng(11)
    n, k, Hkv, G, D, r, bf16 = 135_000, 70_000, 1, 4, 64, 16, ml_dtypes.bfloat16
    keys, v = np.zeros((n, Hkv, D)), rng.standard_normal((n, Hkv, D))
    q = rng.standard_normal((1, 1, Hkv * G, D)).astype(bf16)
    cache = pyattn.PagedKVCache(n // 16 + 4, 16, Hkv, D, "bfloat16", sparq=True)
    ids = _fill(cache, [(keys, v)], bf16)
    out, pos = pyattn.sparq_decode(q, cache, ids, r=r, k=k, return_indices=True)
    assert np.array_equal(np.sort(pos[0, 0, :k]), np.arange(k))
    _check(q, [(keys, v)], out, pos, r, k, "bfloat16")


def test_torch_query_and_the_mean_blend():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    Hkv, G, D, n = 2, 4, 128, 4000
    k, v = rng.standard_normal((n, Hkv, D)), rng.standard_normal((n, Hkv, D)) + 0.5  # a mean worth blending
    cache = pyattn.PagedKVCache(n // 16 + 4, 16, Hkv, D, "bfloat16", sparq=True)
    ids = _fill(cache, [(k, v)], ml_dtypes.bfloat16)
    q = rng.standard_normal((1, 1, Hkv * G, D)).astype(ml_dtypes.bfloat16)
    qt = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16).cuda()
    out, pos = pyattn.sparq_decode(qt, cache, ids, r=32, k=500, return_indices=True)
    assert isinstance(out, pyattn.DeviceArray)
    _check(q, [(k, v)], out.numpy(), pos.numpy(), 32, 500, "bfloat16")

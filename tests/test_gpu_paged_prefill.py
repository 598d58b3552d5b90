"""GPU tests of ``pyattn.paged_prefill``: chunked prefill over pools and page tables the caller manages
(marked ``gpu``; skipped without a driver), against the fp64 reference with the 2x rule, and bitwise
against :func:`pyattn.prefill` over a cache holding the same pages.

Pools are NaN outside the slots a sequence owns (pages assigned at random, so sequences interleave),
and outputs are allocated poisoned: a read through a wrong page, past a sequence's end, or an
unwritten output shows up as NaN. The torch test writes every input on torch's stream just before
the call, behind a sleep, as a vLLM-style engine would.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import pyattn

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import _check, _has_gpu  # noqa: E402
from test_gpu_decode import _pools, _rand, _tables  # noqa: E402
from test_gpu_serving import _check_prefill, _filled  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    phases=[p for p in Phase if p != Phase.shrink or not os.environ.get("PYATTN_TEST_NO_SHRINK")])
DT16 = ["float16", "bfloat16"]


@SETTINGS
@given(data=st.data(), n_seqs=st.integers(1, 3), page_size=st.sampled_from([1, 3, 16, 64, 256]),
       Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), D=st.sampled_from([64, 128, 40, 256]),
       dtype=st.sampled_from(DT16), form=st.sampled_from(["block_table", "csr"]),
       layout=st.sampled_from(["nhd", "hnd"]), causal=st.sampled_from([True, True, False]),
       window=st.sampled_from([None, None, (100, 0), (300, -1)]), mods=st.sampled_from(["", "", "softcap", "alibi"]),
       packed=st.booleans(), q_on_device=st.booleans(), tables_on_device=st.booleans(),
       splits=st.sampled_from([None, None, 1, 3]), seed=st.integers(0, 2**31 - 1))
def test_paged_prefill_matches_reference(data, n_seqs, page_size, Hkv, group, D, dtype, form, layout, causal, window,
                                         mods, packed, q_on_device, tables_on_device, splits, seed):
    rng = np.random.default_rng(seed)
    prefixes = data.draw(st.lists(st.integers(0, 600) | st.sampled_from([0, 1, 255, 256]), min_size=n_seqs,
                                  max_size=n_seqs))
    if packed:
        news = data.draw(st.lists(st.integers(0, 300) | st.sampled_from([1, 64, 129]), min_size=n_seqs,
                                  max_size=n_seqs))
    else:
        news = [data.draw(st.integers(1, 200))] * n_seqs
    lengths = [p + n for p, n in zip(prefixes, news)]
    Hq = Hkv * group
    kp, vp, pages, ks, vs = _pools(rng, lengths, page_size, Hkv, D, dtype, layout, extra=int(rng.integers(1, 3)))
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = _rand(rng, (int(cu[-1]), Hq, D) if packed else (n_seqs, news[0], Hq, D), dtype)
    opts = dict(causal=causal, window=window)
    if mods == "softcap":
        opts["softcap"] = 3.0
    if mods == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (n_seqs, Hq) if n_seqs > 1 else (Hq,)).astype(np.float32)
    tables = _tables(rng, pages, lengths, page_size, form)
    if tables_on_device:
        tables = {k: pyattn.asarray(v) for k, v in tables.items()}
    if packed:
        tables["cu_seqlens_q"] = pyattn.asarray(cu) if tables_on_device else cu
    out, lse = pyattn.paged_prefill(pyattn.asarray(q) if q_on_device else q, pyattn.asarray(kp), pyattn.asarray(vp),
                                    layout=layout, num_splits=splits, return_lse=True, **tables, **opts)
    if q_on_device:
        assert isinstance(out, pyattn.DeviceArray)
        out, lse = out.numpy(), lse.numpy()
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == np.float32
    assert lse.shape == ((Hq, int(cu[-1])) if packed else (n_seqs, Hq, news[0]))
    _check_prefill(out, lse, q, cu, ks, vs, packed, **opts)


@pytest.mark.parametrize("page_size, D, form", [(16, 128, "block_table"), (64, 64, "csr"), (1, 128, "block_table"),
                                                (256, 256, "csr")])
def test_bitwise_equal_to_prefill_over_a_cache_of_the_same_pages(page_size, D, form):
    rng = np.random.default_rng(page_size)
    prefixes, news = [700, 0, 130], [333, 64, 1]
    cache, ids, ks, vs = _filled(rng, prefixes, news, page_size, 2, D, "bfloat16")
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = pyattn.asarray(_rand(rng, (int(cu[-1]), 8, D), "bfloat16"))
    lengths = cache.book.lengths(ids).tolist()
    tables = _tables(rng, [cache.book.pages(i).astype(np.int32) for i in ids], lengths, page_size, form)
    want, wl = pyattn.prefill(q, cache, ids, cu, softcap=20.0, return_lse=True)
    got, gl = pyattn.paged_prefill(q, cache.k, cache.v, cu, softcap=20.0, return_lse=True,
                                   **{k: pyattn.asarray(v) for k, v in tables.items()})
    assert np.array_equal(got.numpy().view(np.uint16), want.numpy().view(np.uint16))
    assert np.array_equal(gl.numpy(), wl.numpy())
    _check_prefill(got.numpy(), gl.numpy(), q.numpy(), cu, ks, vs, True, causal=True, softcap=20.0)


try:
    import torch
except ImportError:
    torch = None


@pytest.mark.skipif(torch is None or not getattr(torch, "cuda", None) or not torch.cuda.is_available(),
                    reason="torch with CUDA not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_engine_arrays_written_just_before_the_call(dtype):
    """vLLM's layout: one (2, num_blocks, page, heads, dim) tensor whose halves are the K and V pools;
    every input written on torch's stream behind a sleep; the bf16 result handed back to torch."""
    rng = np.random.default_rng(11)
    tdt = getattr(torch, dtype)
    lengths, news, ps, Hkv, D, Hq = [900, 300], [512, 77], 16, 2, 128, 8
    kp, vp, pages, ks, vs = _pools(rng, lengths, ps, Hkv, D, dtype, "nhd", extra=5)
    kv_host = np.stack([kp, vp]).view(np.int16)
    tables = _tables(rng, pages, lengths, ps, "block_table")
    cu = np.array([0, news[0], sum(news)], np.int32)
    q = _rand(rng, (sum(news), Hq, D), dtype)
    kv = torch.zeros(kv_host.shape, dtype=tdt, device="cuda")
    tq = torch.zeros(q.shape, dtype=tdt, device="cuda")
    ttab = torch.zeros(tables["block_table"].shape, dtype=torch.int32, device="cuda")
    tlen = torch.zeros(2, dtype=torch.int32, device="cuda")
    tcu = torch.zeros(3, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the writes below land well after this call is queued
    kv.copy_(torch.from_numpy(kv_host).view(tdt), non_blocking=True)
    tq.copy_(torch.from_numpy(q.view(np.int16)).view(tdt), non_blocking=True)
    ttab.copy_(torch.from_numpy(tables["block_table"]), non_blocking=True)
    tlen.copy_(torch.from_numpy(tables["seq_lens"]), non_blocking=True)
    tcu.copy_(torch.from_numpy(cu), non_blocking=True)
    out = pyattn.paged_prefill(tq, kv[0], kv[1], tcu, block_table=ttab, seq_lens=tlen, window=(256, 0))
    got = torch.from_dlpack(out)
    assert got.dtype == tdt and got.shape == tq.shape
    host = got.view(torch.int16).cpu().numpy().view(q.dtype)
    _check_prefill(host, None, q, cu, ks, vs, True, causal=True, window=(256, 0))


# -- tables read unchecked on the device (max_seqlen_q / max_seqlen_k) ---------------------------------
@pytest.mark.parametrize("page_size, D, dtype, splits", [(16, 128, "bfloat16", None), (3, 64, "float16", None),
                                                         (64, 256, "bfloat16", 3), (1, 128, "float16", 2)])
def test_bounded_tables_give_the_checked_result_bitwise(page_size, D, dtype, splits):
    """Right tables under bounds at or above their values: the clamps change nothing. Bounds equal to
    the values (or a fixed split count) make the same plan: bitwise; looser ones may split the keys
    otherwise (the split choice reads the bounds): the reference."""
    rng = np.random.default_rng(page_size + D)
    lengths, news = [700, 64, 131, 5], [333, 64, 1, 5]
    kp, vp, pages, ks, vs = _pools(rng, lengths, page_size, 2, D, dtype, "nhd", extra=3)
    tables = {k: pyattn.asarray(v) for k, v in _tables(rng, pages, lengths, page_size, "block_table").items()}
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = pyattn.asarray(_rand(rng, (int(cu[-1]), 8, D), dtype))
    dkp, dvp, dcu = pyattn.asarray(kp), pyattn.asarray(vp), pyattn.asarray(cu)
    want, wl = pyattn.paged_prefill(q, dkp, dvp, dcu, num_splits=splits, return_lse=True, **tables)
    width = tables["block_table"].shape[1] * page_size
    for mq, mk in ((333, 700), (400, width)):
        got, gl = pyattn.paged_prefill(q, dkp, dvp, dcu, num_splits=splits, return_lse=True, max_seqlen_q=mq,
                                       max_seqlen_k=mk, **tables)
        if splits is not None or (mq, mk) == (333, 700):
            assert np.array_equal(got.numpy().view(np.uint16), want.numpy().view(np.uint16))
            assert np.array_equal(gl.numpy(), wl.numpy())
        else:
            _check_prefill(got.numpy(), gl.numpy(), q.numpy(), cu, ks, vs, True, causal=True)
    _check_prefill(want.numpy(), wl.numpy(), q.numpy(), cu, ks, vs, True, causal=True)


def _clamped(cu, lens, table, total, max_q, max_k, num_pages):
    """What the kernels make of unchecked tables (kernels_src: clamp_rows, the length and page
    clamps): per sequence (first row, rows, keys, pages)."""
    out = []
    for b in range(len(lens)):
        lo = min(max(int(cu[b]), 0), total)
        n = min(min(max(int(cu[b + 1]), lo), total) - lo, max_q)
        sk = min(max(int(lens[b]), 0), max_k)
        pages = np.where((table[b] < 0) | (table[b] >= num_pages), num_pages - 1, table[b])
        out.append((lo, n, sk, pages))
    return out


# Wrong tables (each a set of edits to a right one): entries outside the pool, lengths past the
# bound or negative, offsets negative, decreasing, past q's rows or longer than max_seqlen_q, and a
# sequence with more new tokens than keys (its first rows see no key).
WRONG = {
    "pages": dict(table={(0, 0): -1, (1, 1): 12, (2, 0): 2**31 - 1, (3, 2): -2**31}),
    "lengths": dict(lens=[500, -7, 33, 80]),
    "offsets": dict(cu=[-5, 10, 10, 28, 90]),
    "decreasing": dict(cu=[0, 12, 8, 30, 40]),
    "too long": dict(cu=[0, 30, 31, 39, 40]),
    "more tokens than keys": dict(lens=[3, 20, 5, 12]),
}


@pytest.mark.parametrize("page_size", [16, 3])
@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_wrong_bounded_tables_read_the_clamped_problem(page_size, wrong):
    rng = np.random.default_rng(7)
    N, Hkv, Hq, D, B, total, max_q = 30, 2, 4, 128, 4, 40, 16
    width = -(-80 // page_size)
    max_k = width * page_size
    kp, vp = (_rand(rng, (N, page_size, Hkv, D), "bfloat16") for _ in range(2))  # every slot a real value
    table = rng.integers(0, N, (B, width)).astype(np.int32)
    lens, cu = np.array([60, 20, 45, 12], np.int32), np.array([0, 10, 20, 30, 40], np.int32)
    edit = WRONG[wrong]
    for (b, j), val in edit.get("table", {}).items():
        table[b, j] = val
    lens = np.array(edit.get("lens", lens), np.int32)
    cu = np.array(edit.get("cu", cu), np.int32)
    q = _rand(rng, (total, Hq, D), "bfloat16")
    out, lse = pyattn.paged_prefill(pyattn.asarray(q), pyattn.asarray(kp), pyattn.asarray(vp), pyattn.asarray(cu),
                                    block_table=pyattn.asarray(table), seq_lens=pyattn.asarray(lens),
                                    max_seqlen_q=max_q, max_seqlen_k=max_k, return_lse=True)
    out, lse = out.numpy(), lse.numpy()
    seqs = _clamped(cu, lens, table, total, max_q, max_k, N)
    cover = np.zeros(total, int)
    for lo, n, _, _ in seqs:
        cover[lo:lo + n] += 1
    checked = 0
    for lo, n, sk, pages in seqs:
        if n == 0 or (cover[lo:lo + n] != 1).any():
            continue
        slots = np.arange(sk)
        k = kp[pages[slots // page_size], slots % page_size][None]
        v = vp[pages[slots // page_size], slots % page_size][None]
        _check(out[lo:lo + n][None], lse[:, lo:lo + n][None], q[lo:lo + n][None], k, v, causal=True)
        checked += 1
    assert checked >= 1


@pytest.mark.skipif(torch is None or not getattr(torch, "cuda", None) or not torch.cuda.is_available(),
                    reason="torch with CUDA not installed")
def test_a_bounded_chunk_step_replays_in_a_torch_graph_over_changed_tables():
    """A mixed prefill batch captured once: between replays the engine rewrites its block table,
    lengths and offsets (same tensors); each replay equals the eager call (bitwise: one plan) and the
    fp64 reference over the pages the table names."""
    from test_gpu_graph_capture import _capture

    rng = np.random.default_rng(3)
    N, ps, Hkv, Hq, D, B, cols, total, mq = 96, 16, 2, 8, 128, 3, 32, 300, 256
    kp, vp = (torch.from_numpy(_rand(rng, (N, ps, Hkv, D), "bfloat16").view(np.int16)).view(torch.bfloat16).cuda()
              for _ in range(2))
    q = torch.zeros(total, Hq, D, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(B, cols, dtype=torch.int32, device="cuda")
    lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")

    def refill(new_lens, counts):
        table.copy_(torch.from_numpy(rng.permutation(N)[: B * cols].reshape(B, cols).astype(np.int32) % N))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        cu.copy_(torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32))
        q.copy_(torch.from_numpy(_rand(rng, (total, Hq, D), "bfloat16").view(np.int16)).view(torch.bfloat16))

    def step():
        return torch.from_dlpack(pyattn.paged_prefill(q, kp, vp, cu, block_table=table, seq_lens=lens,
                                                      max_seqlen_q=mq, max_seqlen_k=cols * ps))

    refill([300, 40, 500], [100, 40, 160])
    g, out = _capture(step, "warm-up")
    steps = (([512, 17, 260], [256, 4, 40]), ([1, 400, 99], [1, 200, 99]), ([0, 50, 300], [0, 45, 255]))
    for new_lens, counts in steps:
        refill(new_lens, counts)
        g.replay()
        got = out.clone()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        host = lambda t: t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)  # noqa: E731
        t, kh, vh, qh, gh = table.cpu().numpy(), host(kp), host(vp), host(q), host(got)
        c = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        ks = [kh[t[b, : -(-n // ps)]].reshape(-1, Hkv, D)[:n] for b, n in enumerate(new_lens)]
        vs = [vh[t[b, : -(-n // ps)]].reshape(-1, Hkv, D)[:n] for b, n in enumerate(new_lens)]
        _check_prefill(gh[: c[-1]], None, qh[: c[-1]], c, ks, vs, True, causal=True)


@pytest.mark.parametrize("kernels, page_size, causal", [("own", 16, True), ("own", 3, False), ("sm80", 16, True)])
def test_a_mixed_batch_over_several_rounds_of_the_unit_scan(request, kernels, page_size, causal):
    """A mixed step of 300 sequences: one new token for most, none for some (at the edges of the
    unit scan's rounds of 128 too), long chunks among them. Each block finds its sequence by that
    scan (attention_mask.cuh paged_tile); checked tables and device ones under bounds far above the
    values (a 2048-token budget, as an engine passes) give the reference, bitwise the same."""
    if kernels == "sm80":
        request.getfixturevalue("sm80_prefill")
    rng = np.random.default_rng(300 + page_size)
    news = [1] * 300
    for b in (0, 57, 127, 128, 256, 298):
        news[b] = 0
    for b, m in ((5, 200), (126, 129), (129, 64), (255, 17), (299, 333)):
        news[b] = m
    lengths = [int(p) + m for p, m in zip(rng.integers(0, 200, len(news)), news)]
    kp, vp, pages, ks, vs = _pools(rng, lengths, page_size, 2, 64, "bfloat16", "nhd", extra=1)
    tables = {k: pyattn.asarray(v) for k, v in _tables(rng, pages, lengths, page_size, "block_table").items()}
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = pyattn.asarray(_rand(rng, (int(cu[-1]), 8, 64), "bfloat16"))
    dkp, dvp = pyattn.asarray(kp), pyattn.asarray(vp)
    got, lse = pyattn.paged_prefill(q, dkp, dvp, cu, causal=causal, return_lse=True, **tables)
    _check_prefill(got.numpy(), lse.numpy(), q.numpy(), cu, ks, vs, True, causal=causal)
    bounded, bl = pyattn.paged_prefill(q, dkp, dvp, pyattn.asarray(cu), causal=causal, return_lse=True,
                                       max_seqlen_q=2048, max_seqlen_k=max(lengths), **tables)
    assert np.array_equal(bounded.numpy().view(np.uint16), got.numpy().view(np.uint16))
    assert np.array_equal(bl.numpy(), lse.numpy())


@pytest.fixture
def sm80_prefill(monkeypatch):
    """The paged prefill's sm_80 kernels (attn_prefill_mma, the split combine) as compute_80 PTX,
    which the driver compiles for this GPU: what sm_80 / sm_86 / sm_89 machines run, checked here.
    Plans are built afresh for the fixture's life (none made with this GPU's own kernels is reused)."""
    from pyattn.ops import _prefill, paged_prefill
    from pyattn.pipeline import plans

    real = _prefill.prefill_specs
    monkeypatch.setattr(_prefill, "prefill_specs", lambda dt, d, arch, ptx, *rest: real(dt, d, "sm_80", True, *rest))
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(plans, "_by_id", {})
    monkeypatch.setattr(paged_prefill, "_quick", plans.Memo())
    return real


@pytest.mark.parametrize("page_size, D, splits", [(16, 128, None), (3, 64, 2)])
def test_the_sm80_kernels_checked_bounded_and_wrong_tables(sm80_prefill, page_size, D, splits, launched):
    rng = np.random.default_rng(80 + page_size)
    lengths, news = [300, 64, 131], [200, 64, 1]
    kp, vp, pages, ks, vs = _pools(rng, lengths, page_size, 2, D, "bfloat16", "nhd", extra=0)
    tables = {k: pyattn.asarray(v) for k, v in _tables(rng, pages, lengths, page_size, "block_table").items()}
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = pyattn.asarray(_rand(rng, (int(cu[-1]), 8, D), "bfloat16"))
    dkp, dvp, dcu = pyattn.asarray(kp), pyattn.asarray(vp), pyattn.asarray(cu)
    got, lse = pyattn.paged_prefill(q, dkp, dvp, dcu, num_splits=splits, return_lse=True, softcap=15.0, **tables)
    assert all(name.startswith(("pyattn_attn_prefill_mma", "pyattn_split_combine")) for name in launched), launched
    _check_prefill(got.numpy(), lse.numpy(), q.numpy(), cu, ks, vs, True, causal=True, softcap=15.0)
    bounded = pyattn.paged_prefill(q, dkp, dvp, dcu, num_splits=splits, softcap=15.0, max_seqlen_q=200,
                                   max_seqlen_k=300, **tables)
    assert np.array_equal(bounded.numpy().view(np.uint16), got.numpy().view(np.uint16))
    # Wrong entries under the bounds: negative and past the pool, a length past the bound.
    table = tables["block_table"].numpy()
    bad = table.copy()
    bad[0, 0], bad[1, 1] = -3, 10**6
    lens = np.array([900, 64, 131], np.int32)
    out = pyattn.paged_prefill(q, dkp, dvp, dcu, num_splits=splits, softcap=15.0, block_table=pyattn.asarray(bad),
                               seq_lens=pyattn.asarray(lens), max_seqlen_q=200, max_seqlen_k=300).numpy()
    n_pool = kp.shape[0]
    fixed = np.where((bad < 0) | (bad >= n_pool), n_pool - 1, bad)
    for b, n in enumerate([300, 64, 131]):
        slots = np.arange(n)
        k = kp[fixed[b][slots // page_size], slots % page_size]
        v = vp[fixed[b][slots // page_size], slots % page_size]
        if np.isnan(k.astype(np.float32)).any() or np.isnan(v.astype(np.float32)).any():
            continue  # a clamped entry pointed at the pool's last page, NaN outside its owner's slots
        lo, hi = int(cu[b]), int(cu[b + 1])
        _check(out[lo:hi][None], None, q.numpy()[lo:hi][None], k[None], v[None], causal=True, softcap=15.0)

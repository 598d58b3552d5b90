"""GPU property tests of paged decode and the paged KV cache against the fp64 reference (marked
``gpu``; skipped without a driver).

Decode over any page table must equal dense attention over the gathered K/V (bottom-right causal
for q_len > 1). Pools are filled with NaN outside the slots a sequence owns, so a read past a
sequence's end or through a wrong page shows up as NaN. The cache tests replay random
add/append/fork/truncate/free sequences against a host model and compare the pool bytes exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _check, _has_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DT16 = ["float16", "bfloat16"]


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(DTYPES[dtype])


def _check_decode(out, lse, q, ks, vs, **opts):
    """Compare each batch row with dense attention over its gathered keys ks[b], vs[b] (L, Hkv, D)."""
    out, lse = np.asarray(out), None if lse is None else np.asarray(lse)
    slopes = opts.pop("alibi_slopes", None)
    for b in range(q.shape[0]):
        if slopes is not None:
            opts["alibi_slopes"] = slopes[b:b + 1] if slopes.ndim == 2 else slopes
        if ks[b].shape[0] == 0:  # no key at all: output 0, LSE -inf
            assert np.all(out[b].astype(np.float64) == 0)
            assert lse is None or np.all(np.isneginf(lse[b]))
            continue
        _check(out[b:b + 1], None if lse is None else lse[b:b + 1], q[b:b + 1], ks[b][None], vs[b][None], **opts)


def _pools(rng, lengths, page_size, Hkv, D, dtype, layout, extra):
    """Random page assignment: pools (NaN outside used slots), per-sequence pages, gathered K/V."""
    n_pages = [-(-n // page_size) for n in lengths]
    total = sum(n_pages) + extra
    perm = rng.permutation(total)
    shape = (total, page_size, Hkv, D) if layout == "nhd" else (total, Hkv, page_size, D)
    kp = np.full(shape, np.nan, DTYPES[dtype])
    vp = np.full(shape, np.nan, DTYPES[dtype])
    pages, ks, vs, at = [], [], [], 0
    for n, np_ in zip(lengths, n_pages):
        pg = perm[at:at + np_].astype(np.int32)
        at += np_
        k, v = _rand(rng, (n, Hkv, D), dtype), _rand(rng, (n, Hkv, D), dtype)
        for t in range(n):
            p, s = pg[t // page_size], t % page_size
            if layout == "nhd":
                kp[p, s], vp[p, s] = k[t], v[t]
            else:
                kp[p, :, s], vp[p, :, s] = k[t], v[t]
        pages.append(pg)
        ks.append(k)
        vs.append(v)
    return kp, vp, pages, ks, vs


def _tables(rng, pages, lengths, page_size, form):
    """The page tables of ``pages`` in vLLM's form (padding holds garbage) or FlashInfer's CSR form."""
    if form == "block_table":
        width = max(len(p) for p in pages) + 1
        table = rng.integers(-5, 10**6, (len(pages), width)).astype(np.int32)
        for b, p in enumerate(pages):
            table[b, :len(p)] = p
        return dict(block_table=table, seq_lens=np.array(lengths, np.int32))
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    last = np.array([n - (len(p) - 1) * page_size if n else 0 for n, p in zip(lengths, pages)], np.int32)
    return dict(indptr=indptr, indices=np.concatenate(pages + [np.zeros(2, np.int32)]).astype(np.int32),
                last_page_len=last)


@SETTINGS
@given(lengths=st.lists(st.integers(0, 700) | st.sampled_from([1, 16, 64, 257]), min_size=1, max_size=3),
       page_size=st.sampled_from([1, 3, 16, 64, 256]), Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4, 8]),
       q_len=st.sampled_from([1, 1, 2, 5]), D=st.sampled_from([64, 128, 40, 256]), dtype=st.sampled_from(DT16),
       form=st.sampled_from(["block_table", "csr"]), layout=st.sampled_from(["nhd", "hnd"]),
       splits=st.sampled_from([None, None, 1, 3, 8]), causal=st.booleans(),
       window=st.sampled_from([None, None, (40, 0), (0, -1), (200, 3)]), mods=st.sampled_from(["", "softcap", "alibi"]),
       on_device=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_paged_decode_matches_dense(lengths, page_size, Hkv, group, q_len, D, dtype, form, layout, splits, causal,
                                    window, mods, on_device, seed):
    rng = np.random.default_rng(seed)
    B, Hq = len(lengths), Hkv * group
    kp, vp, pages, ks, vs = _pools(rng, lengths, page_size, Hkv, D, dtype, layout, extra=int(rng.integers(1, 3)))
    q = _rand(rng, (B, q_len, Hq, D), dtype)
    opts = dict(causal=causal, window=window)
    if mods == "softcap":
        opts["softcap"] = 2.5
    if mods == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (B, Hq)).astype(np.float32)
    tables = _tables(rng, pages, lengths, page_size, form)
    if on_device:
        tables = {k: pyattn.asarray(v) for k, v in tables.items()}
    out, lse = pyattn.paged_decode(pyattn.asarray(q) if on_device else q, pyattn.asarray(kp), pyattn.asarray(vp),
                                   layout=layout, num_splits=splits, return_lse=True, **tables, **opts)
    if on_device:
        out, lse = out.numpy(), lse.numpy()
    assert out.shape == q.shape and lse.shape == (B, Hq, q_len)
    _check_decode(out, lse, q, ks, vs, **opts)


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_splits_agree(splits):
    """One long sequence: every split count gives the reference (and the splits' combine is exercised)."""
    rng = np.random.default_rng(splits)
    kp, vp, pages, ks, vs = _pools(rng, [3000], 16, 2, 128, "bfloat16", "nhd", extra=0)
    q = _rand(rng, (1, 1, 8, 128), "bfloat16")
    out, lse = pyattn.paged_decode(q, pyattn.asarray(kp), pyattn.asarray(vp), block_table=pages[0][None],
                                   seq_lens=np.array([3000], np.int32), num_splits=splits, return_lse=True)
    _check_decode(out, lse, q, ks, vs, causal=True)


@pytest.mark.parametrize("splits", [2, 17])
def test_speculative_rows_with_splits_merged_fused_or_by_a_second_launch(splits):
    """16 query tokens x GQA 4 (two row tiles): 2 splits merge inside the decode launch, 17 by
    split_combine after it (the fused share would be over its budget); both give the reference."""
    rng = np.random.default_rng(splits)
    kp, vp, pages, ks, vs = _pools(rng, [3000], 16, 2, 128, "bfloat16", "nhd", extra=0)
    q = _rand(rng, (1, 16, 8, 128), "bfloat16")
    out, lse = pyattn.paged_decode(q, pyattn.asarray(kp), pyattn.asarray(vp), block_table=pages[0][None],
                                   seq_lens=np.array([3000], np.int32), num_splits=splits, return_lse=True)
    _check_decode(out, lse, q, ks, vs, causal=True)


@pytest.mark.parametrize("group, q_len, D, page, mods", [
    (16, 16, 128, 16, "softcap"), (16, 1, 256, 64, "alibi"), (1, 16, 64, 128, "window"), (8, 9, 256, 16, ""),
    (4, 16, 128, 256, "alibi"), (16, 3, 64, 32, "window")])
def test_groups_to_16_and_query_tokens_to_16(group, q_len, D, page, mods):
    """The decode issue's corners that the fuzz above leaves out: GQA groups of 16 and up to 16
    query tokens (up to 256 rows: several row blocks), on pages of 16..256 (on sm_90a the TMA
    kernel's page boxes), ragged lengths ending mid-page, with soft-cap, ALiBi or a window."""
    _corner(np.random.default_rng(group * 100 + q_len), group, q_len, D, page, mods)


def _corner(rng, group, q_len, D, page, mods):
    """paged_decode over 3 ragged sequences (2 KV heads, bf16, NaN outside their slots) with
    ``mods`` ("softcap", "alibi", "window" or ""), checked against the reference."""
    lengths = [1500, 37, 700]
    kp, vp, pages, ks, vs = _pools(rng, lengths, page, 2, D, "bfloat16", "nhd", extra=2)
    q = _rand(rng, (len(lengths), q_len, 2 * group, D), "bfloat16")
    opts = dict(causal=True, window=(100, 0) if mods == "window" else None)
    if mods == "softcap":
        opts["softcap"] = 2.5
    if mods == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (len(lengths), 2 * group)).astype(np.float32)
    table = np.zeros((len(lengths), max(len(p) for p in pages)), np.int32)
    for b, pg in enumerate(pages):
        table[b, :len(pg)] = pg
    out, lse = pyattn.paged_decode(q, pyattn.asarray(kp), pyattn.asarray(vp), block_table=table,
                                   seq_lens=np.array(lengths, np.int32), return_lse=True, **opts)
    _check_decode(out, lse, q, ks, vs, **opts)


@pytest.mark.parametrize("group, q_len, D, page, mods", [
    (4, 1, 128, 1, ""), (8, 1, 64, 8, "softcap"), (4, 2, 256, 3, "alibi"), (1, 5, 40, 1, "window"),
    (2, 4, 128, 12, ""), (4, 4, 128, 1, "")])
def test_small_and_odd_pages_on_gathered_rows(monkeypatch, group, q_len, D, page, mods):
    """Pages TMA boxes do not take (under 16 slots, or not a power of two): on sm_90a up to 8 query
    rows a KV head run the TMA kernel with swapped roles, its producers gathering the rows by
    cp.async (KernelSpec.gather), more rows the cp.async kernel; ragged lengths, pool slots
    outside the sequences NaN (a row read past a sequence's end shows), head dim 40 in the 64
    bucket (the columns past 40 zero-filled, never read from the next head's)."""
    from pyattn.ops import _decode

    specs, real = [], _decode.get_kernel
    monkeypatch.setattr(_decode, "get_kernel", lambda spec, dev: specs.append(spec) or real(spec, dev))
    _decode._spec.cache_clear()  # (memoised: a spec chosen before would not be loaded again here)
    _corner(np.random.default_rng(group * 100 + q_len * 10 + page), group, q_len, D, page, mods)
    decodes = [s for s in specs if s.family.startswith("attn_decode")]
    swap = pyattn.get_device().arch == "sm_90a" and group * q_len <= 8
    assert [(s.family, s.gather) for s in decodes] == [("attn_decode_swap", True) if swap else ("attn_decode", False)]


def test_fused_combine_beyond_its_shared_weights():
    """A decode tile whose shared memory holds fewer split weights than the splits (the combine
    recomputes the rest from their LSEs), many splits empty, rows of two row tiles (GQA 8 x
    q_len 3), and the per-stream counters reused by a second call."""
    from pyattn.kernels.families import DecodeTile, override_tiles, tile_table

    small = DecodeTile(32, 16, 2, 2, 2, 1, "test: 12.8 KiB, room for 98 split weights per row")
    rows = (small,) + tile_table("attn_decode", pyattn.get_device().arch)[1:]
    rng = np.random.default_rng(5)
    kp, vp, pages, ks, vs = _pools(rng, [3000], 16, 2, 32, "float16", "nhd", extra=0)
    q = _rand(rng, (1, 3, 16, 32), "float16")
    with override_tiles("attn_decode", pyattn.get_device().arch, rows):
        for _ in range(2):
            out, lse = pyattn.paged_decode(q, pyattn.asarray(kp), pyattn.asarray(vp), block_table=pages[0][None],
                                           seq_lens=np.array([3000], np.int32), num_splits=256, return_lse=True)
            _check_decode(out, lse, q, ks, vs, causal=True)


@pytest.mark.parametrize("group, q_len, D, splits", [
    (4, 1, 128, 32), (4, 1, 128, 33), (1, 8, 128, 17), (2, 3, 256, 12), (8, 1, 64, 5), (4, 2, 128, 64),
    (8, 1, 128, 256), (2, 3, 256, 40)])
def test_swapped_blocks_combine_many_splits(group, q_len, D, splits):
    """Up to 8 query rows a KV head (on sm_90a the swapped-role blocks, attn_decode_swap) at up to
    256 splits: the last split's block merges them (rows of 1 to 8 query tokens), over two sequences
    (two units a KV head) with splits past their key tiles (empty) and the LSE asked."""
    rng = np.random.default_rng(group * 1000 + q_len * 100 + splits)
    lengths = [3000, 1900]
    kp, vp, pages, ks, vs = _pools(rng, lengths, 16, 2, D, "bfloat16", "nhd", extra=1)
    table = np.zeros((2, max(len(p) for p in pages)), np.int32)
    for b, pg in enumerate(pages):
        table[b, :len(pg)] = pg
    q = _rand(rng, (2, q_len, 2 * group, D), "bfloat16")
    for _ in range(2):  # the second call reuses the split counters the first set back to 0
        out, lse = pyattn.paged_decode(q, pyattn.asarray(kp), pyattn.asarray(vp), block_table=table,
                                       seq_lens=np.array(lengths, np.int32), num_splits=splits, return_lse=True)
        _check_decode(out, lse, q, ks, vs, causal=True)


def test_fused_combine_with_more_units_than_the_first_counter_block():
    """2,560 (kv head, sequence) units split twice: the stream's counter block grows past its first
    1,024 counters, and every unit's last split merges."""
    rng = np.random.default_rng(6)
    lengths = [int(n) for n in rng.integers(200, 400, 80)]
    kp, vp, pages, ks, vs = _pools(rng, lengths, 16, 32, 64, "bfloat16", "nhd", extra=3)
    width = max(len(p) for p in pages)
    table = np.zeros((len(lengths), width), np.int32)
    for b, pg in enumerate(pages):
        table[b, :len(pg)] = pg
    q = _rand(rng, (len(lengths), 1, 32, 64), "bfloat16")
    out, lse = pyattn.paged_decode(q, pyattn.asarray(kp), pyattn.asarray(vp), block_table=table,
                                   seq_lens=np.array(lengths, np.int32), num_splits=2, return_lse=True)
    _check_decode(out, lse, q, ks, vs, causal=True)


def test_out_of_range_page_rejected_before_launch():
    rng = np.random.default_rng(0)
    kp, vp, pages, _, _ = _pools(rng, [40], 16, 1, 64, "float16", "nhd", extra=0)
    table = pages[0][None].copy()
    table[0, 1] = kp.shape[0]  # one past the pool
    q = _rand(rng, (1, 1, 1, 64), "float16")
    with pytest.raises(ValueError, match="block_table: page indices must be in"):
        pyattn.paged_decode(q, pyattn.asarray(kp), pyattn.asarray(vp), block_table=pyattn.asarray(table),
                            seq_lens=np.array([40], np.int32))


# -- the cache -------------------------------------------------------------------------------------

class _Model:
    """Host model of a cache: each sequence's K and V tokens."""

    def __init__(self):
        self.k, self.v = {}, {}


def _gather(cache, sid):
    """A sequence's K/V read back from the pool through its page table."""
    pages, n, ps = cache.book.pages(sid), cache.length(sid), cache.page_size
    kp, vp = cache.k.numpy(), cache.v.numpy()
    idx = np.arange(n)
    return kp[pages[idx // ps], idx % ps], vp[pages[idx // ps], idx % ps]


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "append", "fork", "truncate", "free"]),
                         st.integers(0, 2**31 - 1)), min_size=4, max_size=14)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, page_size=st.sampled_from([1, 4, 16, 128]), num_pages=st.integers(4, 60),
       dtype=st.sampled_from(DT16), q_len=st.sampled_from([1, 3]), seed=st.integers(0, 2**31 - 1))
def test_cache_ops_keep_every_sequence_exact(ops, page_size, num_pages, dtype, q_len, seed):
    rng = np.random.default_rng(seed)
    Hkv, D, group = 2, 64, 4
    cache = pyattn.PagedKVCache(num_pages, page_size, Hkv, D, dtype)
    model = _Model()
    for op, r in ops:
        live = list(model.k)
        pick = live[r % len(live)] if live else None
        if op == "add" or not live:
            sid = cache.add_sequence()
            model.k[sid], model.v[sid] = np.zeros((0, Hkv, D), DTYPES[dtype]), np.zeros((0, Hkv, D), DTYPES[dtype])
        elif op == "append":
            ids = [s for s in live if rng.random() < 0.7] or [pick]
            counts = [int(rng.integers(0, 2 * page_size + 3)) for _ in ids]
            k, v = _rand(rng, (sum(counts), Hkv, D), dtype), _rand(rng, (sum(counts), Hkv, D), dtype)
            before = (cache.book.refcount.copy(), cache.num_free_pages, cache.k.numpy())
            try:
                args = (pyattn.asarray(k), pyattn.asarray(v)) if r % 2 else (k, v)
                cache.append(ids, *args, counts=counts)
            except pyattn.OutOfPagesError:
                assert np.array_equal(before[0], cache.book.refcount) and before[1] == cache.num_free_pages
                assert np.array_equal(before[2].view(np.uint16), cache.k.numpy().view(np.uint16))
                continue
            at = 0
            for sid, c in zip(ids, counts):
                model.k[sid] = np.concatenate([model.k[sid], k[at:at + c]])
                model.v[sid] = np.concatenate([model.v[sid], v[at:at + c]])
                at += c
        elif op == "fork":
            n = int(rng.integers(0, cache.length(pick) + 1)) if r % 2 else None
            sid = cache.fork(pick, n)
            model.k[sid], model.v[sid] = model.k[pick][:n].copy(), model.v[pick][:n].copy()
        elif op == "truncate":
            n = int(rng.integers(0, cache.length(pick) + 1))
            cache.truncate(pick, n)
            model.k[pick], model.v[pick] = model.k[pick][:n], model.v[pick][:n]
        else:
            cache.free(pick)
            del model.k[pick], model.v[pick]
        cache.book.check()
    for sid in model.k:  # the bytes of every live sequence, through its pages
        k, v = _gather(cache, sid)
        assert np.array_equal(k.view(np.uint16), model.k[sid].view(np.uint16)), f"sequence {sid}: K differs"
        assert np.array_equal(v.view(np.uint16), model.v[sid].view(np.uint16)), f"sequence {sid}: V differs"
    ids = list(model.k)
    if ids:
        q = _rand(rng, (len(ids), q_len, Hkv * group, D), dtype)
        out, lse = pyattn.decode(q, cache, ids, return_lse=True)
        _check_decode(out, lse, q, [model.k[i] for i in ids], [model.v[i] for i in ids], causal=True)
        table, lens = cache.block_table(ids)
        again = pyattn.paged_decode(q, cache.k, cache.v, block_table=table, seq_lens=lens)
        assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))
    for sid in ids:
        cache.free(sid)
    assert cache.num_free_pages == num_pages and not cache.book.refcount.any()


def test_decode_loop_matches_dense():
    """A serving loop: prefill by append, then several steps of append-one-token + decode, with a fork."""
    rng = np.random.default_rng(1)
    Hkv, D, group, dtype = 2, 128, 4, "bfloat16"
    cache = pyattn.PagedKVCache(64, 16, Hkv, D, dtype)
    a = cache.add_sequence()
    k0, v0 = _rand(rng, (1, 37, Hkv, D), dtype), _rand(rng, (1, 37, Hkv, D), dtype)
    cache.append([a], k0, v0)
    b = cache.fork(a)
    ks = {a: k0[0], b: k0[0].copy()}
    vs = {a: v0[0], b: v0[0].copy()}
    for _ in range(5):
        k1, v1 = _rand(rng, (2, 1, Hkv, D), dtype), _rand(rng, (2, 1, Hkv, D), dtype)
        cache.append([a, b], pyattn.asarray(k1), pyattn.asarray(v1))
        for i, sid in enumerate((a, b)):
            ks[sid] = np.concatenate([ks[sid], k1[i]])
            vs[sid] = np.concatenate([vs[sid], v1[i]])
        q = _rand(rng, (2, 1, Hkv * group, D), dtype)
        out = pyattn.decode(pyattn.asarray(q), cache, [a, b])
        _check_decode(out.numpy(), None, q, [ks[a], ks[b]], [vs[a], vs[b]], causal=True)
    assert cache.book.pages(a)[0] == cache.book.pages(b)[0]  # the full first pages stay shared
    assert cache.book.pages(a)[2] != cache.book.pages(b)[2]  # the written partial page was copied

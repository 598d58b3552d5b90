"""Per-channel key scales on the CPU: the quantizer's rules and the append planner.

``pyattn.quant.quantize_page`` is checked against its documented properties (error bound, special
pages, the rounding-up of channel scales); ``KeyStager``'s jobs, executed by a NumPy model of the
``kv_key_pages`` kernel, must leave every page quantized from exactly the values the rule in
``pyattn.paged.keypages`` names, through random appends, forks, truncations and frees (the GPU test
holds the kernel to the same model).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _keypages_model import Pages, Pools, dequant_slots, effective, run_jobs
from pyattn.paged.book import OutOfPagesError, PageBook
from pyattn.paged.keypages import KeyStager
from pyattn.quant import CODE_MAX, KEPT_CHANNELS, dequantize_page, fp16_round_up, quantize_page

KINDS = ("int8", "fp8e4m3")


def test_fp16_round_up_is_the_smallest_fp16_at_or_above():
    x = np.float32([0.0, 1e-30, 2.0**-25, 0.1, 0.3333, 1.0, 0.99999994, 65504.0])
    r = fp16_round_up(x)
    assert (r.astype(np.float32) >= x).all()
    below = np.nextafter(r, np.float16(-np.inf))
    assert ((below.astype(np.float32) < x) | (r == 0)).all()
    assert r[0] == 0 and r[1] == np.float16(2.0**-24) and r[5] == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_quantize_page_error_bound_and_outlier_channels(kind, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 16, 64))
    x[..., [3, 40]] *= 30.0  # outlier channels: kept apart in float16
    x[1, :, 7] = 0.0  # an all-zero channel
    x = x.astype(dtype)
    codes, scale, chan, idx, kept = quantize_page(x, kind)
    assert codes.shape == x.shape and scale.shape == (5,) and chan.shape == (5, 64)
    assert idx.shape == (5, KEPT_CHANNELS) and kept.shape == (5, 16, KEPT_CHANNELS)
    assert scale.dtype == np.float32 and chan.dtype == np.float16 and kept.dtype == np.float16
    x64 = x.astype(np.float64)
    amax = np.abs(x64).max(-2)
    # the kept channels: the largest amax first (3 and 40 here), quantized channels' r and codes 0 there
    assert (np.sort(idx[:, :2], -1) == [3, 40]).all()
    assert (np.diff(np.take_along_axis(amax, idx.astype(int), -1), axis=-1) <= 0).all()
    others = np.ones((5, 64), bool)
    others[np.arange(5)[:, None], idx] = False
    assert all(amax[p][~others[p]].min() >= amax[p][others[p]].max() for p in range(5))
    assert (chan[~others] == 0).all() and not np.take_along_axis(codes, idx[:, None, :].astype(int), -1).view(
        np.uint8).any()
    assert (chan <= 1).all() and chan[1, 7] == 0
    v = dequantize_page(codes, scale, chan, idx, kept)
    e = scale[:, None].astype(np.float64) * chan.astype(np.float64)
    assert (e[others] >= amax[others] / CODE_MAX[kind] * (1 - 2.0**-22)).all()  # rounded up: codes clip by rounding at most
    if kind == "int8":
        bound = np.broadcast_to((e / 2 + 2.0**-21 * amax + 2.0**-140)[:, None, :], x.shape)
    else:
        bound = np.maximum(2.0**-4 * np.abs(x64), (2.0**-10 * e)[:, None, :]) + (2.0**-21 * amax)[:, None, :] + 2.0**-140
    kept_bound = 2.0**-11 * (1 + 2.0**-12) * np.abs(x64) + 2.0**-25 * scale[:, None, None].astype(np.float64)
    bound = np.where(others[:, None, :], bound, kept_bound)
    err = np.abs(x64 - v)
    assert (err <= bound).all()
    # per-token scales (one per slot) put the other channels on the outliers' coarse grid
    from pyattn.quant import dequantize, quantize_rows
    per_token = np.abs(x64 - dequantize(*quantize_rows(x, kind)))
    # (int8's grid is uniform, so the other channels gain ~30x; fp8 e4m3 rounds relative to each value,
    # so they gain little: its error is 2**-4 of the value either way)
    assert err[..., :3].mean() < {"int8": 0.2, "fp8e4m3": 1.1}[kind] * per_token[..., :3].mean()
    assert err[..., [3, 40]].max() < 2.0**-10 * np.abs(x64[..., [3, 40]]).max()  # the outliers: float16's rounding
    # keep=0: no channel apart, the largest channel's r is 1
    codes0, scale0, chan0, idx0, kept0 = quantize_page(x, kind, keep=0)
    assert idx0.shape == (5, 0) and kept0.shape == (5, 16, 0) and (chan0.max(-1) == 1).all()
    assert np.array_equal(scale0.view(np.uint32), scale.view(np.uint32))


def test_quantize_page_kept_channel_ties_go_to_the_lower_channel():
    x = np.zeros((1, 2, 16), np.float32)
    x[0, 0, [9, 2, 12, 5, 14]] = [3.0, 3.0, -3.0, 1.0, 3.0]  # four channels tied at 3
    _, _, chan, idx, kept = quantize_page(x, "int8")
    assert idx[0].tolist() == [2, 9, 12, 14]
    assert kept[0, 0].tolist() == [127.0, 127.0, -127.0, 127.0] and chan[0, 5] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_page_special_pages(kind):
    x = np.zeros((3, 4, 16), np.float32)
    x[1, 2, 5] = np.nan
    x[2] = 1.0
    x[2, 0, 0] = -np.inf
    codes, scale, chan, idx, kept = quantize_page(x, kind)
    assert scale[0] == 0 and (chan[0] == 0).all() and not codes[0].view(np.uint8).any()
    for p in (1, 2):  # non-finite anywhere: S is NaN (0x7fffffff), r 0, codes 0
        assert scale[p:p + 1].view(np.uint32)[0] == 0x7FFFFFFF
        assert (chan[p] == 0).all() and not codes[p].view(np.uint8).any()
    assert (idx == np.arange(KEPT_CHANNELS)).all() and not kept.view(np.uint16).any()  # special pages: 0, 1, ..; 0
    with pytest.raises(TypeError, match="^x: "):
        quantize_page(np.zeros((2, 4)), kind)
    with pytest.raises(ValueError, match="^x: "):
        quantize_page(np.zeros(4, np.float32), kind)
    with pytest.raises(ValueError, match="^kind: "):
        quantize_page(np.zeros((2, 4), np.float32), "int4")
    with pytest.raises(ValueError, match="^keep: "):
        quantize_page(np.zeros((2, 4), np.float32), kind, keep=5)


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "append", "append", "fork", "truncate", "free"]),
                         st.integers(0, 2**31 - 1)), min_size=4, max_size=18)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, ps=st.sampled_from([16, 32]), num_pages=st.integers(3, 24), kind=st.sampled_from(KINDS),
       seed=st.integers(0, 2**31 - 1))
def test_planner_keeps_every_page_quantized_by_the_rule(ops, ps, num_pages, kind, seed):
    rng = np.random.default_rng(seed)
    H, D = 2, 16
    book, stager, pools, pages = PageBook(num_pages, ps), KeyStager(ps), Pools(num_pages, ps, H, D, kind), \
        Pages(ps, H, D, kind)
    live = []
    for op, r in ops:
        pick = live[r % len(live)] if live else None
        if op == "add" or not live:
            live.append(book.add_sequence())
        elif op == "append":
            ids = [s for s in live if rng.random() < 0.7] or [pick]
            counts = [int(rng.integers(0, 2 * ps + 3)) for _ in ids]
            new_k = (rng.standard_normal((sum(counts), H, D)) * np.where(rng.random(D) < 0.1, 30, 1)).astype(
                ml_dtypes.bfloat16)
            before = stager.before(book, ids, counts)
            try:
                plan = book.plan_append(ids, counts)
            except OutOfPagesError:
                continue
            work = stager.plan(counts, before, plan.dst)
            read = lambda p: (pools.codes[p], pools.scale[p], pools.chan[p], pools.idx[p],  # noqa: E731
                              pools.kept[p])  # (the state at the call's start: run_jobs below replaces arrays' rows)
            written, at = [], 0
            for c, (length, old_page) in zip(counts, before):
                if c:
                    written += pages.append(length, old_page, plan.dst[at: at + c], new_k[at: at + c], read)
                at += c
            run_jobs(work, new_k, pools)
            stager.commit(work, book)
            stager.check()
            pages.check(written, pools.codes, pools.scale, pools.chan, pools.idx, pools.kept, pools.stage,
                        stager.stage_of)
            assert sorted(work.jobs[:, 0].tolist()) == sorted(written)
        elif op == "fork":
            live.append(book.fork(pick, int(rng.integers(0, book.length(pick) + 1)) if r % 2 else None))
        elif op == "truncate":
            book.truncate(pick, int(rng.integers(0, book.length(pick) + 1)))
            stager.release_unreferenced(book)
        else:
            book.free(pick)
            live.remove(pick)
            stager.release_unreferenced(book)
        stager.check()
        book.check()
        assert all(book.refcount[p] > 0 for p in stager.stage_of)
        # every live sequence's open last page (written since it was last full) has its exact copy
        for sid in live:
            n = book.length(sid)
            if n % ps:
                p = int(book.pages(sid)[-1])
                assert (p in stager.stage_of) == (pages.fill[p] < ps), (sid, p)


def test_planner_reopened_page_is_requantized_from_its_codes():
    """truncate into a full page, then append: the kept keys come back from their codes (a second
    rounding), the new key exactly; the error stays within the two steps."""
    ps, H, D, kind = 16, 1, 16, "int8"
    rng = np.random.default_rng(5)
    book, stager, pools = PageBook(4, ps), KeyStager(ps), Pools(4, ps, H, D, kind)
    sid = book.add_sequence()
    x = rng.standard_normal((ps, H, D)).astype(np.float32)
    for counts, k in (([ps], x), ):
        before = stager.before(book, [sid], counts)
        work = stager.plan(counts, before, book.plan_append([sid], counts).dst)
        run_jobs(work, k, pools)
        stager.commit(work, book)
    assert not stager.stage_of  # full: no staging copy
    def half_step(page):  # per channel: half a code step, or a kept channel's float16 rounding (2**-11 of max |x|)
        b = effective(pools.scale[page], pools.chan[page]).astype(np.float64) / 2
        b[np.arange(H)[:, None], pools.idx[page]] = 2.0**-11 * 1.001 * pools.scale[page][:, None] * CODE_MAX[kind]
        return b

    e_full = half_step(0)
    book.truncate(sid, 5)
    y = rng.standard_normal((1, H, D)).astype(np.float32)
    before = stager.before(book, [sid], [1])
    work = stager.plan([1], before, book.plan_append([sid], [1]).dst)
    assert work.jobs[0].tolist()[3:] == [0, 0] and (work.src[:5] < -work.stage_rows).all()  # source: page 0's codes
    run_jobs(work, y, pools)
    stager.commit(work, book)
    got = dequant_slots(pools.codes[0, :6], pools.scale[0], pools.chan[0], pools.idx[0], pools.kept[0, :6])
    want = np.concatenate([x[:5], y])
    assert (np.abs(got - want) <= (e_full + half_step(0))[None] * 1.001).all()
    assert stager.stage_of == {0: 0}

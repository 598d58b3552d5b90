"""The NumPy-in/NumPy-out pipeline (``pyattn.pipeline.chunks`` and ``pyattn.pipeline.host``).

CPU tests: the chunk planner; the claim that query-row chunks (with the causal key prefix) are
independent problems, checked against the fp64 reference; the threaded host copies; and the whole
pipeline run against a fake GPU whose streams execute their work lazily (only when an event or
stream is waited on), so a missing wait or a staging buffer reused too early shows up as wrong
numbers. GPU tests (marked ``gpu``) compare the real chunked path with the fp64 reference.
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _problems import problem
from pyattn import DeviceArray
from pyattn.pipeline import chunks, host, transfer
from pyattn.pipeline.chunks import Chunk, plan_chunks, prepare_mask, row_chunkable
from pyattn.pipeline.transfer import addr
from pyattn.reference import attention_ref

ml_dtypes = pytest.importorskip("ml_dtypes")

MiB = 1 << 20


# -- planner ---------------------------------------------------------------------------------------


def test_split_range_covers_evenly():
    for n in range(0, 40):
        for parts in range(1, 12):
            r = transfer.split_range(n, parts)
            assert r[0][0] == 0 and r[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [b - a for a, b in r]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert len(r) == max(1, min(parts, n))


@pytest.fixture
def planner(monkeypatch):
    """Fixed planner constants, so these tests do not follow tuning."""
    for name, value in {"_MIN_PIPELINE_BYTES": 8 * MiB, "_CHUNK_BYTES": 4 * MiB, "_MAX_CHUNKS": 64}.items():
        monkeypatch.setattr(chunks, name, value)


def _p(B=1, Sq=4096, Sk=4096, Hq=16, Hkv=16, D=128, **kw):
    q, kv = np.empty((B, Sq, Hq, D), np.float16), np.empty((B, Sk, Hkv, D), np.float16)
    return problem(q, kv, kv, **kw)


def test_small_calls_are_one_chunk(planner):
    assert plan_chunks(_p(B=16), 8 * MiB - 1) == [Chunk(0, 16, 0, 4096, 4096, 0)]
    assert plan_chunks(_p(B=1, Sq=1), 10**9) == [Chunk(0, 1, 0, 1, 4096, 0)]  # one row: nothing to split


def test_batch_chunks_when_there_is_a_batch(planner):
    cs = plan_chunks(_p(B=32), 64 * MiB)  # 16 chunks wanted
    assert len(cs) == 16 and cs[0].b0 == 0 and cs[-1].b1 == 32 and all(c.s0 == 0 and c.s1 == 4096 for c in cs)
    assert len(plan_chunks(_p(B=2), 64 * MiB)) == 2  # fewer entries than chunks wanted: one each


def test_row_chunks_of_one_sequence(planner):
    cs = plan_chunks(_p(), 64 * MiB)
    assert len(cs) == 16 and cs[-1].s1 == 4096 and all(c.kv_len == 4096 and c.causal == 0 for c in cs)
    cs = plan_chunks(_p(Sq=1000, Sk=3000, causal=True), 64 * MiB)  # the causal prefix of each chunk
    assert all(c.kv_len == c.s1 + 2000 and c.causal == 1 for c in cs)
    cs = plan_chunks(_p(Sq=3000, Sk=1000, causal=True), 64 * MiB)  # early rows see no key at all
    assert cs[0].kv_len == 0 and all(c.kv_len == max(0, min(c.s1 - 2000, 1000)) for c in cs)
    cs = plan_chunks(_p(causal="top_left"), 64 * MiB)  # Sq == Sk: top-left is bottom-right
    assert len(cs) == 16 and all(c.causal == 1 and c.kv_len == c.s1 for c in cs)


def test_calls_that_rows_cannot_split_are_one_chunk(planner):
    for kw in (dict(window=(128, 0)), dict(alibi_slopes=np.ones(16, np.float32)),
               dict(causal="top_left", Sk=5000)):
        assert len(plan_chunks(_p(**kw), 64 * MiB)) == 1, kw
    assert len(plan_chunks(_p(causal=True, window=(128, 0), alibi_slopes=np.ones(16, np.float32)), 64 * MiB)) == 16


def test_chunk_count_is_bounded(planner):
    assert len(plan_chunks(_p(B=4096, Sq=8, Sk=8, Hq=1, Hkv=1, D=8), 100 * 1024 * MiB)) == 64


# -- row chunks reproduce the whole (the reason row_chunkable says what it says) ---------------------


@settings(max_examples=120, deadline=None)
@given(Sq=st.integers(1, 24), Sk=st.integers(0, 24), causal=st.sampled_from([False, True, "top_left"]),
       window=st.sampled_from([None, (3, 0), (2, 5), (-1, 1)]), alibi=st.booleans(),
       mask=st.sampled_from([None, "rows", "full", "keys"]), parts=st.integers(2, 5), seed=st.integers(0, 2**16))
def test_row_chunks_reproduce_the_whole(Sq, Sk, causal, window, alibi, mask, parts, seed):
    rng = np.random.default_rng(seed)
    Hq, Hkv, D = 4, 2, 8
    q, k, v = rng.standard_normal((1, Sq, Hq, D)), rng.standard_normal((1, Sk, Hkv, D)), rng.standard_normal((1, Sk, Hkv, D))
    opts = {"causal": causal, "window": window}
    if alibi:
        opts["alibi_slopes"] = rng.random(Hq)
    if mask is not None:
        shape = {"rows": (1, 1, Sq, 1), "full": (1, Hq, Sq, Sk), "keys": (1, 1, 1, Sk)}[mask]
        opts["mask"] = rng.random(shape) > 0.2
    P = problem(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), **opts)
    if not row_chunkable(P):
        return
    whole, whole_lse = attention_ref(q, k, v, return_lse=True, **opts)
    mask4, _ = prepare_mask(opts.get("mask"), (1, Hq, Sq, Sk))
    code = 1 if P.causal else 0
    for s0, s1 in transfer.split_range(Sq, parts):
        kv_len = Sk if not code else min(max(s1 + Sk - Sq, 0), Sk)
        copts = dict(opts, causal=bool(code))
        if mask4 is not None:
            m = mask4[:, :, s0:s1] if mask4.shape[2] > 1 else mask4
            copts["mask"] = m[..., :kv_len] if m.shape[3] > 1 else m
        o, lse = attention_ref(q[:, s0:s1], k[:, :kv_len], v[:, :kv_len], return_lse=True, **copts)
        np.testing.assert_allclose(o, whole[:, s0:s1], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(whole_lse[:, :, s0:s1]))
        fin = np.isfinite(lse)
        np.testing.assert_allclose(lse[fin], whole_lse[:, :, s0:s1][fin], rtol=1e-12, atol=1e-12)


def test_prepare_mask():
    shape = (2, 4, 5, 6)
    m, dt = prepare_mask(np.ones((5, 6)), shape)
    assert m.shape == (1, 1, 5, 6) and dt == np.float32
    m, dt = prepare_mask(np.broadcast_to(np.ones((2, 1, 1, 6), bool), shape), shape)
    assert m.shape == (2, 1, 1, 6) and dt == np.bool_  # broadcast (stride 0) axes shrink to 1
    m, dt = prepare_mask(np.zeros(shape, np.float16), shape)
    assert m.shape == shape and dt == np.float16
    assert prepare_mask(None, shape) == (None, None)


# -- threaded host copies -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.bool_])
def test_threaded_copies_of_strided_slices(monkeypatch, dtype):
    monkeypatch.setattr(transfer, "PIECE_BYTES", 512)
    rng = np.random.default_rng(1)
    src = (rng.standard_normal((2, 300, 8, 32)) > 0) if dtype is np.bool_ else \
        rng.standard_normal((2, 300, 8, 32)).astype(dtype)
    part = src[:, :, 2:6]  # a head slice: strided
    dst = np.empty(part.shape, part.dtype)
    futures = transfer.start_copies([(dst, part)])
    assert len(futures) > 1
    transfer.finish_copies(futures)
    assert np.array_equal(dst.view(np.uint8), np.ascontiguousarray(part).view(np.uint8))
    back = np.zeros_like(src)
    transfer.finish_copies(transfer.start_copies([(back[:, :, 2:6], dst)]))
    assert np.array_equal(back[:, :, 2:6].view(np.uint8), part.view(np.uint8))
    assert not back[:, :, :2].view(np.uint8).any() and not back[:, :, 6:].view(np.uint8).any()


def test_casting_copy():
    src = np.linspace(-3, 3, 4096).reshape(64, 64)
    dst = np.empty((64, 64), np.float32)
    transfer.finish_copies(transfer.start_copies([(dst, src)]))
    np.testing.assert_array_equal(dst, src.astype(np.float32))


# -- the whole pipeline on a fake GPU -------------------------------------------------------------
from fake_gpu import DEV, FakeAttention, fake_pipeline  # noqa: E402
from pyattn.runtime import memory


@pytest.fixture(params=["lazy", "mixed", "lazy, workers send", "mixed, workers send"])
def fake_gpu(monkeypatch, request):
    """Both ways an upload orders its copies (``host._SIGNALS``): flags set by the workers (x86-64), or
    each worker queueing its own piece's copy (elsewhere)."""
    monkeypatch.setattr(host, "_SIGNALS", not request.param.endswith("workers send"))
    return fake_pipeline(monkeypatch, eager_every=3 if request.param.startswith("mixed") else 0)


def _qkv(rng, B, Sq, Sk, Hq, Hkv, D, layout, dtype=np.float32):
    def shape(S, H):
        return (B, S, H, D) if layout == "bshd" else (B, H, S, D)

    return (rng.standard_normal(shape(Sq, Hq)).astype(dtype), rng.standard_normal(shape(Sk, Hkv)).astype(dtype),
            rng.standard_normal(shape(Sk, Hkv)).astype(dtype))


CASES = [  # B, Sq, Sk, Hq, Hkv, layout, options (mask / alibi shapes, causal, window)
    (1, 33, 47, 8, 4, "bshd", {}),  # rows, full K/V
    (1, 40, 47, 8, 4, "bhsd", {"causal": True, "mask": (1, 8, 40, 47), "alibi": (8,)}),  # rows, causal prefixes
    (1, 31, 31, 4, 2, "bshd", {"causal": "top_left", "window": (5, 0)}),  # rows (Sq == Sk)
    (1, 25, 30, 4, 2, "bhsd", {"window": (4, 4)}),  # one sequence that rows cannot split: one chunk
    (5, 20, 20, 4, 1, "bshd", {"mask": (5, 1, 20, 20), "alibi": (5, 4)}),  # batch chunks
    (5, 20, 31, 6, 3, "bhsd", {"mask": (20, 31), "alibi": (5, 6), "causal": True}),
    (3, 5, 0, 4, 2, "bshd", {"alibi": (4,)}),  # no keys: output 0, LSE -inf
    (3, 0, 6, 4, 2, "bhsd", {"mask": (1, 1, 0, 6)}),  # no queries
]


def _options(rng, case):
    B, Sq, Sk, Hq, Hkv, layout, spec = case
    opts = {"scale": 0.3, "causal": spec.get("causal", False), "window": spec.get("window")}
    if "mask" in spec:
        opts["mask"] = np.where(rng.random(spec["mask"]) > 0.2, 0.0, -np.inf)  # float64: staged as float32
    if "alibi" in spec:
        opts["alibi_slopes"] = rng.random(spec["alibi"])
    return opts


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 1 << 40])
def test_pipeline_on_fake_gpu(fake_gpu, monkeypatch, case, chunk_bytes):
    caller, fake = fake_gpu
    monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 0 if chunk_bytes < (1 << 40) else 1 << 40)
    monkeypatch.setattr(chunks, "_CHUNK_BYTES", max(chunk_bytes, 1))
    rng = np.random.default_rng(2)
    B, Sq, Sk, Hq, Hkv, layout, _ = case
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, 16, layout)
    q = np.asfortranarray(q)  # strided host inputs are fine
    opts = _options(rng, case)
    P = problem(q, k, v, layout=layout, **opts)
    out, lse = chunks.attention_numpy(P, q, k, v, mask=opts.get("mask"), alibi_slopes=opts.get("alibi_slopes"),
                                      options={"window": opts["window"], "scale": 0.3}, return_lse=True,
                                      stream=None)
    ref, ref_lse = attention_ref(q, k, v, layout=layout, return_lse=True, **opts)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    if chunk_bytes == 1:  # as many chunks as the planner can make: batch entries, or query rows up to 64
        assert len(fake.calls) == len(plan_chunks(P, 1 << 50))
    elif chunk_bytes == 1 << 40:
        assert len(fake.calls) == 1
    if len(fake.calls) == 1:
        assert fake.calls[0][0] is caller  # one chunk: on the caller's stream
    else:
        assert all(s is not caller for s, _, _ in fake.calls)
    # the second call reuses the streams and pinned buffers, and may write into a given (strided) array
    out2 = np.full(out.shape[::-1], np.nan, out.dtype).T
    res, _ = chunks.attention_numpy(P, q, k, v, mask=opts.get("mask"), alibi_slopes=opts.get("alibi_slopes"),
                                    options={"window": opts["window"], "scale": 0.3}, return_lse=False,
                                    stream=None, out=out2)
    assert res is out2
    np.testing.assert_array_equal(out2, out)


def test_pipeline_error_leaves_it_usable(fake_gpu, monkeypatch):
    _, fake = fake_gpu
    monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 0)
    monkeypatch.setattr(chunks, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 4, 16, 16, 2, 2, 16, "bshd")
    P = problem(q, k, v)
    fake.fail_on_call = 2
    with pytest.raises(ValueError, match="refused"):
        chunks.attention_numpy(P, q, k, v, mask=None, alibi_slopes=None, options={}, return_lse=False, stream=None)
    fake.fail_on_call = None
    out, _ = chunks.attention_numpy(P, q, k, v, mask=None, alibi_slopes=None, options={}, return_lse=False,
                                    stream=None)
    np.testing.assert_allclose(out, attention_ref(q, k, v), rtol=2e-5, atol=2e-5)


def test_failed_staging_copy_raises_and_frees_the_stream(fake_gpu, monkeypatch):
    """A worker's copy that fails (here the 5th piece of several waves) raises from the call; with
    flags, every flag is then set, so no stream is left waiting for a piece nobody stages; the
    next call works."""
    caller, _ = fake_gpu
    from fake_gpu import host_view

    rng = np.random.default_rng(12)
    a = rng.standard_normal((1, 400, 3, 8)).astype(np.float32)
    real_copy, n = host.copy_into, [0]

    def copy(dst, src):
        n[0] += 1
        if n[0] == 5:
            raise MemoryError("staging copy failed")
        real_copy(dst, src)
    monkeypatch.setattr(host, "copy_into", copy)

    def fn(dev, s):
        (da,), out = dev, FakeAttention.array(a.shape, a.dtype, s)
        s.enqueue(lambda: host_view(out).__setitem__(..., host_view(da) + 1))
        return (out,)

    with pytest.raises(MemoryError, match="staging copy failed"):
        host.call(fn, [a], [], caller)
    caller.synchronize()  # would fail (a flag never set) if the stream were left waiting
    monkeypatch.setattr(host, "copy_into", real_copy)
    (res,) = host.call(fn, [a], [], caller)
    np.testing.assert_array_equal(res, a + 1)


def test_signalled_upload_workers_make_no_driver_call(fake_gpu, monkeypatch):
    """With flags (x86-64), every H2D copy of a staged piece is queued by the calling thread, behind
    a wait on that piece's flag; the workers only copy."""
    caller, _ = fake_gpu
    if not host._SIGNALS:
        pytest.skip("the workers queue their own copies on this path")
    from fake_gpu import COPIES

    callers = set()
    real_h2d = host.h2d
    monkeypatch.setattr(host, "h2d", lambda *a: callers.add(threading.get_ident()) or real_h2d(*a))
    a = np.random.default_rng(13).standard_normal((1, 400, 3, 8)).astype(np.float32)
    COPIES.clear()
    (res,) = host.call(lambda dev, s: dev, [a], [], caller)
    np.testing.assert_array_equal(res, a)
    assert callers == {threading.get_ident()}
    sent = [c for c in COPIES if c in ("wait", "h2d")]
    assert len(sent) >= 2 * (a.nbytes // 1024) and sent == ["wait", "h2d"] * (len(sent) // 2)


def test_device_mask_is_passed_through_in_one_chunk(fake_gpu, monkeypatch):
    from fake_gpu import MEM, host_view

    _, fake = fake_gpu
    monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 0)
    monkeypatch.setattr(chunks, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 3, 16, 20, 4, 2, 16, "bshd")
    host_mask = rng.random((3, 1, 16, 20)) > 0.3
    block = MEM.block(host_mask.nbytes)
    dmask = DeviceArray(block.__array_interface__["data"][0], host_mask.shape, np.bool_, DEV)
    host_view(dmask)[...] = host_mask
    P = problem(q, k, v)  # (the op validates the device mask; the pipeline passes it through)
    out, _ = chunks.attention_numpy(P, q, k, v, mask=dmask, alibi_slopes=np.ones(4), options={}, return_lse=False,
                                    stream=None)
    assert len(fake.calls) == 1 and fake.calls[0][2]["mask"] is dmask
    ref = attention_ref(q, k, v, mask=host_mask, alibi_slopes=np.ones(4))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_upload_waves_and_download(fake_gpu, monkeypatch):
    """``host.call``: inputs staged by the workers in waves (each piece its own H2D), results back,
    ``outs`` filled."""
    caller, _ = fake_gpu
    from fake_gpu import COPIES, host_view

    COPIES.clear()
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((1, 400, 3, 8)).astype(np.float32), rng.integers(0, 9, 13).astype(np.int32)

    def fn(dev, s):
        (da, db), out = dev, FakeAttention.array(a.shape, a.dtype, s)

        def work():
            host_view(out)[...] = host_view(da) * 2 + host_view(db)[0]
        s.enqueue(work)
        return (out,)

    (res,) = host.call(fn, [a, b], [], caller)
    np.testing.assert_array_equal(res, (a * 2 + b[0]).astype(np.float32))
    assert COPIES.count("h2d") >= a.nbytes // 1024  # 38 KB of a in 1 KB pieces, 8 KB waves
    given = np.full(a.shape, np.nan, np.float32)
    (res,) = host.call(fn, [a, b], [given], caller)
    assert res is given and np.array_equal(given, (a * 2 + b[0]).astype(np.float32))


def test_pinned_inputs_are_sent_in_place(fake_gpu, monkeypatch):
    """An input in pyattn's pinned memory (``is_pinned``) is sent by the DMA from its own address,
    piece by piece, with no staging copy; a strided view of it, or another dtype, is staged as before."""
    caller, _ = fake_gpu
    from fake_gpu import COPIES, host_view

    rng = np.random.default_rng(10)
    a = rng.standard_normal((1, 400, 3, 8)).astype(np.float32)
    b = rng.standard_normal((300, 4)).astype(np.float32)[:, ::2]  # strided: staged even when "pinned"
    pinned = {id(a), id(b)}
    monkeypatch.setattr(host, "is_pinned", lambda x: id(x) in pinned)
    sources = []  # the host address of every H2D copy
    real_h2d = host.h2d
    monkeypatch.setattr(host, "h2d", lambda dp, sp, n, s: sources.append(sp) or real_h2d(dp, sp, n, s))

    def fn(dev, s):
        (da, db), out = dev, FakeAttention.array(a.shape, a.dtype, s)

        def work():
            host_view(out)[...] = host_view(da) * 2 + host_view(db)[0, 0]
        s.enqueue(work)
        return (out,)

    COPIES.clear()
    (res,) = host.call(fn, [a, b], [], caller)
    np.testing.assert_array_equal(res, (a * 2 + b[0, 0]).astype(np.float32))
    in_place = [sp for sp in sources if addr(a) <= sp < addr(a) + a.nbytes]
    assert len(in_place) >= a.nbytes // 1024  # a's 1 KB pieces, from a itself
    assert len(sources) > len(in_place)  # b's pieces went through staging


def test_pinned_inputs_launch_each_chunk_as_its_rows_are_queued(fake_gpu, monkeypatch):
    """With every input pinned, a query-row chunk is launched right after its own rows' copies are
    queued, before the next chunk's: its event then does not wait for copies it does not read."""
    _, fake = fake_gpu
    monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 0)
    monkeypatch.setattr(chunks, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 1, 64, 48, 4, 2, 16, "bshd")
    monkeypatch.setattr(host, "is_pinned", lambda x: True)
    log = []
    real_h2d, real_call = host.h2d, FakeAttention.__call__
    monkeypatch.setattr(host, "h2d", lambda *a: log.append("h2d") or real_h2d(*a))
    monkeypatch.setattr(FakeAttention, "__call__", lambda self, *a, **kw: log.append("launch") or
                        real_call(self, *a, **kw))
    P = problem(q, k, v)
    out, _ = chunks.attention_numpy(P, q, k, v, mask=None, alibi_slopes=None, options={}, return_lse=False,
                                    stream=None)
    np.testing.assert_allclose(out, attention_ref(q, k, v), rtol=2e-5, atol=2e-5)
    n = len(fake.calls)
    assert n > 1 and log.count("launch") == n
    last_h2d = len(log) - 1 - log[::-1].index("h2d")
    assert log.index("launch") < last_h2d  # the first chunk went before the last rows were queued


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 7), min_size=0, max_size=4), itemsize=st.sampled_from([1, 2, 4]),
       target=st.integers(1, 300))
def test_cuts_tile_the_array_in_contiguous_pieces(shape, itemsize, target):
    """``transfer.cuts``: pieces in memory order, each contiguous, together the whole array, none larger
    than ``target`` unless a single element is."""
    shape = tuple(shape)
    a = np.arange(math.prod(shape) * itemsize, dtype=np.uint8).view(f"u{itemsize}").reshape(shape)
    pieces = transfer.cuts(shape, itemsize, target)
    pos = 0
    for idx, off, pshape in pieces:
        piece = a[idx] if idx else a
        assert piece.shape == pshape and piece.flags.c_contiguous
        assert off == pos and (piece.size == 0 or addr(piece) - addr(a) == off)
        assert piece.nbytes <= max(target, itemsize) or len(pieces) == 1 and a.nbytes <= target
        pos += piece.nbytes
    assert pos == a.nbytes


# -- on a real GPU --------------------------------------------------------------------------------


from test_gpu_attention import _has_gpu  # noqa: E402


GPU_CASES = [  # B, Sq, Sk, Hq, Hkv, D, dtype, layout, options builder
    (1, 200, 300, 16, 4, 64, "float16", "bshd", lambda r, s: {"causal": True}),  # GQA, row chunks, causal prefixes
    (1, 128, 128, 32, 32, 128, "bfloat16", "bhsd", lambda r, s: {}),  # B=1, row chunks, 2-D result copies
    (6, 150, 150, 4, 2, 64, "float16", "bhsd", lambda r, s: {"causal": True}),  # batch chunks, bhsd
    (1, 100, 170, 8, 4, 64, "float16", "bshd",  # mask broadcast over heads, (B, Hq) ALiBi: one chunk
     lambda r, s: {"mask": r.random((s[0], 1, s[1], s[2])) > 0.2, "alibi_slopes": r.random((s[0], s[3]))}),
    (4, 90, 90, 4, 4, 128, "bfloat16", "bhsd",  # float mask broadcast over the batch, ALiBi (B, Hq)
     lambda r, s: {"mask": np.where(r.random((1, s[3], s[1], s[2])) > 0.1, 0.0, -np.inf).astype(np.float32),
                   "alibi_slopes": r.random((s[0], s[3])), "causal": True}),
]


@pytest.mark.parametrize("B, Sq, Sk, Hq, Hkv, D, dtype, layout, make_opts", GPU_CASES)
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("return_lse", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")
def test_gpu_pipeline_matches_reference(monkeypatch, B, Sq, Sk, Hq, Hkv, D, dtype, layout, make_opts, chunked,
                                        return_lse):
    import pyattn
    from pyattn.reference import error_bound

    monkeypatch.setattr(memory, "POISON_ALLOC", True)
    if chunked:
        monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 0)
        monkeypatch.setattr(chunks, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(4)
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D, layout, np.float32)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    opts = make_opts(rng, (B, Sq, Sk, Hq))
    res = pyattn.attention(q, k, v, layout=layout, return_lse=return_lse, **opts)
    out, lse = res if return_lse else (res, None)
    ref, ref_lse = attention_ref(q, k, v, layout=layout, return_lse=True, **opts)
    assert out.dtype == q.dtype and out.shape == ref.shape and not np.isnan(out.astype(np.float64)).any()
    err = np.abs(out.astype(np.float64) - ref).max()
    assert err <= error_bound(q, k, v, layout=layout, **opts)
    if return_lse:
        assert lse.dtype == np.float32 and lse.shape == (B, Hq, Sq)
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isneginf(lse), ~finite)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")
def test_gpu_default_chunking_at_size(monkeypatch):
    """The default planner on a PCIe-sized call (64 MiB, row chunks with causal prefixes), against the
    reference on a few heads, on a caller's stream, and equal to the one-chunk path."""
    import pyattn
    from pyattn.reference import error_bound

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 4096, 16, 128)).astype(np.float16) for _ in range(3))
    with pyattn.Stream() as s:
        out, lse = pyattn.attention(q, k, v, causal=True, return_lse=True, stream=s)
        s.synchronize()
    for h in (0, 7, 15):
        sl = (slice(None), slice(None), slice(h, h + 1))
        ref, ref_lse = attention_ref(q[sl], k[sl], v[sl], causal=True, return_lse=True)
        assert np.abs(out[sl].astype(np.float64) - ref).max() <= error_bound(q[sl], k[sl], v[sl], causal=True)
        np.testing.assert_allclose(lse[:, h], ref_lse[:, 0], rtol=1e-3, atol=1e-3)
    monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 1 << 62)
    one, one_lse = pyattn.attention(q, k, v, causal=True, return_lse=True)
    # chunks are independent problems (each row's keys, scores and order of work are the same), so
    # the numbers agree up to the tile grid's different row blocking
    np.testing.assert_allclose(out.astype(np.float32), one.astype(np.float32), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, one_lse, rtol=1e-5, atol=1e-5)

"""The NumPy-in/NumPy-out pipeline (``pyattn.pipeline.chunks`` and ``pyattn.pipeline.host``) run
whole against a fake GPU (``fake_gpu.py``) whose streams execute their work lazily (only when an
event or stream is waited on), so a missing wait or a staging buffer reused too early shows up as
wrong numbers: chunked calls against the fp64 reference, errors that leave it usable, staging
uploads in waves, signalled uploads, device masks, and pinned inputs sent in place. CPU only.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _host_pipeline_helpers import _qkv
from _problems import problem
from fake_gpu import DEV, FakeAttention, fake_pipeline
from pyattn import DeviceArray
from pyattn.pipeline import chunks, host
from pyattn.pipeline.chunks import plan_chunks
from pyattn.pipeline.transfer import addr
from pyattn.reference import attention_ref


@pytest.fixture(params=["lazy", "mixed", "lazy, workers send", "mixed, workers send"])
def fake_gpu(monkeypatch, request):
    """Both ways an upload orders its copies (``host._SIGNALS``): flags set by the workers (x86-64), or
    each worker queueing its own piece's copy (elsewhere)."""
    monkeypatch.setattr(host, "_SIGNALS", not request.param.endswith("workers send"))
    return fake_pipeline(monkeypatch, eager_every=3 if request.param.startswith("mixed") else 0)


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

"""The NumPy-in/NumPy-out pipeline (``pyattn.ops._host``).

CPU tests: the chunk planner, chunk slicing (GQA groups, mask and ALiBi slices) checked against
the reference, the threaded host copies, and the whole pipeline run against a fake GPU whose
streams execute their work lazily (only when an event or stream is waited on), so a missing wait
or a staging buffer reused too early shows up as wrong numbers. GPU tests (marked ``gpu``) compare
the real chunked path with the fp64 reference.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pyattn import DeviceArray
from pyattn.ops import _host
from pyattn.ops._host import Chunk, chunk_index, plan_chunks, prepare_alibi, prepare_mask, slice_alibi, slice_mask, split_range
from pyattn.reference import attention_ref

ml_dtypes = pytest.importorskip("ml_dtypes")

MiB = 1 << 20


# -- planner ---------------------------------------------------------------------------------------


def test_split_range_covers_evenly():
    for n in range(0, 40):
        for parts in range(1, 12):
            r = split_range(n, parts)
            assert r[0][0] == 0 and r[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [b - a for a, b in r]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert len(r) == max(1, min(parts, n))


@pytest.fixture(autouse=True)
def _head_chunks(monkeypatch):
    """Head-axis chunks are off by default (slower on the measured host, see _host); these tests
    exercise the pipeline machinery, head chunks included."""
    monkeypatch.setattr(_host, "_CHUNK_HEADS", True)


def test_head_chunks_are_off_by_default(monkeypatch):
    monkeypatch.setattr(_host, "_CHUNK_HEADS", False)
    assert plan_chunks(1, 16, 1 << 30) == [Chunk("batch", 0, 1)]
    assert [c.axis for c in plan_chunks(8, 16, 1 << 30)] == ["batch"] * 8


@pytest.fixture
def planner(monkeypatch):
    """Fixed planner constants, so these tests do not follow tuning."""
    for name, value in {"_MIN_PIPELINE_BYTES": 8 * MiB, "_CHUNK_BYTES": 4 * MiB, "_MAX_CHUNKS": 64,
                        "_CHUNK_HEADS": True}.items():
        monkeypatch.setattr(_host, name, value)


def test_small_calls_are_one_chunk(planner):
    assert plan_chunks(16, 16, 8 * MiB - 1) == [Chunk("batch", 0, 16)]
    assert plan_chunks(0, 4, 10**9) == [Chunk("batch", 0, 0)]
    assert plan_chunks(1, 1, 10**9) == [Chunk("batch", 0, 1)]  # nothing to split


def test_batch_split_when_batch_is_large(planner):
    chunks = plan_chunks(32, 8, 64 * MiB)  # 16 chunks wanted
    assert {c.axis for c in chunks} == {"batch"} and len(chunks) == 16
    assert chunks[0].start == 0 and chunks[-1].stop == 32


def test_head_split_when_batch_is_small(planner):
    chunks = plan_chunks(1, 16, 64 * MiB)
    assert [c.axis for c in chunks] == ["heads"] * 16 and chunks[-1] == Chunk("heads", 15, 16)
    chunks = plan_chunks(2, 32, 32 * MiB)  # 8 wanted: heads give 8, batch only 2
    assert len(chunks) == 8 and chunks[0].axis == "heads"
    # MQA with a small batch: the batch is all there is to split
    assert plan_chunks(2, 1, 64 * MiB) == [Chunk("batch", 0, 1), Chunk("batch", 1, 2)]


def test_chunk_count_is_bounded(planner):
    chunks = plan_chunks(4096, 8, 100 * 1024 * MiB)
    assert len(chunks) == 64


# -- slicing against the reference ----------------------------------------------------------------


def _qkv(rng, B, Sq, Sk, Hq, Hkv, D, layout, dtype=np.float32):
    def shape(S, H):
        return (B, S, H, D) if layout == "bshd" else (B, H, S, D)

    return (rng.standard_normal(shape(Sq, Hq)).astype(dtype), rng.standard_normal(shape(Sk, Hkv)).astype(dtype),
            rng.standard_normal(shape(Sk, Hkv)).astype(dtype))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("axis", ["batch", "heads"])
@pytest.mark.parametrize("mask_shape", [None, (3, 1, 5, 7), (1, 6, 1, 7), (5, 7), (3, 6, 5, 7)])
@pytest.mark.parametrize("alibi_shape", [None, (6,), (3, 6)])
def test_chunk_slices_reproduce_the_whole(layout, axis, mask_shape, alibi_shape):
    """Each chunk computed alone (its q/k/v/mask/alibi slices) equals its slice of the whole."""
    rng = np.random.default_rng(0)
    B, Sq, Sk, Hq, Hkv = 3, 5, 7, 6, 2
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, 8, layout)
    opts = {"causal": True}
    if mask_shape is not None:
        opts["mask"] = rng.random(mask_shape) > 0.3
    if alibi_shape is not None:
        opts["alibi_slopes"] = rng.random(alibi_shape)
    ref, ref_lse = attention_ref(q, k, v, layout=layout, return_lse=True, **opts)
    group = Hq // Hkv
    units = B if axis == "batch" else Hkv
    mask4 = prepare_mask(opts.get("mask"), (B, Hq, Sq, Sk))[0]
    for a, b in split_range(units, units):
        c = Chunk(axis, a, b)
        qi, ki, li = chunk_index(c, layout, group)
        copts = {"causal": True}
        if mask4 is not None:
            copts["mask"] = slice_mask(mask4, c, group)
        if alibi_shape is not None:
            copts["alibi_slopes"] = slice_alibi(opts["alibi_slopes"], c, group)
        o, lse = attention_ref(q[qi], k[ki], v[ki], layout=layout, return_lse=True, **copts)
        np.testing.assert_allclose(o, ref[qi], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse[li], rtol=1e-12, atol=1e-12)


def test_prepare_mask():
    shape = (2, 4, 5, 6)
    m, dt = prepare_mask(np.ones((5, 6)), shape)
    assert m.shape == (1, 1, 5, 6) and dt == np.float32
    m, dt = prepare_mask(np.broadcast_to(np.ones((2, 1, 1, 6), bool), shape), shape)
    assert m.shape == (2, 1, 1, 6) and dt == np.bool_  # broadcast (stride 0) axes shrink to 1
    m, dt = prepare_mask(np.zeros(shape, np.float16), shape)
    assert m.shape == shape and dt == np.float16
    assert prepare_mask(None, shape) == (None, None)
    with pytest.raises(ValueError, match="^mask: "):
        prepare_mask(np.ones((3, 6)), shape)
    with pytest.raises(ValueError, match="^mask: "):
        prepare_mask(np.ones((1, 2, 4, 5, 6)), shape)


def test_prepare_alibi():
    s, dt = prepare_alibi(np.ones(4), 2, 4)
    assert s.shape == (4,) and dt == np.float32
    s, dt = prepare_alibi(np.ones((2, 4), ml_dtypes.bfloat16), 2, 4)
    assert dt == np.float32
    with pytest.raises(ValueError, match="^alibi_slopes: "):
        prepare_alibi(np.ones(3), 2, 4)


# -- threaded host copies -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.bool_])
def test_threaded_copies_of_strided_slices(monkeypatch, dtype):
    monkeypatch.setattr(_host, "_PIECE_BYTES", 512)
    rng = np.random.default_rng(1)
    src = (rng.standard_normal((2, 300, 8, 32)) > 0) if dtype is np.bool_ else \
        rng.standard_normal((2, 300, 8, 32)).astype(dtype)
    part = src[:, :, 2:6]  # a head slice: strided
    dst = np.empty(part.shape, part.dtype)
    futures = _host._start_copies([(dst, part)])
    assert len(futures) > 1
    _host._finish_copies(futures)
    assert np.array_equal(dst.view(np.uint8), np.ascontiguousarray(part).view(np.uint8))
    back = np.zeros_like(src)
    _host._finish_copies(_host._start_copies([(back[:, :, 2:6], dst)]))
    assert np.array_equal(back[:, :, 2:6].view(np.uint8), part.view(np.uint8))
    assert not back[:, :, :2].view(np.uint8).any() and not back[:, :, 6:].view(np.uint8).any()


def test_casting_copy():
    src = np.linspace(-3, 3, 4096).reshape(64, 64)
    dst = np.empty((64, 64), np.float32)
    _host._finish_copies(_host._start_copies([(dst, src)]))
    np.testing.assert_array_equal(dst, src.astype(np.float32))


# -- the whole pipeline on a fake GPU -------------------------------------------------------------


class FakeDevice:
    ordinal = 0

    def activate(self):
        pass


class FakeStream:
    """Runs its queued work only when something waits for it, like a GPU that is always late;
    or, when ``eager``, at once, like a GPU with nothing else to do (a mix of both exposes a
    missing wait between streams)."""

    eager_every = 0  # with n > 0, every n-th stream made is eager
    made = 0

    def __init__(self, device=None, name="pipeline"):
        self.device, self.name, self.ops, self.done = device, name, [], 0
        self.handle = self.ptr = id(self)
        FakeStream.made += 1
        self.eager = bool(self.eager_every) and FakeStream.made % self.eager_every == 0

    def enqueue(self, fn):
        self.ops.append(fn)
        if self.eager:
            self.flush()

    def flush(self, upto=None):
        upto = len(self.ops) if upto is None else upto
        while self.done < upto:
            self.done += 1
            self.ops[self.done - 1]()

    def record(self, event=None, *, timing=False):
        event = event if event is not None else FakeEvent()
        event.stream, event.pos = self, len(self.ops)
        return event

    def wait(self, event):
        if event.stream is not None:
            other, pos = event.stream, event.pos
            self.enqueue(lambda: other.flush(pos))

    def synchronize(self):
        self.flush()


class FakeEvent:
    def __init__(self, device=None, *, timing=False):
        self.stream, self.pos = None, 0

    def synchronize(self):
        if self.stream is not None:
            self.stream.flush(self.pos)


class FakeMemory:
    """Host memory standing for device memory and pinned memory, filled with garbage."""

    def __init__(self):
        self.blocks = []

    def block(self, nbytes):
        a = np.full(max(int(nbytes), 1) + 256, 0xA5, np.uint8)
        self.blocks.append(a)
        start = -a.ctypes.data % 256  # 256-byte aligned, as the driver's allocations are
        return a[start:start + max(int(nbytes), 1)]


class FakePinned:
    def __init__(self, nbytes):
        self.nbytes = int(nbytes)
        self._a = MEM.block(nbytes)
        self.ptr = self._a.ctypes.data
        self.closed = False

    def array(self, dtype, shape):
        assert not self.closed, "pinned buffer used after close"
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self._a[:n].view(dtype).reshape(shape)

    def close(self):
        self.closed = True


class FakeAllocation:
    def __init__(self, nbytes):
        self._a = MEM.block(nbytes)
        self.ptr = self._a.ctypes.data if nbytes else 0
        self.nbytes = nbytes


class FakePool:
    def allocate(self, nbytes, stream):
        return FakeAllocation(nbytes)


MEM = FakeMemory()
DEV = FakeDevice()


def _host_view(d):
    if d.nbytes == 0:
        return np.empty(d.shape, d.dtype)
    raw = (ctypes.c_char * d.nbytes).from_address(d.ptr)
    return np.ndarray(d.shape, d.dtype, buffer=raw, strides=d.strides)


def _memcpy(dst, src, n, stream):
    if n:
        stream.enqueue(lambda: ctypes.memmove(dst, src, n))


class FakeAttention:
    """The device path: checks its arguments, queues the reference computation on the stream."""

    def __init__(self, fail_on_call=None):
        self.calls, self.fail_on_call = [], fail_on_call

    def __call__(self, q, k, v, *, stream, layout, return_lse, **opts):
        self.calls.append((stream, q.shape, opts))
        if self.fail_on_call == len(self.calls):
            raise ValueError("mask: refused by the fake device path")
        for x in (q, k, v, opts.get("mask"), opts.get("alibi_slopes")):
            assert x is None or (isinstance(x, DeviceArray) and x.is_c_contiguous and x.ptr % 256 == 0)
        B, Hq, Sq = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:3]
        out_a, lse_a = FakeAllocation(q.nbytes), FakeAllocation(B * Hq * Sq * 4)
        out = DeviceArray(out_a.ptr, q.shape, q.dtype, DEV, owner=out_a, stream=stream)
        lse = DeviceArray(lse_a.ptr, (B, Hq, Sq), np.float32, DEV, owner=lse_a, stream=stream)

        def compute():  # runs when the stream gets there: reads whatever the inputs hold by then
            hopts = {n: (_host_view(x) if isinstance(x, DeviceArray) else x) for n, x in opts.items()}
            o, l_ = attention_ref(_host_view(q), _host_view(k), _host_view(v), layout=layout, return_lse=True,
                                  **hopts)
            _host_view(out)[...] = o.astype(q.dtype)
            _host_view(lse)[...] = l_.astype(np.float32)

        stream.enqueue(compute)
        return (out, lse) if return_lse else out


@pytest.fixture(params=["lazy", "mixed"])
def fake_gpu(monkeypatch, request):
    monkeypatch.setattr(FakeStream, "eager_every", 3 if request.param == "mixed" else 0)
    monkeypatch.setattr(FakeStream, "made", 0)
    caller = FakeStream(DEV, "caller")  # made first, lazy; then pipeline streams 0, 1, 2: lazy, eager, lazy
    fake = FakeAttention()
    for name, value in {"Stream": FakeStream, "Event": FakeEvent, "PinnedBuffer": FakePinned,
                        "get_pool": lambda device: FakePool(), "get_device": lambda: DEV,
                        "as_stream": lambda stream, device: caller if stream is None else stream,
                        "_h2d": _memcpy, "_d2h": _memcpy, "_device_attention": fake, "_pipelines": {}}.items():
        monkeypatch.setattr(_host, name, value)
    monkeypatch.setattr(_host, "_PIECE_BYTES", 1024)  # exercise the worker threads on small arrays
    return caller, fake


CASES = [  # B, Sq, Sk, Hq, Hkv, layout, mask shape, alibi shape
    (1, 33, 47, 8, 4, "bshd", None, None),
    (1, 33, 47, 12, 4, "bhsd", (1, 12, 33, 47), (12,)),
    (5, 20, 20, 4, 1, "bshd", (5, 1, 20, 20), (5, 4)),
    (5, 20, 31, 6, 3, "bhsd", (20, 31), (5, 6)),
    (2, 17, 9, 4, 4, "bshd", (2, 4, 17, 9), None),
    (3, 5, 0, 4, 2, "bshd", None, (4,)),  # no keys: output 0, LSE -inf
    (3, 0, 6, 4, 2, "bhsd", (1, 1, 0, 6), None),  # no queries
]


@pytest.mark.parametrize("B, Sq, Sk, Hq, Hkv, layout, mask_shape, alibi_shape", CASES)
@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 1 << 40])
def test_pipeline_on_fake_gpu(fake_gpu, monkeypatch, B, Sq, Sk, Hq, Hkv, layout, mask_shape, alibi_shape,
                              chunk_bytes):
    caller, fake = fake_gpu
    monkeypatch.setattr(_host, "_MIN_PIPELINE_BYTES", 0 if chunk_bytes < (1 << 40) else 1 << 40)
    monkeypatch.setattr(_host, "_CHUNK_BYTES", max(chunk_bytes, 1))
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, 16, layout)
    q = np.asfortranarray(q)  # strided host inputs are fine
    opts = {"causal": True, "scale": 0.3}
    if mask_shape is not None:
        opts["mask"] = np.where(rng.random(mask_shape) > 0.2, 0.0, -np.inf)  # float64: staged as float32
    if alibi_shape is not None:
        opts["alibi_slopes"] = rng.random(alibi_shape)
    out, lse = _host.attention_numpy(q, k, v, layout=layout, return_lse=True, stream=None, options=dict(opts))
    ref, ref_lse = attention_ref(q, k, v, layout=layout, return_lse=True, **opts)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
    assert out.dtype == q.dtype and lse.dtype == np.float32

    n_chunks = len(fake.calls)
    if chunk_bytes == 1 << 40:
        assert n_chunks == 1 and fake.calls[0][0] is caller  # one chunk: on the caller's stream
    else:
        assert n_chunks > 1 and all(s is not caller for s, _, _ in fake.calls)
        assert caller.ops, "the caller's stream must be ordered after the pipeline's work"
        if chunk_bytes == 1:  # as many chunks as units: batch entries, or KV heads when they are more
            assert n_chunks == (Hkv if B < Hkv else B)
    # the second call reuses the streams and pinned buffers, and may write into a given (strided) array
    out2 = np.full(out.shape[::-1], np.nan, out.dtype).T
    assert _host.attention_numpy(q, k, v, layout=layout, return_lse=False, stream=None, options=dict(opts),
                                 out=out2) is out2
    np.testing.assert_array_equal(out2, out)
    with pytest.raises(ValueError, match="^out: "):
        _host.attention_numpy(q, k, v, layout=layout, return_lse=False, stream=None, options={}, out=out[..., :1])


def test_pipeline_error_leaves_it_usable(fake_gpu, monkeypatch):
    _, fake = fake_gpu
    monkeypatch.setattr(_host, "_MIN_PIPELINE_BYTES", 0)
    monkeypatch.setattr(_host, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 4, 16, 16, 2, 2, 16, "bshd")
    fake.fail_on_call = 2
    with pytest.raises(ValueError, match="refused"):
        _host.attention_numpy(q, k, v, layout="bshd", return_lse=False, stream=None, options={})
    fake.fail_on_call = None
    out = _host.attention_numpy(q, k, v, layout="bshd", return_lse=False, stream=None, options={})
    np.testing.assert_allclose(out, attention_ref(q, k, v), rtol=2e-5, atol=2e-5)


def test_device_mask_is_passed_through_in_one_chunk(fake_gpu, monkeypatch):
    _, fake = fake_gpu
    monkeypatch.setattr(_host, "_MIN_PIPELINE_BYTES", 0)
    monkeypatch.setattr(_host, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 3, 16, 20, 4, 2, 16, "bshd")
    host_mask = rng.random((3, 1, 16, 20)) > 0.3
    a = FakeAllocation(host_mask.nbytes)
    dmask = DeviceArray(a.ptr, host_mask.shape, np.bool_, DEV, owner=a)
    _host_view(dmask)[...] = host_mask
    out = _host.attention_numpy(q, k, v, layout="bshd", return_lse=False, stream=None,
                                options={"mask": dmask, "alibi_slopes": np.ones(4)})
    assert len(fake.calls) == 1 and fake.calls[0][2]["mask"] is dmask
    ref = attention_ref(q, k, v, mask=host_mask, alibi_slopes=np.ones(4))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_bad_mask_fails_before_any_gpu_work(fake_gpu):
    _, fake = fake_gpu
    q = np.zeros((1, 4, 2, 16), np.float16)
    with pytest.raises(ValueError, match="^mask: "):
        _host.attention_numpy(q, q, q, layout="bshd", return_lse=False, stream=None,
                              options={"mask": np.ones((3, 4, 4), bool)})
    assert not fake.calls


# -- on a real GPU --------------------------------------------------------------------------------


def _has_gpu() -> bool:
    try:
        import pyattn

        return pyattn.device_count() > 0
    except Exception:
        return False


GPU_CASES = [  # B, Sq, Sk, Hq, Hkv, D, dtype, layout, options builder
    (1, 200, 300, 16, 4, 64, "float16", "bshd", lambda r, s: {"causal": True}),  # GQA, head chunks
    (1, 128, 128, 32, 32, 128, "bfloat16", "bshd", lambda r, s: {}),  # B=1, many heads
    (6, 150, 150, 4, 2, 64, "float16", "bhsd", lambda r, s: {"causal": True}),  # batch chunks, bhsd
    (1, 100, 170, 8, 4, 64, "float16", "bshd",  # mask broadcast over heads, (B, Hq) ALiBi
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
    from pyattn.reference import error_bound

    monkeypatch.setenv("PYATTN_POISON_ALLOC", "1")
    if chunked:
        monkeypatch.setattr(_host, "_MIN_PIPELINE_BYTES", 0)
        monkeypatch.setattr(_host, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(4)
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D, layout, np.float32)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    opts = make_opts(rng, (B, Sq, Sk, Hq))
    res = _host.attention_numpy(q, k, v, layout=layout, return_lse=return_lse, stream=None, options=dict(opts))
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
    """The default planner on a PCIe-sized call (64 MiB, 16 head chunks), against the reference
    on a few heads, on a caller's stream, and equal to the one-chunk path."""
    import pyattn
    from pyattn.reference import error_bound

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 4096, 16, 128)).astype(np.float16) for _ in range(3))
    monkeypatch.setattr(_host, "_CHUNK_HEADS", True)  # off by default (slower, see _host); tested all the same
    assert len(plan_chunks(1, 16, 4 * q.nbytes + 4 * 16 * 4096)) > 1
    with pyattn.Stream() as s:
        out, lse = _host.attention_numpy(q, k, v, layout="bshd", return_lse=True, stream=s, options={})
        s.synchronize()
    for h in (0, 7, 15):
        sl = (slice(None), slice(None), slice(h, h + 1))
        ref, ref_lse = attention_ref(q[sl], k[sl], v[sl], return_lse=True)
        assert np.abs(out[sl].astype(np.float64) - ref).max() <= error_bound(q[sl], k[sl], v[sl])
        np.testing.assert_allclose(lse[:, h], ref_lse[:, 0], rtol=1e-3, atol=1e-3)
    old = _host._MIN_PIPELINE_BYTES
    try:
        _host._MIN_PIPELINE_BYTES = 1 << 62
        one, one_lse = _host.attention_numpy(q, k, v, layout="bshd", return_lse=True, stream=None, options={})
    finally:
        _host._MIN_PIPELINE_BYTES = old
    # chunks are independent problems: same kernel, same numbers (allow an ulp in case the
    # kernel's launch shape ever depends on the grid size)
    np.testing.assert_allclose(out.astype(np.float32), one.astype(np.float32), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, one_lse, rtol=1e-5, atol=1e-5)

"""The device-resident call path on a CPU, through the fake driver of ``fake_driver.py``: which
driver calls a repeat call makes, the stream-order rule on it, and the repeat-call fast path
(a changed shape, stride, dtype, device or option must miss it).

torch is the stand-in ``fake_driver.fake_torch()`` installed as ``sys.modules["torch"]``.
"""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from pyattn.runtime.stream import LEGACY_STREAM, Stream, borrowed

SHAPE = (1, 16, 2, 64)


@pytest.fixture
def gpu(monkeypatch):
    with fake_driver.installed(monkeypatch, torch=True) as fake:
        yield fake


def _repeat_calls(fn) -> dict:
    """Driver calls of a call in a steady loop (the first call validates, plans and loads; each
    rebinding frees the previous result, as a loop does)."""
    keep = fn()
    keep = fn()
    fake_driver.CALLS.clear()
    keep = fn()  # noqa: F841
    return dict(fake_driver.CALLS)


def test_the_fake_leaves_no_device_state_behind():
    """What pyattn makes per device under the fake driver (the NumPy path's pipelines, device tile
    lists) is gone with it: a GPU test later in the same process once ran a NumPy call on a
    pipeline of fake streams and staging addresses, and crashed."""
    from pyattn.ops import block_sparse
    from pyattn.pipeline import chunks

    def state():
        return chunks._pipelines, dict(chunks._pipelines), block_sparse._lists, dict(block_sparse._lists)

    before = state()
    with pytest.MonkeyPatch.context() as mp, fake_driver.installed(mp):
        x = np.zeros((1, 2048, 16, 64), np.float16)  # 4 MiB each: the NumPy path pipelines it (chunks)
        pyattn.attention(x, x, x)
        made = dict(chunks._pipelines)
    assert made  # (the call made one under the fake)
    after = state()
    assert all(a is b for a, b in zip(after[::2], before[::2])) and after[1::2] == before[1::2]


def test_legacy_stream_is_one_handle(gpu):
    """0 (the NULL stream) and CU_STREAM_LEGACY name the legacy default stream: one ``ptr``, so a
    call on it never waits for itself, and an export never names 0 (refused by the CAI spec)."""
    dev = pyattn.get_device()
    assert borrowed(dev, 0).ptr == borrowed(dev, LEGACY_STREAM).ptr == Stream(dev, handle=0).ptr == LEGACY_STREAM
    a = pyattn.empty(SHAPE, np.float16, stream=0)
    assert a.__cuda_array_interface__["stream"] == LEGACY_STREAM
    fake_driver.CALLS.clear()
    a.__dlpack__(stream=LEGACY_STREAM)  # the consumer is the producer: nothing to wait for
    assert "cuStreamWaitEvent" not in fake_driver.CALLS
    pyattn.attention(a, a, a, stream=0)
    assert "cuStreamWaitEvent" not in fake_driver.CALLS
    s = Stream(dev)
    s.close()
    assert s.ptr == LEGACY_STREAM


def test_repeat_call_driver_calls(gpu):
    """A repeat tiny call: the context check and the launch; the result's block is the one the
    previous result freed on the same stream (no allocation or free through the driver)."""
    d = pyattn.empty(SHAPE, np.float16)
    assert _repeat_calls(lambda: pyattn.attention(d, d, d)) == {"cuCtxGetCurrent": 1, "cuLaunchKernel": 1}
    t = gpu.torch.Tensor(SHAPE, d.ptr)
    assert _repeat_calls(lambda: pyattn.attention(t, t, t)) == {"cuCtxGetCurrent": 1, "cuLaunchKernel": 1}


def test_torch_current_stream_read_once_per_call(gpu):
    torch = gpu.torch
    t = torch.Tensor(SHAPE, pyattn.empty(SHAPE, np.float16).ptr)
    pyattn.attention(t, t, t)
    torch.stream_reads = 0
    calls = _repeat_calls(lambda: pyattn.attention(t, t, t))
    assert torch.stream_reads == 3  # one per call
    assert "cuStreamWaitEvent" not in calls  # it runs on the stream that wrote its inputs


# -- the repeat-call fast path -------------------------------------------------------------------------
@pytest.fixture
def full(monkeypatch):
    """Counts the calls that took the full path (read into Args, signature, validation)."""
    from pyattn.ops import attention as op

    calls = []
    real = op._full

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(op, "_full", spy)
    return calls


def _da(shape=SHAPE, dtype=np.float16, strides=None, device=None, stream=None, ptr=None):
    """A DeviceArray over a pool block big enough for any view of ``shape`` used here."""
    dev = device if device is not None else pyattn.get_device()
    base = pyattn.empty((4 * int(np.prod(shape)),), dtype, device=dev, stream=stream)
    return pyattn.DeviceArray(base.ptr if ptr is None else ptr, shape, dtype, dev, strides=strides, owner=base,
                              stream=base.stream)


def test_repeat_calls_take_the_fast_path_and_read_new_pointers(gpu, full):
    gpu.record_launches = True
    a, b = _da(), _da()
    pyattn.attention(a, a, a)
    assert len(full) == 1
    fake_driver.LAUNCHES.clear()
    o1 = pyattn.attention(a, b, a)  # same layouts, other addresses: the fast path, with b's pointer
    o2 = pyattn.attention(b, a, b, return_lse=False)  # return_lse given as its default: still the same key
    assert len(full) == 1
    (_, _, _, p1), (_, _, _, p2) = fake_driver.LAUNCHES
    assert p1[:5] == (a.ptr, b.ptr, a.ptr, o1.ptr, 0)
    assert p2[:5] == (b.ptr, a.ptr, b.ptr, o2.ptr, 0)


def _variants(base_strides):
    """(name, call) pairs, each differing from ``attention(x, x, x)`` in one thing that changes the plan."""
    other_dev = lambda: pyattn.get_device(1)  # noqa: E731
    swapped = (base_strides[0], base_strides[2], base_strides[1], 1)  # a transposed view: same shape
    return {
        "shape": lambda x: pyattn.attention(*[_da((1, 32, 2, 64))] * 3),
        "strides": lambda x: pyattn.attention(*[_da(strides=tuple(2 * s for s in swapped))] * 3),
        "dtype": lambda x: pyattn.attention(*[_da(dtype=ml_dtypes.bfloat16)] * 3),
        "device": lambda x: pyattn.attention(*[_da(device=other_dev())] * 3),
        "one input": lambda x: pyattn.attention(x, _da((1, 8, 2, 64)), _da((1, 8, 2, 64))),
        "causal": lambda x: pyattn.attention(x, x, x, causal=True),
        "causal top_left": lambda x: pyattn.attention(x, x, x, causal="top_left"),
        "window": lambda x: pyattn.attention(x, x, x, window=(4, 0)),
        "softcap": lambda x: pyattn.attention(x, x, x, softcap=30.0),
        "scale": lambda x: pyattn.attention(x, x, x, scale=0.5),
        "layout": lambda x: pyattn.attention(x, x, x, layout="bhsd"),
        "return_lse": lambda x: pyattn.attention(x, x, x, return_lse=True),
        "out": lambda x: pyattn.attention(x, x, x, out=_da()),
        "mask": lambda x: pyattn.attention(x, x, x, mask=_da((1, 1, 16, 16), np.bool_)),
        "alibi": lambda x: pyattn.attention(x, x, x, alibi_slopes=_da((2,), np.float32)),
    }


@pytest.mark.parametrize("what", list(_variants((0, 0, 0, 1))))
def test_a_changed_layout_or_option_misses_the_fast_path(gpu, full, what):
    """Each variant is validated on its own (the full path), and repeats hit its own entry."""
    x = _da()
    pyattn.attention(x, x, x)
    pyattn.attention(x, x, x)
    assert len(full) == 1
    call = _variants(x.strides)[what]
    call(x)
    assert len(full) == 2, what
    call(x)  # (new arrays of the same layouts)
    assert len(full) == 2


def test_torch_layout_changes_miss_the_fast_path(gpu, full):
    torch = gpu.torch
    ptr = _da().ptr
    t = torch.Tensor(SHAPE, ptr)
    pyattn.attention(t, t, t)
    pyattn.attention(torch.Tensor(SHAPE, ptr), t, t)  # another tensor, same layout: a hit
    assert len(full) == 1
    transposed = torch.Tensor(SHAPE, ptr, stride=(2048, 64, 1024, 1))
    for x in (transposed, torch.Tensor(SHAPE, ptr, "bfloat16"), torch.Tensor(SHAPE, ptr, device=1)):
        n = len(full)
        try:
            pyattn.attention(x, x, x)
        except ValueError:
            pass  # (device 1 tensors on a 2-device fake: fine either way; what matters is the full path ran)
        assert len(full) == n + 1


def test_option_types_are_part_of_the_key(gpu):
    """``causal=1`` equals ``causal=True`` (and hashes alike) but is refused: a memo must not let it through."""
    x = _da()
    pyattn.attention(x, x, x, causal=True)
    with pytest.raises(TypeError, match="^causal: "):
        pyattn.attention(x, x, x, causal=1)
    pyattn.attention(x, x, x, return_lse=False)
    with pytest.raises(TypeError, match="^return_lse: "):
        pyattn.attention(x, x, x, return_lse=0)


def test_fast_path_checks_addresses_and_keeps_out(gpu, full):
    x = _da()
    out = _da()
    assert pyattn.attention(x, x, x, out=out) is out
    assert pyattn.attention(x, x, x, out=out) is out
    assert len(full) == 1
    shifted = _da(ptr=x.ptr + 2)
    with pytest.raises(ValueError, match=r"^k: .*16-byte aligned"):
        pyattn.attention(x, shifted, x, out=out)
    with pytest.raises(ValueError, match=r"^out: .*aligned"):
        pyattn.attention(x, x, x, out=_da(ptr=out.ptr + 2))
    assert len(full) == 1  # (both refused on the fast path)


def test_fast_path_follows_the_stream_rule(gpu):
    """Per call: each input's producer stream is waited for, and torch's current stream is read."""
    gpu.record_launches = True
    dev = pyattn.get_device()
    other = Stream(dev)
    mine = _da()
    theirs = _da(stream=other)  # produced on another stream
    pyattn.attention(mine, mine, mine)
    fake_driver.CALLS.clear()
    pyattn.attention(mine, theirs, mine)  # same key as the first call; a new producer
    assert fake_driver.CALLS["cuStreamWaitEvent"] == 1
    torch = gpu.torch
    t = torch.Tensor(SHAPE, mine.ptr)
    pyattn.attention(t, t, t)
    torch.current_stream = 0x9000  # the user switched torch streams: the op follows
    fake_driver.LAUNCHES.clear()
    fake_driver.CALLS.clear()
    pyattn.attention(t, t, t)
    assert fake_driver.LAUNCHES[0][2] == 0x9000
    assert "cuStreamWaitEvent" not in fake_driver.CALLS
    pyattn.attention(t, t, t, stream=other)  # rule 1: an explicit stream waits for torch's
    assert fake_driver.LAUNCHES[1][2] == other.ptr
    assert fake_driver.CALLS["cuStreamWaitEvent"] == 1


# -- decode ---------------------------------------------------------------------------------------------
@pytest.fixture
def cache(gpu):
    c = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16")
    ids = [c.add_sequence() for _ in range(2)]
    kv = np.zeros((2, 256, 2, 64), ml_dtypes.bfloat16)
    c.append(ids, kv, kv)
    return c, ids


@pytest.fixture
def full_decode(monkeypatch):
    from pyattn.ops import decode as op

    calls = []
    real = op._full
    monkeypatch.setattr(op, "_full", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_decode_repeat_calls(gpu, cache, full_decode):
    """A steady decode loop: one context check and one launch (two splits, their combine fused in); the
    partials share the output's block; q's new address is read."""
    c, ids = cache
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    assert _repeat_calls(lambda: pyattn.decode(q, c, ids)) == {"cuCtxGetCurrent": 1, "cuLaunchKernel": 1}
    assert len(full_decode) == 1
    q2 = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    fake_driver.LAUNCHES.clear()
    out = pyattn.decode(q2, c, ids)
    assert len(full_decode) == 1
    ((name, grid, _, p),) = fake_driver.LAUNCHES  # one launch: the split combine is fused in
    assert grid[0] == 2 and name.startswith("pyattn_attn_decode")  # two splits
    assert p[:4] == (q2.ptr, c.k.ptr, c.v.ptr, out.ptr)
    assert out.ptr < p[5] < p[6] < out.ptr + out.owner.nbytes  # the partials, behind out in its block
    assert p[7] != 0  # the stream's split counters


def test_decode_with_a_large_combine_share_merges_in_a_second_launch(gpu, cache):
    """16 query tokens x a GQA group of 4 at 33 splits: the fused combine's last block would read
    4 items (4 consumer warps of attn_decode_tma) x 3 batches of splits per thread (over its
    budget), so the decode leaves the merge (null counters) to split_combine, launched right after
    on the same stream."""
    c, ids = cache
    gpu.record_launches = True
    q = _da((2, 16, 8, 64), ml_dtypes.bfloat16)
    fake_driver.LAUNCHES.clear()
    out = pyattn.decode(q, c, ids, num_splits=33)
    (name, grid, _, p), (cname, _, cstream, cp) = fake_driver.LAUNCHES
    assert name.startswith("pyattn_attn_decode_tma") and grid[0] == 33 and p[7] == 0
    assert cname.startswith("pyattn_split_combine") and cp[:2] == (p[5], p[6]) and cp[4] == out.ptr
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids, num_splits=2)  # 8 items x 1 batch: within the budget, fused
    ((name, grid, _, p),) = fake_driver.LAUNCHES
    assert grid[0] == 2 and p[7] != 0


def test_decode_changes_miss_the_fast_path(gpu, cache, full_decode):
    c, ids = cache
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    pyattn.decode(q, c, ids)
    other = pyattn.PagedKVCache(64, 32, 2, 64, "bfloat16")  # another page size
    other_ids = [other.add_sequence() for _ in range(2)]
    variants = [
        lambda: pyattn.decode(_da((2, 2, 8, 64), ml_dtypes.bfloat16), c, ids),  # q_len
        lambda: pyattn.decode(_da((1, 1, 8, 64), ml_dtypes.bfloat16), c, ids[:1]),  # batch, number of ids
        lambda: pyattn.decode(q, other, other_ids),
        lambda: pyattn.decode(q, c, ids, causal=False),
        lambda: pyattn.decode(q, c, ids, window=(8, 0)),
        lambda: pyattn.decode(q, c, ids, num_splits=1),
        lambda: pyattn.decode(q, c, ids, softcap=20.0),
        lambda: pyattn.decode(q, c, ids, return_lse=True),
        lambda: pyattn.decode(q, c, ids, alibi_slopes=_da((8,), np.float32)),
    ]
    for i, call in enumerate(variants):
        call()
        assert len(full_decode) == 2 + i, i
        call()  # its own entry now
        assert len(full_decode) == 2 + i, i
    with pytest.raises(TypeError, match="^q: expected dtype bfloat16"):
        pyattn.decode(_da((2, 1, 8, 64), np.float16), c, ids)


def test_decode_checks_ids_and_addresses_every_call(gpu, cache):
    c, ids = cache
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    pyattn.decode(q, c, ids)
    pyattn.decode(q, c, ids)
    with pytest.raises(ValueError, match=r"^q: the address must be 16-byte aligned"):
        pyattn.decode(_da((2, 1, 8, 64), ml_dtypes.bfloat16, ptr=q.ptr + 8), c, ids)
    c.free(ids[1])
    with pytest.raises(ValueError, match="no live sequence"):
        pyattn.decode(q, c, ids)
    with pytest.raises(ValueError, match="^q: expected an array on the cache's device"):
        pyattn.decode(_da((1, 1, 8, 64), ml_dtypes.bfloat16, device=pyattn.get_device(1)), c, ids[:1])


def test_memo_keys_do_not_keep_a_cache_alive(gpu):
    """The decode memos key on the cache's layout: a dropped cache frees its pools."""
    import weakref

    c = pyattn.PagedKVCache(16, 16, 2, 64, "float16")
    ids = [c.add_sequence()]
    c.append(ids, np.zeros((1, 4, 2, 64), np.float16), np.zeros((1, 4, 2, 64), np.float16))
    pyattn.decode(_da((1, 1, 4, 64)), c, ids)
    pyattn.decode(_da((1, 1, 4, 64)), c, ids)
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None


def test_a_refused_address_makes_no_driver_call(gpu):
    """As on the full path, the per-call checks run before any device work."""
    x = _da()
    shifted = _da(ptr=x.ptr + 4)
    pyattn.attention(x, x, x)
    fake_driver.CALLS.clear()
    with pytest.raises(ValueError, match=r"^q: "):
        pyattn.attention(shifted, x, x)
    assert not fake_driver.CALLS


def test_numpy_calls_validate_once_and_stage_without_events(gpu, cache, monkeypatch):
    """Repeat NumPy calls find their problem by signature (q, k, v are read for shape, dtype and
    strides only); a small call's staging buffer is released after its synchronisation, so it makes
    no event calls; an ``out=`` (read for its writeable flag) is validated every call."""
    from pyattn.ops import attention as att_op
    from pyattn.ops import decode as dec_op

    made = []
    for mod, name in ((att_op, "make_problem"), (dec_op, "check_query")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **k: made.append(1) or _real(*a, **k))
    q = np.ones(SHAPE, np.float16)
    calls = _repeat_calls(lambda: pyattn.attention(q, q, q))
    assert len(made) == 2  # the NumPy call's problem, and its one chunk's on the uploaded arrays
    assert not {n for n in calls if n.startswith("cuEvent")}, calls
    assert calls.get("cuMemcpyHtoDAsync") == 1 and calls.get("cuMemcpyDtoHAsync") == 1
    c, ids = cache
    qd = np.ones((2, 1, 8, 64), ml_dtypes.bfloat16)
    calls = _repeat_calls(lambda: pyattn.decode(qd, c, ids))
    assert len(made) == 3 and not {n for n in calls if n.startswith("cuEvent")}, calls
    out = np.empty(SHAPE, np.float16)
    pyattn.attention(q, q, q, out=out)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        pyattn.attention(q, q, q, out=out)


def test_a_ragged_decode_runs_its_longest_sequence_first(gpu, cache):
    """batch_order (DecodeParams field 11) is null for an even batch and, for a ragged one, the
    device copy of the entries longest first, uploaded with the cache's decode table."""
    from pyattn.paged.book import longest_first

    c, ids = cache
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids)
    assert fake_driver.LAUNCHES[-1][3][11] == 0
    kv = np.zeros((1, 40, 2, 64), ml_dtypes.bfloat16)
    c.append([ids[1]], kv, kv)
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids)
    tables = c.decode_tables(ids, c._stream)[0]
    assert tables[4] is not None and fake_driver.LAUNCHES[-1][3][11] == tables[4].ptr
    assert longest_first(c.book.lengths(ids)).tolist() == [1, 0]


def test_is_pinned_follows_the_views_to_pyattn_pinned_memory(gpu):
    from pyattn.runtime.pinned import is_pinned

    a = pyattn.pinned_empty((4, 8), np.float16)
    assert is_pinned(a) and is_pinned(a[1:3]) and is_pinned(a.view(np.uint16).T)
    assert not is_pinned(np.zeros((4, 8), np.float16)) and not is_pinned(np.zeros(4)[1:])


def test_pinned_empty_as_a_first_cuda_call_makes_a_context_current(gpu):
    """cuMemHostAlloc needs a current context: pinned_empty before any other call must make one
    (an H200 run found CUDA_ERROR_NOT_INITIALIZED), and must leave a caller's own context alone."""
    from pyattn.runtime import pinned

    gpu.current = 0  # no context current on this thread
    fake_driver.CALLS.clear()
    a = pyattn.pinned_empty((1 << 20,), np.uint8)  # a size no pooled block has yet
    assert a.shape == (1 << 20,) and gpu.current != 0 and fake_driver.CALLS["cuCtxSetCurrent"] == 1
    fake_driver.CALLS.clear()
    pinned.PinnedBuffer(4096)  # a context is current now: no switch
    assert fake_driver.CALLS["cuCtxSetCurrent"] == 0


def test_staging_is_write_combined_and_results_are_not(gpu):
    """Uploads stage through write-combined pinned memory (the CPU only writes it, the DMA reads it
    without snooping); result arrays, which the caller reads, stay cached."""
    from cuda.bindings import driver

    wc = driver.CU_MEMHOSTALLOC_WRITECOMBINED
    before = set(gpu.host_flags)
    q = np.zeros((1, 64, 2, 64), np.float16)
    out = pyattn.attention(q, q, q)
    new = {p: f for p, f in gpu.host_flags.items() if p not in before}
    staged = [p for p, f in new.items() if f & wc]
    assert staged and all(f & driver.CU_MEMHOSTALLOC_PORTABLE for f in new.values())
    result = out.__array_interface__["data"][0]
    owner = max(p for p in new if p <= result)  # the pinned block the result views
    assert not new[owner] & wc


def test_tma_decode_maps_describe_the_pools(gpu, cache):
    """attn_decode_tma (the fake GPU is sm_90a, the cache's pages 16 slots) reads the pools through a
    pair of tensor maps: (head dim, slot, kv head, page) with the pools' byte strides, boxes of 64
    columns x min(page, block_n) slots, 128-byte swizzle; encoded and uploaded once per pool pair."""
    from pyattn.runtime import tensormap

    c, ids = cache
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    pyattn.decode(q, c, ids)
    keys = [k for k in tensormap._memo if k[1] in (c.k.ptr, c.v.ptr)]
    assert sorted(k[1] for k in keys) == sorted((c.k.ptr, c.v.ptr))
    for dtype, _, (dims, strides), box, swizzle in keys:  # NHD pools (64 pages, 16 slots, 2 heads, 64)
        assert (dtype, dims, strides, box, swizzle) == ("bf16", (64, 16, 2, 64), (256, 128, 4096), (64, 16), 128)
    encodes = fake_driver.CALLS["cuTensorMapEncodeTiled"]
    pyattn.decode(q, c, ids)
    assert fake_driver.CALLS["cuTensorMapEncodeTiled"] == encodes == 2


@pytest.mark.parametrize("kind, key_scales, D", [("int8", "token", 128), ("fp8_e4m3", "token", 128),
                                                ("int8", "channel", 128), ("int8", "token", 64)])
def test_tma_decode_maps_of_8_bit_pools(gpu, kind, key_scales, D):
    """An 8-bit cache takes attn_decode_tma too (per-token or per-channel key scales): its code pools
    as uint8 maps, boxes of 128 codes (one 128-byte swizzle row) x min(page, block_n) slots. The 64
    head-dim bucket keeps the cp.async kernel, whose launch encodes no map."""
    from pyattn.runtime import tensormap

    c = pyattn.PagedKVCache(64, 16, 2, D, kind, key_scales=key_scales)
    ids = [c.add_sequence() for _ in range(2)]
    kv = np.zeros((2, 256, 2, D), ml_dtypes.bfloat16)
    c.append(ids, kv, kv)
    fake_driver.CALLS.clear()
    gpu.record_launches = True
    pyattn.decode(_da((2, 1, 8, D), ml_dtypes.bfloat16), c, ids)
    name = fake_driver.LAUNCHES[-1][0]
    keys = [k for k in tensormap._memo if k[1] in (c.k.ptr, c.v.ptr)]
    if D == 64:
        assert keys == [] and fake_driver.CALLS["cuTensorMapEncodeTiled"] == 0
        assert name.startswith("pyattn_attn_decode_") and "tma" not in name
        return
    assert sorted(k[1] for k in keys) == sorted((c.k.ptr, c.v.ptr)) and name.startswith("pyattn_attn_decode_tma")
    for dtype, _, (dims, strides), box, swizzle in keys:  # NHD pools (64 pages, 16 slots, 2 heads, 128 codes)
        assert (dtype, dims, strides, box, swizzle) == ("u8", (128, 16, 2, 64), (256, 128, 4096), (128, 16), 128)

"""CUDA graph capture on a CPU, through the fake driver's capture (``fake_driver._Fake.begin_capture``):
what pyattn queues while a stream captures, and what it refuses.

The fake answers ``cuStreamIsCapturing`` / ``cuStreamGetCaptureInfo`` and refuses, as the driver does,
a free of a block from outside the capture, a wait for an event recorded outside it and a
synchronisation of the capturing stream (``fake.refused``; a real driver would invalidate the
capture). The GPU side (replays against eager calls) is ``test_gpu_graph_capture.py``.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from cuda.bindings import driver

import pyattn
from _host_path_helpers import SHAPE, _da  # (fixture gpu: conftest.py)
from pyattn.kernels.params import DECODE_PARAMS
from pyattn.ops import _decode
from pyattn.runtime.memory import DevicePool, get_pool
from pyattn.runtime.stream import Stream

BF16 = ml_dtypes.bfloat16


def _block(a):
    """The pool Allocation behind DeviceArray ``a``."""
    owner = a.owner
    while isinstance(owner, pyattn.DeviceArray):
        owner = owner.owner
    return owner


def _spy_launches(monkeypatch, module, params_struct) -> list:
    """Each launch through ``module.launch`` whose struct is ``params_struct``, unpacked by field
    name (the launch still goes to the fake driver)."""
    seen, real = [], module.launch
    names = [name for name, _ in params_struct.fields]

    def spy(kernel, grid, block, smem, s, params):
        if len(params) == params_struct.size:
            seen.append(dict(zip(names, struct.unpack_from(params_struct.format, params))))
        return real(kernel, grid, block, smem, s, params)

    monkeypatch.setattr(module, "launch", spy)
    return seen


@pytest.fixture
def decode_params(monkeypatch):
    """Each decode launch's DecodeParams, unpacked by field name."""
    return _spy_launches(monkeypatch, _decode, DECODE_PARAMS)


def test_a_result_allocated_in_a_capture_is_the_graph_s_own(gpu):
    """On a stream whose earlier calls left kept blocks: the result is a fresh allocation node of
    the capture (a kept block's address would be shared by eager calls and replays), and it is
    never kept for reuse: freed in the capture, it is a free node of it."""
    dev = pyattn.get_device()
    s = Stream(dev)
    d = pyattn.empty(SHAPE, np.float16, stream=s)
    for _ in range(3):
        kept = _block(pyattn.attention(d, d, d, stream=s)).ptr  # freed at once: kept for s
    assert get_pool(dev)._spares[(s.ptr, 4096)][-1][0] == kept
    cid = gpu.begin_capture(s)
    out = pyattn.attention(d, d, d, stream=s)
    block = _block(out)
    assert block.graph == cid and gpu.graph_blocks[block.ptr] == cid and block.ptr != kept
    ptr = block.ptr
    del out, block
    assert ("cuMemFreeAsync", int(s.handle)) in gpu.captured  # its free node
    assert all(p != ptr for blocks in get_pool(dev)._spares.values() for p, _ in blocks)
    gpu.end_capture(s)
    assert gpu.refused == []


def test_a_block_from_before_the_capture_is_freed_after_it(gpu):
    """A block the user drops while its stream captures (too big to keep) waits on a list, and is
    freed by the next free once the capture has ended."""
    dev = pyattn.get_device()
    s = Stream(dev)
    big = pyattn.empty((DevicePool.SPARE_BLOCK_BYTES,), np.float16, stream=s)
    gpu.begin_capture(s)
    del big
    assert not any(name == "cuMemFreeAsync" for name, _ in gpu.captured)
    gpu.end_capture(s)
    from fake_driver import CALLS

    CALLS.clear()
    other = pyattn.empty((DevicePool.SPARE_BLOCK_BYTES,), np.float16, stream=s)
    del other
    assert CALLS["cuMemFreeAsync"] == 2  # the waiting block, then this one
    assert gpu.refused == []
    # Each free is made in this thread's relaxed capture mode (a global-mode capture on another
    # stream would refuse it), and the mode is restored after.
    modes = driver.CUstreamCaptureMode
    assert gpu.free_modes[-2:] == [modes.CU_STREAM_CAPTURE_MODE_RELAXED] * 2
    assert gpu.capture_mode == modes.CU_STREAM_CAPTURE_MODE_GLOBAL


def test_inputs_from_streams_outside_the_capture_are_not_waited_for(gpu):
    """A DeviceArray written on another stream: outside a capture the call waits for that stream
    (an event); in a capture the graph's launch is ordered by its stream instead (the driver
    refuses a wait across the capture's boundary)."""
    dev = pyattn.get_device()
    s, writer = Stream(dev), Stream(dev)
    d = pyattn.empty(SHAPE, np.float16, stream=writer)
    from fake_driver import CALLS

    CALLS.clear()
    pyattn.attention(d, d, d, stream=s)
    assert CALLS["cuStreamWaitEvent"] == 1
    gpu.begin_capture(s)
    pyattn.attention(d, d, d, stream=s)
    assert not any(name == "cuStreamWaitEvent" for name, _ in gpu.captured)
    gpu.end_capture(s)
    assert gpu.refused == []


def _contig(batch=2, max_len=256):
    q = _da((batch, 1, 8, 64), BF16)
    kc, vc = _da((batch, max_len, 2, 64), BF16), _da((batch, max_len, 2, 64), BF16)
    return q, kc, vc


def test_contiguous_decode_captures_with_max_seqlen(gpu, decode_params):
    """Device lengths under ``max_seqlen``: no copy-back and no upload; the kernel gets the
    lengths' address and the bound (uniform_len), the pool's page count (its page-entry clamp),
    and a split-combine counter block of the graph's own, zeroed by a memset node and freed by a
    free node after the launch, while the stream's own counter block stays as the eager calls left
    it."""
    dev = pyattn.get_device()
    s = Stream(dev)
    q, kc, vc = _contig()
    lens = _da((2,), np.int32, stream=s)
    pyattn.contiguous_decode(q, kc, vc, lens, max_seqlen=256, stream=s)  # eager, the same shapes
    eager = decode_params[-1]
    stream_counters = get_pool(dev)._counters.get(s.ptr)
    cid = gpu.begin_capture(s)
    out = pyattn.contiguous_decode(q, kc, vc, lens, max_seqlen=256, stream=s)
    p = decode_params[-1]
    names = [name for name, _ in gpu.captured]
    assert "cuMemcpyHtoDAsync" not in names and "cuMemcpyDtoHAsync" not in names
    assert "cuStreamSynchronize" not in names
    assert p["kv_len"] == lens.ptr and p["uniform_len"] == 256 and p["batch_order"] == 0
    assert p["num_pages"] > 0 and p["num_splits"] == eager["num_splits"]
    if p["num_splits"] > 1 and p["split_counters"]:  # the fused combine's counters: the graph's own
        assert gpu.graph_blocks.get(p["split_counters"]) == cid
        assert "cuMemsetD8Async" in names
        assert stream_counters is None or p["split_counters"] != stream_counters.ptr
        assert get_pool(dev)._counters.get(s.ptr) is stream_counters
    assert _block(out).graph == cid
    gpu.end_capture(s)
    assert gpu.refused == []


def test_paged_decode_captures_with_max_seqlen(gpu, decode_params):
    """A vLLM block table and lengths on the device under ``max_seqlen``: read by the kernel as they
    are at each replay (no copy-back, no order upload), lengths clamped to the bound and page
    entries to the pool."""
    s = Stream(pyattn.get_device())
    q = _da((2, 1, 8, 64), BF16)
    kp, vp = _da((32, 16, 2, 64), BF16), _da((32, 16, 2, 64), BF16)
    table, lens = _da((2, 16), np.int32), _da((2,), np.int32)
    with pytest.raises(pyattn.CaptureError, match="make one call of the same shapes before the capture"):
        with_capture = gpu.begin_capture(s)  # the first call over these pools uploads their tensor maps
        pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=lens, max_seqlen=200, stream=s)
    gpu.end_capture(s)
    assert with_capture and gpu.captured == []
    pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=lens, max_seqlen=200, stream=s)
    gpu.begin_capture(s)
    pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=lens, max_seqlen=200, stream=s)
    p = decode_params[-1]
    assert (p["page_indices"], p["kv_len"], p["uniform_len"], p["batch_order"]) == (table.ptr, lens.ptr, 200, 0)
    assert p["num_pages"] == 32 and p["table_stride"] == 16
    names = [name for name, _ in gpu.captured]
    assert "cuMemcpyHtoDAsync" not in names and "cuMemcpyDtoHAsync" not in names
    gpu.end_capture(s)
    assert gpu.refused == []


def test_checked_device_lengths_bound_the_kernel_by_their_maximum(gpu, decode_params):
    """Outside ``max_seqlen`` the bound the kernel clamps to is the checked lengths' maximum, so
    checked lengths are unchanged by the clamp."""
    q, kc, vc = _contig()
    lens = pyattn.asarray(np.array([100, 37], np.int32))
    from fake_driver import CALLS

    CALLS.clear()
    pyattn.contiguous_decode(q, kc, vc, np.array([100, 37], np.int32))  # ragged host lengths: uploaded
    assert decode_params[-1]["uniform_len"] == 100 and decode_params[-1]["kv_len"] != 0
    del lens


def test_calls_a_graph_cannot_replay_are_refused_before_the_stream_sees_them(gpu, cache):
    """NumPy inputs (an upload), a PagedKVCache (host bookkeeping), device lengths checked on the
    host (a copy-back, or a plan from values a replay would not see): CaptureError, and nothing
    queued on the capturing stream."""
    c, ids = cache
    dev = pyattn.get_device()
    s = Stream(dev)
    q, kc, vc = _contig()
    qd = _da((2, 1, 8, 64), BF16)
    pyattn.decode(qd, c, ids, stream=s)  # eager first: plans, kept tables
    lens_here = _da((2,), np.int32, stream=s)  # written on the capturing stream: its copy-back is refused
    kp, vp = _da((32, 16, 2, 64), BF16), _da((32, 16, 2, 64), BF16)
    table = _da((2, 16), np.int32, stream=s)
    gpu.begin_capture(s)
    cases = [
        lambda: pyattn.attention(np.zeros(SHAPE, np.float16), np.zeros(SHAPE, np.float16),
                                 np.zeros(SHAPE, np.float16), stream=s),
        lambda: pyattn.decode(qd, c, ids, stream=s),
        lambda: pyattn.contiguous_decode(q, kc, vc, lens_here, stream=s),
        lambda: pyattn.paged_decode(qd, kp, vp, block_table=table, seq_lens=lens_here, stream=s),
    ]
    for case in cases:
        with pytest.raises(pyattn.CaptureError, match="capturing a CUDA graph"):
            case()
    assert gpu.captured == [], gpu.captured
    gpu.end_capture(s)
    assert gpu.refused == []


def test_device_lengths_checked_on_the_host_are_refused_in_a_capture(gpu):
    """Lengths written on another stream copy back fine, but a graph would keep the splits planned
    from those values: refused once the call's stream is known to capture."""
    s = Stream(pyattn.get_device())
    q, kc, vc = _contig()
    lens = pyattn.asarray(np.array([100, 37], np.int32))  # on pyattn's own stream
    gpu.begin_capture(s)
    with pytest.raises(pyattn.CaptureError, match="max_seqlen"):
        pyattn.contiguous_decode(q, kc, vc, lens, stream=s)
    gpu.end_capture(s)


def test_max_seqlen_validation(gpu):
    q, kc, vc = _contig()
    dl = _da((2,), np.int32)
    with pytest.raises(ValueError, match="max_seqlen: bounds device lengths.*cache_seqlens must then be a device"):
        pyattn.contiguous_decode(q, kc, vc, np.array([3, 4], np.int32), max_seqlen=10)
    with pytest.raises(ValueError, match="max_seqlen: bounds device lengths"):
        pyattn.contiguous_decode(q, kc, vc, 5, max_seqlen=10)
    with pytest.raises(ValueError, match=r"max_seqlen: expected an int in \[0, 256\], got 257"):
        pyattn.contiguous_decode(q, kc, vc, dl, max_seqlen=257)
    with pytest.raises(TypeError, match="max_seqlen: expected an int, got float"):
        pyattn.contiguous_decode(q, kc, vc, dl, max_seqlen=10.0)
    new = _da((2, 3, 2, 64), BF16)
    with pytest.raises(ValueError, match="max_seqlen: bounds the lengths after the 3 new tokens, so expected at "
                                         "least 3, got 2"):
        pyattn.contiguous_decode(q, kc, vc, dl, k_new=new, v_new=new, max_seqlen=2)
    kp, vp = _da((32, 16, 2, 64), BF16), _da((32, 16, 2, 64), BF16)
    table = _da((2, 4), np.int32)
    with pytest.raises(ValueError, match=r"max_seqlen: expected an int in \[0, 64\], got 65"):
        pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=dl, max_seqlen=65)
    with pytest.raises(ValueError, match="block_table must then be a device"):
        pyattn.paged_decode(q, kp, vp, block_table=np.zeros((2, 4), np.int32), seq_lens=dl, max_seqlen=10)
    with pytest.raises(ValueError, match="seq_lens must then be a device"):
        pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=np.zeros(2, np.int32), max_seqlen=10)
    with pytest.raises(ValueError, match="max_seqlen: takes the block_table form"):
        pyattn.paged_decode(q, kp, vp, indptr=_da((3,), np.int32), indices=_da((4,), np.int32),
                            last_page_len=dl, max_seqlen=10)


def test_device_lengths_under_max_seqlen_take_the_repeat_path(gpu, full_contig, decode_params):
    """An eager loop of the graph-captured step's form: after the first call, validation is
    reused (one context check, one capture query, one launch) and each call's lengths are read
    from the array it passes; another bound is another key."""
    from _host_path_helpers import _repeat_calls

    q, kc, vc = _contig()
    lens, other = _da((2,), np.int32), _da((2,), np.int32)
    calls = _repeat_calls(lambda: pyattn.contiguous_decode(q, kc, vc, lens, max_seqlen=200))
    assert calls == {"cuCtxGetCurrent": 1, "cuStreamIsCapturing": 1, "cuLaunchKernelEx": 1}
    assert len(full_contig) == 1
    pyattn.contiguous_decode(q, kc, vc, other, max_seqlen=200)
    assert len(full_contig) == 1
    assert (decode_params[-1]["kv_len"], decode_params[-1]["uniform_len"]) == (other.ptr, 200)
    pyattn.contiguous_decode(q, kc, vc, other, max_seqlen=256)
    assert len(full_contig) == 2 and decode_params[-1]["uniform_len"] == 256
    # with the step's new tokens: the append's launch too, and still one capture query a call
    kn = _da((2, 1, 2, 64), BF16)
    calls = _repeat_calls(lambda: pyattn.contiguous_decode(q, kc, vc, lens, k_new=kn, v_new=kn, max_seqlen=200))
    assert calls == {"cuCtxGetCurrent": 1, "cuStreamIsCapturing": 1, "cuLaunchKernelEx": 2}


def test_paged_decode_under_max_seqlen_takes_the_repeat_path(gpu, decode_params, monkeypatch):
    """vLLM's eager decode loop in the captured step's form: after the first call the validation
    is reused and each call reads its tables' addresses (new ones: read, not validated again);
    the kernel gets the bound and the table's row stride."""
    from _host_path_helpers import _repeat_calls
    from pyattn.ops import decode as op

    validations = []
    real = op.check_pools
    monkeypatch.setattr(op, "check_pools", lambda *a, **k: validations.append(1) or real(*a, **k))
    q = _da((2, 1, 8, 64), BF16)
    kp, vp = _da((32, 16, 2, 64), BF16), _da((32, 16, 2, 64), BF16)
    table, lens = _da((2, 16), np.int32), _da((2,), np.int32)
    calls = _repeat_calls(lambda: pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=lens, max_seqlen=200))
    assert calls == {"cuCtxGetCurrent": 1, "cuStreamIsCapturing": 1, "cuLaunchKernelEx": 1}
    assert len(validations) == 1
    table2, lens2 = _da((2, 16), np.int32), _da((2,), np.int32)
    pyattn.paged_decode(q, kp, vp, block_table=table2, seq_lens=lens2, max_seqlen=200)
    p = decode_params[-1]
    assert (p["page_indices"], p["kv_len"], p["uniform_len"], p["table_stride"]) == (table2.ptr, lens2.ptr, 200, 16)
    assert len(validations) == 1
    pyattn.paged_decode(q, kp, vp, block_table=table2, seq_lens=lens2, max_seqlen=100)  # another bound: a key
    assert len(validations) == 2 and decode_params[-1]["uniform_len"] == 100
    wide = _da((2, 8), np.int32, strides=(32, 4))  # rows 8 entries wide, 8 apart: another layout, its own stride
    pyattn.paged_decode(q, kp, vp, block_table=wide, seq_lens=lens2, max_seqlen=100)
    assert len(validations) == 3 and decode_params[-1]["table_stride"] == 8
    misaligned = _da((2, 1, 8, 64), BF16, ptr=q.ptr + 8)
    with pytest.raises(ValueError, match="q: the address must be 16-byte aligned"):
        pyattn.paged_decode(misaligned, kp, vp, block_table=table, seq_lens=lens, max_seqlen=200)


def test_a_captured_step_appends_from_the_device_lengths(gpu, decode_params, monkeypatch):
    """``contiguous_decode(..., k_new=, v_new=, max_seqlen=)`` in a capture: the append's items are
    the geometry's kept ones (uploaded at the eager call before), the kernel shifts them by the
    device lengths (clamped to max_seqlen - n_new) and writes the lengths after the append into a
    block of the graph's own, which the decode reads; nothing goes through host memory."""
    from pyattn.kernels.params import KV_APPEND_PARAMS
    from pyattn.paged import appender

    appends = _spy_launches(monkeypatch, appender, KV_APPEND_PARAMS)
    s = Stream(pyattn.get_device())
    q, kc, vc = _contig()
    lens = _da((2,), np.int32)
    kn, vn = _da((2, 1, 2, 64), BF16), _da((2, 1, 2, 64), BF16)
    pyattn.contiguous_decode(q, kc, vc, lens, k_new=kn, v_new=vn, max_seqlen=256, stream=s)  # eager first
    items = appends[-1]["dst"]
    cid = gpu.begin_capture(s)
    pyattn.contiguous_decode(q, kc, vc, lens, k_new=kn, v_new=vn, max_seqlen=256, stream=s)
    a, p = appends[-1], decode_params[-1]
    assert (a["dst"], a["dst_base"], a["per_seq"], a["base_max"], a["n_items"]) == (items, lens.ptr, 1, 255, 2)
    assert a["k_src"] == kn.ptr and gpu.graph_blocks.get(a["len_out"]) == cid
    assert p["kv_len"] == a["len_out"] and p["uniform_len"] == 256
    names = [name for name, _ in gpu.captured]
    assert "cuMemcpyHtoDAsync" not in names and "cuStreamSynchronize" not in names
    gpu.end_capture(s)
    assert gpu.refused == []


def test_a_split_attention_call_captures_with_the_graph_s_own_partials_and_counters(gpu, monkeypatch):
    """A call whose last round of query tiles is split by keys (pyattn/ops/_fwd_tail.py; one
    attn_fwd_tma block an SM on the fake's 132): in a capture its fp32 partials and its counters
    are the graph's own blocks (the counters zeroed by a memset node, not the stream's block,
    which eager calls beside a replay use), both freed in the capture."""
    import fake_driver
    from pyattn.kernels.params import ATTN_FWD_TMA_PARAMS
    from pyattn.ops import _fwd

    monkeypatch.setitem(fake_driver.OCCUPANCY, "attn_fwd_tma", 1)
    seen = _spy_launches(monkeypatch, _fwd, ATTN_FWD_TMA_PARAMS)
    s = Stream(pyattn.get_device())
    q, k, v = _da((1, 256, 99, 128), BF16), _da((1, 2048, 99, 128), BF16), _da((1, 2048, 99, 128), BF16)
    pyattn.attention(q, k, v, stream=s)  # eager first: the plan, the stream's counter block
    eager = seen[-1]
    assert eager["sk_iters"] == 66 * 16 and gpu.graph_blocks.get(eager["sk_ctr"]) is None
    cid = gpu.begin_capture(s)
    out = pyattn.attention(q, k, v, stream=s)
    p = seen[-1]
    assert p["sk_iters"] == 66 * 16 and p["sk_ctr"] != eager["sk_ctr"]
    assert gpu.graph_blocks[p["sk_ctr"]] == cid and gpu.graph_blocks[p["sk_part"]] == cid
    names = [name for name, _ in gpu.captured]
    assert "cuMemsetD8Async" in names and names.count("cuMemFreeAsync") >= 2  # the counters' and partials'
    del out
    gpu.end_capture(s)
    assert gpu.refused == []

"""The device-resident attention call path on a CPU, through the fake driver of ``fake_driver.py``:
which driver calls a repeat call makes, the legacy stream's one handle, the stream-order rule on it,
and the repeat-call fast path (a changed shape, stride, dtype, device or option must miss it; the
per-call address checks run on it, before any driver call). Decode's repeat path is in
test_host_path_decode.py, NumPy calls and pinned memory in test_host_path_numpy.py.

torch is the stand-in ``fake_torch.fake_torch()`` installed as ``sys.modules["torch"]`` (the
``gpu`` fixture, conftest.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from _host_path_helpers import SHAPE, _da, _repeat_calls
from pyattn.runtime.stream import LEGACY_STREAM, Stream, borrowed


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
    """A repeat tiny call: the context check, whether the stream captures a CUDA graph (before
    the result takes a kept block), and the launch (the fake GPU is an sm_90: as the stream's
    previous kernel's programmatic dependent); the result's block is the one the previous result
    freed on the same stream (no allocation or free through the driver)."""
    d = pyattn.empty(SHAPE, np.float16)
    calls = {"cuCtxGetCurrent": 1, "cuStreamIsCapturing": 1, "cuLaunchKernelEx": 1}
    assert _repeat_calls(lambda: pyattn.attention(d, d, d)) == calls
    t = gpu.torch.Tensor(SHAPE, d.ptr)
    assert _repeat_calls(lambda: pyattn.attention(t, t, t)) == calls


def test_torch_current_stream_read_once_per_call(gpu):
    torch = gpu.torch
    t = torch.Tensor(SHAPE, pyattn.empty(SHAPE, np.float16).ptr)
    pyattn.attention(t, t, t)
    torch.stream_reads = 0
    calls = _repeat_calls(lambda: pyattn.attention(t, t, t))
    assert torch.stream_reads == 3  # one per call
    assert "cuStreamWaitEvent" not in calls  # it runs on the stream that wrote its inputs


# -- the repeat-call fast path -------------------------------------------------------------------------
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


def test_a_refused_address_makes_no_driver_call(gpu):
    """As on the full path, the per-call checks run before any device work."""
    x = _da()
    shifted = _da(ptr=x.ptr + 4)
    pyattn.attention(x, x, x)
    fake_driver.CALLS.clear()
    with pytest.raises(ValueError, match=r"^q: "):
        pyattn.attention(shifted, x, x)
    assert not fake_driver.CALLS


@pytest.mark.parametrize("mask_shape", [(2, 2, 300, 4200), (2, 1, 1, 4200), (1, 2, 300, 4200)])
def test_bool_mask_words_map_for_the_staged_row(gpu, monkeypatch, mask_shape):
    """d = 64 from 4096 keys (a row with stage_bits): the packed words' map is u32, unswizzled,
    boxes of 4 words x 192 rows over (words, rows, heads, batch), broadcast axes of size 1; a
    key-padding mask (B, 1, 1, Sk) is packed as 192 copies of its row, a whole box at row 0."""
    import pyattn.ops._fwd as fwd

    maps = []

    def spy(dtype, ptr, layout, box, swizzle=128, l2_promotion=256):
        maps.append((dtype, layout, box, swizzle))
        return bytes(128)

    monkeypatch.setattr(fwd, "encode_tiled", spy)
    B, H, Sq, Sk, D = 2, 2, 300, 4200, 64
    q, k = _da((B, Sq, H, D), ml_dtypes.bfloat16), _da((B, Sk, H, D), ml_dtypes.bfloat16)
    pyattn.attention(q, k, k, mask=_da(mask_shape, np.bool_))
    words = 33 * 4  # 4200 keys: 33 groups of 128
    rows = Sq if mask_shape[2] > 1 else 192
    dims = (words, rows, mask_shape[1], mask_shape[0])
    steps = (4 * words if rows > 1 else 16, 4 * words * rows if dims[2] > 1 else 16,
             4 * words * rows * dims[2] if dims[3] > 1 else 16)
    assert maps[-1] == ("u32", (dims, steps), (4, 192), 0)

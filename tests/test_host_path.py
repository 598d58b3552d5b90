"""The device-resident call path on a CPU, through the fake driver of ``fake_driver.py``: which
driver calls a repeat call makes, the stream-order rule on it, and the repeat-call fast path
(a changed shape, stride, dtype, device or option must miss it).

torch is the stand-in ``fake_driver.fake_torch()`` installed as ``sys.modules["torch"]``.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from pyattn.runtime.stream import LEGACY_STREAM, Stream, borrowed

SHAPE = (1, 16, 2, 64)


@pytest.fixture
def gpu(monkeypatch):
    fake = fake_driver.install(monkeypatch)
    torch = fake_driver.fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    fake.torch = torch
    return fake


def _repeat_calls(fn) -> dict:
    """Driver calls of the second of two calls (the first validates, plans and loads)."""
    keep = fn()
    fake_driver.CALLS.clear()
    keep = fn()  # noqa: F841 (rebinding frees the first result, as a loop does)
    return dict(fake_driver.CALLS)


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
    """A repeat tiny call: the context check, the result's allocation, the launch, and the free of
    the previous result; nothing else."""
    d = pyattn.empty(SHAPE, np.float16)
    assert _repeat_calls(lambda: pyattn.attention(d, d, d)) == {
        "cuCtxGetCurrent": 1, "cuMemAllocFromPoolAsync": 1, "cuLaunchKernel": 1, "cuMemFreeAsync": 1}


def test_torch_current_stream_read_once_per_call(gpu):
    torch = gpu.torch
    t = torch.Tensor(SHAPE, pyattn.empty(SHAPE, np.float16).ptr)
    pyattn.attention(t, t, t)
    torch.stream_reads = 0
    calls = _repeat_calls(lambda: pyattn.attention(t, t, t))
    assert torch.stream_reads == 2  # one per call
    assert "cuStreamWaitEvent" not in calls  # it runs on the stream that wrote its inputs

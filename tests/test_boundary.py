"""The array boundary on a CPU: reading users' arrays, the stream-order rule, DLPack export of every
dtype, the signature memo, and NVRTC kept out of the process.

torch is faked by a module installed as ``sys.modules["torch"]`` (pyattn never imports torch, it
only looks there), so the torch fast path and the torch stream rule run without torch or a GPU.
"""

from __future__ import annotations

import inspect
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import pyattn
from pyattn.interop import inputs, streams
from pyattn.interop.inputs import LEGACY_PRODUCER, TORCH_PRODUCER, read
from pyattn.pipeline.plans import signature
from pyattn.runtime import dlpack
from pyattn.runtime.stream import LEGACY_STREAM

BF16 = np.dtype(ml_dtypes.bfloat16)


# -- a fake torch ------------------------------------------------------------------------------------
class _FakeTorchDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


def _fake_torch(current_stream=0x7000):
    torch = types.ModuleType("torch")

    class Tensor:
        def __init__(self, shape, dtype="float16", ptr=0x10000, device=0, stride=None):
            self.shape, self.dtype, self._ptr, self._device = tuple(shape), _FakeTorchDtype(dtype), ptr, device
            self._stride = stride or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
            self.reads = 0

        def data_ptr(self):
            self.reads += 1
            return self._ptr

        def stride(self):
            return self._stride

        def get_device(self):
            return self._device

        @property
        def __cuda_array_interface__(self):  # torch's own: slow, and no stream; must not be used
            raise AssertionError("the torch fast path must not read __cuda_array_interface__")

    torch.Tensor = Tensor
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda ordinal: torch.current)
    torch.current = current_stream
    return torch


@pytest.fixture
def torch(monkeypatch):
    fake = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    return fake


def test_torch_tensors_are_read_by_attribute(torch):
    t = torch.Tensor((1, 4, 2, 64), "bfloat16", ptr=0x20000, device=0, stride=(4 * 2 * 64, 64, 4 * 64, 1))
    a = read("q", t)
    assert (a.kind, a.shape, a.dtype, a.strides, a.ordinal, a.ptr) == (
        inputs.TORCH, (1, 4, 2, 64), BF16, (512, 64, 256, 1), 0, 0x20000)
    assert a.producer is TORCH_PRODUCER


class _Dev:
    ordinal = 0


class _Stream:
    def __init__(self, ptr):
        self.ptr, self.device = ptr, _Dev()


def _orderings(monkeypatch, torch_stream=0x7000):
    """Record ``order_after(consumer, producer)`` calls; the torch stream is ``torch_stream``."""
    calls = []
    monkeypatch.setattr(streams, "order_after", lambda consumer, producer: calls.append((consumer.ptr, producer)))
    monkeypatch.setattr(streams, "torch_current_stream", lambda device: _Stream(torch_stream))
    monkeypatch.setattr(streams, "default_stream", lambda device: _Stream(0xAAAA))
    monkeypatch.setattr(streams, "as_stream", lambda stream, device: _Stream(stream))
    return calls


def _cai_obj(stream="absent", version=3):
    cai = {"shape": (2, 8), "typestr": "<f2", "data": (0x5000, False), "version": version}
    if stream != "absent":
        cai["stream"] = stream
    return types.SimpleNamespace(__cuda_array_interface__=cai)


def test_stream_rule_torch_inputs_run_on_torchs_stream(torch, monkeypatch):
    calls = _orderings(monkeypatch)
    t = read("q", torch.Tensor((2, 8)))
    s, torch_now = streams.choose_stream(None, _Dev(), True)
    assert s.ptr == torch_now == 0x7000  # rule 2: torch's current stream
    streams.order_inputs(s, _Dev(), [t, None], torch_now)
    assert calls == []  # already on the stream that wrote it
    s, torch_now = streams.choose_stream(0x1234, _Dev(), True)  # rule 1: an explicit stream...
    assert torch_now is None
    streams.order_inputs(s, _Dev(), [t])
    assert calls == [(0x1234, 0x7000)]  # ...waits for torch's current stream


def test_stream_rule_cai_and_device_arrays(monkeypatch):
    calls = _orderings(monkeypatch)
    v3 = read("k", _cai_obj(stream=0x3333))
    no_stream = read("v", _cai_obj())
    v2 = read("mask", _cai_obj(version=2))
    assert (v3.producer, no_stream.producer, v2.producer) == (0x3333, LEGACY_PRODUCER, LEGACY_PRODUCER)
    producer = _Stream(0x4444)
    own = pyattn.DeviceArray(0x8000, (2, 8), np.float16, None, stream=producer)
    same = pyattn.DeviceArray(0x9000, (2, 8), np.float16, None, stream=_Stream(0xAAAA))
    args = [v3, no_stream, v2, read("a", own), read("b", same)]
    s, _ = streams.choose_stream(None, _Dev(), False)
    assert s.ptr == 0xAAAA  # rule 3: pyattn's own stream
    streams.order_inputs(s, _Dev(), args)
    # each other producer once: the CAI v3 stream, the legacy stream (both legacy-rule inputs), the DeviceArray's
    assert calls == [(0xAAAA, 0x3333), (0xAAAA, LEGACY_STREAM), (0xAAAA, 0x4444)]


def test_malformed_array_interfaces_are_refused_naming_the_argument():
    bad = {
        "not a dict": [1, 2],
        "no typestr": {"shape": (2,), "data": (0, False), "version": 3},
        "negative dim": {"shape": (2, -1), "typestr": "<f2", "data": (0, False), "version": 3},
        "bad data": {"shape": (2,), "typestr": "<f2", "data": "x", "version": 3},
        "read-only": {"shape": (2,), "typestr": "<f2", "data": (0, True), "version": 3},
        "masked": {"shape": (2,), "typestr": "<f2", "data": (0, False), "version": 3, "mask": object()},
        "stream 0": {"shape": (2,), "typestr": "<f2", "data": (0, False), "version": 3, "stream": 0},
        "strides rank": {"shape": (2, 2), "typestr": "<f2", "data": (0, False), "version": 3, "strides": (2,)},
        "bad typestr": {"shape": (2,), "typestr": "zz", "data": (0, False), "version": 3},
    }
    for what, cai in bad.items():
        with pytest.raises((TypeError, ValueError), match=r"^q: "):
            read("q", types.SimpleNamespace(__cuda_array_interface__=cai))
    with pytest.raises(ValueError, match=r"^shape: expected non-negative dims"):
        pyattn.DeviceArray(0, (2, -3), np.float16, None)


# -- DLPack export of every dtype --------------------------------------------------------------------
def _tensor_fields(capsule):
    """(device type, device id, ndim, code, bits, lanes, shape, strides) as a consumer reads them."""
    head = object.__basicsize__
    struct_ptr = int(dlpack._view(id(capsule) + head, 8).view(np.uint64)[0])
    off = 32 if "versioned" in repr(capsule) else 0
    t = dlpack._view(struct_ptr + off, 48)
    dev, ordinal, ndim = (int(x) for x in t[8:20].view(np.int32))
    shape_ptr, strides_ptr = (int(x) for x in t[24:40].view(np.uint64))
    shape = tuple(int(x) for x in dlpack._view(shape_ptr, 8 * ndim).view(np.int64))
    strides = tuple(int(x) for x in dlpack._view(strides_ptr, 8 * ndim).view(np.int64))
    return dev, ordinal, ndim, int(t[20]), int(t[21]), int(t[22:24].view(np.uint16)[0]), shape, strides


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("dtype, code", [(np.float32, 2), (np.float16, 2), (BF16, 4),
                                         (np.dtype(ml_dtypes.float8_e4m3fn), 10),
                                         (np.dtype(ml_dtypes.float8_e5m2), 12), (np.int32, 0), (np.bool_, 6)])
def test_dlpack_export_names_the_dtype_and_the_cuda_device(dtype, code, versioned):
    dt = np.dtype(dtype)
    a = pyattn.DeviceArray(0x7F0000001000, (2, 3, 4), dt, types.SimpleNamespace(ordinal=3),
                           strides=(4 * dt.itemsize, 8 * dt.itemsize, dt.itemsize))  # a transposed view
    cap = a.__dlpack__(stream=-1, max_version=(1, 0) if versioned else None)
    assert ("versioned" in repr(cap)) == versioned
    fields = _tensor_fields(cap)
    assert fields == (2, 3, 3, code, 8 * dt.itemsize, 1, (2, 3, 4), (4, 8, 1))
    assert a.__dlpack_device__() == (2, 3)


def test_dlpack_capsule_is_read_as_cuda_by_a_real_consumer():
    """NumPy consumes DLPack capsules: it sees the device we wrote, and refuses (CPU only)."""
    a = pyattn.DeviceArray(0x7F0000001000, (4,), np.float16, types.SimpleNamespace(ordinal=0))
    wrapper = types.SimpleNamespace(__dlpack__=lambda **kw: a.__dlpack__(stream=-1),
                                    __dlpack_device__=lambda: (1, 0))
    with pytest.raises((RuntimeError, BufferError), match="Unsupported device"):
        np.from_dlpack(wrapper)


def test_dlpack_refuses_what_it_cannot_name():
    a = pyattn.DeviceArray(0x1000, (2,), np.dtype("V4"), types.SimpleNamespace(ordinal=0))
    with pytest.raises(BufferError, match="no type code"):
        a.__dlpack__(stream=-1)
    with pytest.raises(BufferError, match="copy=True"):
        a.__dlpack__(stream=-1, copy=True)


def test_cuda_array_interface_only_for_dtypes_it_can_name():
    dev = types.SimpleNamespace(ordinal=0)
    assert pyattn.DeviceArray(0x1000, (2,), np.float16, dev).__cuda_array_interface__["typestr"] == "<f2"
    for dt in (BF16, ml_dtypes.float8_e4m3fn):
        x = pyattn.DeviceArray(0x1000, (2,), dt, dev)
        assert not hasattr(x, "__cuda_array_interface__")  # so consumers take __dlpack__


# -- the signature memo ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [pyattn.attention, pyattn.decode])
def test_signature_covers_every_parameter_but_stream(op):
    """The memo key is made from the op's locals(): every parameter but ``stream`` must change it."""
    names = [n for n in inspect.signature(op).parameters if n != "stream"]
    base = {n: f"<{n}>" for n in names}
    keys = {n: signature(dict(base, **{n: f"<other {n}>"}, stream=None), {}) for n in names}
    keys["base"] = signature(dict(base, stream=None), {})
    assert len(set(keys.values())) == len(keys)
    assert signature(dict(base, stream="a"), {}) == signature(dict(base, stream="b"), {})


def test_memo_takes_host_arrays_only_where_named_and_no_unhashables():
    host = read("q", np.zeros((1, 2, 1, 8), np.float16))
    assert signature({"q": host.obj, "stream": None}, {"q": host}) is None
    # named: validation reads only its kind, shape, dtype and strides (attention's q, k, v)
    named = signature({"q": host.obj, "stream": None}, {"q": host}, host_ok=("q",))
    other = read("q", np.zeros((1, 2, 1, 8), np.float32))
    assert named is not None and named != signature({"q": other.obj, "stream": None}, {"q": other}, host_ok=("q",))
    assert signature({"mask": host.obj, "stream": None}, {"mask": host}, host_ok=("q",)) is None
    assert signature({"window": [1, 2], "stream": None}, {}) is None  # a list: validated every call
    dev = read("q", pyattn.DeviceArray(0x1000, (1, 2, 1, 8), np.float16, None))
    params = {"q": dev.obj, "window": (1, 2), "stream": None}
    assert signature(params, {"q": dev}) == signature(dict(params), {"q": dev}) is not None

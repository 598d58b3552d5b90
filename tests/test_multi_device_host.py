"""Two devices in one process, on a CPU through the fake driver (two fake devices, a context each).

A framework that holds device 0 (torch's or CuPy's current device is the thread's current
context) calls pyattn on arrays of device 1. Every public call must then (a) do its device work in
device 1's context: kernels loaded there and launched there, on device 1's streams, events recorded
on streams of their own context, and context-relative stream handles (the legacy and per-thread
streams) read while device 1's context is current; and (b) put device 0's context back when it
returns or raises (``pyattn.runtime.device.keeps_context``), first calls and repeat calls alike.
The fake driver notes every call that mixed contexts (``mixed``) and every context-relative handle
with the context current then (``relative``). ``tests/test_gpu_multi_device.py`` runs the same on
two real GPUs.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from _host_path_helpers import _da
from test_foreign_repeat import _Dl

CTX0, CTX1 = fake_driver._CTX, fake_driver._CTX + 1
S = (1, 16, 2, 64)


def _d1(shape=S, dtype=np.float16):
    return _da(shape, dtype, device=pyattn.get_device(1))


def _cache1():
    cache = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16", device=1)
    ids = [cache.add_sequence() for _ in range(2)]
    kv = np.zeros((2, 40, 2, 64), ml_dtypes.bfloat16)
    cache.append(ids, kv, kv)
    return cache, ids


def _attention():
    q = _d1()
    return lambda: pyattn.attention(q, q, q, causal=True)


def _merge():
    q = _d1()
    o, lse = pyattn.attention(q, q, q, return_lse=True)
    return lambda: pyattn.merge_states(o, lse, o, lse)


def _varlen():
    q, cu = _d1((16, 2, 64)), _d1((2,), np.int32)
    return lambda: pyattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=16, max_seqlen_k=16)


def _backward():
    q = _d1()
    o, lse = pyattn.attention(q, q, q, return_lse=True)
    return lambda: pyattn.attention_backward(q, q, q, q, o, lse)


def _decode():
    cache, ids = _cache1()
    q = _d1((2, 1, 8, 64), ml_dtypes.bfloat16)
    return lambda: pyattn.decode(q, cache, ids)


def _contiguous():
    q, kc = _d1((2, 1, 8, 64), ml_dtypes.bfloat16), _d1((2, 64, 2, 64), ml_dtypes.bfloat16)
    return lambda: pyattn.contiguous_decode(q, kc, kc, 40)


def _paged_decode_numpy_tables():
    q, kp = _d1((2, 1, 8, 64), ml_dtypes.bfloat16), _d1((32, 16, 2, 64), ml_dtypes.bfloat16)
    table, lens = np.arange(8, dtype=np.int32).reshape(2, 4), np.array([60, 33], np.int32)
    return lambda: pyattn.paged_decode(q, kp, kp, block_table=table, seq_lens=lens)  # (tables uploaded)


def _contiguous_ragged():
    q, kc = _d1((2, 1, 8, 64), ml_dtypes.bfloat16), _d1((2, 64, 2, 64), ml_dtypes.bfloat16)
    lens = np.array([40, 17], np.int32)
    return lambda: pyattn.contiguous_decode(q, kc, kc, lens)


def _prefill():
    cache, ids = _cache1()
    q = _d1((2, 8, 8, 64), ml_dtypes.bfloat16)
    return lambda: pyattn.prefill(q, cache, ids)


class _LegacyCai:
    """A CUDA array interface of device 1 with no stream (written on that device's legacy stream),
    telling its device through ``__dlpack_device__``."""

    def __init__(self, da):
        self.__cuda_array_interface__ = {"shape": da.shape, "typestr": da.dtype.str, "data": (da.ptr, False),
                                         "version": 2}

    def __dlpack_device__(self):
        return (2, 1)


def _legacy_interface():
    q = _LegacyCai(_d1())
    return lambda: pyattn.attention(q, q, q)  # waits for device 1's legacy stream: 1 read in its context


def _append():
    cache, ids = _cache1()
    kv = _d1((2, 1, 2, 64), ml_dtypes.bfloat16)
    return lambda: cache.append(ids, kv, kv)


def _cache_made():
    return lambda: _cache1()


def _asarray():
    x = np.zeros(S, np.float16)
    return lambda: pyattn.asarray(x, device=pyattn.get_device(1))


def _numpy():
    a = _d1()
    return lambda: a.numpy()


def _dlpack_legacy():
    q = _d1()
    out = pyattn.attention(q, q, q)  # its stream: pyattn's own of device 1
    return lambda: out.__dlpack__(stream=1)  # torch's default stream: device 1's legacy stream


def _stream_event():
    dev = pyattn.get_device(1)
    return lambda: (pyattn.Stream(dev), pyattn.Event(dev), dev.synchronize())


CALLS = {"attention": _attention, "merge_states": _merge, "attention_varlen": _varlen, "attention_backward": _backward,
         "decode": _decode, "contiguous_decode": _contiguous, "PagedKVCache.append": _append,
         "paged_decode, NumPy tables": _paged_decode_numpy_tables, "contiguous_decode, ragged": _contiguous_ragged,
         "prefill": _prefill, "attention, interfaces without a stream": _legacy_interface,
         "PagedKVCache()": _cache_made, "asarray": _asarray, "DeviceArray.numpy": _numpy,
         "__dlpack__(stream=1)": _dlpack_legacy, "Stream, Event, synchronize": _stream_event}


LEGACY = {"__dlpack__(stream=1)", "attention, interfaces without a stream"}  # (they read handle 1)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_on_device_1_works_there_and_puts_device_0_back(gpu, name):
    call = CALLS[name]()  # its arrays made on device 1 (by public calls, which put device 0 back too)
    for _ in range(3):  # a first call, then repeat calls (the fast paths)
        pyattn.get_device(0).activate()
        gpu.mixed.clear()
        gpu.relative.clear()
        call()
        assert gpu.current == CTX0, f"{name} left device 1's context current"
        assert not gpu.mixed, gpu.mixed
        assert all(ctx == CTX1 for _, _, ctx in gpu.relative), gpu.relative
        assert gpu.relative or name not in LEGACY, "the case no longer reaches a legacy-stream handle"


def test_a_thread_without_a_context(gpu):
    """No context current (nothing chose a device on this thread, which CUDA's runtime reads as
    device 0): a call on device 1 leaves none current again; a call on device 0 leaves device 0's
    (the same device to the runtime), so a one-GPU loop pays no switch a call."""
    q1, q0 = _d1(), _da(device=pyattn.get_device(0))
    gpu.current = 0
    pyattn.attention(q1, q1, q1)
    assert gpu.current == 0
    pyattn.attention(q0, q0, q0)
    assert gpu.current == CTX0
    fake_driver.CALLS.clear()
    pyattn.attention(q0, q0, q0)
    assert fake_driver.CALLS["cuCtxSetCurrent"] == 0


def test_the_context_is_put_back_when_the_call_raises(gpu, monkeypatch):
    q = _d1()
    pyattn.attention(q, q, q)  # (loaded: the next call reaches its launch at once)
    refused = (fake_driver.driver.CUresult.CUDA_ERROR_LAUNCH_FAILED,)
    monkeypatch.setattr(fake_driver.driver, "cuLaunchKernelEx", lambda *a: refused)
    pyattn.get_device(0).activate()
    with pytest.raises(pyattn.CudaError, match="CUDA_ERROR_LAUNCH_FAILED"):
        pyattn.attention(q, q, q)
    assert gpu.current == CTX0


def test_nested_public_calls_put_it_back_once(gpu):
    """Public calls made inside another wrapped call (as ``prefill`` calls its cache's wrapped
    methods) leave device 1 current between them; the outermost call puts device 0 back."""
    from pyattn.runtime.device import keeps_context

    q = _d1()

    @keeps_context
    def outer():
        pyattn.attention(q, q, q)
        inner_left = gpu.current
        pyattn.attention(q, q, q)
        return inner_left

    pyattn.get_device(0).activate()
    assert outer() == CTX1
    assert gpu.current == CTX0


def test_torch_tensors_on_cuda1_use_cuda1s_current_stream(gpu):
    """torch's current device 0, tensors on cuda:1: the call reads torch's current stream *of
    device 1* (rule 2), runs in device 1's context and puts device 0's back."""
    torch = gpu.torch
    t = torch.Tensor(S, _d1().ptr, device=1)
    for _ in range(2):
        pyattn.get_device(0).activate()
        torch.stream_ordinals.clear()
        out = pyattn.attention(t, t, t)
        assert out.device.ordinal == 1
        assert torch.stream_ordinals == [1]
        assert gpu.current == CTX0 and not gpu.mixed


def test_a_device_1_block_freed_while_device_0_is_current(gpu):
    """A result of device 1 dropped while device 0's context is current (a torch program on cuda:0
    holding it): its free, and the event that orders it after another stream that used the block,
    are made in device 1's context, and device 0's is current again afterwards."""
    import gc

    from pyattn.interop.streams import note_use

    dev1 = pyattn.get_device(1)
    a, b = pyattn.Stream(dev1), pyattn.Stream(dev1)
    block = pyattn.empty((1 << 20,), np.uint8, device=dev1, stream=a)  # over the pool's spare size
    note_use(b, [block])  # used on b too: the free waits for b (an event recorded on b)
    pyattn.get_device(0).activate()
    gpu.mixed.clear()
    fake_driver.CALLS.clear()
    del block
    gc.collect()
    pyattn.runtime._resource.run_deferred()  # (a free may be handed to the thread that owns the staging workers)
    assert fake_driver.CALLS["cuMemFreeAsync"] == 1 and fake_driver.CALLS["cuEventRecord"] == 1
    assert not gpu.mixed, gpu.mixed
    assert gpu.current == CTX0


def test_a_device_1_module_unloaded_while_device_0_is_current(gpu):
    """``cuModuleUnload`` works on the current context: a module of device 1 dropped under device 0's
    context is unloaded in its own, and device 0's is current again afterwards."""
    from pyattn.runtime.module import Module

    module = Module(pyattn.get_device(1), b"\0")
    pyattn.get_device(0).activate()
    gpu.mixed.clear()
    fake_driver.CALLS.clear()
    module.close()
    pyattn.runtime._resource.run_deferred()
    assert fake_driver.CALLS["cuModuleUnload"] == 1
    assert not gpu.mixed, gpu.mixed
    assert gpu.current == CTX0


def test_a_stream_of_another_device_is_refused_before_any_work(gpu):
    """``stream=`` of device 1 for arrays of device 0: a ValueError naming ``stream``, before the call
    allocates or launches anything (a pyattn Stream, its raw handle, a ``__cuda_stream__`` object)."""

    class Foreign:
        def __init__(self, ptr):
            self.__cuda_stream__ = (0, ptr)

    q = _da()  # device 0
    s1 = pyattn.Stream(pyattn.get_device(1))
    pyattn.attention(q, q, q)  # (planned and loaded: the refused calls would otherwise get that far only)
    for stream in (s1, s1.ptr, Foreign(s1.ptr)):
        fake_driver.CALLS.clear()
        with pytest.raises(ValueError, match="stream: expected a stream of device 0"):
            pyattn.attention(q, q, q, stream=stream)
        assert not fake_driver.CALLS["cuLaunchKernelEx"] and not fake_driver.CALLS["cuMemAllocFromPoolAsync"]
    s0 = pyattn.Stream(pyattn.get_device(0))
    pyattn.attention(q, q, q, stream=s0.ptr)  # its own device's: fine


@pytest.mark.parametrize("kind", ["DeviceArray", "torch", "interface", "dlpack"])
def test_repeat_calls_alternating_between_devices(gpu, kind):
    """One signature on device 0 and on device 1 in turn (the repeat path's quick keys): each call
    runs on its arrays' device, in its context, every input kind."""
    def make(ordinal):
        da = _da(device=pyattn.get_device(ordinal))
        if kind == "torch":
            return gpu.torch.Tensor(S, da.ptr, device=ordinal)
        if kind == "interface":
            return _Interface(da, ordinal)
        if kind == "dlpack":  # a JAX-like array: imported on the call's stream, its export ordering it
            return _Dl(da)
        return da

    x = {0: make(0), 1: make(1)}
    for ordinal in (0, 1, 0, 1, 1, 0):
        gpu.mixed.clear()
        out = pyattn.attention(x[ordinal], x[ordinal], x[ordinal])
        assert out.device.ordinal == ordinal and not gpu.mixed, (ordinal, gpu.mixed)


class _Interface:
    """A CuPy-like array of device ``ordinal`` (a v3 interface with its stream, and its device)."""

    def __init__(self, da, ordinal):
        self.ordinal = ordinal
        self.__cuda_array_interface__ = {"shape": da.shape, "typestr": da.dtype.str, "data": (da.ptr, False),
                                         "version": 3, "stream": da.stream.ptr}

    def __dlpack_device__(self):
        return (2, self.ordinal)

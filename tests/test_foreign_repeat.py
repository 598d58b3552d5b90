"""Foreign device arrays on the repeat-call path, on a CPU through the fake driver: CUDA array
interfaces (CuPy, Numba) keyed by their interface dict and DLPack-only arrays (JAX) by their
attributes. A repeat reads each array once and follows new pointers and producer streams; a
changed layout misses; whatever the full path refuses is refused after a hit too, with the same
error (hypothesis fuzzes of interface dicts and of DLPack-only arrays).
"""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fake_driver
import pyattn
from _host_path_helpers import _da, _repeat_calls  # (its fixtures gpu, full, cache, full_decode: conftest.py)


# -- CUDA array interfaces (CuPy, Numba, ...) on the fast path ------------------------------------------
class _Cai:
    """A CuPy-like array: its interface dict built on each access (with the stream current now),
    its device told by ``__dlpack_device__``. ``reads`` counts the interface's reads; ``given``, a
    whole dict to hand out instead, and ``named``, its ``dtype`` attribute, serve the fuzz below."""

    def __init__(self, da, stream=0x5000, typestr=None, strides=None, ordinal=0, **extra):
        self.da, self.stream, self.ordinal, self.extra, self.reads = da, stream, ordinal, extra, 0
        self.typestr = typestr or da.dtype.str
        self.strides = strides
        self.given, self.named = None, da.dtype

    def __dlpack_device__(self):
        return (2, self.ordinal)

    @property
    def dtype(self):  # (names bfloat16, whose interface typestr is the opaque '<V2')
        return self.named

    @property
    def __cuda_array_interface__(self):
        self.reads += 1
        if self.given is not None:
            return dict(self.given)
        cai = {"shape": self.da.shape, "typestr": self.typestr, "data": (self.da.ptr, False),
               "strides": self.strides, "version": 3, "stream": self.stream}
        cai.update(self.extra)
        return cai


def test_cai_repeat_calls_take_the_fast_path(gpu, full):
    """A repeat call on interface arrays reads each interface once, and follows its new pointer
    and its new producer stream; the driver calls are those of a DeviceArray call plus the wait
    for the producer (rule 3: pyattn's stream waits for the interface's stream)."""
    gpu.record_launches = True
    a, b = _Cai(_da()), _Cai(_da())
    pyattn.attention(a, a, a)
    assert len(full) == 1
    a.reads = 0
    fake_driver.LAUNCHES.clear()
    fake_driver.CALLS.clear()
    o = pyattn.attention(a, b, a)
    assert len(full) == 1 and a.reads == 2 and b.reads == 1
    assert fake_driver.LAUNCHES[0][3][:4] == (a.da.ptr, b.da.ptr, a.da.ptr, o.ptr)
    del o  # (in a steady loop the previous result's block is reused)
    assert _repeat_calls(lambda: pyattn.attention(a, b, a)) == {  # one wait: a and b name the same stream
        "cuCtxGetCurrent": 1, "cuEventRecord": 1, "cuStreamWaitEvent": 1, "cuLaunchKernelEx": 1,
        "cuStreamIsCapturing": 2}  # (before the wait and before the result's block: no graph capture)
    b.stream = 0x6000  # the user switched streams: the op waits for the new one too
    fake_driver.CALLS.clear()
    pyattn.attention(a, b, a)
    assert fake_driver.CALLS["cuStreamWaitEvent"] == 2 and len(full) == 1
    b.stream = None  # CAI v3 without a stream: the legacy default stream wrote it
    fake_driver.CALLS.clear()
    pyattn.attention(a, b, a)
    assert fake_driver.CALLS["cuStreamWaitEvent"] == 2 and len(full) == 1
    out = _Cai(_da())
    pyattn.attention(a, a, a, out=out)
    assert pyattn.attention(a, a, a, out=out) is out and len(full) == 2


class _CupyLike(_Cai):
    """A CuPy array as pyattn tells one: its type's module is CuPy's. Its interface names CuPy's
    current stream (the legacy stream as 1), as CuPy's does."""

    __module__ = "cupy._core.core"


def _fake_cupy(monkeypatch, ptr):
    """``sys.modules["cupy"]`` with a current stream of handle ``ptr``; returns that stream object."""
    current = types.SimpleNamespace(ptr=ptr)
    devices = []

    def get_current_stream(device_id=-1):
        devices.append(device_id)
        return current

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=get_current_stream)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    current.devices = devices
    return current


def test_cupy_arrays_run_on_cupys_current_stream(gpu, full, monkeypatch):
    """Stream rule 2 for CuPy: a call with CuPy inputs runs on CuPy's current stream of the arrays'
    device (the stream their interface names), with no event and no wait, on the full path and the
    repeat path alike; its result lives on that stream and keeps CuPy's stream object alive."""
    gpu.record_launches = True
    current = _fake_cupy(monkeypatch, 0x5000)
    a = _CupyLike(_da(), stream=0x5000)
    fake_driver.CALLS.clear()
    o = pyattn.attention(a, a, a)
    assert len(full) == 1 and "cuStreamWaitEvent" not in fake_driver.CALLS
    assert o.stream.ptr == 0x5000 and o.stream._owner is current and current.devices[-1] == 0
    del o
    fake_driver.LAUNCHES.clear()
    calls = _repeat_calls(lambda: pyattn.attention(a, a, a))
    assert len(full) == 1 and "cuStreamWaitEvent" not in calls and "cuEventRecord" not in calls
    assert {launch[2] for launch in fake_driver.LAUNCHES} == {0x5000}
    current.ptr = a.stream = 0  # CuPy's null stream: the legacy stream, which its interface names 1
    a.stream = 1
    fake_driver.CALLS.clear()
    o = pyattn.attention(a, a, a)
    assert o.stream.ptr == 1 and "cuStreamWaitEvent" not in fake_driver.CALLS
    # rule 1 first: an explicit stream waits for the interface's stream
    s = pyattn.Stream()
    fake_driver.CALLS.clear()
    assert pyattn.attention(a, a, a, stream=s).stream is s
    assert fake_driver.CALLS["cuStreamWaitEvent"] == 1
    # a torch tensor among the inputs: torch's current stream, which waits for CuPy's
    t = gpu.torch.Tensor(a.da.shape, a.da.ptr)
    fake_driver.CALLS.clear()
    o = pyattn.attention(t, a, a)
    assert o.stream.ptr != 1 and fake_driver.CALLS["cuStreamWaitEvent"] == 1
    # pyattn.asarray of a CuPy array: a view ordered on CuPy's stream
    assert pyattn.asarray(a).stream.ptr == 1


def test_cupy_is_told_by_its_types_module():
    from pyattn.interop.streams import is_cupy

    assert is_cupy(_CupyLike(types.SimpleNamespace(shape=(1,), dtype=np.dtype(np.float16), ptr=0)))
    assert not is_cupy(_Cai(types.SimpleNamespace(shape=(1,), dtype=np.dtype(np.float16), ptr=0)))
    assert not is_cupy(np.zeros(2)) and not is_cupy(types.SimpleNamespace(__module__="cupy"))


@pytest.mark.parametrize("what", ["shape", "strides", "typestr", "device", "type"])
def test_cai_layout_changes_miss_the_fast_path(gpu, full, what):
    x = _Cai(_da())
    pyattn.attention(x, x, x)
    pyattn.attention(x, x, x)
    assert len(full) == 1
    swapped = (x.da.strides[0], x.da.strides[2], x.da.strides[1], x.da.strides[3])  # bytes: a transposed view

    class Other(_Cai):
        pass

    y = {"shape": lambda: _Cai(_da((1, 32, 2, 64))), "strides": lambda: _Cai(_da(), strides=swapped),
         "typestr": lambda: _Cai(_da(dtype=np.float32)), "device": lambda: _Cai(_da(device=pyattn.get_device(1)),
                                                                                  ordinal=1),
         "type": lambda: Other(_da())}[what]()
    pyattn.attention(y, y, y)
    assert len(full) == 2
    pyattn.attention(y, y, y)
    assert len(full) == 2


@pytest.mark.parametrize("bad, match", [
    (dict(data=(0x10000, True)), r"^k: the array is read-only"),
    (dict(mask=(1,)), r"^k: masked arrays are not supported"),
    (dict(stream=0), r"^k: __cuda_array_interface__ stream must be None or a nonzero int"),
    (dict(stream="7"), r"^k: __cuda_array_interface__ stream must be None or a nonzero int"),
    (dict(data=(-1, False)), r"^k: __cuda_array_interface__ data must be"),
])
def test_cai_fields_the_full_path_refuses_are_refused_after_a_hit(gpu, full, bad, match):
    """The key holds the layout only: an interface of the same layout whose other fields are bad
    leaves the fast path and is refused there, naming the argument."""
    x = _Cai(_da())
    pyattn.attention(x, x, x)
    pyattn.attention(x, x, x)
    y = _Cai(x.da)
    stream = bad.pop("stream", "keep")
    if stream != "keep":
        y.stream = stream
    y.extra = bad
    with pytest.raises((ValueError, TypeError), match=match):
        pyattn.attention(x, y, x)


def test_cai_fast_path_checks_addresses(gpu, full):
    x = _Cai(_da())
    pyattn.attention(x, x, x)
    y = _Cai(_da(ptr=x.da.ptr + 2))
    with pytest.raises(ValueError, match=r"^k: .*16-byte aligned"):
        pyattn.attention(x, y, x)
    assert len(full) == 1  # refused on the fast path


def test_cai_without_a_told_device_has_no_fast_path(gpu, full):
    """Without ``__dlpack_device__`` the device is asked of the driver each call: no key."""
    import types

    x = _da()
    cai = {"shape": x.shape, "typestr": "<f2", "data": (x.ptr, False), "version": 3}
    ns = types.SimpleNamespace(__cuda_array_interface__=cai)
    for _ in range(3):
        pyattn.attention(ns, ns, ns)
    assert len(full) == 3


def test_cai_decode_and_append_repeat_calls(gpu, cache, full_decode):
    c, ids = cache
    gpu.record_launches = True
    q = _Cai(_da((2, 1, 8, 64), ml_dtypes.bfloat16))
    pyattn.decode(q, c, ids)
    q2 = _Cai(_da((2, 1, 8, 64), ml_dtypes.bfloat16))
    fake_driver.LAUNCHES.clear()
    out = pyattn.decode(q2, c, ids)
    assert len(full_decode) == 1 and q2.reads == 1
    assert fake_driver.LAUNCHES[0][3][:4] == (q2.da.ptr, c.k.ptr, c.v.ptr, out.ptr)
    k = _Cai(_da((2, 1, 2, 64), ml_dtypes.bfloat16))
    c.append(ids, k, k)
    assert k.reads == 4  # the full path: the key's read and the Arg's, as k and as v
    k2 = _Cai(_da((2, 1, 2, 64), ml_dtypes.bfloat16))
    c.append(ids, k2, k2)
    assert k2.reads == 2  # a repeat append: the key's reads only
    assert [c.length(i) for i in ids] == [258, 258]


class _Dl:
    """A JAX-like array: DLPack only, its shape and dtype as attributes (no strides: dense). Records
    the consumer stream of each export; ``device`` overrides what ``__dlpack_device__`` says."""

    def __init__(self, da):
        self.da, self.shape, self.dtype, self.streams, self.device = da, da.shape, da.dtype, [], None

    def __dlpack_device__(self):
        return self.da.__dlpack_device__() if self.device is None else self.device

    def __dlpack__(self, stream=None, **kw):
        self.streams.append(stream)
        return self.da.__dlpack__(stream=stream, **kw)


def test_dlpack_repeat_calls_take_the_fast_path_and_import_on_the_calls_stream(gpu, full):
    gpu.record_launches = True
    a, b = _Dl(_da()), _Dl(_da())
    pyattn.attention(a, a, a)
    assert len(full) == 1
    fake_driver.LAUNCHES.clear()
    o = pyattn.attention(a, b, a)
    assert len(full) == 1
    (_, _, stream, p), = fake_driver.LAUNCHES
    assert p[:4] == (a.da.ptr, b.da.ptr, a.da.ptr, o.ptr)
    assert b.streams == [stream]  # imported once, with the call's stream as the consumer
    with pyattn.Stream() as s:
        pyattn.attention(a, b, a, stream=s)
        assert b.streams[-1] == s.ptr


def test_dlpack_fast_path_checks_the_export_and_addresses(gpu, full):
    a = _Dl(_da())
    pyattn.attention(a, a, a)
    liar = _Dl(_da((1, 8, 2, 64)))
    liar.shape = a.shape  # its attributes say one shape, its export another
    with pytest.raises(ValueError, match=r"^k: its DLPack export has shape \(1, 8, 2, 64\)"):
        pyattn.attention(a, liar, a)
    with pytest.raises(ValueError, match=r"^k: .*16-byte aligned"):
        pyattn.attention(a, _Dl(_da(ptr=a.da.ptr + 2)), a)
    assert len(full) == 1  # both refused on the fast path


# -- the fast path accepts and refuses exactly what the full path does ----------------------------------
_ABSENT = object()


@st.composite
def _interfaces(draw):
    """An interface dict near a valid (1, 16, 2, 64) float16 one, with one to three fields changed."""
    base = _da()
    ptr, strides = base.ptr, base.strides
    options = {
        "data": [(ptr, False), (ptr, True), [ptr, False], (np.int64(ptr), False), (-1, False), ("x", False),
                 (ptr,), (ptr + 2, False)],
        "stream": [_ABSENT, None, 0, 1, 0x5000, -1, "7", True, 2 ** 63],
        "version": [_ABSENT, 2, 3, "3", None],
        "mask": [_ABSENT, None, (1,)],
        "typestr": ["<f2", "<f4", "<V2", "<i2", "f2", 7],
        "shape": [(1, 16, 2, 64), [1, 16, 2, 64], (1, 16, 2, -1), (1, 8, 2, 64)],
        "strides": [None, strides, (strides[0], strides[2], strides[1], strides[3]), (3, 3, 3, 3), (1, 2)],
    }
    cai = {"shape": (1, 16, 2, 64), "typestr": "<f2", "data": (ptr, False), "strides": None, "version": 3,
           "stream": 0x5000}
    for field in draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=3, unique=True)):
        value = draw(st.sampled_from(options[field]))
        if value is _ABSENT:
            cai.pop(field, None)
        else:
            cai[field] = value
    named = draw(st.sampled_from([None, np.dtype(np.float16), np.dtype(np.float32)]))
    return base, cai, named


def _outcome(call):
    """What a call did: the q / k / v addresses it launched with, or its error's type and message."""
    fake_driver.LAUNCHES.clear()
    try:
        call()
    except Exception as exc:  # noqa: BLE001  (compared as they are)
        return type(exc).__name__, str(exc)
    return "launched", fake_driver.LAUNCHES[-1][3][:3]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_interfaces())
def test_fast_path_agrees_with_the_full_path_on_any_interface(gpu, full, case):
    """Prime the fast path with a valid interface, then call with a changed one: the outcome (the
    addresses launched, or the error's type and message) is the full path's for the same call. A
    change that keeps the layout and is valid must take the fast path (the test is not vacuous)."""
    from pyattn.ops import attention as op

    gpu.record_launches = True
    base, cai, named = case
    x = _Cai(_da())
    pyattn.attention(x, x, x)  # the fast path now holds _Cai's layout
    y = _Cai(base)
    y.given, y.named = cai, named
    n = len(full)
    quick = _outcome(lambda: pyattn.attention(x, y, x))
    took_fast_path = len(full) == n
    op._quick._entries.clear()
    op._memo._entries.clear()
    assert quick == _outcome(lambda: pyattn.attention(x, y, x)), cai
    data, stream = cai["data"], cai.get("stream")
    valid_same_layout = (
        cai["shape"] == (1, 16, 2, 64) and type(cai["shape"]) is tuple and cai["typestr"] == "<f2"
        and cai["strides"] is None and type(data) is tuple and len(data) == 2 and type(data[0]) is int
        and data[0] >= 0 and data[1] is False and cai.get("mask") is None and type(cai.get("version", 0)) is int
        and (cai.get("version", 0) < 3 or stream is None or (type(stream) is int and stream != 0)))
    if valid_same_layout:
        assert took_fast_path, cai


@st.composite
def _dlpack_arrays(draw):
    """A DLPack-only array near a valid (1, 16, 2, 64) float16 one, with one to three things changed:
    its export (another layout or a misaligned address), its shape or dtype attributes, its device."""
    choices = {
        "export": [lambda: _da(), lambda: _da((1, 8, 2, 64)), lambda: _da(dtype=np.float32),
                   lambda: _da(ptr=_da().ptr + 2)],
        "shape": [(1, 16, 2, 64), [1, 16, 2, 64], (1, 8, 2, 64), None],
        "dtype": [np.dtype(np.float16), "float16", np.float16, "float32", None, "bogus"],
        "device": [None, (2, 0), (1, 0), (2, 1), (13, 0)],
    }
    changed = draw(st.lists(st.sampled_from(sorted(choices)), min_size=1, max_size=3, unique=True))
    picks = {k: draw(st.sampled_from(choices[k])) if k in changed else choices[k][0] for k in choices}
    y = _Dl(picks["export"]())
    y.shape, y.dtype, y.device = picks["shape"], picks["dtype"], picks["device"]
    return y


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(y=_dlpack_arrays())
def test_fast_path_agrees_with_the_full_path_on_any_dlpack_array(gpu, full, y):
    """As the interface fuzz above, for DLPack-only arrays: after a hit, a changed array gets the full
    path's outcome."""
    from pyattn.ops import attention as op

    gpu.record_launches = True
    x = _Dl(_da())
    pyattn.attention(x, x, x)  # the fast path now holds _Dl's layout
    quick = _outcome(lambda: pyattn.attention(x, y, x))
    op._quick._entries.clear()
    op._memo._entries.clear()
    assert quick == _outcome(lambda: pyattn.attention(x, y, x))

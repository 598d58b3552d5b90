"""``pyattn.merge_states`` validation on a CPU, and ``DeviceArray.transpose`` (which it serves).

LSEs come in the one convention every op returns: (B, H, S) for "bshd" and "bhsd" outputs, (H, T)
for "thd". Bad calls must raise before any GPU work (the driver is blocked, so a call that slips
through raises NoDeviceError instead); good calls of every form pass validation and reach the
driver. Needs no driver.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.runtime.device as device_mod
from _merge_states_helpers import BF16
from pyattn.array import DeviceArray
from pyattn.interop.inputs import read

BLOCKED = "driver blocked by test_merge_states_validation"


class FakeCudaArray:
    """A CUDA array as CAI describes it (byte strides, None = C order); data pointer 0, never read."""

    def __init__(self, shape, dtype=np.float32, strides=None):
        dt = np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "descr": dt.descr,
                                         "data": (0, False), "strides": strides, "version": 3}


@pytest.fixture
def blocked_driver(monkeypatch):
    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


def h(shape, dtype=np.float16):
    return np.ones(shape, dtype)


def d(shape, dtype=np.float16, strides=None):
    return FakeCudaArray(shape, dtype, strides)


O = h((2, 5, 3, 64))  # bshd: B=2, S=5, H=3, D=64
L = np.zeros((2, 3, 5), np.float32)  # its LSE: (B, H, S)
F32 = np.float32
VE, TE = ValueError, TypeError
BAD = {  # name: (positional args, keyword args, exception, regex of the message)
    "3 positional": ((O, L, O), {}, TE, r"^merge_states: expected \(o_a, lse_a, o_b, lse_b\) or \(os, lses\)"),
    "not an array": ((O, L, "x", L), {}, TE, r"^o_b: expected a NumPy array or a CUDA array"),
    "layout": ((O, L, O, L), {"layout": "bsh"}, VE, r"^layout: expected one of \('bshd', 'bhsd', 'thd'\)"),
    "o 3-D for bshd": ((h((2, 3, 64)), np.zeros((2, 3), F32)) * 2, {}, VE,
                       r"^o_a: expected \(batch, seq, heads, head_dim\) for layout='bshd', got \(2, 3, 64\)"),
    "o 4-D for thd": ((O, L) * 2, {"layout": "thd"}, VE, r"^o_a: expected \(total, heads, head_dim\)"),
    "o_b shape": ((O, L, h((2, 4, 3, 64)), L), {}, VE,
                  r"^o_b: expected shape \(2, 5, 3, 64\) \(from o_a\), got \(2, 4, 3, 64\)"),
    "lse as o.shape[:-1]": ((O, np.zeros((2, 5, 3), F32), O, L), {}, VE,
                            r"^lse_a: expected shape \(2, 3, 5\) \(the LSE of a bshd output of shape "
                            r"\(2, 5, 3, 64\)\), got \(2, 5, 3\)"),
    "bhsd lse": ((h((2, 3, 5, 64)), np.zeros((2, 5, 3), F32)) * 2, {"layout": "bhsd"}, VE,
                 r"^lse_a: expected shape \(2, 3, 5\)"),
    "thd lse (T, H)": ((h((7, 3, 64)), np.zeros((7, 3), F32)) * 2, {"layout": "thd"}, VE,
                       r"^lse_a: expected shape \(3, 7\)"),
    "lse dtype": ((O, L, O, L.astype(np.float64)), {}, TE, r"^lse_b: expected dtype float32 .*got float64"),
    "o dtype": ((O.astype(np.float64), L) * 2, {}, TE,
                r"^o_a: expected dtype float32, float16 or bfloat16, got float64"),
    "mixed o dtypes": ((O, L, O.astype(F32), L), {}, TE, r"^o_b: expected dtype float16 \(from o_a\), got float32"),
    "head_dim 12": ((h((2, 5, 3, 12)), L) * 2, {}, VE, r"^o_a: head_dim must be a multiple of 8 in \[8, 256\], got 12"),
    "head_dim 264": ((h((2, 5, 3, 264)), L) * 2, {}, VE, r"^o_a: head_dim must be .*got 264"),
    "host o, device lse": ((O, d((2, 3, 5), F32), O, L), {}, TE,
                           r"^merge_states: expected all host \(NumPy\) or all device arrays, got o_a on host, "
                           r"o_b on host, lse_a on device, lse_b on host"),
    "device in, host out": ((d((2, 5, 3, 64)), d((2, 3, 5), F32)) * 2, {"out": O}, TE, r"out on host"),
    "host NaN lse": ((O, L, O, np.full((2, 3, 5), np.nan, F32)), {}, VE, r"^lse_b: LSE values must be finite or -inf"),
    "host +inf lse": ((O, np.full((2, 3, 5), np.inf, F32), O, L), {}, VE, r"^lse_a: LSE values"),
    "D not contiguous": ((d((2, 5, 3, 64)), d((2, 3, 5), F32), d((2, 5, 3, 64), strides=(3840, 768, 256, 4)),
                          d((2, 3, 5), F32)), {}, VE,
                         r"^o_b: the head_dim axis must be contiguous \(stride 1 element\), "
                         r"got strides \(1920, 384, 128, 2\)"),
    "too many rows": ((d((2**16, 2**15 + 1, 8)), d((2**15 + 1, 2**16), F32)) * 2, {"layout": "thd"}, VE,
                      r"^o_a: dims, rows .* must each be < 2\*\*31"),
    # stacked and list forms
    "stack 4-D": ((h((2, 5, 3, 64)), np.zeros((2, 3, 5), F32)), {}, VE,
                  r"^os: expected \(n_states,\) \+ \(batch, seq, heads, head_dim\) for layout='bshd'"),
    "stack lses shape": ((h((4, 2, 5, 3, 64)), np.zeros((4, 2, 5, 3), F32)), {}, VE,
                         r"^lses: expected shape \(4, 2, 3, 5\) \(n_states \+ the LSE of a bshd output\), "
                         r"got \(4, 2, 5, 3\)"),
    "stack of none": ((h((0, 2, 5, 3, 64)), np.zeros((0, 2, 3, 5), F32)), {}, VE, r"^os: expected at least one state"),
    "list and array": (([O, O], np.zeros((2, 2, 3, 5), F32)), {}, TE,
                       r"^os, lses: expected two lists \(or tuples\) of arrays or two stacked arrays, "
                       r"got list and ndarray"),
    "empty lists": (([], []), {}, VE, r"^os, lses: expected equally long non-empty lists, got lengths 0 and 0"),
    "lists 3 and 2": (([O] * 3, [L] * 2), {}, VE, r"^os, lses: .*got lengths 3 and 2"),
    "list item shape": (([O, O, h((2, 5, 3, 72))], [L] * 3), {}, VE,
                        r"^os\[2\]: expected shape \(2, 5, 3, 64\) \(from os\[0\]\)"),
    "list lse shape": (([O, O], [L, L[:1]]), {}, VE, r"^lses\[1\]: expected shape \(2, 3, 5\)"),
    "list item type": (([O, None], [L, L]), {}, TE, r"^os\[1\]: expected a NumPy array"),
    "list mixed places": (([O, d((2, 5, 3, 64))], [L, L]), {}, TE, r"os\[1\] on device"),
    # out
    "out shape": ((O, L, O, L), {"out": h((2, 5, 3, 72))}, VE,
                  r"^out: expected shape \(2, 5, 3, 64\) and dtype float16, got shape \(2, 5, 3, 72\)"),
    "out dtype": ((O, L, O, L), {"out": h((2, 5, 3, 64), F32)}, VE, r"^out: expected .*dtype float32"),
    "out lse": ((O, L, O, L), {"out": (None, np.zeros((2, 5, 3), F32))}, VE,
                r"^out\[1\]: expected shape \(2, 3, 5\) and dtype float32, got shape \(2, 5, 3\)"),
    "out triple": ((O, L, O, L), {"out": (O, L, L)}, VE, r"^out: expected an array or an \(o, lse\) pair"),
    "out read-only": ((O, L, O, L), {"out": np.broadcast_to(O, O.shape)}, VE, r"^out: expected a writeable NumPy"),
    "out D strided": ((d((2, 5, 3, 64)), d((2, 3, 5), F32)) * 2, {"out": d((2, 5, 3, 64), strides=(3840, 768, 256, 4))},
                      VE, r"^out: the head_dim axis must be contiguous"),
    "stream": ((O, L, O, L), {"stream": "s"}, TE, r"^stream: expected None, a pyattn.Stream"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_calls_raise_before_gpu_work(case, blocked_driver):
    args, kwargs, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        pyattn.merge_states(*args, **kwargs)


GOOD = {  # name: (positional args, keyword args)
    "host pair": ((O, L, O, L), {}),
    "host stack bf16 5 states": ((h((5, 7, 2, 4, 256), BF16), np.zeros((5, 7, 4, 2), np.float32)), {}),
    "host lists thd": (([h((9, 2, 8), np.float32)] * 3, [np.zeros((2, 9), np.float32)] * 3), {"layout": "thd"}),
    "device pair, strided lse": ((d((2, 5, 3, 64)), d((2, 3, 5), np.float32, strides=(60, 4, 12)),
                                  d((2, 5, 3, 64)), d((2, 3, 5), np.float32)), {}),
    "device stack bhsd": ((d((3, 2, 4, 5, 64)), d((3, 2, 4, 5), np.float32)), {"layout": "bhsd"}),
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_good_calls_pass_validation_and_reach_the_driver(case, blocked_driver):
    args, kwargs = GOOD[case]
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.merge_states(*args, **kwargs)


# --------------------------------------------------------------------------- DeviceArray.transpose
@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=5), data=st.data())
def test_transpose_permutes_shape_and_strides_like_numpy(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    ref = np.empty(shape, np.float32)
    a = DeviceArray(4096, shape, np.float32, None, owner="alloc", stream="s")
    for t, r in ((a.transpose(*perm), ref.transpose(perm)), (a.transpose(perm), ref.transpose(perm)),
                 (a.transpose(), ref.transpose()), (a.transpose(*[p - len(shape) for p in perm]), ref.transpose(perm))):
        assert (t.shape, t.strides, t.ptr, t.owner, t.stream) == (r.shape, r.strides, 4096, "alloc", "s")
        assert t.elem_strides == tuple(s // 4 for s in r.strides)
        assert read("x", t).strides == t.elem_strides


def test_transpose_rejects_bad_axes():
    a = DeviceArray(0, (2, 3, 4), np.float32, None)
    for axes, exc in (((0, 1), ValueError), ((0, 0, 1), ValueError), ((0, 1, 3), ValueError), ((0, 1.0, 2), TypeError)):
        with pytest.raises(exc, match=r"^axes: "):
            a.transpose(*axes)


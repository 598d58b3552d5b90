"""Input validation of ``pyattn.attention`` (CPU only).

Every bad call must raise ``ValueError``/``TypeError`` naming the argument *before* any GPU
work. There is no GPU in CI, so a call that slips past validation reaches the driver and raises
``pyattn.NoDeviceError`` instead, which ``pytest.raises(ValueError/TypeError)`` does not accept.
The tests that need a call to reach the driver block it with the ``blocked_driver`` fixture, so
they behave the same on a machine that has a GPU.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.runtime.device as device_mod
from _problems import problem
from pyattn.array import DeviceArray
from pyattn.interop.inputs import read
from pyattn.validate.attention import AttentionProblem

BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCKED = "driver blocked by test_validation"


class FakeCudaArray:
    """The minimum a CUDA array library exposes: ``__cuda_array_interface__`` (v3).

    ``strides`` are in bytes (None = C-contiguous), as CAI specifies. The data pointer is 0:
    validation must never dereference it, and a call that passes validation goes to
    ``get_device()`` (the driver) to find the array's device.
    """

    def __init__(self, shape, dtype=np.float32, strides=None):
        dt = np.dtype(dtype)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": dt.str, "descr": dt.descr,
            "data": (0, False), "strides": None if strides is None else tuple(strides), "version": 3,
        }


def host(shape, dtype=np.float32):
    return np.ones(shape, dtype=dtype)


def dev(shape, dtype=np.float32, strides=None):
    return FakeCudaArray(shape, dtype, strides)


def c_strides_bytes(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@pytest.fixture
def blocked_driver(monkeypatch):
    """Any driver initialisation raises a recognisable NoDeviceError, GPU or not."""

    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


# Shapes used throughout, bshd: q (B=2, Sq=5, Hq=4, D=64), k/v (B=2, Sk=7, Hkv=2, D=64).
Q, KV = (2, 5, 4, 64), (2, 7, 2, 64)


# --------------------------------------------------------------------------------------------
# Rejected calls: (q, k, v, kwargs, exception, regex the message must match)
# --------------------------------------------------------------------------------------------
def _case(q, k, v, exc, match, **kwargs):
    return (q, k, v, kwargs, exc, match)


BAD = {
    # ranks
    "q 3-D": _case(host((5, 4, 64)), host(KV), host(KV), ValueError, r"^q: expected a 4-D array"),
    "k 5-D": _case(host(Q), host((1,) + KV), host(KV), ValueError, r"^k: expected a 4-D array"),
    "v 3-D": _case(host(Q), host(KV), host((7, 2, 64)), ValueError, r"^v: expected a 4-D array"),
    "q 2-D bhsd": _case(host((5, 64)), host(KV), host(KV), ValueError,
                        r"^q: expected a 4-D array \(batch, heads, seq, head_dim\)", layout="bhsd"),
    # shape agreement
    "batch mismatch": _case(host(Q), host((3, 7, 2, 64)), host((3, 7, 2, 64)), ValueError,
                            r"^k: expected batch 2 \(from q\), got 3"),
    "head_dim mismatch": _case(host(Q), host((2, 7, 2, 32)), host((2, 7, 2, 32)), ValueError,
                               r"^k: expected head_dim 64 \(from q\), got 32"),
    "v seq != k seq": _case(host(Q), host(KV), host((2, 8, 2, 64)), ValueError,
                            r"^v: expected the same shape as k"),
    "v heads != k heads": _case(host(Q), host(KV), host((2, 7, 1, 64)), ValueError,
                                r"^v: expected the same shape as k"),
    "v head_dim != k head_dim": _case(host(Q), host(KV), host((2, 7, 2, 128)), ValueError,
                                      r"^v: expected the same shape as k"),
    "Hq not multiple of Hkv": _case(host((2, 5, 3, 64)), host(KV), host(KV), ValueError,
                                    r"^k: query heads \(3\) must be a multiple of key/value heads \(2\)"),
    "Hkv = 0": _case(host(Q), host((2, 7, 0, 64)), host((2, 7, 0, 64)), ValueError, r"^k: query heads"),
    # head_dim range
    "head_dim 60": _case(host((2, 5, 4, 60)), host((2, 7, 2, 60)), host((2, 7, 2, 60)), ValueError,
                         r"head_dim must be a multiple of 8 in \[8, 256\], got 60"),
    "head_dim 4": _case(host((2, 5, 4, 4)), host((2, 7, 2, 4)), host((2, 7, 2, 4)), ValueError,
                        r"head_dim .* got 4"),
    "head_dim 0": _case(host((2, 5, 4, 0)), host((2, 7, 2, 0)), host((2, 7, 2, 0)), ValueError,
                        r"head_dim .* got 0"),
    "head_dim 264": _case(host((1, 5, 1, 264)), host((1, 7, 1, 264)), host((1, 7, 1, 264)), ValueError,
                          r"head_dim .* got 264"),
    # dtypes
    "float64": _case(host(Q, np.float64), host(KV, np.float64), host(KV, np.float64), TypeError,
                     r"^q: expected dtype float32, float16, bfloat16 or float8_e4m3fn, got float64"),
    "int32": _case(host(Q, np.int32), host(KV, np.int32), host(KV, np.int32), TypeError,
                   r"^q: expected dtype .* got int32"),
    "v alone float64": _case(host(Q), host(KV), host(KV, np.float64), TypeError,
                             r"^v: expected dtype .* got float64"),
    "mixed f16/f32": _case(host(Q, np.float16), host(KV, np.float32), host(KV, np.float16), TypeError,
                           r"^q, k, v: expected one dtype, got q float16, k float32, v float16"),
    "mixed bf16/f16": _case(host(Q, BF16), host(KV, BF16), host(KV, np.float16), TypeError,
                            r"^q, k, v: expected one dtype"),
    "device float64": _case(dev(Q, np.float64), dev(KV, np.float64), dev(KV, np.float64), TypeError,
                            r"^q: expected dtype .* got float64"),
    # not arrays / host mixed with device
    "q is a list": _case(host(Q).tolist(), host(KV), host(KV), TypeError,
                         r"^q: expected a NumPy array or a CUDA array"),
    "v is None": _case(host(Q), host(KV), None, TypeError, r"^v: expected a NumPy array"),
    "q host, k/v device": _case(host(Q), dev(KV), dev(KV), TypeError,
                                r"^q, k, v: expected all host \(NumPy\) or all device arrays, "
                                r"got q on host, k on device, v on device"),
    "v device only": _case(host(Q), host(KV), dev(KV), TypeError, r"v on device"),
    # layout / causal / scale
    "layout bsdh": _case(host(Q), host(KV), host(KV), ValueError, r"^layout: expected one of", layout="bsdh"),
    "layout upper case": _case(host(Q), host(KV), host(KV), ValueError, r"^layout:", layout="BSHD"),
    "layout None": _case(host(Q), host(KV), host(KV), ValueError, r"^layout:", layout=None),
    "causal int": _case(host(Q), host(KV), host(KV), TypeError, r"^causal: expected a bool", causal=1),
    "causal str": _case(host(Q), host(KV), host(KV), ValueError, r"^causal: expected False, True", causal="yes"),
    "causal None": _case(host(Q), host(KV), host(KV), TypeError, r"^causal: expected a bool", causal=None),
    "scale 0": _case(host(Q), host(KV), host(KV), ValueError, r"^scale: expected a finite positive", scale=0.0),
    "scale int 0": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=0),
    "scale negative": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=-0.125),
    "scale nan": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=math.nan),
    "scale inf": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=math.inf),
    "scale -inf": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=-math.inf),
    "scale np.float32 nan": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=np.float32("nan")),
    "scale str": _case(host(Q), host(KV), host(KV), TypeError, r"^scale: expected a number", scale="0.125"),
    # device arrays whose head_dim axis is not contiguous (CAI strides are in bytes)
    "q head_dim stride 2": _case(dev(Q, strides=(2 * 5 * 4 * 128 * 4, 4 * 128 * 4, 128 * 4, 8)),
                                 dev(KV), dev(KV), ValueError,
                                 r"^q: the head_dim axis must be contiguous \(stride 1 element\)"),
    "k head_dim reversed": _case(dev(Q), dev(KV, strides=(7 * 2 * 64 * 4, 2 * 64 * 4, 64 * 4, -4)), dev(KV),
                                 ValueError, r"^k: the head_dim axis must be contiguous"),
    # v (2, 7, 2, 64) f16 as a view of a (2, 64, 7, 2) buffer: its head_dim stride is 14 elements
    "v transposed (head_dim <-> seq)": _case(dev(Q, np.float16), dev(KV, np.float16),
                                             dev(KV, np.float16, strides=(64 * 7 * 2 * 2, 2 * 2, 2, 7 * 2 * 2)),
                                             ValueError, r"^v: the head_dim axis must be contiguous"),
    "v head_dim stride 0 (f16)": _case(dev(Q, np.float16), dev(KV, np.float16),
                                       dev(KV, np.float16, strides=(7 * 2 * 64 * 2, 2 * 64 * 2, 64 * 2, 0)),
                                       ValueError, r"^v: the head_dim axis must be contiguous"),
    "bhsd q head_dim stride 2": _case(dev((2, 4, 5, 64), strides=(4 * 5 * 128 * 4, 5 * 128 * 4, 128 * 4, 8)),
                                      dev((2, 2, 7, 64)), dev((2, 2, 7, 64)), ValueError,
                                      r"^q: the head_dim axis must be contiguous", layout="bhsd"),
    # bhsd: the heads axis is axis 1 (read as bshd, these would report heads 4 and 8 instead)
    "bhsd Hq not multiple of Hkv": _case(host((2, 3, 4, 64)), host((2, 2, 8, 64)), host((2, 2, 8, 64)), ValueError,
                                         r"^k: query heads \(3\) must be a multiple of key/value heads \(2\)",
                                         layout="bhsd"),
    "bhsd batch mismatch": _case(host((2, 4, 5, 64)), host((1, 2, 7, 64)), host((1, 2, 7, 64)), ValueError,
                                 r"^k: expected batch 2", layout="bhsd"),
    "bhsd v seq mismatch": _case(host((2, 4, 5, 64)), host((2, 2, 7, 64)), host((2, 2, 6, 64)), ValueError,
                                 r"^v: expected the same shape as k", layout="bhsd"),
}

@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    q, k, v, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        pyattn.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_make_problem_rejects_the_same_inputs(case):
    """The op adds no checks of its own before the GPU: reading and validation alone reject every case."""
    q, k, v, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        problem(q, k, v, **kwargs)


def test_bhsd_shapes_are_read_with_heads_on_axis_1(blocked_driver):
    q, kv = host((2, 4, 6, 64)), host((2, 2, 3, 64))  # bhsd: Hq=4, Hkv=2; bshd: Hq=6, Hkv=3
    p = problem(q, kv, kv, layout="bhsd")
    assert (p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (4, 2, 6, 3)
    p = problem(q, kv, kv, layout="bshd")
    assert (p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (6, 3, 4, 2)
    q2, kv2 = host((2, 4, 6, 64)), host((2, 4, 3, 64))  # bhsd: Hq=4, Hkv=4
    bad_kv = host((2, 3, 4, 64))  # bhsd: Hkv=3 does not divide Hq=4; bshd: Hkv=4 does not divide Hq=6
    with pytest.raises(ValueError, match=r"^k: query heads \(4\) must be a multiple of key/value heads \(3\)"):
        problem(q2, bad_kv, bad_kv, layout="bhsd")
    with pytest.raises(ValueError, match=r"^k: query heads \(6\) must be a multiple of key/value heads \(4\)"):
        problem(q2, bad_kv, bad_kv, layout="bshd")
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.attention(q2, kv2, kv2, layout="bhsd")


# --------------------------------------------------------------------------------------------
# Accepted calls: validation passes and the call reaches the driver
# --------------------------------------------------------------------------------------------
class _DLPackOnly:
    """A CUDA tensor seen through DLPack only (no CAI), torch-style: ``dtype`` attribute, ``stride()``
    in elements. Classification uses the attributes; the array itself is never touched."""

    def __init__(self, shape, stride=None, dtype="torch.bfloat16"):
        self.shape, self.dtype = shape, dtype
        self._stride = stride if stride is not None else tuple(s // 2 for s in c_strides_bytes(shape, 2))

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(self, **kwargs):  # the import happens only at launch, after validation
        raise AssertionError("validation must not import the array")

    def stride(self):
        return self._stride


class _TorchBF16NoTypestr(_DLPackOnly):
    """torch < 2.6-style bfloat16 CUDA tensor: the CAI getter raises (KeyError in torch's typestr table)."""

    @property
    def __cuda_array_interface__(self):
        raise KeyError("torch.bfloat16")


class _TorchBF16VoidTypestr(_DLPackOnly):
    """Newer torch: bfloat16 is exported through CAI as typestr "<V2" (ml_dtypes' str), dtype attr says bf16."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<V2", "data": (0, False), "version": 2,
                "strides": tuple(2 * s for s in self._stride)}


GOOD = {
    "fp32 bshd": (host(Q), host(KV), host(KV), {}),
    "fp16 bshd causal": (host(Q, np.float16), host(KV, np.float16), host(KV, np.float16), {"causal": True}),
    "bf16 bshd": (host(Q, BF16), host(KV, BF16), host(KV, BF16), {"scale": 0.5}),
    "fp32 bhsd": (host((2, 4, 5, 64)), host((2, 2, 7, 64)), host((2, 2, 7, 64)), {"layout": "bhsd"}),
    "fp16 bhsd causal np.bool_": (host((2, 4, 5, 64), np.float16), host((2, 2, 7, 64), np.float16),
                                  host((2, 2, 7, 64), np.float16), {"layout": "bhsd", "causal": np.bool_(True)}),
    "bf16 bhsd": (host((2, 4, 5, 64), BF16), host((2, 2, 7, 64), BF16), host((2, 2, 7, 64), BF16),
                  {"layout": "bhsd"}),
    "MQA Hkv=1 head_dim 8": (host((1, 3, 8, 8)), host((1, 9, 1, 8)), host((1, 9, 1, 8)), {}),
    "head_dim 256": (host((1, 3, 2, 256), np.float16), host((1, 3, 2, 256), np.float16),
                     host((1, 3, 2, 256), np.float16), {"causal": False, "scale": 1}),
    "non-contiguous host views": (host((2, 5, 8, 64))[:, :, ::2], host((2, 7, 2, 128))[..., ::2],
                                  np.asfortranarray(host(KV)), {}),
    "scale np.float16": (host(Q), host(KV), host(KV), {"scale": np.float16(0.25)}),
    "device fp16": (dev(Q, np.float16), dev(KV, np.float16), dev(KV, np.float16), {}),
    "device bf16 bhsd (DLPack, dtype attribute)": (_DLPackOnly((2, 4, 5, 64)), _DLPackOnly((2, 2, 7, 64)),
                                                   _DLPackOnly((2, 2, 7, 64)), {"layout": "bhsd"}),
    # strided device views are fine as long as head_dim is contiguous (seq stride doubled here)
    "device strided seq": (dev(Q, strides=(5 * 4 * 64 * 8, 4 * 64 * 8, 64 * 4, 4)), dev(KV), dev(KV), {}),
}


@pytest.mark.parametrize("case", list(GOOD.values()), ids=list(GOOD))
def test_valid_input_passes_validation_and_reaches_the_driver(case, blocked_driver):
    q, k, v, kwargs = case
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_valid_numpy_call_without_gpu_raises_no_device_error(dtype, layout):
    """The real environment, nothing patched: with no driver/GPU, a valid call ends in NoDeviceError."""
    if pyattn.device_count() > 0:
        pytest.skip("a GPU is present; the blocked-driver variant covers this")
    q = host((1, 4, 3, 32) if layout == "bhsd" else (1, 3, 4, 32), dtype)
    kv = host((1, 2, 5, 32) if layout == "bhsd" else (1, 5, 2, 32), dtype)
    with pytest.raises(pyattn.NoDeviceError) as info:
        pyattn.attention(q, kv, kv, causal=True, layout=layout)
    assert info.value.reason in ("no_driver", "no_device")  # no driver library, or no GPU behind it


# --------------------------------------------------------------------------------------------
# reading the inputs (pyattn.interop.inputs.read)
# --------------------------------------------------------------------------------------------
def test_read_host_ignores_strides():
    x = host((2, 6, 4, 16))[:, ::2]  # a non-contiguous view: copied contiguously to the device
    d = read("q", x)
    assert (d.name, d.shape, d.dtype, d.on_device) == ("q", (2, 3, 4, 16), np.dtype(np.float32), False)
    assert d.strides == (3 * 4 * 16, 4 * 16, 16, 1)


def test_read_cuda_array_interface():
    f = dev((2, 3, 4, 16), np.float16, strides=(2 * 3 * 4 * 16 * 2, 4 * 16 * 2 * 2, 16 * 2, 2))
    d = read("k", f)
    assert d.on_device and d.shape == (2, 3, 4, 16) and d.dtype == np.float16
    assert d.strides == (2 * 3 * 4 * 16, 4 * 16 * 2, 16, 1)  # bytes -> elements
    d = read("k", dev((2, 3, 4, 16)))  # strides None = C-contiguous
    assert d.strides == (3 * 4 * 16, 4 * 16, 16, 1)


def test_read_device_array_without_touching_the_gpu(blocked_driver):
    # A DeviceArray is only a description; classifying it must not need its device.
    a = DeviceArray(0, (1, 4, 2, 32), BF16, device=None, strides=(4 * 2 * 64 * 2, 2 * 64 * 2, 64 * 2, 2))
    d = read("v", a)
    assert d.on_device and d.dtype == BF16 and d.strides == (4 * 2 * 64, 2 * 64, 64, 1)
    bad = DeviceArray(0, (1, 4, 2, 32), BF16, device=None, strides=(4 * 2 * 64 * 2, 2 * 64 * 2, 2, 2 * 2))
    with pytest.raises(ValueError, match=r"^q: the head_dim axis must be contiguous"):
        pyattn.attention(bad, bad, bad)


def test_read_uses_the_dtype_attribute_without_cai():
    x = _DLPackOnly((1, 8, 2, 64))
    d = read("q", x)
    assert d.on_device and d.shape == (1, 8, 2, 64) and d.dtype == BF16
    assert d.strides == (8 * 2 * 64, 2 * 64, 64, 1)
    with pytest.raises(TypeError, match=r"^k: expected dtype .* got complex64"):
        problem(x, _DLPackOnly((1, 8, 2, 64), dtype="torch.complex64"), x)


def test_bf16_tensor_exported_as_void_typestr_is_accepted(blocked_driver):
    """torch (and DeviceArray) export bfloat16 through CAI as '<V2'; the object's dtype says bf16."""
    x = _TorchBF16VoidTypestr((1, 8, 2, 64))
    d = read("q", x)
    assert d.on_device and d.dtype == BF16 and d.strides == (8 * 2 * 64, 2 * 64, 64, 1)
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.attention(x, x, x)


def test_dlpack_tensor_with_strided_head_dim_is_rejected(blocked_driver):
    """torch-style ``.stride()`` (elements) is read, not assumed C-contiguous."""
    x = _DLPackOnly((1, 8, 2, 64), (8 * 2 * 128, 2 * 128, 128, 2))  # head_dim stride 2 elements
    with pytest.raises(ValueError, match=r"^q: the head_dim axis must be contiguous"):
        pyattn.attention(x, x, x)


# --------------------------------------------------------------------------------------------
# make_problem fields
# --------------------------------------------------------------------------------------------
def test_make_problem_fields_bshd():
    p = problem(host(Q, np.float16), host(KV, np.float16), host(KV, np.float16), causal=np.bool_(True))
    assert isinstance(p, AttentionProblem)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (2, 4, 2, 5, 7, 64)
    assert p.group == 2 and p.dtype == "float16" and p.layout == "bshd" and p.on_device is False
    assert p.causal == 1 and type(p.causal) is int  # the kernel's code: 1 = bottom-right
    assert p.scale == pytest.approx(1 / 8) and type(p.scale) is float
    assert p.out_shape() == Q
    assert p.q_strides == (5 * 4 * 64, 4 * 64, 64)  # (batch, seq, head), elements
    assert p.k_strides == p.v_strides == (7 * 2 * 64, 2 * 64, 64)


def test_make_problem_fields_bhsd():
    q, kv = host((3, 6, 5, 96), BF16), host((3, 2, 9, 96), BF16)
    p = problem(q, kv, kv, layout="bhsd", scale=2)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (3, 6, 2, 5, 9, 96)
    assert p.group == 3 and p.dtype == "bfloat16" and p.layout == "bhsd" and p.causal == 0
    assert p.scale == 2.0 and type(p.scale) is float
    assert p.out_shape() == (3, 6, 5, 96)
    assert p.q_strides == (6 * 5 * 96, 96, 5 * 96)  # (batch, seq, head) of a bhsd buffer


def test_make_problem_device_strides():
    q = dev(Q, strides=(5 * 4 * 64 * 8, 4 * 64 * 8, 64 * 4, 4))
    p = problem(q, dev(KV), dev(KV))
    assert p.on_device is True
    assert p.q_strides == (5 * 4 * 64 * 2, 4 * 64 * 2, 64)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), hkv=st.integers(1, 4), group=st.integers(1, 4), sq=st.integers(0, 40),
       sk=st.integers(0, 40), d=st.integers(1, 32).map(lambda n: 8 * n), layout=st.sampled_from(["bshd", "bhsd"]),
       dtype=st.sampled_from([np.float32, np.float16, BF16]))
def test_make_problem_property(b, hkv, group, sq, sk, d, layout, dtype):
    hq = hkv * group

    def shape(s, h):
        return (b, s, h, d) if layout == "bshd" else (b, h, s, d)

    q, kv = np.empty(shape(sq, hq), dtype), np.empty(shape(sk, hkv), dtype)
    p = problem(q, kv, kv, layout=layout)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (b, hq, hkv, sq, sk, d)
    assert p.group == group
    assert p.out_shape() == q.shape
    assert p.scale == pytest.approx(1 / math.sqrt(d), rel=1e-15)
    assert p.dtype == np.dtype(dtype).name


# --------------------------------------------------------------------------------------------
# Regression tests for gaps found in review (each failed before its fix)
# and the marker gets removed.
# --------------------------------------------------------------------------------------------
def test_bool_scale_is_rejected(blocked_driver):
    with pytest.raises((TypeError, ValueError), match=r"^scale:"):
        pyattn.attention(host(Q), host(KV), host(KV), scale=True)


def test_device_strides_not_multiple_of_itemsize_are_rejected(blocked_driver):
    q = dev((1, 2, 1, 8), strides=(2 * 8 * 6, 8 * 6, 8 * 6, 6))
    with pytest.raises(ValueError, match=r"^q:"):
        pyattn.attention(q, q, q)


def test_bf16_tensor_whose_cai_getter_raises_is_classified(blocked_driver):
    x = _TorchBF16NoTypestr((1, 8, 2, 64))
    d = read("q", x)
    assert d.on_device and d.dtype == BF16
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.attention(x, x, x)


class _BareCAI:
    """Only a CAI dict, nothing else (a SimpleNamespace-style wrapper, as in numba/cuDF examples)."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def test_bare_cai_with_void_typestr_is_a_type_error_naming_the_argument():
    x = _BareCAI({"shape": (1, 2, 1, 8), "typestr": "<V2", "data": (0, False), "strides": None, "version": 3})
    with pytest.raises(TypeError, match=r"^q:"):
        problem(x, x, x)

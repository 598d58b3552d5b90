"""``pyattn.attention``'s accepted inputs and how array inputs are read (CPU only): valid calls pass
validation and reach the driver (blocked by conftest.py's ``blocked_driver`` fixture, or the real
driver without a GPU), ``pyattn.interop.inputs.read`` on host arrays, the CUDA array interface,
DLPack-only (torch-style) tensors and ``DeviceArray``, and regression tests of gaps found in review.
Rejected calls are in test_validation.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from _problems import problem
from _validation_helpers import BF16, BLOCKED, KV, Q, dev, host
from pyattn.array import DeviceArray
from pyattn.interop.inputs import read


def c_strides_bytes(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


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

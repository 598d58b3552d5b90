"""Shared inputs of the ``pyattn.attention`` validation tests (test_validation.py,
test_validation_inputs.py, test_options.py): host and fake device arrays, the shapes used throughout,
and ``BLOCKED``, the message of conftest.py's ``blocked_driver`` fixture."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCKED = "driver blocked by the blocked_driver fixture"


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


# Shapes used throughout, bshd: q (B=2, Sq=5, Hq=4, D=64), k/v (B=2, Sk=7, Hkv=2, D=64).
Q, KV = (2, 5, 4, 64), (2, 7, 2, 64)

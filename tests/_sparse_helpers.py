"""Shared inputs of the ``sparse_attention`` tests (test_sparse_validation.py, test_sparse_launch.py):
the problem's sizes, a fake CUDA array, q/k/v of either layout and the CSR key lists used throughout."""

from __future__ import annotations

import numpy as np

B, SQ, HQ, HKV, SK, D = 2, 5, 4, 2, 7, 64


class FakeCudaArray:
    """A CUDA array as its interface describes it (data pointer 0: validation never reads it).
    ``shape``/``dtype`` attributes too: CAI spells bfloat16 as an opaque ``<V2`` (as torch does)."""

    def __init__(self, shape, dtype=np.float32):
        dt = np.dtype(dtype)
        self.shape, self.dtype = tuple(shape), dt
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "descr": dt.descr,
                                         "data": (0, False), "strides": None, "version": 3}

    def __dlpack_device__(self):  # where an opaque bfloat16 CAI sends pyattn (device 0 -> the driver)
        return (2, 0)


def qkv(dtype=np.float32, device=False, layout="bshd"):
    qs, ks = ((B, SQ, HQ, D), (B, SK, HKV, D)) if layout == "bshd" else ((B, HQ, SQ, D), (B, HKV, SK, D))
    if device:
        return FakeCudaArray(qs, dtype), FakeCudaArray(ks, dtype), FakeCudaArray(ks, dtype)
    return np.ones(qs, dtype), np.ones(ks, dtype), np.ones(ks, dtype)


def csr(lists):
    """(indices, offsets) of a list of per-row key lists."""
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    return np.array([i for x in lists for i in x], dtype=np.int32), offsets


# Query rows 0..4: two keys, every key (unsorted), none, one, the last key.
INDICES, OFFSETS = csr([[0, 3], [6, 2, 0, 1, 5, 4, 3], [], [1], [6]])
NNZ = INDICES.size

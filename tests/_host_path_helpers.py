"""Shared by the fake-driver repeat-call tests (test_host_path_attention.py, test_host_path_decode.py,
test_host_path_numpy.py, test_foreign_repeat.py): the driver calls of a call in a steady loop, and
device arrays over pool blocks. Their fixtures (``gpu``, ``full``, ``cache``, ``full_decode``) are
in conftest.py.
"""

from __future__ import annotations

import numpy as np

import fake_driver
import pyattn

SHAPE = (1, 16, 2, 64)


def _repeat_calls(fn) -> dict:
    """Driver calls of a call in a steady loop (the first call validates, plans and loads; each
    rebinding frees the previous result, as a loop does)."""
    keep = fn()
    keep = fn()
    fake_driver.CALLS.clear()
    keep = fn()  # noqa: F841
    return dict(fake_driver.CALLS)


def _da(shape=SHAPE, dtype=np.float16, strides=None, device=None, stream=None, ptr=None):
    """A DeviceArray over a pool block big enough for any view of ``shape`` used here."""
    dev = device if device is not None else pyattn.get_device()
    base = pyattn.empty((4 * int(np.prod(shape)),), dtype, device=dev, stream=stream)
    return pyattn.DeviceArray(base.ptr if ptr is None else ptr, shape, dtype, dev, strides=strides, owner=base,
                              stream=base.stream)

"""A stand-in for ``torch`` in CPU tests of the device-resident op path (``fake_driver.installed(...,
torch=True)`` installs it): what pyattn reads of a CUDA tensor and of torch's current stream."""

from __future__ import annotations

import types

import numpy as np


def fake_torch(current_stream=0x7000):
    """A stand-in for ``torch`` (install it as ``sys.modules["torch"]``): what pyattn reads of a CUDA
    tensor. ``current_stream`` is torch's current stream handle (settable; a
    non-default one by default); ``stream_reads`` counts how often pyattn asked for it, and
    ``stream_ordinals`` lists the device each time."""
    torch = types.ModuleType("torch")

    class Dtype:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return f"torch.{self.name}"

    dtypes = {}

    class Tensor:
        def __init__(self, shape, ptr, dtype="float16", stride=None, device=0):
            self.shape, self._ptr, self.device = tuple(shape), ptr, device
            self.dtype = dtypes.setdefault(dtype, Dtype(dtype))
            self._stride = stride or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))

        def data_ptr(self):
            return self._ptr

        def stride(self):
            return self._stride

        def get_device(self):
            return self.device

    def current(ordinal):
        torch.stream_reads += 1
        torch.stream_ordinals.append(ordinal)
        return torch.current_stream

    torch.Tensor = Tensor
    torch.current_stream, torch.stream_reads, torch.stream_ordinals = current_stream, 0, []
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=current)
    return torch

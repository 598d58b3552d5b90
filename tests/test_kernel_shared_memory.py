"""``Kernel.set_max_dynamic_shared`` on the fake driver (no GPU): when a kernel needs the opt-in."""

from __future__ import annotations

from cuda.bindings import driver

import fake_driver
import pyattn


def test_the_opt_in_counts_the_kernels_static_shared_memory(gpu, monkeypatch):
    """Without the opt-in a block's static and dynamic shared memory together stay within 48 KiB, so
    a kernel with 38000 static bytes needs it for 32 KiB of dynamic memory (it was asked only above
    48 KiB of dynamic memory, and such a launch failed with CUDA_ERROR_INVALID_VALUE)."""
    from pyattn.runtime.module import Module

    A = driver.CUfunction_attribute
    static = {int(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES): 38000}
    sets = []
    monkeypatch.setattr(driver, "cuFuncGetAttribute", lambda attr, fn: (fake_driver.OK, static.get(int(attr), 0)))
    monkeypatch.setattr(driver, "cuFuncSetAttribute",
                        lambda fn, attr, value: sets.append((int(attr), value)) or (fake_driver.OK,))
    kernel = Module(pyattn.get_device(0), b"\0").kernel("k")
    assert kernel.static_shared_bytes == 38000
    kernel.set_max_dynamic_shared(48 * 1024 - 38000)
    assert sets == []
    kernel.set_max_dynamic_shared(32768)
    kernel.set_max_dynamic_shared(32768)  # (once)
    assert sets == [(int(A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), 32768)]

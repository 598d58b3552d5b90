"""``pyattn.contiguous_decode``'s call path on a CPU, through the fake driver of ``fake_driver.py``:
a decode loop with one int length takes the repeat path (one launch, the length by value, the
geometry's page table kept), follows new cache pointers (another layer's caches), and checks the
length and the addresses every call; ragged host lengths take the full path and upload.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from _host_path_helpers import _da, _repeat_calls  # (fixtures gpu, full_contig: conftest.py)

BF16 = ml_dtypes.bfloat16


def test_int_lengths_take_the_repeat_path(gpu, full_contig):
    """A step of a decode loop: one launch and one context check; the length (new every step) goes
    by value (a null kv_len pointer), the page table is the geometry's kept one, and another
    layer's caches of the same geometry are read at their own addresses."""
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), BF16)
    kc, vc = _da((2, 256, 2, 64), BF16), _da((2, 256, 2, 64), BF16)
    assert _repeat_calls(lambda: pyattn.contiguous_decode(q, kc, vc, 100)) == {"cuCtxGetCurrent": 1,
                                                                              "cuLaunchKernelEx": 1}
    assert len(full_contig) == 1
    fake_driver.LAUNCHES.clear()
    out = pyattn.contiguous_decode(q, kc, vc, 101)
    k2, v2 = _da((2, 256, 2, 64), BF16), _da((2, 256, 2, 64), BF16)  # the next layer
    pyattn.contiguous_decode(q, k2, v2, 101)
    assert len(full_contig) == 1
    (_, _, _, p), (_, _, _, p2) = fake_driver.LAUNCHES
    assert p[:4] == (q.ptr, kc.ptr, vc.ptr, out.ptr) and p2[1:3] == (k2.ptr, v2.ptr)
    assert p[10] == 0 and p2[10] == 0  # kv_len: by value
    assert p[8] == p2[8] != 0  # one kept page table for the geometry


def test_repeat_calls_check_length_and_addresses(gpu, full_contig):
    q = _da((2, 1, 8, 64), BF16)
    kc, vc = _da((2, 256, 2, 64), BF16), _da((2, 256, 2, 64), BF16)
    pyattn.contiguous_decode(q, kc, vc, 10)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected an int in \[0, 256\], got 257"):
        pyattn.contiguous_decode(q, kc, vc, 257)
    bad = _da((2, 256, 2, 64), BF16, ptr=kc.ptr + 8)  # 8 bytes off a 16-byte boundary
    with pytest.raises(ValueError, match="k_cache: the kernel copies 16-byte rows"):
        pyattn.contiguous_decode(q, bad, vc, 10)


def test_changes_miss_the_repeat_path(gpu, full_contig):
    q = _da((2, 1, 8, 64), BF16)
    kc = _da((2, 256, 2, 64), BF16)
    pyattn.contiguous_decode(q, kc, kc, 10)
    variants = [
        lambda: pyattn.contiguous_decode(q, _da((2, 512, 2, 64), BF16), _da((2, 512, 2, 64), BF16), 10),  # max_len
        lambda: pyattn.contiguous_decode(q, _da((2, 2, 256, 64), BF16), _da((2, 2, 256, 64), BF16), 10,
                                         layout="hnd"),
        lambda: pyattn.contiguous_decode(q, kc, kc, 10, window=(8, 0)),
        lambda: pyattn.contiguous_decode(q, kc, kc, 10, return_lse=True),
    ]
    for i, call in enumerate(variants):
        call()
        assert len(full_contig) == 2 + i, i
        call()
        assert len(full_contig) == 2 + i, i  # its own entry now


def test_ragged_host_lengths_upload_every_call(gpu, full_contig):
    """Ragged NumPy lengths: the full path each call, the lengths (and the longest-first order)
    uploaded and read by pointer."""
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), BF16)
    kc = _da((2, 256, 2, 64), BF16)
    lens = np.array([40, 200], np.int32)
    fake_driver.LAUNCHES.clear()
    for _ in range(2):
        pyattn.contiguous_decode(q, kc, kc, lens)
    assert len(full_contig) == 2
    for _, _, _, p in fake_driver.LAUNCHES:
        assert p[10] != 0 and p[11] != 0  # kv_len and the batch order on the device
    fake_driver.LAUNCHES.clear()
    pyattn.contiguous_decode(q, kc, kc, np.array([77, 77], np.int32))  # equal values: by value
    ((_, _, _, p),) = fake_driver.LAUNCHES
    assert p[10] == 0 and p[11] == 0

"""``pyattn.contiguous_decode``'s call path on a CPU, through the fake driver of ``fake_driver.py``:
a decode loop with one int length takes the repeat path (one launch, the length by value, the
geometry's page table kept), follows new cache pointers (another layer's caches), and checks the
length and the addresses every call; ragged host lengths take the full path and upload.
"""

from __future__ import annotations

import ctypes

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
    assert _repeat_calls(lambda: pyattn.contiguous_decode(q, kc, vc, 100)) == {  # (capture: the result's block)
        "cuCtxGetCurrent": 1, "cuStreamIsCapturing": 1, "cuLaunchKernelEx": 1}
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


def _u32(x: int) -> tuple:
    """The two int32 fields packed in one recorded 64-bit word (low, high)."""
    return x & 0xFFFFFFFF, x >> 32


def test_new_tokens_are_appended_before_the_decode(gpu, full_contig):
    """k_new / v_new (device, (batch, n_new, Hkv, D)): one kv_append launch over the caches' view
    (the new tokens' addresses and strides, batch x n_new items), then the decode; a decode loop
    of such calls with a growing int length takes the repeat path, two launches a step."""
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), BF16)
    kc, vc = _da((2, 256, 2, 64), BF16), _da((2, 256, 2, 64), BF16)
    kn, vn = _da((2, 3, 2, 64), BF16), _da((2, 3, 2, 64), BF16)
    fake_driver.LAUNCHES.clear()
    for length in (10, 13, 16):
        pyattn.contiguous_decode(q, kc, vc, length, k_new=kn, v_new=vn)
    assert len(full_contig) == 1
    names = [n for n, _, _, _ in fake_driver.LAUNCHES]
    assert len(names) == 6 and all(n.startswith("pyattn_kv_append") for n in names[::2])
    assert all(n.startswith("pyattn_attn_decode") for n in names[1::2])
    (_, _, _, a), (_, _, _, d) = fake_driver.LAUNCHES[-2:]
    assert a[:2] == (kn.ptr, vn.ptr) and a[6:10] == (128, 64, 128, 64)  # token and head strides
    assert _u32(a[10]) == (6, 0) and a[11:13] == (0, 0)  # 2 x 3 items, no patches, slots as they are
    assert a[14] == kc.ptr  # the K cache
    assert d[1:3] == (kc.ptr, vc.ptr) and d[10] == 0  # the length (16 + 3) by value


def test_new_tokens_validation(gpu):
    q = _da((2, 1, 8, 64), BF16)
    kc = _da((2, 256, 2, 64), BF16)
    kn = _da((2, 3, 2, 64), BF16)
    with pytest.raises(ValueError, match="k_new, v_new: give both or neither, got k_new alone"):
        pyattn.contiguous_decode(q, kc, kc, 10, k_new=kn)
    with pytest.raises(ValueError, match=r"v_new: expected shape \(2, n_new >= 1, 2, 64\), got \(2, 3, 4, 64\)"):
        pyattn.contiguous_decode(q, kc, kc, 10, k_new=kn, v_new=_da((2, 3, 4, 64), BF16))
    with pytest.raises(TypeError, match="k_new: expected dtype bfloat16"):
        pyattn.contiguous_decode(q, kc, kc, 10, k_new=_da((2, 3, 2, 64), np.float16), v_new=kn)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected an int in \[0, 253\] \(max_len 256 - 3 new"):
        pyattn.contiguous_decode(q, kc, kc, 254, k_new=kn, v_new=kn)
    pyattn.contiguous_decode(q, kc, kc, 253, k_new=kn, v_new=kn)  # bound, then the repeat path's checks
    with pytest.raises(ValueError, match=r"cache_seqlens: expected an int in \[0, 253\]"):
        pyattn.contiguous_decode(q, kc, kc, 254, k_new=kn, v_new=kn)
    off = _da((2, 3, 2, 64), BF16, ptr=kn.ptr + 8)
    with pytest.raises(ValueError, match="v_new: the append kernel copies 16-byte chunks"):
        pyattn.contiguous_decode(q, kc, kc, 10, k_new=kn, v_new=off)
    with pytest.raises(ValueError, match=r"<= 253 \(max_len 256 - 3 new tokens\), got cache_seqlens\[1\] = 254"):
        pyattn.contiguous_decode(q, kc, kc, np.array([3, 254], np.int32), k_new=kn, v_new=kn)
    with pytest.raises(TypeError, match="v_new: expected a device array as k_new is, got a host array"):
        pyattn.contiguous_decode(q, kc, kc, 10, k_new=kn, v_new=np.zeros((2, 3, 2, 64), BF16))
    other = _da((2, 3, 2, 64), BF16, strides=(2 * 3 * 2 * 64 * 2, 256, 128, 2))  # K's strides differ
    with pytest.raises(ValueError, match="v_new: expected k_new's element strides"):
        pyattn.contiguous_decode(q, kc, kc, 10, k_new=kn, v_new=other)


def test_host_new_tokens_are_uploaded(gpu, full_contig):
    """NumPy k_new / v_new: uploaded with the call (C-contiguous rows), the full path every time."""
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), BF16)
    kc = _da((2, 256, 2, 64), BF16)
    kn = np.zeros((2, 1, 2, 64), BF16)
    fake_driver.LAUNCHES.clear()
    for length in (5, 6):
        pyattn.contiguous_decode(q, kc, kc, length, k_new=kn, v_new=kn)
    assert len(full_contig) == 2
    (_, _, _, a) = fake_driver.LAUNCHES[0]
    assert a[6:10] == (128, 64, 128, 64) and _u32(a[10]) == (2, 0)


@pytest.mark.parametrize("layout, max_len, lens", [("nhd", 256, 7), ("hnd", 256, np.array([5, 130], np.int32)),
                                                   ("nhd", 100, np.array([0, 97], np.int32))])
def test_append_items_address_each_new_token(gpu, layout, max_len, lens):
    """The kv_append items the call hands its kernel (read from the mailbox, pinned memory on the
    fake driver too): token i of sequence b goes to the view's slot of position lens[b] + i (the
    view's page table is linear: slot b * per * P + t), from row b * n_new + i of the new tokens;
    on the 128-slot view (max_len 256) and on one page a sequence (max_len 100)."""
    gpu.record_launches = True
    B, H, D, n = 2, 2, 64, 3
    shape = (B, max_len, H, D) if layout == "nhd" else (B, H, max_len, D)
    kc = _da(shape, BF16)
    kn = _da((B, n, H, D), BF16)
    fake_driver.LAUNCHES.clear()
    pyattn.contiguous_decode(_da((B, 1, 8, D), BF16), kc, kc, lens, k_new=kn, v_new=kn, layout=layout)
    (_, _, _, a), _ = fake_driver.LAUNCHES
    items = np.ctypeslib.as_array((ctypes.c_int32 * (2 * B * n)).from_address(a[2]))
    dst, src = items[:B * n].reshape(B, n), items[B * n:].reshape(B, n)
    seq_stride, slot_stride = kc.elem_strides[0], kc.elem_strides[1 if layout == "nhd" else 2]
    L = np.broadcast_to(np.asarray(lens), (B,))
    for b in range(B):
        for i in range(n):
            # the kernel reads slot dst as page dst // P, slot dst % P of the view, whose page stride is
            # P slot strides: element offset dst * slot stride, which must be the cache's (b, L[b] + i)
            assert dst[b, i] * slot_stride == b * seq_stride + (L[b] + i) * slot_stride
            assert src[b, i] == b * n + i
    assert a[3] == a[2] + 4 * B * n  # the sources follow the destinations

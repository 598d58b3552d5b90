"""The backward's device call path on a CPU, through the fake driver of ``fake_driver.py``: which
kernels it launches, on which stream, with which pointers, and what it returns (no GPU)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import fake_driver
import pyattn
from pyattn.kernels.specs import KernelSpec


@pytest.fixture
def gpu(monkeypatch):
    with fake_driver.installed(monkeypatch, torch=True, record_launches=True) as fake:
        yield fake


def _arrays(B=2, Sq=100, Sk=300, Hq=8, Hkv=2, D=128, dtype=np.float16):
    q, dout, out = (pyattn.empty((B, Sq, Hq, D), dtype) for _ in range(3))
    k, v = (pyattn.empty((B, Sk, Hkv, D), dtype) for _ in range(2))
    lse = pyattn.empty((B, Hq, Sq), np.float32)
    return dout, q, k, v, out, lse


def _kinds(names) -> list:
    """Family, dtype and head dim of each launched entry point (``pyattn_<family>_<dtype>_d<dim>_m...``)."""
    return [re.match(r"pyattn_(attn_bwd_[a-z]+_f(?:16|32)_d\d+)_m", n).group(1) for n in names]


def test_three_launches_on_one_stream_with_the_callers_pointers(gpu):
    dout, q, k, v, out, lse = _arrays()
    fake_driver.LAUNCHES.clear()
    dq, dk, dv = pyattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    names = [name for name, *_ in fake_driver.LAUNCHES]
    # (the fake GPU is an sm_90a: the wgmma main kernel)
    assert _kinds(names) == ["attn_bwd_pre_f16_d32", "attn_bwd_wgmma_f16_d128", "attn_bwd_convert_f16_d32"]
    grids = [grid for _, grid, *_ in fake_driver.LAUNCHES]
    # pre: 100 rows padded to whole 64-row query tiles (128) / 16 rows per block (d=128: 16 chunks of
    # 16 bytes per row, 2 rows per warp, 8 warps); main: 128-key blocks
    assert grids == [(128 // 16, 8, 2), (300 // 128 + 1, 2, 2), (100 // 16 + 1, 8, 2)]
    assert len({s for _, _, s, _ in fake_driver.LAUNCHES}) == 1
    ptrs = fake_driver.LAUNCHES[1][3]  # q, k, v, o, dout, lse, dq, dk: the struct's leading pointers
    assert ptrs[:6] == (q.ptr, k.ptr, v.ptr, out.ptr, dout.ptr, lse.ptr)
    assert ptrs[6:8] == (dq.ptr, dk.ptr)
    assert all(launch[3] == ptrs for launch in fake_driver.LAUNCHES)  # one struct for all three
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == np.float16


def test_given_outputs_are_written_and_returned(gpu):
    dout, q, k, v, out, lse = _arrays(dtype=np.float32, D=64)
    dests = [pyattn.empty(x.shape, np.float32) for x in (q, k, v)]
    fake_driver.LAUNCHES.clear()
    grads = pyattn.attention_backward(dout, q, k, v, out, lse, dq=dests[0], dk=dests[1], dv=dests[2],
                                      deterministic=True)
    assert all(g is d for g, d in zip(grads, dests))
    assert _kinds(n for n, *_ in fake_driver.LAUNCHES) == ["attn_bwd_pre_f32_d32", "attn_bwd_simt_f32_d64",
                                                           "attn_bwd_convert_f32_d32"]
    assert fake_driver.LAUNCHES[0][3][6:8] == (dests[0].ptr, dests[1].ptr)


def test_torch_tensors_run_on_torchs_current_stream(gpu):
    torch = gpu.torch
    dout, q, k, v, out, lse = _arrays(D=64)
    t = [torch.Tensor(a.shape, a.ptr, dtype="float16" if a.dtype == np.float16 else "float32")
         for a in (dout, q, k, v, out, lse)]
    fake_driver.LAUNCHES.clear()
    pyattn.attention_backward(*t)
    assert {s for _, _, s, _ in fake_driver.LAUNCHES} == {torch.current_stream}


def test_empty_sides_launch_only_what_has_work(gpu):
    dout, q, k, v, out, lse = _arrays(Sq=0)
    fake_driver.LAUNCHES.clear()
    dq, dk, dv = pyattn.attention_backward(dout, q, k, v, out, lse)
    assert _kinds(n for n, *_ in fake_driver.LAUNCHES) == ["attn_bwd_wgmma_f16_d128"]  # dk = dv = 0 still written
    dout, q, k, v, out, lse = _arrays(Sk=0)
    fake_driver.LAUNCHES.clear()
    pyattn.attention_backward(dout, q, k, v, out, lse)
    assert _kinds(n for n, *_ in fake_driver.LAUNCHES) == ["attn_bwd_pre_f16_d32", "attn_bwd_convert_f16_d32"]


def test_varlen_passes_the_offsets(gpu, monkeypatch):
    import pyattn.ops.backward as bwd

    q, dout, out = (pyattn.empty((50, 4, 64), np.float16) for _ in range(3))
    k, v = (pyattn.empty((70, 2, 64), np.float16) for _ in range(2))
    lse = pyattn.empty((4, 50), np.float32)
    host = {}
    cu_q, cu_k = (pyattn.empty((3,), np.int32) for _ in range(2))
    host[cu_q.ptr], host[cu_k.ptr] = np.array([0, 20, 50], np.int32), np.array([0, 60, 70], np.int32)
    monkeypatch.setattr(bwd, "fetch_values", lambda a: host[a.ptr])  # (the fake device holds no values)
    fake_driver.LAUNCHES.clear()
    dq, dk, dv = pyattn.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    # pre: the longest sequence (30) padded to one query tile, 32 rows per block (d=64); main: keys of
    # the longest (60) in one key block
    bm = KernelSpec("attn_bwd_wgmma", "f16", 64, "sm_90a").tiles.block_m  # (the fake GPU is an sm_90a)
    assert [grid for _, grid, *_ in fake_driver.LAUNCHES] == [(-(-bm // 32), 4, 2), (1, 2, 2), (1, 4, 2)]
    assert (dq.shape, dk.shape) == ((50, 4, 64), (70, 2, 64))
    params = fake_driver.LAUNCHES[0][3]
    assert params[:6] == (q.ptr, k.ptr, v.ptr, out.ptr, dout.ptr, lse.ptr)


def test_misaligned_addresses_are_refused_before_any_launch(gpu):
    dout, q, k, v, out, lse = _arrays(D=64)
    bad = pyattn.DeviceArray(dout.ptr + 2, dout.shape, dout.dtype, dout.device)
    fake_driver.LAUNCHES.clear()
    with pytest.raises(ValueError, match="^dout: the tensor-core kernel reads 16-byte chunks"):
        pyattn.attention_backward(bad, q, k, v, out, lse)
    dk = pyattn.empty(k.shape, np.float16)
    with pytest.raises(ValueError, match="^dk: the tensor-core kernel writes pairs"):
        pyattn.attention_backward(dout, q, k, v, out, lse, dk=pyattn.DeviceArray(dk.ptr + 2, dk.shape, dk.dtype,
                                                                                   dk.device))
    assert fake_driver.LAUNCHES == []

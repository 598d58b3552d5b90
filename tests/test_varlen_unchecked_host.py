"""``attention_varlen`` / ``attention_varlen_backward`` over device offsets with both maxima given, on a
CPU through the fake driver: the offsets are not read on the host (FlashAttention's varlen contract),
so the call needs no synchronisation and a CUDA graph can capture it; the kernels get the packed row
counts they clamp each sequence into (kernels_src/common.cuh ``clamp_rows``). What the clamps do to
wrong offsets on the GPU is ``test_gpu_varlen_unchecked.py``.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import fake_driver
import pyattn
from _host_path_helpers import _da  # (fixture gpu: conftest.py)
from pyattn.kernels.params import ATTN_BWD_PARAMS, ATTN_FWD_PARAMS
from pyattn.ops import _bwd, _fwd, backward, varlen
from pyattn.runtime.stream import Stream
from pyattn.validate.attention import make_varlen_problem

CU_Q, CU_K = [0, 4, 10], [0, 5, 12]  # two sequences: 4 and 6 queries over 5 and 7 keys


def _spy(monkeypatch, module, params) -> list:
    """The leading ``params`` struct of each launch through ``module.launch``, by field name (the
    TMA forward's struct carries its tensor maps after it)."""
    seen, real, names = [], module.launch, [name for name, _ in params.fields]

    def spy(kernel, grid, block, smem, s, packed):
        if len(packed) >= params.size:
            seen.append(dict(zip(names, struct.unpack_from(params.format, packed))))
        return real(kernel, grid, block, smem, s, packed)

    monkeypatch.setattr(module, "launch", spy)
    return seen


@pytest.fixture
def fetched(monkeypatch) -> list:
    """The offsets the ops copy back for their checks (names), answered with valid values."""
    names, values = [], {"cu_seqlens_q": np.array(CU_Q, np.int32), "cu_seqlens_k": np.array(CU_K, np.int32)}

    def fetch(a):
        names.append(a.name)
        return values[a.name]

    monkeypatch.setattr(varlen, "fetch_values", fetch)
    monkeypatch.setattr(backward, "fetch_values", fetch)
    return names


def _arrays(stream=None):
    q = _da((10, 4, 64), np.float16, stream=stream)
    k, v = _da((12, 2, 64), np.float16, stream=stream), _da((12, 2, 64), np.float16, stream=stream)
    return q, k, v, _da((3,), np.int32, stream=stream), _da((3,), np.int32, stream=stream)


def test_device_offsets_with_both_maxima_are_not_read(gpu, fetched, monkeypatch):
    """Checked (one maximum or none): the offsets come back and the kernel's maxima are theirs.
    Unchecked (both): nothing is fetched or synchronised, the kernel takes the given maxima and the
    packed row counts its clamps need."""
    launched = _spy(monkeypatch, _fwd, ATTN_FWD_PARAMS)
    q, k, v, cq, ck = _arrays()
    pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=8, causal=True)
    assert fetched == ["cu_seqlens_q", "cu_seqlens_k"]
    p = launched[-1]
    assert (p["seqlen_q"], p["seqlen_k"], p["total_q"], p["total_k"]) == (8, 7, 10, 12)
    fetched.clear()
    fake_driver.CALLS.clear()
    pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=6, max_seqlen_k=9, causal=True)
    assert fetched == []
    assert not {"cuMemcpyDtoHAsync", "cuMemcpyDtoH", "cuStreamSynchronize", "cuCtxSynchronize"} & set(fake_driver.CALLS)
    p = launched[-1]
    assert (p["seqlen_q"], p["seqlen_k"], p["total_q"], p["total_k"]) == (6, 9, 10, 12)
    assert (p["cu_seqlens_q"], p["cu_seqlens_k"]) == (cq.ptr, ck.ptr)


def test_dense_calls_pass_no_packed_rows(gpu, monkeypatch):
    launched = _spy(monkeypatch, _fwd, ATTN_FWD_PARAMS)
    d = _da((1, 16, 2, 64), np.float16)
    pyattn.attention(d, d, d)
    assert (launched[-1]["cu_seqlens_q"], launched[-1]["total_q"], launched[-1]["total_k"]) == (0, 0, 0)


def test_host_offsets_are_checked_even_with_both_maxima(blocked_driver):
    q, kv = np.zeros((10, 4, 64), np.float16), np.zeros((12, 2, 64), np.float16)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: expected an int in \[the longest sequence \(6\)"):
        pyattn.attention_varlen(q, kv, kv, np.array(CU_Q, np.int32), np.array(CU_K, np.int32), max_seqlen_q=5,
                                max_seqlen_k=7)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: must start at 0"):
        pyattn.attention_varlen(q, kv, kv, np.array(CU_Q, np.int32), np.array([0, 9, 7], np.int32), max_seqlen_q=6,
                                max_seqlen_k=9)


def test_the_maxima_are_still_validated(gpu, fetched):
    q, k, v, cq, ck = _arrays()
    for bad, exc in ((2**31, ValueError), (-1, ValueError), (3.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="^max_seqlen_k: "):
            pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=6, max_seqlen_k=bad)
    assert fetched == []


def test_packed_rows_past_int32_are_refused():
    """Offsets are int32 (as are the packed row counts the kernels clamp to): a packed array they
    cannot address is refused on its shape, with no offset value read."""
    from test_validate_first import Dev
    from pyattn.interop.inputs import read_args

    a = read_args({"q": Dev((2**31, 1, 8)), "k": Dev((4, 1, 8)), "v": Dev((4, 1, 8)),
                   "cu_q": Dev((2,), np.int32), "cu_k": Dev((2,), np.int32)},
                  ("q", "k", "v", "cu_q", "cu_k"), ("q", "k", "v", "cu_q", "cu_k"))
    with pytest.raises(ValueError, match=r"^q/k: sequence lengths must be < 2\*\*31, got 2147483648, 4"):
        make_varlen_problem(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], None, max_seqlen_q=1, max_seqlen_k=1)


def test_an_unchecked_call_captures_and_a_checked_one_is_refused(gpu):
    """In a capture: the unchecked call's result is the graph's own and nothing synchronises; a
    checked call's copy-back is refused (CaptureError naming the maxima) before the stream sees it."""
    s = Stream(pyattn.get_device())
    q, k, v, cq, ck = _arrays(stream=s)
    pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=6, max_seqlen_k=7, stream=s)  # loads the kernel
    cid = gpu.begin_capture(s)
    out = pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=6, max_seqlen_k=7, stream=s)
    assert out.owner.graph == cid
    names = [name for name, _ in gpu.captured]
    assert "cuMemcpyDtoHAsync" not in names and "cuStreamSynchronize" not in names
    n = len(gpu.captured)
    with pytest.raises(pyattn.CaptureError, match="max_seqlen_q"):
        pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_k=7, stream=s)
    assert len(gpu.captured) == n
    del out
    gpu.end_capture(s)
    assert gpu.refused == []


def test_the_backward_takes_the_same_rule(gpu, fetched, monkeypatch):
    launched = _spy(monkeypatch, _bwd, ATTN_BWD_PARAMS)
    q, k, v, cq, ck = _arrays()
    o, lse = _da((10, 4, 64), np.float16), _da((4, 10), np.float32)
    pyattn.attention_varlen_backward(o, q, k, v, o, lse, cq, ck, max_seqlen_q=6, max_seqlen_k=9)
    assert fetched == []
    p = launched[-1]
    assert (p["seqlen_q"], p["seqlen_k"], p["total_q"], p["total_k"]) == (6, 9, 10, 12)
    assert (p["cu_seqlens_q"], p["cu_seqlens_k"]) == (cq.ptr, ck.ptr)
    pyattn.attention_varlen_backward(o, q, k, v, o, lse, cq, ck, max_seqlen_k=9)
    assert fetched == ["cu_seqlens_q", "cu_seqlens_k"]
    assert (launched[-1]["seqlen_q"], launched[-1]["seqlen_k"]) == (6, 9)


def test_unchecked_repeat_calls_take_the_quick_path(gpu, fetched, monkeypatch):
    """Same layouts and options (maxima included), new arrays: no argument read or validated again,
    the new pointers launched; a checked call never takes it (its offsets' values are per call)."""
    launched = _spy(monkeypatch, _fwd, ATTN_FWD_PARAMS)
    reads, real = [], varlen.read_args
    monkeypatch.setattr(varlen, "read_args", lambda *a: reads.append(1) or real(*a))
    first, second = _arrays(), _arrays()
    for arrays in (first, second, second):
        pyattn.attention_varlen(*arrays, max_seqlen_q=6, max_seqlen_k=7, window=(3, 0))
    assert len(reads) == 1 and fetched == []
    q, k, v, cq, ck = second
    p = launched[-1]
    assert (p["q"], p["k"], p["v"], p["cu_seqlens_q"], p["cu_seqlens_k"]) == (q.ptr, k.ptr, v.ptr, cq.ptr, ck.ptr)
    assert (p["seqlen_q"], p["seqlen_k"], p["window_left"], p["total_q"]) == (6, 7, 3, 10)
    pyattn.attention_varlen(*second, max_seqlen_q=6, max_seqlen_k=8, window=(3, 0))  # another maximum: a new key
    assert len(reads) == 2 and launched[-1]["seqlen_k"] == 8
    for _ in range(2):
        pyattn.attention_varlen(*second, max_seqlen_k=7)
    assert len(reads) == 4 and fetched == ["cu_seqlens_q", "cu_seqlens_k"] * 2


def test_a_quick_repeat_writes_into_out_and_returns_the_lse(gpu, monkeypatch):
    launched = _spy(monkeypatch, _fwd, ATTN_FWD_PARAMS)
    q, k, v, cq, ck = _arrays()
    for _ in range(3):
        out = _da((10, 4, 64), np.float16)
        res, lse = pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=6, max_seqlen_k=7, out=out, return_lse=True)
        assert res is out and launched[-1]["o"] == out.ptr and lse.shape == (4, 10)
        assert launched[-1]["lse"] == lse.ptr

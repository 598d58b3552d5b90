"""``sparse_attention`` input validation (CPU only): accepted calls, rejected calls and the vectorised
CSR checker against a per-row reference.

Every bad call must raise ``ValueError``/``TypeError`` naming the argument before any GPU work.
Calls that pass validation reach the driver, which ``blocked_driver`` turns into a recognisable
``NoDeviceError`` (with or without a GPU), as in ``test_validation``. The launch a valid call makes
and the NVRTC compile of the kernel are in test_sparse_launch.py.
"""

from __future__ import annotations

import re
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.runtime.device as device_mod
from _sparse_helpers import B, D, HKV, HQ, INDICES, NNZ, OFFSETS, SK, SQ, FakeCudaArray, qkv
from pyattn.ops.sparse import sparse_attention
from pyattn.validate.csr import check_csr, check_row_access

BLOCKED = "driver blocked by test_sparse_validation"


@pytest.fixture
def blocked_driver(monkeypatch):
    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


def passes_validation(*args, **kwargs):
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        sparse_attention(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Accepted calls
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(SQ + 1,), (HQ, SQ + 1), (B, HQ, SQ + 1), (1, SQ + 1), (1, HQ, SQ + 1),
                                   (B, 1, SQ + 1), (1, 1, SQ + 1)])
def test_offsets_shapes_are_accepted(shape, blocked_driver):
    offsets = np.broadcast_to(OFFSETS, shape).copy()
    info = check_csr(INDICES, offsets, B, HQ, SQ, SK)
    rows_b, rows_h = ((1,) * 3 + shape)[-3:-1]
    assert info.offsets.shape == (rows_b, rows_h, SQ + 1) and info.offsets.dtype == np.int32
    assert info.stride_h == (SQ + 1 if rows_h > 1 else 0)
    assert info.stride_b == (rows_h * (SQ + 1) if rows_b > 1 else 0)
    passes_validation(*qkv(), INDICES, offsets)


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_dtypes_layouts_and_device_inputs_pass(dtype, layout, device, blocked_driver):
    passes_validation(*qkv(dtype, device, layout), INDICES, OFFSETS, layout=layout, return_lse=True)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int64, np.uint64, ">i4"])
def test_integer_dtypes_are_converted_to_int32(dtype, blocked_driver):
    info = check_csr(INDICES.astype(dtype), OFFSETS.astype(dtype), B, HQ, SQ, SK)
    assert info.indices.dtype == np.int32 and info.offsets.dtype == np.int32
    assert info.indices.flags.c_contiguous and info.offsets.flags.c_contiguous
    np.testing.assert_array_equal(info.indices, INDICES)
    np.testing.assert_array_equal(info.offsets.ravel(), OFFSETS)
    passes_validation(*qkv(), INDICES.astype(dtype), OFFSETS.astype(dtype))


def test_non_contiguous_index_arrays_are_accepted():
    idx = np.repeat(INDICES, 2)[::2]
    off = np.broadcast_to(OFFSETS, (HQ, SQ + 1))  # stride 0 on the head axis
    info = check_csr(idx, off, B, HQ, SQ, SK)
    np.testing.assert_array_equal(info.indices, INDICES)
    assert info.offsets.shape == (1, HQ, SQ + 1) and info.stride_h == SQ + 1


def test_entries_no_row_covers_are_not_checked():
    indices = np.concatenate([INDICES, [-5, 99, 1, 1]]).astype(np.int64)  # garbage past the last list
    offsets = OFFSETS + 0
    assert check_csr(indices, offsets, B, HQ, SQ, SK).indices.size == NNZ + 4
    # lists may start anywhere and overlap: rows 0 and 1 share entries
    indices = np.array([9, 2, 1, 0, 9], np.int32)
    check_csr(indices, np.array([1, 3, 4, 4, 4, 4]), B, HQ, SQ, SK)


def test_empty_problems_validate():
    check_csr(np.zeros(0, np.int32), np.zeros(1, np.int32), B, HQ, 0, SK)  # seqlen_q = 0
    check_csr(np.zeros(0, np.int32), np.zeros(SQ + 1, np.int32), B, HQ, SQ, 0)  # no keys, empty lists


# --------------------------------------------------------------------------------------------
# Rejected calls
# --------------------------------------------------------------------------------------------
def _off(values, shape=None):
    o = np.array(values, np.int32)
    return np.broadcast_to(o, shape).copy() if shape else o


def _huge_uint64():
    idx = INDICES.astype(np.uint64)
    idx[idx == 6] = 2**63 + 5  # wraps to a negative int64: must be reported as itself
    return idx


BAD = {
    "indices list": ([0, 3], OFFSETS, TypeError, r"^indices: expected a host NumPy int32 array, got list"),
    "offsets tuple": (INDICES, tuple(OFFSETS), TypeError, r"^offsets: expected a host NumPy int32 array"),
    "indices on device": (FakeCudaArray((NNZ,), np.int32), OFFSETS, TypeError,
                          r"^indices: device index arrays are not supported yet"),
    "offsets on device": (INDICES, FakeCudaArray((SQ + 1,), np.int32), TypeError,
                          r"^offsets: device index arrays are not supported yet"),
    "indices float": (INDICES.astype(np.float32), OFFSETS, TypeError, r"^indices: expected an integer dtype.*float32"),
    "offsets float": (INDICES, OFFSETS.astype(np.float64), TypeError, r"^offsets: expected an integer dtype"),
    "indices bool": (INDICES > 0, OFFSETS, TypeError, r"^indices: expected an integer dtype.*bool"),
    "offsets bool": (INDICES, OFFSETS > 0, TypeError, r"^offsets: expected an integer dtype.*bool"),
    "indices 2-D": (INDICES[None], OFFSETS, ValueError, r"^indices: expected a 1-D array"),
    "indices 0-D": (np.array(3, np.int32), OFFSETS, ValueError, r"^indices: expected a 1-D array"),
    "offsets Sq": (INDICES, OFFSETS[:-1], ValueError,
                   r"^offsets: expected shape \(6,\), \(4, 6\) or \(2, 4, 6\).*got \(5,\)"),
    "offsets Sq+2": (INDICES, np.append(OFFSETS, NNZ), ValueError, r"^offsets: expected shape .*got \(7,\)"),
    "offsets 0-D": (INDICES, np.zeros((), np.int32), ValueError, r"^offsets: expected shape .*got \(\)"),
    "offsets heads": (INDICES, _off(OFFSETS, (HQ + 1, SQ + 1)), ValueError, r"^offsets: expected shape .*got \(5, 6\)"),
    "offsets kv heads": (INDICES, _off(OFFSETS, (HKV, SQ + 1)), ValueError, r"^offsets: .*got \(2, 6\)"),
    "offsets batch": (INDICES, _off(OFFSETS, (B + 1, HQ, SQ + 1)), ValueError, r"^offsets: .*got \(3, 4, 6\)"),
    "offsets 4-D": (INDICES, _off(OFFSETS, (1, B, HQ, SQ + 1)), ValueError, r"^offsets: .*got \(1, 2, 4, 6\)"),
    "offsets transposed": (INDICES, _off(OFFSETS, (HQ, SQ + 1)).T.copy(), ValueError, r"^offsets: .*got \(6, 4\)"),
    "offset negative": (INDICES, _off([0, 2, -1, 9, 10, 11]), ValueError,
                        r"^offsets: offsets\[2\] = -1 is outside \[0, len\(indices\)\] = \[0, 11\]"),
    "offset past nnz": (INDICES, _off([0, 2, 9, 9, 10, 12]), ValueError,
                        r"^offsets: offsets\[5\] = 12 is outside \[0, len\(indices\)\] = \[0, 11\]"),
    "offset huge": (INDICES, _off([0, 2, 9, 9, 10, 11]).astype(np.int64) + np.array([0, 0, 0, 0, 0, 2**40]),
                    ValueError, r"^offsets: offsets\[5\] = 1099511627787 is outside"),
    "offsets decreasing": (INDICES, _off([0, 2, 9, 8, 10, 11]), ValueError,
                           r"^offsets: decreasing within a row list: offsets\[2\] = 9 > offsets\[3\] = 8 "
                           r"\(query row 2 "),
    "index negative": (np.where(INDICES == 2, -1, INDICES).astype(np.int32), OFFSETS, ValueError,
                       r"^indices: indices\[3\] = -1, listed by query row 1 \(offsets\[1\]\), is outside "
                       r"\[0, seqlen_k\) = \[0, 7\)"),
    "index = Sk": (np.where(INDICES == 1, SK, INDICES).astype(np.int32), OFFSETS, ValueError,
                   r"^indices: indices\[5\] = 7, listed by query row 1 .*outside \[0, seqlen_k\) = \[0, 7\)"),
    "index huge uint64": (_huge_uint64(), OFFSETS, ValueError,
                          r"^indices: indices\[2\] = 9223372036854775813, listed by query row 1"),
    "duplicate": (np.where(INDICES == 5, 3, INDICES).astype(np.int32), OFFSETS, ValueError,
                  r"^indices: query row 1 \(offsets\[1\]\) lists key 3 twice, at indices\[6\] and indices\[8\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_index_arrays_are_rejected_before_gpu_work(case, blocked_driver):
    indices, offsets, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        sparse_attention(*qkv(), indices, offsets)
    with pytest.raises(exc, match=match):  # device q/k/v: the index checks come first too
        sparse_attention(*qkv(device=True), indices, offsets)


def test_errors_name_the_batch_and_head_of_the_row():
    per_bh = np.broadcast_to(OFFSETS, (B, HQ, SQ + 1)).copy()
    per_bh[1, 2, 3] = 20
    with pytest.raises(ValueError, match=r"^offsets: offsets\[1, 2, 3\] = 20 is outside"):
        check_csr(INDICES, per_bh, B, HQ, SQ, SK)
    # head 3's row 4 lists entries 10..11: key 6 twice
    indices = np.append(INDICES, 6).astype(np.int32)
    per_h = np.broadcast_to(OFFSETS, (HQ, SQ + 1)).copy()
    per_h[3, 4:] = [10, 12]
    with pytest.raises(ValueError, match=r"^indices: query row 4 \(offsets\[3, 4\]\) lists key 6 twice, "
                                         r"at indices\[10\] and indices\[11\]"):
        check_csr(indices, per_h, B, HQ, SQ, SK)


BAD_QKV = {
    "layout": (dict(layout="bsdh"), ValueError, r"^layout: expected one of"),
    "q rank": (dict(q=np.ones((B, SQ, HQ * D), np.float32)), ValueError, r"^q: expected a 4-D array"),
    "k dtype": (dict(k=np.ones((B, SK, HKV, D), np.float16)), TypeError, r"^q, k, v: expected one dtype"),
    "q dtype": (dict(q=np.ones((B, SQ, HQ, D), np.float64)), TypeError, r"^q: expected dtype float32"),
    "heads": (dict(k=np.ones((B, SK, 3, D), np.float32), v=np.ones((B, SK, 3, D), np.float32)), ValueError,
              r"^k: query heads \(4\) must be a multiple of key/value heads \(3\)"),
    "head_dim": (dict(q=np.ones((B, SQ, HQ, 12), np.float32), k=np.ones((B, SK, HKV, 12), np.float32),
                      v=np.ones((B, SK, HKV, 12), np.float32)), ValueError, r"^q: head_dim must be a multiple of 8"),
    "v shape": (dict(v=np.ones((B, SK + 1, HKV, D), np.float32)), ValueError, r"^v: expected the same shape as k"),
    "scale": (dict(scale=-1.0), ValueError, r"^scale: expected a finite positive number"),
    "out shape": (dict(out=np.ones((B, SQ, HQ, D + 8), np.float32)), ValueError, r"^out: expected shape"),
    "out dtype": (dict(out=np.ones((B, SQ, HQ, D), np.float16)), TypeError, r"^out: expected dtype float32"),
    "out device": (dict(out=FakeCudaArray((B, SQ, HQ, D))), TypeError, r"^out: expected a NumPy array like q"),
    "mixed": (dict(k=FakeCudaArray((B, SK, HKV, D))), TypeError, r"^q, k, v: expected all host"),
}


@pytest.mark.parametrize("case", sorted(BAD_QKV))
def test_bad_qkv_arguments_are_rejected(case, blocked_driver):
    changes, exc, match = BAD_QKV[case]
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v, **changes}
    kwargs = {key: val for key, val in args.items() if key not in ("q", "k", "v")}
    with pytest.raises(exc, match=match):
        sparse_attention(args["q"], args["k"], args["v"], INDICES, OFFSETS, **kwargs)


def test_qkv_errors_come_before_index_errors(blocked_driver):
    with pytest.raises(ValueError, match=r"^scale:"):
        sparse_attention(*qkv(), INDICES, OFFSETS[:-1], scale=0.0)


@pytest.mark.parametrize("ptr, strides, ok", [
    (0x1000, (B * SQ * HQ * D, HQ * D, D, 1), True),
    (0x1008, (B * SQ * HQ * D, HQ * D, D, 1), False),  # misaligned base
    (0x1000, (B * SQ * HQ * (D + 2), HQ * (D + 2), D + 2, 1), False),  # rows 4 bytes apart from 16
    (0x1000, (12345, HQ * D, D, 1), True),  # batch of 1: its stride is never used
])
def test_alignment_check(ptr, strides, ok):
    shape = (1 if strides[0] == 12345 else B, SQ, HQ, D)
    a = types.SimpleNamespace(name="k", ptr=ptr, dtype=np.dtype(np.float16), strides=strides, shape=shape)
    if ok:
        check_row_access(a)
    else:
        with pytest.raises(ValueError, match=r"^k: the sparse kernel accesses rows in 16-byte aligned pieces"):
            check_row_access(a)


# --------------------------------------------------------------------------------------------
# The vectorised checker against a straightforward per-row one
# --------------------------------------------------------------------------------------------
def _where(ndim, b, h, i):
    return "offsets[" + ", ".join(str(x) for x in (b, h, i)[3 - ndim:]) + "]"


def reference_check(indices, offsets, batch, heads_q, seqlen_q, seqlen_k):
    """The first error, category by category, rows in row-major order: a regex for its message, or None."""
    off = offsets.reshape((1,) * (3 - offsets.ndim) + offsets.shape).astype(object)
    nnz, nd = len(indices), offsets.ndim
    rows = [(b, h) for b in range(off.shape[0]) for h in range(off.shape[1])]
    for b, h in rows:
        for i in range(seqlen_q + 1):
            if not 0 <= off[b, h, i] <= nnz:
                return re.escape(f"offsets: {_where(nd, b, h, i)} = {off[b, h, i]} is outside")
    for b, h in rows:
        for i in range(seqlen_q):
            if off[b, h, i + 1] < off[b, h, i]:
                return re.escape(f"{_where(nd, b, h, i)} = {off[b, h, i]} > {_where(nd, b, h, i + 1)}")
    for b, h in rows:
        for i in range(seqlen_q):
            for p in range(off[b, h, i], off[b, h, i + 1]):
                if not 0 <= int(indices[p]) < seqlen_k:
                    return re.escape(f"indices: indices[{p}] = {indices[p]}, listed by query row {i} "
                                     f"({_where(nd, b, h, i)})")
    for b, h in rows:
        for i in range(seqlen_q):
            keys = [int(x) for x in indices[off[b, h, i]:off[b, h, i + 1]]]
            twice = sorted({x for x in keys if keys.count(x) > 1})
            if twice:
                first = [off[b, h, i] + j for j, x in enumerate(keys) if x == twice[0]][:2]
                return re.escape(f"indices: query row {i} ({_where(nd, b, h, i)}) lists key {twice[0]} twice, "
                                 f"at indices[{first[0]}] and indices[{first[1]}]")
    return None


@st.composite
def csr_cases(draw):
    batch, heads_q, seqlen_q, seqlen_k = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, 5)),
                                          draw(st.integers(0, 6)))
    ndim = draw(st.integers(1, 3))
    shape = ((batch, heads_q, seqlen_q + 1)[3 - ndim:])
    nnz = draw(st.integers(0, 16))
    in_range = seqlen_k > 0 and draw(st.booleans())  # else values one past either end occur too
    values = st.integers(0, seqlen_k - 1) if in_range else st.integers(-1, seqlen_k)
    indices = np.array(draw(st.lists(values, min_size=nnz, max_size=nnz)), np.int64)
    # mostly sorted offsets in [0, nnz], sometimes nudged out of range or out of order
    offsets = np.sort(np.array(draw(st.lists(st.integers(0, nnz), min_size=int(np.prod(shape)),
                                             max_size=int(np.prod(shape)))), np.int64).reshape(shape), axis=-1)
    for _ in range(draw(st.integers(0, 2))):
        flat = offsets.reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] += draw(st.sampled_from([-2, -1, 1, 2]))
    return indices, offsets, batch, heads_q, seqlen_q, seqlen_k


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(csr_cases(), st.sampled_from([np.int32, np.int64]), st.sampled_from([1, 3, 1 << 22]))
def test_checker_agrees_with_a_per_row_reference(case, dtype, chunk):
    import pyattn.validate.csr as mod

    indices, offsets, batch, heads_q, seqlen_q, seqlen_k = case
    indices = indices.astype(dtype)
    expected = reference_check(indices, offsets, batch, heads_q, seqlen_q, seqlen_k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "_CHUNK", chunk)  # tiny chunks: errors must still be found in row-major order
        if expected is None:
            info = check_csr(indices, offsets, batch, heads_q, seqlen_q, seqlen_k)
            np.testing.assert_array_equal(info.offsets.reshape(offsets.shape), offsets)
        else:
            with pytest.raises(ValueError, match=expected):
                check_csr(indices, offsets, batch, heads_q, seqlen_q, seqlen_k)

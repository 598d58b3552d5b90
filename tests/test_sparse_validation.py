"""``sparse_attention`` input validation and the NVRTC compile of its kernel (CPU only).

Every bad call must raise ``ValueError``/``TypeError`` naming the argument before any GPU work.
Calls that pass validation reach the driver, which ``blocked_driver`` turns into a recognisable
``NoDeviceError`` (with or without a GPU), as in ``test_validation``.
"""

from __future__ import annotations

import math
import re
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.runtime.device as device_mod
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec
from _problems import problem
from pyattn.ops.sparse import sparse_attention
from pyattn.validate.csr import check_csr, check_row_access

BLOCKED = "driver blocked by test_sparse_validation"
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


@pytest.fixture
def blocked_driver(monkeypatch):
    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


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
# The launch a valid call makes, with the device layer faked
# --------------------------------------------------------------------------------------------
class _Fake:
    """A device array stand-in: the attributes the launch reads."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The device layer of ``ops.sparse._run`` faked: plans, outputs, uploads and launches."""
    import pyattn.ops.sparse as mod

    device, launches, ptrs = _Fake(arch="sm_90a", ordinal=0), [], iter(range(0x10000, 2**40, 0x10000))

    def array(shape, dtype):
        return _Fake(ptr=next(ptrs), shape=tuple(shape), dtype=np.dtype(dtype), device=device)

    monkeypatch.setattr(mod, "get_plan", lambda build, P, dev: mod._Plan(_spec_of(P, dev), None))
    monkeypatch.setattr(mod, "output", lambda dev, s, shape, dtype: array(shape, dtype))
    monkeypatch.setattr(mod, "upload", lambda arrays, dev, s: [array(a.shape, a.dtype) for a in arrays])
    monkeypatch.setattr(mod, "launch", lambda *args: launches.append(args))

    def run(q, k, v, indices, offsets, *, layout="bshd", scale=None, return_lse=False):
        P = problem(q, k, v, layout=layout, scale=scale)
        csr = check_csr(indices, offsets, P.batch, P.heads_q, P.seqlen_q, P.seqlen_k)
        dq, dk, dv = (array(x.shape, x.dtype) for x in (q, k, v))
        return mod._run(P, csr, device, "stream", dq, dk, dv, None, return_lse)

    return run, launches


def _spec_of(P, device):
    bucket = next(b for b in HEAD_DIM_BUCKETS if b >= P.head_dim)
    return KernelSpec("attn_sparse", {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[P.dtype], bucket,
                      device.arch)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("shape", [(SQ + 1,), (HQ, SQ + 1), (B, HQ, SQ + 1)])
def test_launch_parameters(layout, shape, fake_gpu):
    import struct

    run, launches = fake_gpu
    q, k, v = qkv(np.float16, layout=layout)
    out, lse = run(q, k, v, INDICES, np.broadcast_to(OFFSETS, shape).copy(), layout=layout, scale=0.5,
                   return_lse=True)
    assert out.shape == q.shape and out.dtype == np.float16 and lse.shape == (B, HQ, SQ) and lse.dtype == np.float32
    (kernel, grid, block, smem, stream, raw), = launches
    spec = _spec_of(problem(q, k, v, layout=layout), _Fake(arch="sm_90a"))
    assert (spec.family, spec.dtype, spec.head_dim, spec.arch) == ("attn_sparse", "f16", 64, "sm_90a")
    assert grid == (-(-SQ // 4), HQ, B) and block == (128, 1, 1) and smem == 0 and stream == "stream"
    p = dict(zip([n for n, _ in spec.params.fields], struct.unpack_from(spec.params.format, raw)))
    seq, head = (HQ * D, D) if layout == "bshd" else (D, SQ * D)
    assert (p["q_stride_b"], p["q_stride_s"], p["q_stride_h"]) == (SQ * HQ * D, seq, head)
    assert (p["o_stride_b"], p["o_stride_s"], p["o_stride_h"]) == (SQ * HQ * D, seq, head)
    seq, head = (HKV * D, D) if layout == "bshd" else (D, SK * D)
    for name in ("k", "v"):
        assert (p[f"{name}_stride_b"], p[f"{name}_stride_s"], p[f"{name}_stride_h"]) == (SK * HKV * D, seq, head)
    assert (p["off_stride_b"], p["off_stride_h"]) == {1: (0, 0), 2: (0, SQ + 1), 3: (HQ * (SQ + 1), SQ + 1)}[len(shape)]
    assert (p["lse_stride_b"], p["lse_stride_h"]) == (HQ * SQ, SQ)
    assert (p["batch"], p["heads_q"], p["group"], p["seqlen_q"], p["seqlen_k"], p["head_dim"]) == (B, HQ, 2, SQ, SK, D)
    assert p["scale_log2"] == pytest.approx(0.5 * math.log2(math.e))
    assert all(p[n] for n in ("q", "k", "v", "o", "lse", "indices", "offsets"))


def test_empty_problem_launches_nothing(fake_gpu):
    run, launches = fake_gpu
    q, k, v = qkv()
    out, _ = run(q[:, :0], k, v, np.zeros(0, np.int32), np.zeros(1, np.int32))
    assert out.shape == (B, 0, HQ, D) and launches == []


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


# --------------------------------------------------------------------------------------------
# NVRTC: the kernel compiles for every dtype and bucket (one arch) and on every other arch
# --------------------------------------------------------------------------------------------
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")


def _compile_specs():
    specs = [KernelSpec("attn_sparse", dt, d, "sm_90a") for dt in ("f32", "f16", "bf16") for d in HEAD_DIM_BUCKETS]
    others = [a for a in ARCHS if a != "sm_90a"]
    picks = [("bf16", 96), ("f16", 160), ("f32", 224), ("bf16", 256)]
    return specs + [KernelSpec("attn_sparse", dt, d, a) for a, (dt, d) in zip(others, picks)]


def test_sparse_kernel_compiles_without_spills():
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("cuda.bindings")
    from pyattn.jit.headers import cuda_include_dir
    from pyattn.jit.nvrtc import compile_source
    from pyattn.jit.source import kernel_headers, render

    inc = str(cuda_include_dir()[0])
    specs = _compile_specs()
    assert {s.arch for s in specs} == set(ARCHS) and len(specs) == 28

    def build(spec):
        opts = spec.compile_options((inc,)) + ("-Xptxas=-v",)
        return compile_source(render(spec), kernel_headers(), opts, name=spec.describe())

    with ThreadPoolExecutor(max_workers=4) as pool:
        for spec, (image, log) in zip(specs, pool.map(build, specs)):
            what = spec.describe()
            assert image[:4] == b"\x7fELF", what
            assert f"-arch {spec.arch} ".encode() in image, what
            assert spec.entry_name.encode() + b"\0" in image, what
            # register arrays (q, the accumulator, 8 K/V rows) must stay in registers
            assert re.findall(r"(\d+) bytes stack frame", log) == ["0"], (what, log)
            assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], (what, log)

"""GPU tests of ``pyattn.attention`` against the fp64 reference (marked ``gpu``; skipped without a driver).

Every output is allocated poisoned (``memory.POISON_ALLOC``: NaN bytes), so an element the
kernel fails to write shows up as NaN and fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.reference import attention_ref, error_bound

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pyattn.runtime.stream import LEGACY_STREAM


def _has_gpu() -> bool:
    try:
        return pyattn.device_count() > 0
    except Exception:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype, layout="bshd"):
    def shape(S, H):
        return (B, S, H, D) if layout == "bshd" else (B, H, S, D)

    dt = DTYPES[dtype]
    return (rng.standard_normal(shape(Sq, Hq)).astype(dt), rng.standard_normal(shape(Sk, Hkv)).astype(dt),
            rng.standard_normal(shape(Sk, Hkv)).astype(dt))


def _check(out, lse, q, k, v, **opts):
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **opts)
    out = np.asarray(out).astype(np.float64)
    assert out.shape == ref.shape
    assert not np.isnan(out).any(), "unwritten (poisoned) or NaN output elements"
    err = np.abs(out - ref).max() if out.size else 0.0
    bound = error_bound(q, k, v, **opts) if out.size else 0.0
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    if lse is not None:
        lse = np.asarray(lse).astype(np.float64)
        assert lse.shape == ref_lse.shape
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isneginf(lse), ~finite), "-inf LSE exactly where a row sees no key"
        if finite.any():
            assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-3 * max(1.0, np.abs(ref_lse[finite]).max())


LENGTHS = st.sampled_from([1, 17, 113, 239, 1000]) | st.integers(1, 300)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3, 4]),
       D=st.sampled_from([8, 16, 32, 40, 64, 72, 96, 128, 136, 160, 192, 200, 256]),
       dtype=st.sampled_from(sorted(DTYPES)), causal=st.booleans(), layout=st.sampled_from(["bshd", "bhsd"]),
       seed=st.integers(0, 2**31 - 1))
def test_attention_matches_reference(B, Sq, Sk, Hkv, group, D, dtype, causal, layout, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype, layout)
    out, lse = pyattn.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and lse.dtype == np.float32
    _check(out, lse.astype(np.float64), q, k, v, causal=causal, layout=layout)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_device_inputs_and_scale(dtype):
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, 2, 300, 517, 8, 2, 128, dtype)
    dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
    out = pyattn.attention(dq, dk, dv, scale=0.3, causal=True)
    assert isinstance(out, pyattn.DeviceArray) and out.shape == q.shape and out.dtype == q.dtype
    _check(out.numpy(), None, q, k, v, scale=0.3, causal=True)


def test_fully_masked_rows_and_empty_keys():
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, 1, 70, 20, 4, 4, 64, "float16")
    out, lse = pyattn.attention(q, k, v, causal=True, return_lse=True)  # rows 0..49 see no key
    assert np.all(out[:, :50] == 0) and np.all(np.isneginf(lse[:, :, :50]))
    _check(out, lse.astype(np.float64), q, k, v, causal=True)
    out, lse = pyattn.attention(q, k[:, :0], v[:, :0], return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    empty_q = pyattn.attention(q[:, :0], k, v)
    assert empty_q.shape == (1, 0, 4, 64)


def test_long_sequence():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 4096, 4096, 4, 1, 128, "bfloat16")
    out, lse = pyattn.attention(q, k, v, causal=True, return_lse=True)
    _check(out, lse.astype(np.float64), q, k, v, causal=True)


try:  # torch is only a comparison and an interop partner here, never a dependency
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_zero_copy_round_trip(dtype):
    """torch in, DeviceArray out, back to torch zero-copy through DLPack (bfloat16 included) and CAI."""
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(2, 200, 6, 64, device="cuda", dtype=tdt, generator=g)
    q = big[:, 50:150]  # strided view: batch stride 200*6*64, not contiguous over the batch
    k = torch.randn(2, 300, 3, 64, device="cuda", dtype=tdt, generator=g)
    v = torch.randn(2, 300, 3, 64, device="cuda", dtype=tdt, generator=g)
    out = pyattn.attention(q, k, v, causal=True)
    assert isinstance(out, pyattn.DeviceArray)
    t_out = torch.from_dlpack(out)
    assert t_out.shape == q.shape and t_out.dtype == tdt and t_out.device.type == "cuda"
    assert t_out.data_ptr() == out.ptr  # zero copy
    Sq, Sk = q.shape[1], k.shape[1]
    bottom_right = torch.ones(Sq, Sk, dtype=torch.bool, device="cuda").tril(diagonal=Sk - Sq)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double(),
        attn_mask=bottom_right, enable_gqa=True).transpose(1, 2)
    host = lambda t: t.double().cpu().numpy()  # noqa: E731
    np.testing.assert_allclose(host(t_out), host(ref), atol=2e-2 if dtype == "bfloat16" else 5e-3)
    if dtype != "bfloat16":  # the CUDA array interface has no typestr for bf16 (DLPack is its route)
        t_cai = torch.as_tensor(out, device="cuda")
        assert t_cai.data_ptr() == out.ptr
    # and our own export back into pyattn
    again = pyattn.asarray(t_out)
    np.testing.assert_array_equal(again.numpy().astype(np.float64), host(t_out))


def test_cupy_round_trip():
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 1, 64, 64, 2, 2, 32, "float16")
    out = pyattn.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v))
    c_out = cp.asarray(out)  # CAI, with the producing stream
    _check(cp.asnumpy(c_out), None, q, k, v)
    c_dl = cp.from_dlpack(out)
    assert int(c_dl.data.ptr) == out.ptr


def test_two_streams():
    rng = np.random.default_rng(5)
    problems = [_inputs(rng, 2, 513, 700, 8, 4, 64, "float16"), _inputs(rng, 1, 900, 333, 4, 1, 128, "bfloat16")]
    with pyattn.Stream() as s1, pyattn.Stream() as s2:
        outs = []
        for (q, k, v), s in zip(problems, (s1, s2)):
            d = [pyattn.asarray(x, stream=s) for x in (q, k, v)]
            outs.append(pyattn.attention(*d, causal=True, stream=s))
        for out, (q, k, v), s in zip(outs, problems, (s1, s2)):
            s.synchronize()
            _check(out.numpy(stream=s), None, q, k, v, causal=True)
    if torch is None:
        return
    # a foreign stream given as an int handle and as a __cuda_stream__ object
    ts = torch.cuda.Stream()
    q, k, v = problems[0]
    _check(pyattn.attention(q, k, v, causal=True, stream=ts.cuda_stream), None, q, k, v, causal=True)
    if hasattr(ts, "__cuda_stream__"):
        _check(pyattn.attention(q, k, v, causal=True, stream=ts), None, q, k, v, causal=True)


def test_events_time_a_kernel():
    dev = pyattn.get_device()
    rng = np.random.default_rng(6)
    q, k, v = (pyattn.asarray(x) for x in _inputs(rng, 1, 1024, 1024, 8, 8, 64, "float16"))
    s = pyattn.Stream(dev)
    start = s.record(timing=True)
    pyattn.attention(q, k, v, stream=s)
    end = s.record(timing=True)
    assert 0 < start.elapsed_ms(end) < 1000


def test_arrays_outlive_a_closed_stream():
    """Closing a stream while arrays allocated on it live: reading and freeing them later is safe
    (regression: their free once ran cuMemFreeAsync on the destroyed CUstream and segfaulted)."""
    import gc

    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 1, 64, 80, 2, 1, 64, "float16")
    with pyattn.Stream() as s:
        d = [pyattn.asarray(x, stream=s) for x in (q, k, v)]
        out = pyattn.attention(*d, stream=s)
    assert s.ptr == LEGACY_STREAM  # a closed stream stands for the legacy default stream
    _check(out.numpy(), None, q, k, v)
    del out, d
    gc.collect()
    pyattn.get_device().synchronize()


@needs_torch
def test_misaligned_device_inputs_are_rejected_before_launch():
    """The tensor-core kernel reads 16-byte chunks: an address or stride it cannot read is a
    ValueError naming the argument, never a device fault (the context stays usable after)."""
    big = torch.randn(1, 64, 2, 72, device="cuda", dtype=torch.float16)
    ok = big[..., :64]  # strides (9216, 144, 72, 1): multiples of 8, aligned
    shifted = big[..., 1:65]  # same strides, address off by 2 bytes
    odd_stride = torch.randn(1, 64, 2, 68, device="cuda", dtype=torch.float16)[..., :64]  # 68 % 8 != 0
    with pytest.raises(ValueError, match=r"^q: .*16-byte aligned"):
        pyattn.attention(shifted, ok, ok)
    with pytest.raises(ValueError, match=r"^k: .*multiples of 8"):
        pyattn.attention(ok, odd_stride, ok)
    out = pyattn.attention(ok, ok, ok)  # still works afterwards
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (ok, ok, ok)))
    np.testing.assert_allclose(torch.from_dlpack(out).float().cpu().numpy(),
                               ref.transpose(1, 2).float().cpu().numpy(), atol=5e-3)

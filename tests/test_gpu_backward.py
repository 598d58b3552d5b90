"""GPU tests of ``pyattn.attention_backward`` / ``attention_varlen_backward`` against the fp64 reference
gradients with the 2x rule (marked ``gpu``; skipped without a driver).

Each call's ``out`` and ``lse`` come from ``pyattn.attention(..., return_lse=True)``, as in
training. Outputs are allocated poisoned (``memory.POISON_ALLOC``, NaN bytes; the backward's
scratch too) and caller-given outputs are filled with NaN, so an element no kernel writes fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.reference import attention_backward_ref, attention_varlen_backward_ref, backward_error_bounds
from test_gpu_attention import _has_gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

try:  # torch is an interop partner here, never a dependency
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype, layout="bshd"):
    def shape(S, H):
        return (B, S, H, D) if layout == "bshd" else (B, H, S, D)

    dt = DTYPES[dtype]
    return tuple(rng.standard_normal(s).astype(dt) for s in (shape(Sq, Hq), shape(Sq, Hq), shape(Sk, Hkv),
                                                            shape(Sk, Hkv)))


def _check(grads, dout, q, k, v, **opts):
    """Each of (dq, dk, dv) against the fp64 reference: no NaN, the right shape, within the 2x rule."""
    refs = attention_backward_ref(dout, q, k, v, **opts)
    bounds = backward_error_bounds(dout, q, k, v, **opts)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bounds):
        g = np.asarray(g).astype(np.float64)
        assert g.shape == r.shape, name
        assert not np.isnan(g).any(), f"{name}: unwritten (poisoned) or NaN elements"
        err = np.abs(g - r).max() if g.size else 0.0
        assert err <= b, f"{name}: max error {err:.3e} > bound {b:.3e} (max |ref| {np.abs(r).max():.3e})"


def _fwd_bwd(dout, q, k, v, **opts):
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    return pyattn.attention_backward(dout, q, k, v, out, lse, **opts)


LENGTHS = st.sampled_from([1, 17, 113, 239, 600]) | st.integers(1, 300)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3, 4]),
       D=st.sampled_from([8, 32, 40, 64, 96, 128, 160, 200, 256]), dtype=st.sampled_from(sorted(DTYPES)),
       causal=st.sampled_from([False, True, "top_left"]), layout=st.sampled_from(["bshd", "bhsd"]),
       window=st.sampled_from([None, None, (16, 0), (40, 7), (-1, 3)]), softcap=st.sampled_from([None, None, 20.0]),
       alibi=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_backward_matches_reference(B, Sq, Sk, Hkv, group, D, dtype, causal, layout, window, softcap, alibi, seed):
    rng = np.random.default_rng(seed)
    dout, q, k, v = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype, layout)
    opts = dict(causal=causal, layout=layout, window=window, softcap=softcap,
                alibi_slopes=rng.uniform(0.01, 0.3, Hkv * group).astype(np.float32) if alibi else None)
    grads = _fwd_bwd(dout, q, k, v, **opts)
    assert all(isinstance(g, np.ndarray) and g.dtype == q.dtype for g in grads)
    _check(grads, dout, q, k, v, **opts)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fully_masked_rows_and_empty_sides(dtype):
    rng = np.random.default_rng(1)
    dout, q, k, v = _inputs(rng, 1, 150, 40, 4, 2, 64, dtype)
    dq, dk, dv = _fwd_bwd(dout, q, k, v, causal=True)  # query rows 0..109 see no key
    assert np.all(dq[:, :110] == 0)
    _check((dq, dk, dv), dout, q, k, v, causal=True)
    dq, dk, dv = _fwd_bwd(dout, q, k[:, :0], v[:, :0])  # no keys: dq = 0
    assert np.all(dq == 0) and dk.shape == (1, 0, 2, 64)
    dq, dk, dv = _fwd_bwd(dout[:, :0], q[:, :0], k, v)  # no queries: dk = dv = 0
    assert dq.shape == (1, 0, 4, 64) and np.all(dk == 0) and np.all(dv == 0)


@pytest.mark.parametrize("D", [8, 64, 200])
def test_fp32_one_key_gives_exactly_zero_dk(D):
    """With one key, out = v and dS = P (dP - dsum) is 0 in exact arithmetic, so the reference dk is
    exactly 0. On the fp32 path dsum is summed in dP's order, so dk must be exactly 0 too (the 2x
    rule against an exact 0 leaves no room for a rounding difference between the two sums)."""
    rng = np.random.default_rng(D)
    dout, q, k, v = _inputs(rng, 2, 37, 1, 4, 2, D, "float32")
    for opts in ({}, {"softcap": 20.0}, {"alibi_slopes": np.full(4, 0.2, np.float32)}):
        dq, dk, dv = _fwd_bwd(dout, q, k, v, **opts)
        assert np.all(dk == 0) and np.all(dq == 0), opts
        _check((dq, dk, dv), dout, q, k, v, **opts)


def test_long_causal_sequence_gqa():
    rng = np.random.default_rng(2)
    dout, q, k, v = _inputs(rng, 1, 2048, 2048, 8, 2, 128, "bfloat16")
    _check(_fwd_bwd(dout, q, k, v, causal=True), dout, q, k, v, causal=True)


@pytest.fixture
def mma_sync_main(monkeypatch):
    """The mma.sync main kernel where the GPU would run the wgmma one (sm_90a, d <= 128), so the
    other archs' path stays tested on a Hopper test machine too."""
    from pyattn.kernels.registry import forget_kernels
    from pyattn.kernels.specs import KernelSpec
    from pyattn.ops import _bwd

    chosen = _bwd.select_backward_specs

    def select(dtype, head_dim, arch, **kw):
        pre, main, conv = chosen(dtype, head_dim, arch, **kw)
        if main.family == "attn_bwd_wgmma":
            bucket = -(-head_dim // 32) * 32
            main = KernelSpec("attn_bwd_mma", main.dtype, bucket, arch, main.ptx, softcap=main.softcap,
                              alibi=main.alibi)
        return pre, main, conv

    monkeypatch.setattr(_bwd, "select_backward_specs", select)
    forget_kernels()  # plans key on the kernel generation: none built with the other kernel is reused
    yield
    forget_kernels()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(Sq=LENGTHS, Sk=LENGTHS, group=st.sampled_from([1, 4]), D=st.sampled_from([32, 64, 96, 128]),
       dtype=st.sampled_from(["float16", "bfloat16"]), causal=st.sampled_from([False, True]),
       softcap=st.sampled_from([None, 20.0]), seed=st.integers(0, 2**31 - 1))
def test_mma_sync_backward_on_hopper_too(mma_sync_main, Sq, Sk, group, D, dtype, causal, softcap, seed):
    from pyattn.kernels.registry import loaded_kernels

    rng = np.random.default_rng(seed)
    dout, q, k, v = _inputs(rng, 1, Sq, Sk, 2 * group, 2, D, dtype)
    _check(_fwd_bwd(dout, q, k, v, causal=causal, softcap=softcap), dout, q, k, v, causal=causal, softcap=softcap)
    assert "attn_bwd_wgmma" not in {spec.family for _, spec in loaded_kernels()}


@pytest.mark.parametrize("dtype, D", [("bfloat16", 128), ("float16", 64), ("float32", 64), ("bfloat16", 256)])
def test_deterministic_mode_is_bit_identical(dtype, D):
    rng = np.random.default_rng(3)
    dout, q, k, v = _inputs(rng, 2, 700, 1100, 4, 2, D, dtype)
    d_in = [pyattn.asarray(x) for x in (dout, q, k, v)]
    out, lse = pyattn.attention(*d_in[1:], causal=True, return_lse=True)
    runs = [[g.numpy() for g in pyattn.attention_backward(*d_in, out, lse, causal=True, deterministic=True)]
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    _check(runs[0], dout, q, k, v, causal=True)
    fast = [g.numpy() for g in pyattn.attention_backward(*d_in, out, lse, causal=True)]
    _check(fast, dout, q, k, v, causal=True)
    assert np.array_equal(fast[1].view(np.uint8), runs[0][1].view(np.uint8))  # dk, dv never use atomics


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("on_device", [False, True])
def test_varlen(dtype, on_device):
    rng = np.random.default_rng(4)
    lens_q, lens_k = [113, 0, 1, 300, 17], [200, 5, 1, 300, 0]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    dt = DTYPES[dtype]
    q, dout = (rng.standard_normal((cu_q[-1], 6, 64)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((cu_k[-1], 2, 64)).astype(dt) for _ in range(2))
    slopes = rng.uniform(0.01, 0.2, (5, 6)).astype(np.float32)
    opts = dict(causal=True, alibi_slopes=slopes, softcap=15.0)
    args = [q, k, v, cu_q, cu_k]
    if on_device:
        args = [pyattn.asarray(x) for x in args]
    out, lse = pyattn.attention_varlen(*args, return_lse=True, **opts)
    d_dout = pyattn.asarray(dout) if on_device else dout
    grads = pyattn.attention_varlen_backward(d_dout, *args[:3], out, lse, *args[3:], deterministic=on_device, **opts)
    grads = [g.numpy() if on_device else g for g in grads]
    refs = attention_varlen_backward_ref(dout, q, k, v, cu_q, cu_k, **opts)
    for n in range(5):  # each sequence against its own dense bound
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        one = dict(causal=True, alibi_slopes=slopes[n], softcap=15.0)
        bounds = backward_error_bounds(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], **one)
        for g, r, b, s in zip(grads, refs, bounds, (qs, ks, ks)):
            assert not np.isnan(g[s].astype(np.float64)).any()
            assert np.abs(g[s].astype(np.float64) - r[s]).max(initial=0.0) <= b


def test_given_device_outputs_bhsd():
    rng = np.random.default_rng(5)
    dout, q, k, v = _inputs(rng, 2, 130, 90, 4, 4, 96, "float16", "bhsd")
    d = [pyattn.asarray(x) for x in (dout, q, k, v)]
    out, lse = pyattn.attention(*d[1:], layout="bhsd", scale=0.2, return_lse=True)
    dests = [pyattn.asarray(np.full(x.shape, np.nan, np.float16)) for x in (q, k, v)]
    grads = pyattn.attention_backward(*d, out, lse, layout="bhsd", scale=0.2, dq=dests[0], dk=dests[1], dv=dests[2])
    assert all(g is x for g, x in zip(grads, dests))
    _check([g.numpy() for g in grads], dout, q, k, v, layout="bhsd", scale=0.2)


def test_numpy_in_numpy_out_with_given_outputs():
    rng = np.random.default_rng(6)
    dout, q, k, v = _inputs(rng, 1, 77, 55, 6, 3, 32, "bfloat16")
    out, lse = pyattn.attention(q, k, v, window=(20, 5), return_lse=True)
    dests = [np.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    grads = pyattn.attention_backward(dout, q, k, v, out, lse, window=(20, 5), dq=dests[0], dk=dests[1], dv=dests[2])
    assert all(g is d for g, d in zip(grads, dests))
    _check(grads, dout, q, k, v, window=(20, 5))


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_tensors_in_and_autograd_agrees(dtype):
    """torch tensors straight in (views, requires_grad), DeviceArrays out that torch takes zero-copy;
    the gradients agree with torch autograd through SDPA in float64."""
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 300, 8, 64, device="cuda", dtype=tdt, generator=g).requires_grad_()
    k = torch.randn(2, 260, 2, 64, device="cuda", dtype=tdt, generator=g).requires_grad_()
    v = torch.randn(2, 260, 2, 64, device="cuda", dtype=tdt, generator=g).requires_grad_()
    dout = torch.randn(2, 300, 8, 64, device="cuda", dtype=tdt, generator=g)
    out, lse = pyattn.attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True)
    dq = torch.full((2, 8, 300, 64), float("nan"), device="cuda", dtype=tdt).transpose(1, 2)  # strided destinations
    dkv = torch.full((2, 260, 2, 2, 64), float("nan"), device="cuda", dtype=tdt)
    grads = pyattn.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=True, dq=dq,
                                      dk=dkv[:, :, :, 0], dv=dkv[:, :, :, 1])
    assert grads[0] is dq
    to_t = lambda a: torch.from_dlpack(a.view(np.uint16)).view(torch.bfloat16) if a.dtype.name == "bfloat16" \
        else torch.from_dlpack(a)  # noqa: E731
    tg = [x if torch.is_tensor(x) else to_t(x) for x in grads]
    qd, kd, vd = (x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    mask = torch.ones(300, 260, dtype=torch.bool, device="cuda").tril(diagonal=260 - 300)
    ref = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)
    ref.backward(dout.double().transpose(1, 2))
    host = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    np_in = [host(x) for x in (dout, q, k, v)]
    bounds = backward_error_bounds(*(x.astype(DTYPES[dtype]) for x in np_in), causal=True)
    for got, want, b in zip(tg, (qd.grad, kd.grad, vd.grad), bounds):
        assert np.abs(host(got) - host(want.transpose(1, 2))).max() <= b

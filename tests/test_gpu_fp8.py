"""GPU tests of attention on fp8 e4m3 inputs (attn_fwd_fp8 with the fp8_vt pass) against the fp64
reference of their values; marked ``gpu``, skipped without an sm_90a GPU.

The tolerance is the 2x rule against a naive fp8 implementation (``pyattn.reference_fp8`` says what
it rounds). Inputs carry per-tensor descale factors of different sizes, so a factor applied to the
wrong tensor, or not at all, fails. Key counts cross the 16-key groups of V^T's permutation and the
128-key tiles; head dims below, at and between the 128 and 256 buckets; GQA; masks, windows,
soft-cap, ALiBi; rows that see no key; torch tensors in and the bf16 output out to torch.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.reference import attention_fp8_ref, fp8_error_bound, quantize_fp8

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from _tma_helpers import _view  # noqa: E402
from test_gpu_wgmma_ws import _is_sm90a  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = st.sampled_from([1, 15, 16, 17, 127, 128, 129, 300]) | st.integers(1, 600)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _inputs(rng, B, Sq, Sk, Hq, Hkv, D, layout="bshd", spread=(3.0, 0.5, 2.0)):
    """fp8 codes of q, k, v (magnitudes ``spread``) and their descale factors."""
    def shape(S, H):
        return (B, S, H, D) if layout == "bshd" else (B, H, S, D)

    shapes = (shape(Sq, Hq), shape(Sk, Hkv), shape(Sk, Hkv))
    pairs = [quantize_fp8(m * rng.standard_normal(s)) for m, s in zip(spread, shapes)]
    return tuple(c for c, _ in pairs), tuple(d for _, d in pairs)


def _run(codes, descale, **opts):
    dq, dk, dv = (pyattn.asarray(c) for c in codes)
    out, lse = pyattn.attention(dq, dk, dv, return_lse=True, descale_q=descale[0], descale_k=descale[1],
                                descale_v=descale[2], **opts)
    assert isinstance(out, pyattn.DeviceArray) and out.dtype == BF16
    return out.numpy(), lse.numpy()


def _check(out, lse, codes, descale, **opts):
    ref, ref_lse = attention_fp8_ref(*codes, descale=descale, return_lse=True, **opts)
    out = np.asarray(out).astype(np.float64)
    assert out.shape == ref.shape
    assert not np.isnan(out).any(), "unwritten (poisoned) or NaN output elements"
    if out.size:
        err, bound = np.abs(out - ref).max(), fp8_error_bound(*codes, descale=descale, **opts)
        assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    lse = np.asarray(lse).astype(np.float64)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~finite), "-inf LSE exactly where a row sees no key"
    if finite.any():  # the scores of the codes are exact in fp32: the LSE is as precise as 16-bit calls'
        assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-3 * max(1.0, np.abs(ref_lse[finite]).max())


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       D=st.sampled_from([32, 64, 96, 128, 144, 192, 256]), causal=st.sampled_from([False, True, "top_left"]),
       window=st.sampled_from([None, (100, 0), (37, 11)]), softcap=st.sampled_from([None, 15.0]),
       alibi=st.booleans(), layout=st.sampled_from(["bshd", "bhsd"]), seed=st.integers(0, 2**31 - 1))
def test_fp8_matches_the_reference(B, Sq, Sk, Hkv, group, D, causal, window, softcap, alibi, layout, seed):
    rng = np.random.default_rng(seed)
    codes, descale = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, layout)
    opts = dict(causal=causal, window=window, softcap=softcap, layout=layout)
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, Hkv * group).astype(np.float32)
    out, lse = _run(codes, descale, **opts)
    _check(out, lse, codes, descale, **opts)


@pytest.mark.parametrize("D", [128, 256])
def test_fp8_long_rows_and_the_lazy_reference(D):
    """Thousands of keys, scores whose row max keeps growing along the row (the softmax's reference
    moves late, so P up to 256 enters e4m3) and a large descale on q."""
    rng = np.random.default_rng(D)
    B, S, H = 1, 3000, 2
    q = rng.standard_normal((B, S, H, D))
    k = rng.standard_normal((B, S, H, D)) * np.linspace(0.2, 3.0, S)[None, :, None, None]
    v = rng.standard_normal((B, S, H, D))
    (qc, dq), (kc, dk), (vc, dv) = quantize_fp8(40.0 * q), quantize_fp8(k), quantize_fp8(v)
    for causal in (False, True):
        out, lse = _run((qc, kc, vc), (dq, dk, dv), causal=causal, scale=1.0 / (40.0 * np.sqrt(D)))
        _check(out, lse, (qc, kc, vc), (dq, dk, dv), causal=causal, scale=1.0 / (40.0 * np.sqrt(D)))


def test_fp8_bool_masks_and_empty_rows():
    """A bool mask (packed to bits) with rows masked entirely: output 0 and LSE -inf there."""
    rng = np.random.default_rng(7)
    B, Sq, Sk, H, D = 2, 200, 333, 4, 128
    codes, descale = _inputs(rng, B, Sq, Sk, H, 2, D)
    mask = rng.random((B, 1, Sq, Sk)) < 0.7
    mask[:, :, 5] = False  # a row that sees nothing
    out, lse = _run(codes, descale, mask=pyattn.asarray(mask))
    _check(out, lse, codes, descale, mask=mask)
    assert (out[:, 5] == 0).all() and np.isneginf(lse[:, :, 5]).all()


def test_fp8_out_view_and_repeat_calls():
    """``out=`` a bf16 view with padded rows; the second call takes the repeat path with other data."""
    B, S, H, D = 1, 257, 2, 128
    base = pyattn.asarray(np.full((B * S * H * (D + 8),), 7.0, dtype=BF16))
    view = _view(base, 0, (B, S, H, D), (S * H * (D + 8), H * (D + 8), D + 8, 1))
    for seed in (0, 1):
        codes, descale = _inputs(np.random.default_rng(seed), B, S, S, H, H, D)
        dq, dk, dv = (pyattn.asarray(c) for c in codes)
        got = pyattn.attention(dq, dk, dv, causal=True, out=view, descale_q=descale[0], descale_k=descale[1],
                               descale_v=descale[2])
        assert got is view
        ref = attention_fp8_ref(*codes, descale=descale, causal=True)
        got = base.numpy().reshape(B, S, H, D + 8).astype(np.float64)
        assert np.abs(got[..., :D] - ref).max() <= fp8_error_bound(*codes, descale=descale, causal=True)
        assert (got[..., D:] == 7.0).all()  # the padding columns untouched


def test_fp8_torch_tensors_in_bf16_out():
    """torch float8_e4m3fn tensors written by torch right before the call, the bf16 result handed
    back to torch zero-copy."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    B, S, H, D = 2, 500, 4, 128
    codes, descale = _inputs(rng, B, S, S, H, H, D)
    tq, tk, tv = (torch.from_numpy(c.view(np.uint8)).to("cuda").view(torch.float8_e4m3fn) for c in codes)
    late = torch.empty_like(tq)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000)  # ~1 ms on torch's stream before the copy that writes q
    late.copy_(tq)
    out = pyattn.attention(late, tk, tv, causal=True, descale_q=descale[0], descale_k=descale[1],
                           descale_v=descale[2])
    t = torch.from_dlpack(out)
    assert t.dtype == torch.bfloat16 and t.shape == (B, S, H, D)
    got = t.float().cpu().numpy().astype(np.float64)
    ref = attention_fp8_ref(*codes, descale=descale, causal=True)
    assert np.abs(got - ref).max() <= fp8_error_bound(*codes, descale=descale, causal=True)

"""GPU tests of ``pyattn.contiguous_decode`` against the fp64 reference (marked ``gpu``).

Caches are filled with NaN past each sequence's length (and in the padding of a padded sequence
stride), so a read past a length or through a wrong page of the paged view shows up as NaN. Every
length form (an int, equal or ragged NumPy lengths, ragged or equal device lengths) and both
layouts run, on geometries that take the view's 128-slot pages, smaller ones, and one page of
``max_len`` slots a sequence; with new tokens (``k_new`` / ``v_new``) the caches' bytes are
compared after the call too, and a decode loop writes a prompt, then a token a step. torch tensors
written by torch just before the call are read in stream order and the bf16 result goes back to
torch.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.ops._contiguous import paged_view
from pyattn.interop.inputs import read
from pyattn.validate.contiguous import check_caches

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _has_gpu  # noqa: E402
from test_gpu_decode import _check_decode, _rand  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU"),
              pytest.mark.usefixtures("poison_allocations")]


def _caches(rng, lengths, max_len, Hkv, D, dtype, layout, pad):
    """NaN-filled (batch, max_len + pad, ...) buffers holding each sequence's tokens, and device
    views of their first max_len slots; the gathered K/V per sequence for the reference."""
    B, L = len(lengths), max_len + pad
    shape = (B, L, Hkv, D) if layout == "nhd" else (B, Hkv, L, D)
    kb, vb = (np.full(shape, np.nan, DTYPES[dtype]) for _ in range(2))
    ks, vs = [], []
    for b, n in enumerate(lengths):
        k, v = _rand(rng, (n, Hkv, D), dtype), _rand(rng, (n, Hkv, D), dtype)
        if layout == "nhd":
            kb[b, :n], vb[b, :n] = k, v
        else:
            kb[b, :, :n], vb[b, :, :n] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        ks.append(k)
        vs.append(v)
    view_shape = (B, max_len, Hkv, D) if layout == "nhd" else (B, Hkv, max_len, D)
    kd, vd = (pyattn.DeviceArray(d.ptr, view_shape, d.dtype, d.device, strides=d.strides, owner=d, stream=d.stream)
              for d in (pyattn.asarray(kb), pyattn.asarray(vb)))  # the first max_len slots of each sequence
    return kd, vd, ks, vs


def _written(cache_view, layout):
    """The whole buffer under a cache view (its owner), on the host, as (B, L + pad, Hkv, D)."""
    x = cache_view.owner.numpy()
    return x if layout == "nhd" else x.transpose(0, 2, 1, 3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), max_len=st.sampled_from([16, 100, 256, 320, 1024, 4096]),
       pad=st.sampled_from([0, 0, 8, 128]), Hkv=st.integers(1, 2), group=st.sampled_from([1, 4, 8]),
       q_len=st.sampled_from([1, 1, 2, 5]), D=st.sampled_from([64, 128, 256]),
       dtype=st.sampled_from(["float16", "bfloat16"]), layout=st.sampled_from(["nhd", "hnd"]),
       form=st.sampled_from(["int", "numpy equal", "numpy ragged", "device ragged", "device equal"]),
       splits=st.sampled_from([None, None, 1, 3]), mods=st.sampled_from(["", "", "softcap", "alibi", "window"]),
       q_on_device=st.booleans(), n_new=st.sampled_from([0, 0, 1, 3]), seed=st.integers(0, 2**31 - 1))
def test_contiguous_decode_matches_dense(B, max_len, pad, Hkv, group, q_len, D, dtype, layout, form, splits, mods,
                                         q_on_device, n_new, seed):
    """Every length form, layout and geometry; with n_new > 0 the new tokens' K/V (device with a
    device q, else NumPy) are written first: the attention covers them, and the caches hold them
    at their positions with nothing else changed (the NaN past each sequence stays)."""
    rng = np.random.default_rng(seed)
    top = max_len - n_new
    if "ragged" in form:
        lengths = [int(x) for x in rng.integers(0, top + 1, B)]
        lengths[0] = top  # the longest at the caches' end
    else:
        lengths = [int(rng.integers(max(0, q_len - n_new), top + 1))] * B
    kd, vd, ks, vs = _caches(rng, lengths, max_len, Hkv, D, dtype, layout, pad)
    new = {}
    if n_new:
        kn, vn = _rand(rng, (B, n_new, Hkv, D), dtype), _rand(rng, (B, n_new, Hkv, D), dtype)
        new = {"k_new": pyattn.asarray(kn), "v_new": pyattn.asarray(vn)} if q_on_device else {"k_new": kn, "v_new": vn}
        before = [_written(x, layout) for x in (kd, vd)]
        ks = [np.concatenate([k, kn[b]]) for b, k in enumerate(ks)]
        vs = [np.concatenate([v, vn[b]]) for b, v in enumerate(vs)]
    Hq = Hkv * group
    q = _rand(rng, (B, q_len, Hq, D), dtype)
    opts = dict(causal=True, window=(60, 0) if mods == "window" else None)
    if mods == "softcap":
        opts["softcap"] = 2.5
    if mods == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (B, Hq)).astype(np.float32)
    lens = {"int": lengths[0], "numpy equal": np.array(lengths, np.int32),
            "numpy ragged": np.array(lengths, np.int32)}.get(form)
    if lens is None:
        lens = pyattn.asarray(np.array(lengths, np.int32))
    out, lse = pyattn.contiguous_decode(pyattn.asarray(q) if q_on_device else q, kd, vd, lens, layout=layout,
                                        num_splits=splits, return_lse=True, **new, **opts)
    if q_on_device:
        out, lse = out.numpy(), lse.numpy()
    assert out.shape == q.shape and lse.shape == (B, Hq, q_len)
    _check_decode(out, lse, q, ks, vs, **opts)
    if n_new:
        for x, was, src in zip((kd, vd), before, (kn, vn)):
            want = was.copy()
            for b, n in enumerate(lengths):
                want[b, n:n + n_new] = src[b]
            np.testing.assert_array_equal(_written(x, layout).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_long_caches_take_the_128_slot_view_and_split(layout):
    """(2, 32k) caches in the view's 128-slot pages (on sm_90a the TMA decode), split decode, GQA 4,
    q_len 4 (speculative rows), one int length then the same again as ragged NumPy lengths."""
    rng = np.random.default_rng(7)
    kd, vd, ks, vs = _caches(rng, [32768, 32768], 32768, 2, 128, "bfloat16", layout, 0)
    pool, per, cols = paged_view(check_caches(read("k_cache", kd), read("v_cache", vd), layout))
    assert (pool.page_size, cols) == (128, 256)
    q = _rand(rng, (2, 4, 8, 128), "bfloat16")
    out, lse = pyattn.contiguous_decode(q, kd, vd, 32768, layout=layout, return_lse=True)
    _check_decode(out, lse, q, ks, vs, causal=True)
    short = [32768, 20001]
    out, lse = pyattn.contiguous_decode(q, kd, vd, np.array(short, np.int32), layout=layout, return_lse=True)
    _check_decode(out, lse, q, [k[:n] for k, n in zip(ks, short)], [v[:n] for v, n in zip(vs, short)], causal=True)


def test_torch_caches_written_just_before_the_call():
    """A decode step the way a torch app writes it: the new token's K/V written into torch caches
    (HF's (batch, heads, max_len, dim) layout) and the query computed by torch on its current
    stream behind a ~1 ms pre-roll, then contiguous_decode at once; the bf16 result goes back to
    torch zero-copy and equals the reference over what torch wrote."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    B, Hkv, Hq, L, D, n = 2, 2, 8, 1024, 128, 700
    kc = torch.from_numpy(rng.standard_normal((B, Hkv, L, D)).astype(np.float32)).to("cuda", torch.bfloat16)
    vc = torch.from_numpy(rng.standard_normal((B, Hkv, L, D)).astype(np.float32)).to("cuda", torch.bfloat16)
    k_new = torch.from_numpy(rng.standard_normal((B, Hkv, 1, D)).astype(np.float32)).to("cuda", torch.bfloat16)
    q_src = torch.from_numpy(rng.standard_normal((B, 1, Hq, D)).astype(np.float32)).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)
        kc[:, :, n - 1:n] = k_new * 3  # late writes: a read not ordered after them sees the old values
        vc[:, :, n - 1:n] = k_new * -2
        q = q_src * 0.5
        out = pyattn.contiguous_decode(q, kc, vc, n, layout="hnd")
        t = torch.from_dlpack(out)
        assert t.dtype == torch.bfloat16
        got = t.float().cpu().numpy()
    torch.cuda.synchronize()
    f = lambda x: x.float().cpu().numpy()  # noqa: E731
    ks = [f(kc[b, :, :n]).transpose(1, 0, 2).astype(ml_dtypes.bfloat16) for b in range(B)]
    vs = [f(vc[b, :, :n]).transpose(1, 0, 2).astype(ml_dtypes.bfloat16) for b in range(B)]
    _check_decode(got.astype(ml_dtypes.bfloat16), None, f(q).astype(ml_dtypes.bfloat16), ks, vs, causal=True)


def test_a_decode_loop_appending_each_step():
    """A prompt's K/V written by one call (n_new = 300, q_len 1), then eight steps of one new token
    each with a growing int length (the repeat path after the first step), every step's output
    against the reference over everything written so far."""
    rng = np.random.default_rng(11)
    B, Hkv, D, L = 2, 2, 128, 1024
    kc, vc = (pyattn.asarray(np.full((B, L, Hkv, D), np.nan, ml_dtypes.bfloat16)) for _ in range(2))
    ks, vs, n = [np.zeros((0, Hkv, D), ml_dtypes.bfloat16)] * B, [np.zeros((0, Hkv, D), ml_dtypes.bfloat16)] * B, 0
    for step, n_new in enumerate([300] + [1] * 8):
        kn, vn = _rand(rng, (B, n_new, Hkv, D), "bfloat16"), _rand(rng, (B, n_new, Hkv, D), "bfloat16")
        q = _rand(rng, (B, 1, 4 * Hkv, D), "bfloat16")
        out = pyattn.contiguous_decode(pyattn.asarray(q), kc, vc, n, k_new=pyattn.asarray(kn), v_new=pyattn.asarray(vn))
        ks = [np.concatenate([k, kn[b]]) for b, k in enumerate(ks)]
        vs = [np.concatenate([v, vn[b]]) for b, v in enumerate(vs)]
        n += n_new
        _check_decode(out.numpy(), None, q, ks, vs, causal=True)


def test_nan_keys_in_every_split_reach_the_output():
    """A NaN key among a row's keys makes that row NaN, whatever the split count: with every split
    holding one, the fused split combine must not drop the splits' NaN LSEs (fmaxf does) and
    return 0 / -inf. Other kv heads' rows stay finite."""
    rng = np.random.default_rng(17)
    B, L, Hkv, D = 1, 4096, 2, 128
    k = _rand(rng, (B, L, Hkv, D), "bfloat16")
    k[0, ::256, 1, 7] = np.nan  # kv head 1: one NaN key every 256 (every split of 8 holds some)
    kc, vc = pyattn.asarray(k), pyattn.asarray(_rand(rng, (B, L, Hkv, D), "bfloat16"))
    q = pyattn.asarray(_rand(rng, (B, 1, 4 * Hkv, D), "bfloat16"))
    for splits in (1, 8):
        out, lse = pyattn.contiguous_decode(q, kc, vc, L, num_splits=splits, return_lse=True)
        o, ls = out.numpy().astype(np.float64), lse.numpy()
        assert np.isnan(o[0, 0, 4:]).all() and np.isnan(ls[0, 4:]).all(), splits  # kv head 1's q heads
        assert np.isfinite(o[0, 0, :4]).all() and np.isfinite(ls[0, :4]).all(), splits

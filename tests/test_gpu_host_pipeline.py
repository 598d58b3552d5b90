"""The NumPy-in/NumPy-out pipeline on a real GPU (marked ``gpu``; skipped without a driver): the
chunked and one-chunk paths against the fp64 reference (GQA, causal prefixes, masks, ALiBi, both
layouts), and the default planner at a PCIe-sized call. CPU tests of the pipeline are in
test_host_pipeline_plan.py and test_host_pipeline_fake.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from _host_pipeline_helpers import _qkv
from pyattn.pipeline import chunks
from pyattn.reference import attention_ref
from pyattn.runtime import memory
from test_gpu_attention import _has_gpu

ml_dtypes = pytest.importorskip("ml_dtypes")


GPU_CASES = [  # B, Sq, Sk, Hq, Hkv, D, dtype, layout, options builder
    (1, 200, 300, 16, 4, 64, "float16", "bshd", lambda r, s: {"causal": True}),  # GQA, row chunks, causal prefixes
    (1, 128, 128, 32, 32, 128, "bfloat16", "bhsd", lambda r, s: {}),  # B=1, row chunks, 2-D result copies
    (6, 150, 150, 4, 2, 64, "float16", "bhsd", lambda r, s: {"causal": True}),  # batch chunks, bhsd
    (1, 100, 170, 8, 4, 64, "float16", "bshd",  # mask broadcast over heads, (B, Hq) ALiBi: one chunk
     lambda r, s: {"mask": r.random((s[0], 1, s[1], s[2])) > 0.2, "alibi_slopes": r.random((s[0], s[3]))}),
    (4, 90, 90, 4, 4, 128, "bfloat16", "bhsd",  # float mask broadcast over the batch, ALiBi (B, Hq)
     lambda r, s: {"mask": np.where(r.random((1, s[3], s[1], s[2])) > 0.1, 0.0, -np.inf).astype(np.float32),
                   "alibi_slopes": r.random((s[0], s[3])), "causal": True}),
]


@pytest.mark.parametrize("B, Sq, Sk, Hq, Hkv, D, dtype, layout, make_opts", GPU_CASES)
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("return_lse", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")
def test_gpu_pipeline_matches_reference(monkeypatch, B, Sq, Sk, Hq, Hkv, D, dtype, layout, make_opts, chunked,
                                        return_lse):
    import pyattn
    from pyattn.reference import error_bound

    monkeypatch.setattr(memory, "POISON_ALLOC", True)
    if chunked:
        monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 0)
        monkeypatch.setattr(chunks, "_CHUNK_BYTES", 1)
    rng = np.random.default_rng(4)
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D, layout, np.float32)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    opts = make_opts(rng, (B, Sq, Sk, Hq))
    res = pyattn.attention(q, k, v, layout=layout, return_lse=return_lse, **opts)
    out, lse = res if return_lse else (res, None)
    ref, ref_lse = attention_ref(q, k, v, layout=layout, return_lse=True, **opts)
    assert out.dtype == q.dtype and out.shape == ref.shape and not np.isnan(out.astype(np.float64)).any()
    err = np.abs(out.astype(np.float64) - ref).max()
    assert err <= error_bound(q, k, v, layout=layout, **opts)
    if return_lse:
        assert lse.dtype == np.float32 and lse.shape == (B, Hq, Sq)
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isneginf(lse), ~finite)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")
def test_gpu_default_chunking_at_size(monkeypatch):
    """The default planner on a PCIe-sized call (64 MiB, row chunks with causal prefixes), against the
    reference on a few heads, on a caller's stream, and equal to the one-chunk path."""
    import pyattn
    from pyattn.reference import error_bound

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 4096, 16, 128)).astype(np.float16) for _ in range(3))
    with pyattn.Stream() as s:
        out, lse = pyattn.attention(q, k, v, causal=True, return_lse=True, stream=s)
        s.synchronize()
    for h in (0, 7, 15):
        sl = (slice(None), slice(None), slice(h, h + 1))
        ref, ref_lse = attention_ref(q[sl], k[sl], v[sl], causal=True, return_lse=True)
        assert np.abs(out[sl].astype(np.float64) - ref).max() <= error_bound(q[sl], k[sl], v[sl], causal=True)
        np.testing.assert_allclose(lse[:, h], ref_lse[:, 0], rtol=1e-3, atol=1e-3)
    monkeypatch.setattr(chunks, "_MIN_PIPELINE_BYTES", 1 << 62)
    one, one_lse = pyattn.attention(q, k, v, causal=True, return_lse=True)
    # chunks are independent problems (each row's keys, scores and order of work are the same), so
    # the numbers agree up to the tile grid's different row blocking
    np.testing.assert_allclose(out.astype(np.float32), one.astype(np.float32), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, one_lse, rtol=1e-5, atol=1e-5)

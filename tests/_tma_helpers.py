"""Helpers shared by the GPU tests of the TMA-fed sm_90a kernel (attn_fwd_tma): test_gpu_tma_views.py,
test_gpu_tma_masks.py and test_gpu_tma_persistent.py, and reached from test_gpu_fp8.py (``_view``) and
test_gpu_three_warpgroups.py (``check_varlen``). No tests here.

``SETTINGS`` / ``LENGTHS``: the hypothesis settings and sequence lengths of the property tests;
``TMA_DIMS``: the head dims whose bf16 calls attn_fwd_tma serves; ``_view``: a strided DeviceArray view
at an element offset; ``_tma_row``: attn_fwd_tma's tile-table row for a head dim's bucket;
``check_varlen``: ``attention_varlen`` against the fp64 reference, sequence by sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.array import DeviceArray
from pyattn.kernels.specs import select_attention_spec
from pyattn.reference import error_bound

pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES  # noqa: E402

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = st.sampled_from([1, 63, 64, 65, 127, 128, 129, 300]) | st.integers(1, 400)
TMA_DIMS = [d for d in (32, 40, 64, 72, 96, 128, 136, 160, 192, 200, 256)
            if select_attention_spec("bfloat16", d, "sm_90a").family == "attn_fwd_tma"]


def _view(base: DeviceArray, offset_elems: int, shape: tuple, strides: tuple) -> DeviceArray:
    """A view of ``base`` at an element offset with element ``strides`` (DeviceArray takes bytes)."""
    size = base.dtype.itemsize
    return DeviceArray(base.ptr + offset_elems * size, shape, base.dtype, base.device,
                       strides=tuple(s * size for s in strides), owner=base.owner, stream=base.stream)


def _tma_row(head_dim: int, table: str = "dense"):
    """attn_fwd_tma's tile-table row for ``head_dim``'s bucket (None without one)."""
    from pyattn.kernels.families import tile_table

    bucket = select_attention_spec("bfloat16", head_dim, "sm_90a", keys=1 << 20).head_dim
    return next((r for r in tile_table("attn_fwd_tma", "sm_90a", table=table) if r.max_head_dim == bucket), None)


def check_varlen(rng, lens: list, D: int, causal: bool) -> None:
    """``attention_varlen`` of sequences of (queries, keys) ``lens`` (8 query heads, 2 KV heads,
    bf16, device arrays) against the fp64 reference, sequence by sequence (the 2x rule), with -inf
    LSE exactly where a row sees no key."""
    from pyattn.reference import attention_varlen_ref

    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    dt = DTYPES["bfloat16"]
    q = rng.standard_normal((cu_q[-1], 8, D)).astype(dt)
    k, v = (rng.standard_normal((cu_k[-1], 2, D)).astype(dt) for _ in range(2))
    out, lse = pyattn.attention_varlen(*(pyattn.asarray(x) for x in (q, k, v, cu_q, cu_k)), causal=causal,
                                       return_lse=True)
    out, lse = out.numpy().astype(np.float64), lse.numpy()
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    assert not np.isnan(out).any()
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    for n in range(len(lens)):
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        bound = error_bound(q[None, rows], k[None, keys], v[None, keys], causal=causal)
        assert np.abs(out[rows] - ref[rows]).max() <= bound, f"sequence {n} {lens[n]}"

"""GPU tests of the TMA-fed sm_90a kernel (attn_fwd_tma) against the fp64 reference; marked ``gpu``,
skipped without an sm_90a GPU.

The other GPU modules reach it too (every dense 16-bit call on sm_90a whose bucket its table
has); these aim at what is new on its path: tensor maps over strided views, broadcast (stride 0)
axes, head dims below and between the 64-wide boxes, GQA, varlen rows read past a sequence's end,
and maps re-encoded when the same layout comes with other arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.array import DeviceArray
from pyattn.kernels.specs import select_attention_spec

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _check, _inputs  # noqa: E402
from test_gpu_wgmma_ws import _is_sm90a  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = st.sampled_from([1, 63, 64, 65, 127, 128, 129, 300]) | st.integers(1, 400)
TMA_DIMS = [d for d in (32, 40, 64, 72, 96, 128, 136, 160, 192, 200, 256)
            if select_attention_spec("bfloat16", d, "sm_90a").family == "attn_fwd_tma"]


def _view(base: DeviceArray, offset_elems: int, shape: tuple, strides: tuple) -> DeviceArray:
    """A view of ``base`` at an element offset with element ``strides`` (DeviceArray takes bytes)."""
    size = base.dtype.itemsize
    return DeviceArray(base.ptr + offset_elems * size, shape, base.dtype, base.device,
                       strides=tuple(s * size for s in strides), owner=base.owner, stream=base.stream)


def test_the_dense_path_is_the_tma_kernel():
    assert TMA_DIMS, "attn_fwd_tma serves no head dim"
    assert select_attention_spec("bfloat16", 128, "sm_90a", mask="bool").family == "attn_fwd_wgmma"


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       D=st.sampled_from(TMA_DIMS or [128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       causal=st.sampled_from([False, True, "top_left"]), window=st.sampled_from([None, (100, 0), (37, 11)]),
       softcap=st.sampled_from([None, 15.0]), alibi=st.booleans(), layout=st.sampled_from(["bshd", "bhsd"]),
       seed=st.integers(0, 2**31 - 1))
def test_tma_kernel_matches_the_reference(B, Sq, Sk, Hkv, group, D, dtype, causal, window, softcap, alibi, layout,
                                          seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype, layout)
    opts = dict(causal=causal, window=window, softcap=softcap, layout=layout)
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, Hkv * group).astype(np.float32)
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    _check(out, lse, q, k, v, **opts)


@SETTINGS
@given(B=st.integers(1, 3), S=LENGTHS, H=st.integers(1, 3), D=st.sampled_from(TMA_DIMS or [128]),
       dtype=st.sampled_from(["float16", "bfloat16"]), causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_packed_qkv_views(B, S, H, D, dtype, causal, seed):
    """q, k, v as views into one (B, S, 3, H, D + 8) buffer: row strides of 3 H (D + 8) elements,
    a head stride that is not the head dim, and the padding columns never read."""
    rng = np.random.default_rng(seed)
    host = rng.standard_normal((B, S, 3, H, D + 8)).astype(DTYPES[dtype])
    base = pyattn.asarray(host)
    st_ = (S * 3 * H * (D + 8), 3 * H * (D + 8), D + 8, 1)
    q, k, v = (_view(base, i * H * (D + 8), (B, S, H, D), st_) for i in range(3))
    out = pyattn.attention(q, k, v, causal=causal)
    _check(out.numpy(), None, *(np.ascontiguousarray(host[:, :, i, :, :D]) for i in range(3)), causal=causal)


@pytest.mark.parametrize("D", [64, 128])
def test_keys_broadcast_over_the_batch(D):
    """K and V with batch stride 0 (one cache shared by every batch entry): a map axis of size 1."""
    if D not in TMA_DIMS:
        pytest.skip(f"attn_fwd_tma does not serve d={D}")
    rng = np.random.default_rng(D)
    B, Sq, Sk, H = 3, 77, 200, 2
    q = rng.standard_normal((B, Sq, H, D)).astype(ml_dtypes.bfloat16)
    kv1 = [rng.standard_normal((1, Sk, H, D)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    dk, dv = (pyattn.asarray(x) for x in kv1)
    k, v = (_view(x, 0, (B, Sk, H, D), (0, H * D, D, 1)) for x in (dk, dv))
    out, lse = pyattn.attention(pyattn.asarray(q), k, v, return_lse=True)
    kb, vb = (np.broadcast_to(x, (B, Sk, H, D)) for x in kv1)
    _check(out.numpy(), lse.numpy(), q, kb, vb)


def test_broadcast_sequence_axis_takes_the_cp_async_kernel():
    """A key axis of stride 0 cannot be a TMA map's row axis: the call runs attn_fwd_wgmma, correctly."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 40, 2, 128)).astype(ml_dtypes.bfloat16)
    row = [rng.standard_normal((1, 1, 2, 128)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    k, v = (_view(pyattn.asarray(x), 0, (1, 90, 2, 128), (2 * 128, 0, 128, 1)) for x in row)
    out = pyattn.attention(pyattn.asarray(q), k, v)
    _check(out.numpy(), None, q, *(np.broadcast_to(x, (1, 90, 2, 128)) for x in row))


def test_new_arrays_with_the_same_layout_get_their_own_maps():
    """The maps are memoised by address: a second call with other arrays must read those."""
    rng = np.random.default_rng(5)
    sets = [_inputs(rng, 1, 300, 300, 2, 1, 128, "bfloat16") for _ in range(3)]
    dev = [[pyattn.asarray(x) for x in s] for s in sets]
    for s, d in zip(sets * 2, dev * 2):
        _check(pyattn.attention(*d, causal=True).numpy(), None, *s, causal=True)

"""GPU tests of the sm_90a wgmma kernel's warp-specialized rows (a producer warpgroup, mbarrier
ring, setmaxnreg, ping-pong) against the fp64 reference; marked ``gpu``, skipped without an
sm_90a GPU.

By default the d = 128 rows (dense, bool and 16-bit masks) are warp-specialized (dev/probe_ws.py,
dev/probe_mask_cost.py, BENCHMARKS.md); these tests also put WS rows in the d = 64 buckets through
``override_tiles``, as tuning does, and keep that path correct too.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import pyattn
from pyattn.kernels.families import WgmmaTile, override_tiles, tile_table

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import _check, _has_gpu, _inputs  # noqa: E402


def _is_sm90a() -> bool:
    return _has_gpu() and pyattn.get_device().arch == "sm_90a"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = st.sampled_from([1, 63, 64, 65, 129, 300]) | st.integers(1, 400)

# One WS row per head-dim bucket that fits (d = 192 spills its producer at 56 registers).
_WS_DENSE = (WgmmaTile(64, 64, 2, 4, True, 1, "test", True), WgmmaTile(128, 128, 2, 3, True, 1, "test", True))
_WS_MASK1 = (WgmmaTile(64, 64, 2, 4, True, 1, "test", True), WgmmaTile(128, 64, 2, 4, True, 1, "test", True))


@contextlib.contextmanager
def _ws_tables():
    with override_tiles("attn_fwd_wgmma", "sm_90a", _WS_DENSE + tile_table("attn_fwd_wgmma", "sm_90a")[2:]), \
            override_tiles("attn_fwd_wgmma", "sm_90a", _WS_MASK1 + tile_table("attn_fwd_wgmma", "sm_90a", "mask1")[2:],
                           table="mask1"):
        yield


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 3]),
       D=st.sampled_from([32, 64, 96, 128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       causal=st.sampled_from([False, True, "top_left"]), softcap=st.sampled_from([None, 20.0]),
       mask=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_ws_rows_match_the_reference(B, Sq, Sk, Hkv, group, D, dtype, causal, softcap, mask, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype)
    opts = dict(causal=causal, softcap=softcap)
    if mask:
        opts["mask"] = rng.random((Sq, Sk)) > 0.2
    with _ws_tables():
        out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    _check(out, lse, q, k, v, **opts)

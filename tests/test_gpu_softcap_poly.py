"""GPU tests of the soft-capped rows whose softmax takes some of its exp2s by polynomial on the FMA
pipe (attn_fwd_tma rows' ``poly_exp``; ``poly_exp2`` in kernels_src/mma.cuh) against the fp64
reference (marked ``gpu``; sm_90a only). tests/test_poly_exp.py checks the polynomial itself on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.kernels.families import tile_table
from pyattn.kernels.specs import select_attention_spec

pytest.importorskip("ml_dtypes")
from test_gpu_attention import _check, _inputs  # noqa: E402
from test_gpu_wgmma_ws import _is_sm90a  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]


POLY_ROWS = [r for r in tile_table("attn_fwd_tma", "sm_90a") if r.poly_exp or r.poly_exp_max]


@pytest.mark.parametrize("D", [r.max_head_dim for r in POLY_ROWS] or [128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cap", [0.5, 30.0, 51.0, 60.0])
# its causal calls run the row under test: not the short row, nor (4 heads of one prompt) the small-grid row
@pytest.mark.usefixtures("no_causal_short_row", "short_row_on_any_grid")
def test_soft_capped_rows_with_exp2_on_the_fma_pipe(D, dtype, cap, launched):
    """The rows whose soft-capped calls take some exp2s by polynomial (poly_exp / poly_exp_max; where
    the dtype and cap select neither, the SFU-only kernel is checked the same way): causal bottom-right
    with more queries than keys, so the first rows see no key (the clamp must give P = 0 exactly for
    -inf scores: 0 output, LSE -inf), the diagonal tiles mix visible and masked keys, and the keys
    pass the row's min_keys so the call runs that row."""
    if not POLY_ROWS:
        pytest.skip("no attn_fwd_tma row takes poly_exp")
    row = next(r for r in POLY_ROWS if r.max_head_dim == D)
    rng = np.random.default_rng(D + int(cap))
    Sk = max(row.min_keys, 1024) + 77
    Sq = Sk + 200
    spec = select_attention_spec(dtype, D, "sm_90a", keys=Sk, softcap=cap, causal=True)
    # bf16 up to a cap of 51: the bounded soft-cap (row.poly_exp); fp16 and larger caps a row max
    assert (spec.family, spec.q_tiles) == ("attn_fwd_tma", 0)
    assert spec.tiles.poly_exp == (0, row.poly_exp_max, row.poly_exp)[spec.softcap]
    q, k, v = _inputs(rng, 1, Sq, Sk, 4, 2, D, dtype, "bshd")
    q = (q.astype(np.float32) * 3).astype(q.dtype)  # large scores, so the cap bites
    opts = dict(causal=True, softcap=cap)
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    assert spec.entry_name in launched, launched  # the row asserted above is the one that ran
    assert not np.asarray(out)[:, :200].astype(np.float64).any(), "rows that see no key: 0"
    _check(out, lse, q, k, v, **opts)

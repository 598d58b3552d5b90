"""pyattn.reference's argument checks (CPU only): every reference function names the argument it
refuses, and each reference module imports first in a fresh interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyattn.reference import attention_lowp, attention_ref, attention_varlen_ref, error_bound


# --------------------------------------------------------------------------- validation


def _qkv(b=1, sq=4, sk=5, hq=4, hkv=2, d=8, dv=None):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, dv or d)))


Q, K, V = _qkv()
CU = np.array([0, 4], dtype=np.int32)


@pytest.mark.parametrize("call, exc, name", [
    (lambda: attention_ref(Q[0], K, V), ValueError, "q"),
    (lambda: attention_ref(Q, K[..., :4], V), ValueError, "k"),
    (lambda: attention_ref(Q, np.concatenate([K, K]), V), ValueError, "k"),
    (lambda: attention_ref(Q, K, V[:, :3]), ValueError, "v"),
    (lambda: attention_ref(Q[:, :, :3], K, V), ValueError, "k"),  # Hq % Hkv != 0
    (lambda: attention_ref(Q.astype(np.int32), K, V), TypeError, "q"),
    (lambda: attention_ref(Q, K, V, layout="bsHd"), ValueError, "layout"),
    (lambda: attention_ref(Q, K, V, causal="diagonal"), ValueError, "causal"),
    (lambda: attention_ref(Q, K, V, causal=1), TypeError, "causal"),
    (lambda: attention_ref(Q, K, V, window=(3,)), ValueError, "window"),
    (lambda: attention_ref(Q, K, V, window=(-2, 0)), ValueError, "window"),
    (lambda: attention_ref(Q, K, V, window=(1.5, 0)), TypeError, "window"),
    (lambda: attention_ref(Q, K, V, softcap=0.0), ValueError, "softcap"),
    (lambda: attention_ref(Q, K, V, scale=float("nan")), ValueError, "scale"),
    (lambda: attention_ref(Q, K, V, alibi_slopes=np.ones(2)), ValueError, "alibi_slopes"),
    (lambda: attention_ref(Q, K, V, mask=np.ones((4, 5, 5), bool)), ValueError, "mask"),
    (lambda: attention_ref(Q, K, V, mask=np.ones((4, 5), np.int64)), TypeError, "mask"),
    (lambda: attention_ref(Q, K, V, mask=np.full((4, 5), np.inf)), ValueError, "mask"),
    (lambda: attention_varlen_ref(Q[0], K[0, :4], V[0, :4], CU.astype(np.int64), CU),
     TypeError, "cu_seqlens_q"),
    (lambda: attention_varlen_ref(Q[0], K[0, :4], V[0, :4], CU, np.array([0, 3], np.int32)),
     ValueError, "cu_seqlens_k"),
    (lambda: attention_varlen_ref(Q[0], K[0, :4], V[0, :4], np.array([0, 5, 4], np.int32),
                                  CU), ValueError, "cu_seqlens_q"),
    (lambda: attention_varlen_ref(Q, K, V, CU, CU), ValueError, "q"),
    (lambda: attention_lowp(Q.astype(np.float16), K, V), TypeError, "k"),
    (lambda: error_bound(Q, K, V, return_lse=True), TypeError, "return_lse"),
])
def test_validation_errors_name_the_argument(call, exc, name):
    with pytest.raises(exc) as info:
        call()
    assert str(info.value).startswith(name)


@pytest.mark.parametrize("module", ["reference", "reference_dense", "reference_composed", "reference_backward",
                                    "reference_sparq", "reference_fp8"])
def test_each_reference_module_imports_first(module):
    """Each reference module imports in a fresh interpreter before any other: none imports the
    pyattn.reference facade (a circle through it failed with a partially initialised module)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", f"import pyattn.{module}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr

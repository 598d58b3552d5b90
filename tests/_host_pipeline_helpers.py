"""Shared by the host pipeline test modules (test_host_pipeline_fake.py, test_gpu_host_pipeline.py):
random q, k, v in either layout."""

from __future__ import annotations

import numpy as np


def _qkv(rng, B, Sq, Sk, Hq, Hkv, D, layout, dtype=np.float32):
    def shape(S, H):
        return (B, S, H, D) if layout == "bshd" else (B, H, S, D)

    return (rng.standard_normal(shape(Sq, Hq)).astype(dtype), rng.standard_normal(shape(Sk, Hkv)).astype(dtype),
            rng.standard_normal(shape(Sk, Hkv)).astype(dtype))

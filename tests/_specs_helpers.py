"""Shared constants of the kernel-spec tests (test_spec_select.py, test_spec_fields.py,
test_spec_tiles.py, test_spec_render.py): the supported archs, the dtypes' NumPy names, which family
and header serve which dtype, and ``_expected``, the (family, bucket) a plain call selects."""

from __future__ import annotations

from pyattn.kernels.specs import HEAD_DIM_BUCKETS

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# Which family serves which dtype: fp32 stays on CUDA cores, 16-bit inputs go to the tensor cores.
FAMILY_FOR = {"float32": "attn_fwd_simt", "float16": "attn_fwd_mma", "bfloat16": "attn_fwd_mma"}
HEADER_FOR = {"attn_fwd_simt": "attention_fwd.cuh", "attn_fwd_mma": "attention_fwd_mma.cuh",
              "attn_fwd_tf32": "attention_fwd_tf32.cuh", "attn_fwd_wgmma": "attention_fwd_wgmma.cuh",
              "attn_fwd_tma": "attention_fwd_tma.cuh"}


def _expected(dtype_name, arch, d):
    """(family, bucket) that a plain (long) call selects: on sm_90a 16-bit inputs go to the TMA-fed
    wgmma kernel (64-wide buckets; every bucket has a TMA row)."""
    if arch == "sm_90a" and dtype_name != "float32":
        return "attn_fwd_tma", -(-d // 64) * 64
    return FAMILY_FOR[dtype_name], min(b for b in HEAD_DIM_BUCKETS if b >= d)

"""Families with one launch shape on every arch and no dynamic shared memory.

merge_states (LSE merge of attention states), split_combine (the same kernel merging the fp32
partials of a key-split prefill, or of a decode whose splits are not merged inside its kernel,
into the output type),
kv_append (paged-cache writes), attn_sparse (CSR gather attention), mask_bits (a bool mask packed
to bits for attn_fwd_tma) and fp8_vt (fp8 V transposed for attn_fwd_fp8). No traits struct, so
nothing for the rendered unit to assert about shared memory.
"""

from __future__ import annotations

from ..params import FP8_VT_PARAMS, KV_APPEND_PARAMS, MASK_BITS_PARAMS, MERGE_STATES_PARAMS, SPARSE_PARAMS
from .base import (CTYPES, KV_KINDS, MAX_HEAD_DIM, PAGED_ALIGNMENT, WGMMA_ARCHS, Alignment, Family, FixedTile,
                   every_arch)

__all__ = ["MERGE_STATES", "SPLIT_COMBINE", "KV_APPEND", "ATTN_SPARSE", "MASK_BITS", "FP8_VT"]

# One warp per row, 4 warps per block (memory-bound; rows are independent).
_MERGE = every_arch((FixedTile(MAX_HEAD_DIM, block_m=4, block_n=0, warps=4,
                               reason="memory-bound elementwise combine: one warp per row, 4 rows per block"),))
# A grid-stride copy, one thread per 16-byte chunk of a (token, kv head) row.
_APPEND = every_arch((FixedTile(MAX_HEAD_DIM, block_m=0, block_n=0, warps=8,
                                reason="memory-bound scatter: 256 threads, grid-stride over 16-byte chunks"),))
# A grid-stride pack, one thread per 32-key word; sm_90a only (its one reader is attn_fwd_tma).
_BITS = {arch: (FixedTile(MAX_HEAD_DIM, block_m=0, block_n=0, warps=8,
                          reason="memory-bound pack: 256 threads, grid-stride over words; 16k x 16k bytes in "
                                 "74 us, 84% of DRAM (ncu, H200)"),)
         for arch in WGMMA_ARCHS}
# 64 keys x 64 head dims a block of 256 threads, through shared memory; sm_90a only (its one reader
# is attn_fwd_fp8).
_VT = {arch: (FixedTile(MAX_HEAD_DIM, block_m=64, block_n=64, warps=8,
                        reason="memory-bound transpose: 64 x 64 byte tiles, 4-byte loads and stores; unmeasured"),)
       for arch in WGMMA_ARCHS}
# One warp per query row, 8 keys per step; 4 rows per block.
_SPARSE = every_arch((FixedTile(MAX_HEAD_DIM, block_m=4, block_n=8, warps=4,
                                reason="gather kernel: one warp per query row (rows have their own key lists); "
                                       "unmeasured"),))

MERGE_STATES = Family(
    name="merge_states", label="merge_states", header="merge_states.cuh", params=MERGE_STATES_PARAMS,
    tables={"dense": _MERGE},
    template_id=lambda spec, t: (f"pyattn::merge_states<{CTYPES[spec.dtype]}, {CTYPES[spec.dtype]}, "
                                 f"{spec.head_dim}, {t.warps}>"),
)

SPLIT_COMBINE = Family(  # fp32 split partials -> the output type
    name="split_combine", label="split_combine", header="merge_states.cuh", params=MERGE_STATES_PARAMS,
    tables={"dense": _MERGE},
    template_id=lambda spec, t: f"pyattn::merge_states<float, {CTYPES[spec.dtype]}, {spec.head_dim}, {t.warps}>",
    dtypes=("f16", "bf16"),
)

KV_APPEND = Family(  # the head dim is a launch parameter: one variant (bucket 32) serves every head dim
    name="kv_append", label="kv_append", header="kv_append.cuh", params=KV_APPEND_PARAMS,
    tables={"dense": _APPEND},
    template_id=lambda spec, t: f"pyattn::kv_append<{CTYPES[spec.dtype]}, {KV_KINDS[spec.kv]}>",
    dtypes=("f16", "bf16"), alignment=PAGED_ALIGNMENT, kv=True,
)

ATTN_SPARSE = Family(  # rows are read and written in (up to) 16-byte aligned pieces
    name="attn_sparse", label="attn_sparse", header="attention_sparse.cuh", params=SPARSE_PARAMS,
    tables={"dense": _SPARSE},
    template_id=lambda spec, t: f"pyattn::attn_sparse<{CTYPES[spec.dtype]}, {spec.head_dim}, {t.warps}>",
    alignment=Alignment(qkv=16, out=16),
)

MASK_BITS = Family(  # dtype and head dim unused: one variant (f16, bucket 32) per arch
    name="mask_bits", label="mask_bits", header="mask_bits.cuh", params=MASK_BITS_PARAMS,
    tables={"dense": _BITS},
    template_id=lambda spec, t: "pyattn::mask_bits", dtypes=("f16",),
)

FP8_VT = Family(  # head dim read at run time: one variant (bucket 32) per arch
    name="fp8_vt", label="fp8_vt", header="fp8_vt.cuh", params=FP8_VT_PARAMS,
    tables={"dense": _VT},
    template_id=lambda spec, t: "pyattn::fp8_vt", dtypes=("e4m3",),
)

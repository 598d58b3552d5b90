"""Kernel specs: which compiled variant serves a problem, and the variants warm-ups compile.

A :class:`KernelSpec` is frozen and hashable; it alone derives a variant's template instantiation,
entry name, launch shape, compile options and cache key from the family records in
:mod:`pyattn.kernels.families`. The class is defined in :mod:`pyattn.kernels.kernel_spec` and
imported here: this module is the public home of every spec name (the class, the vocabulary the
families define, the selection functions and the variant lists below).
"""

from __future__ import annotations

from .families import FAMILIES as _REGISTRY
from .families import KV_HEAD_DIM_BUCKETS, WGMMA_ARCHS, takes_bounded_softcap, tile_config
from .families.backward import row_pass_rows_per_warp
from .families.base import (DTYPES, FP8_DTYPES, HEAD_DIM_BUCKETS, KV_KINDS, MASK_KINDS, MAX_HEAD_DIM,
                            WGMMA_BWD_MAX_HEAD_DIM, TileConfig)
from .kernel_spec import KernelSpec

__all__ = ["KernelSpec", "TileConfig", "DTYPES", "HEAD_DIM_BUCKETS", "KV_HEAD_DIM_BUCKETS", "MAX_HEAD_DIM",
           "MASK_KINDS", "KV_KINDS", "FAMILIES", "WGMMA_ARCHS", "select_attention_spec", "standard_specs",
           "warmup_specs", "decode_specs", "decode_max_q_tiles", "tile_config", "select_backward_specs",
           "row_pass_rows_per_warp", "backward_specs", "fp8_specs", "softcap_kind", "SOFTCAP_BOUNDED_MAX"]

FAMILIES = tuple(_REGISTRY)  # the family names; the records are pyattn.kernels.families.FAMILIES

# The largest soft-cap of the bounded form (softcap_kind): with c = cap * log2(e), P against the fixed
# reference min(c, 124 - c) spans [2^-124, 2^(2c - 124)]; 51 keeps the top at 2^23.2 (Gemma 2's 50 and
# Grok's 30 fit).
SOFTCAP_BOUNDED_MAX = 51.0


def decode_max_q_tiles(arch: str, head_dim: int, kv: str = "") -> int:
    """The most m16 row tiles one decode block takes at ``head_dim`` (a bucket) on ``arch``."""
    from .families.decode import decode_row  # the decode records, on first use only

    return decode_row(arch, head_dim, kv).max_q_tiles


def _tag_and_bucket(dtype_name: str, head_dim: int) -> tuple:
    """The spec dtype tag of ``dtype_name`` and the smallest head-dim bucket >= ``head_dim``."""
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype_name!r}")
    bucket = next((b for b in HEAD_DIM_BUCKETS if b >= head_dim), None)
    if bucket is None:
        raise ValueError(f"head_dim: at most {MAX_HEAD_DIM} is supported, got {head_dim}")
    return DTYPES[dtype_name][0], bucket


def softcap_kind(softcap: float, tag: str, family: str, mask: str = "none", alibi: bool = False,
                 q_tiles: int = 0) -> int:
    """``KernelSpec.softcap`` for a call's soft-cap value ``softcap`` (0 or False: none) on ``family``.

    2, the bounded form, where ``0 < softcap <=`` :data:`SOFTCAP_BOUNDED_MAX` and the spec fields take
    it (``families.takes_bounded_softcap``: bf16, nothing added to the capped score, ...): every
    score is then within ``softcap`` of 0 and the softmax runs against a fixed reference instead of a
    row max (``attention_fwd_wgmma_mainloop.cuh``, FIXED_REF). Otherwise 1 with a soft-cap, 0 without.
    """
    if not softcap:
        return 0
    bounded = softcap <= SOFTCAP_BOUNDED_MAX and takes_bounded_softcap(family, tag, mask, alibi, q_tiles)
    return 2 if bounded else 1


def select_attention_spec(dtype_name: str, head_dim: int, arch: str, *, ptx: bool = False, mask: str = "none",
                          softcap: float = 0.0, alibi: bool = False, allow_tf32: bool = False,
                          sparse: int = 0, tma: bool = True, keys: int = 1 << 20,
                          mask_rows: bool = False, causal: bool = False, queries: int = 0, batch_heads: int = 0,
                          sm_count: int = 0) -> KernelSpec:
    """Choose the kernel spec for an attention problem.

    Parameters
    ----------
    dtype_name : str
        NumPy dtype name of q/k/v (``float32``, ``float16``, ``bfloat16``).
    head_dim : int
        The problem's head dim (a multiple of 8, at most :data:`MAX_HEAD_DIM`).
    arch : str
    ptx : bool
    mask : str
        Mask tensor element type (:data:`MASK_KINDS`), ``"none"`` without a mask tensor.
    softcap : float
        The call's soft-cap, 0 (or False) without one; True counts as a cap of 1 (:func:`softcap_kind`).
    alibi : bool
        Whether the call uses ALiBi slopes.
    allow_tf32 : bool
        float32 inputs may run on TF32 tensor cores (10-bit mantissa products) instead of exact FMA.
    sparse : int
        The block-sparse mode (``KernelSpec.sparse``), 0 for a dense call.
    tma : bool
        Whether TMA tensor maps can describe the call's q, k, v and float mask tensor
        (``runtime.tensormap.rank4``): a broadcast sequence or key axis cannot be. A bool mask
        needs no map: the TMA kernel reads it packed to bits (spec mask ``"bits"``).
    keys : int
        The call's seqlen_k (varlen: the longest): the TMA kernel's rows say from how many keys
        on they serve (default: a long call).
    mask_rows : bool
        The mask is broadcast over the query rows (query stride 0, a key-padding mask): the TMA
        kernel then takes a float mask as one row a stage on its dense rows (mask ``"<kind>_row"``).
    causal : bool
        The call is causal: the TMA kernel's short row may serve causal calls of more keys than
        others (``max_keys_causal``: persistent blocks balance causal row blocks by pairing them).
    queries, batch_heads, sm_count : int
        The call's seqlen_q (varlen: the longest), batch x query heads, and the GPU's SM count: a
        plain call whose query tiles would leave the GPU a short last round runs the TMA kernel's
        short row's smaller tiles (``q_tiles`` 2) where ``short_small_grid`` predicts them faster
        (below the short row's keys; past them non-causal calls only). 0 (the default): not known,
        never.

    Raises
    ------
    ValueError
        For fp8 inputs (``float8_e4m3fn``) where attn_fwd_fp8 cannot run them: another arch than
        sm_90a, a block-sparse call, arrays TMA cannot map. Nothing falls back to another kernel.
    """
    if dtype_name in FP8_DTYPES:
        return _fp8_spec(dtype_name, head_dim, arch, ptx=ptx, mask=mask, softcap=softcap, alibi=alibi, sparse=sparse,
                         tma=tma)
    tag, bucket = _tag_and_bucket(dtype_name, head_dim)
    q_tiles = 0
    # fp32 stays exact (CUDA-core FMA) unless TF32 is allowed; 16-bit inputs go to the tensor cores:
    # warpgroup MMA on sm_90a (its buckets are multiples of 64, score modifiers included).
    if tag == "f32":
        family = "attn_fwd_tf32" if allow_tf32 else "attn_fwd_simt"
    elif arch in WGMMA_ARCHS:
        # Calls go to the TMA-fed kernel where its table has the bucket (measured faster); block-
        # sparse lists, and what TMA cannot map, are copied by the cp.async kernel.
        from .families.small_grid import short_small_grid  # the wgmma records: sm_90a only (issue 16)
        from .families.tma import tma_serves, tma_serves_short

        # A bool mask reaches the TMA kernel packed to bits (the mask_bits kernel, per call), a
        # float key-padding mask as one row a stage.
        bucket = -(-head_dim // 64) * 64
        packed = "bits" if mask == "bool" else f"{mask}_row" if mask_rows and mask != "none" else mask
        # Below a row's number of keys, the short row where it has one.
        short = tma and not sparse and tma_serves_short(arch, bucket, keys, packed, bool(alibi), causal)
        tma = short or tma and not sparse and tma_serves(arch, bucket, keys, packed)
        family, mask = ("attn_fwd_tma", packed) if tma else ("attn_fwd_wgmma", mask)
        q_tiles = int(short)
        # A plain call whose query tiles would not fill the GPU: the short row's smaller tiles (its
        # mods_row) instead, at any number of keys (non-causal past the short row's).
        if tma and sm_count and packed == "none" and not alibi and short_small_grid(
                arch, bucket, queries, batch_heads, causal, sm_count, short=short, keys=keys):
            q_tiles = 2
    else:
        family = "attn_fwd_mma"
    return KernelSpec(family, tag, bucket, arch, ptx, mask,
                      softcap_kind(softcap, tag, family, mask, bool(alibi), q_tiles), bool(alibi), q_tiles=q_tiles,
                      sparse=sparse)


def _fp8_spec(dtype_name: str, head_dim: int, arch: str, *, ptx, mask, softcap, alibi, sparse, tma) -> KernelSpec:
    """attn_fwd_fp8's spec for fp8 inputs (:func:`select_attention_spec`): head dims up to 128 in the
    128 bucket (one 128-byte row; smaller ones zero-padded by the copy engine), larger in 256."""
    if arch not in WGMMA_ARCHS:
        raise ValueError(f"dtype: {dtype_name} inputs run on 8-bit warpgroup MMA, arch in {WGMMA_ARCHS} only; "
                         f"got {arch!r}")
    if sparse:
        raise ValueError(f"dtype: block-sparse attention takes float16 or bfloat16, got {dtype_name}")
    if not tma:
        raise ValueError(f"q/k/v: {dtype_name} inputs are read through TMA maps, which these arrays' strides "
                         "do not allow (16-byte aligned strides, no broadcast sequence axis)")
    if mask not in ("none", "bool"):
        raise ValueError(f"mask: {dtype_name} inputs take a bool mask or none, got {mask!r}")
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head_dim: at most {MAX_HEAD_DIM} is supported, got {head_dim}")
    return KernelSpec("attn_fwd_fp8", FP8_DTYPES[dtype_name][0], 128 if head_dim <= 128 else 256, arch, ptx,
                      "bits" if mask == "bool" else "none", bool(softcap), bool(alibi))


def fp8_specs(arch: str) -> list:
    """The fp8 variants ``attention`` can select on ``arch`` without score modifiers (none off sm_90a)."""
    if arch not in WGMMA_ARCHS:
        return []
    return [select_attention_spec(name, d, arch) for name in FP8_DTYPES for d in (128, 256)] + [
        KernelSpec("fp8_vt", "e4m3", HEAD_DIM_BUCKETS[0], arch)]


# Decode variants warmed by default: the common head dims, one row tile (a GQA group of up to 16
# query heads at q_len 1). Others (speculative q_len, rarer head dims) compile on first use.
_WARM_DECODE_DIMS = (64, 128, 256)


def decode_specs(arch: str, head_dims=_WARM_DECODE_DIMS, q_tiles=(1,), ptx: bool = False) -> list:
    """The paged-cache kernels without modifiers: decode (its split combine fused in; on sm_90a
    both the cp.async and the TMA kernel, which pages of 16 slots and more take, with its
    swapped-role blocks for up to 8 rows) and append."""
    from .families.decode import decode_row, tma_decode_serves
    specs = []
    for tag in ("f16", "bf16"):
        for d in head_dims:
            specs += [KernelSpec("attn_decode", tag, d, arch, ptx, q_tiles=mt)
                      for mt in q_tiles if mt <= decode_max_q_tiles(arch, d)]
            if tma_decode_serves(arch, d, 16):
                specs += [KernelSpec("attn_decode_tma", tag, d, arch, ptx, q_tiles=mt)
                          for mt in q_tiles if mt <= decode_row(arch, d, tma=True).max_q_tiles]
                if 1 in q_tiles:  # GQA groups of 4 / 8 at q_len 1
                    specs.append(KernelSpec("attn_decode_swap", tag, d, arch, ptx, q_tiles=1))
        specs.append(KernelSpec("kv_append", tag, HEAD_DIM_BUCKETS[0], arch, ptx))
    return specs


def standard_specs(arch: str) -> list:
    """Every variant ``attention`` can select on ``arch`` without score modifiers (for short calls and
    long ones: the TMA kernel's rows serve from a number of keys on; short calls on a small grid)."""
    plain = [select_attention_spec(name, d, arch, keys=keys) for name in DTYPES for d in HEAD_DIM_BUCKETS
             for keys in (1, 1 << 20)]
    # a call of one query tile on a GPU of one SM: the short row's small-grid row, where it has one
    plain += [select_attention_spec(name, d, arch, keys=1, queries=1, batch_heads=1, sm_count=1) for name in DTYPES
              for d in HEAD_DIM_BUCKETS]
    plain += [select_attention_spec("float32", d, arch, allow_tf32=True) for d in HEAD_DIM_BUCKETS]
    from .families.tma import tma_tail_splits

    # long calls whose last round of query tiles the plan splits by keys (pyattn/ops/_fwd_tail.py)
    plain += [s.replace(q_tiles=3) for s in plain if s.family == "attn_fwd_tma" and not s.q_tiles
              and tma_tail_splits(s.arch, s.head_dim, s.mask, s.softcap, s.alibi)]
    return list(dict.fromkeys(plain))  # wgmma's 64-wide buckets serve two 32-wide ones


def warmup_specs(arch: str) -> list:
    """What ``pyattn warmup`` precompiles for ``arch``: :func:`standard_specs`, :func:`decode_specs` and
    :func:`fp8_specs`."""
    return standard_specs(arch) + decode_specs(arch) + fp8_specs(arch)


def select_backward_specs(dtype_name: str, head_dim: int, arch: str, *, ptx: bool = False, softcap: bool = False,
                          alibi: bool = False) -> tuple:
    """The three kernels of a backward call: ``(attn_bwd_pre, main, attn_bwd_convert)``.

    The main kernel is, for float16/bfloat16, ``attn_bwd_wgmma`` (warpgroup MMA) on sm_90a up to head
    dim 128 (its buckets are multiples of 64) and ``attn_bwd_mma`` (mma.sync tensor cores) otherwise;
    ``attn_bwd_simt`` (exact fp32 FMA) for float32; at the smallest head-dim bucket >= ``head_dim``.
    The row kernels read the head dim at run time (one variant per dtype).
    """
    tag, bucket = _tag_and_bucket(dtype_name, head_dim)
    if tag == "f32":
        main = "attn_bwd_simt"
    elif arch in WGMMA_ARCHS and head_dim <= WGMMA_BWD_MAX_HEAD_DIM:
        main, bucket = "attn_bwd_wgmma", -(-head_dim // 64) * 64
    else:
        main = "attn_bwd_mma"
    return (KernelSpec("attn_bwd_pre", tag, HEAD_DIM_BUCKETS[0], arch, ptx),
            KernelSpec(main, tag, bucket, arch, ptx, softcap=bool(softcap), alibi=bool(alibi)),
            KernelSpec("attn_bwd_convert", tag, HEAD_DIM_BUCKETS[0], arch, ptx))


def backward_specs(arch: str) -> list:
    """Every variant ``attention_backward`` can select on ``arch`` without score modifiers (``pyattn
    warmup`` leaves them out: they compile on a first backward call, or warm them with
    ``pyattn.jit.build_many(backward_specs(arch))``)."""
    specs = [s for name in DTYPES for d in HEAD_DIM_BUCKETS for s in select_backward_specs(name, d, arch)]
    return list(dict.fromkeys(specs))

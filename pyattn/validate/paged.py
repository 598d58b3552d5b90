"""Validate decode inputs: queries, K/V page pools, page tables.

Inputs are :class:`~pyattn.interop.inputs.Arg` objects. No driver call here (device page tables
are copied back for their range check by the caller's ``fetch``, after everything else is
checked), so every mistake is a ``ValueError``/``TypeError`` naming the argument, and all of it is
testable without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .options import check_alibi, check_causal, check_int, check_scale, check_softcap, check_window

__all__ = ["DecodeProblem", "PoolInfo", "check_pools", "check_query", "check_q_address", "check_block_table",
           "check_csr", "check_table_form", "POOL_LAYOUTS", "DECODE_DTYPES", "MAX_SPLITS", "check_cache_options",
           "check_layout", "check_pool_address", "check_pool_call_addresses", "check_append", "check_token_rows",
           "check_token_chunks", "check_token_address", "check_max_seqlen", "KEY_SCALES"]

DECODE_DTYPES = ("float16", "bfloat16")
POOL_LAYOUTS = ("nhd", "hnd")  # (pages, page_size, heads, dim) / (pages, heads, page_size, dim)
MAX_SPLITS = 256  # splits of one sequence: each holds fp32 partial rows in the call's workspace
_MAX_GRID_YZ = 65535
KEY_SCALES = ("token", "channel")


@dataclass(frozen=True)
class PoolInfo:
    """A validated K/V page-pool pair: geometry and element strides (page, slot, head).

    ``kv`` is ``""`` for fp16/bf16 pools, else the 8-bit kind (``"int8"`` / ``"fp8e4m3"``, see
    :mod:`pyattn.quant`): ``dtype`` is then the code dtype and ``ks_strides`` / ``vs_strides`` are
    the (page, slot, head) element strides of the float32 K / V scale pools (0s without them).
    ``key_channel``: the keys have per-(page, channel) scales (``ks_strides`` then address each page's
    scale record, slot stride 0).
    """

    num_pages: int
    page_size: int
    heads_kv: int
    head_dim: int
    dtype: np.dtype
    k_strides: tuple
    v_strides: tuple
    kv: str = ""
    ks_strides: tuple = (0, 0, 0)
    vs_strides: tuple = (0, 0, 0)
    key_channel: bool = False


@dataclass(frozen=True)
class DecodeProblem:
    """A validated decode call (shapes logical; strides in elements)."""

    batch: int
    q_len: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: np.dtype
    q_strides: tuple  # (batch, token, head)
    q_on_device: bool
    causal: int
    window: tuple
    softcap: float
    scale: float
    alibi: object  # options.AlibiInfo or None
    num_splits: int | None  # the caller's override
    pool: PoolInfo = None  # the pools it reads

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def check_pools(k_pool, v_pool, layout: str = "nhd") -> PoolInfo:
    """Validate K/V pool Args of shape (num_pages, page_size, heads_kv, head_dim) (``"nhd"``) or
    (num_pages, heads_kv, page_size, head_dim) (``"hnd"``): device arrays, fp16/bf16, head_dim
    contiguous, 16-byte aligned rows (the kernel copies 16-byte chunks)."""
    check_layout(layout)
    ins = [k_pool, v_pool]
    for i in ins:
        if not i.on_device:
            raise TypeError(f"{i.name}: expected a device array (the page pool lives on the GPU), got a host array")
        if i.dtype.name not in DECODE_DTYPES:
            raise TypeError(f"{i.name}: expected dtype float16 or bfloat16, got {i.dtype}")
        if len(i.shape) != 4:
            axes = "pages, page_size, heads, dim" if layout == "nhd" else "pages, heads, page_size, dim"
            raise ValueError(f"{i.name}: expected 4 dims ({axes}), got shape {i.shape}")
        if i.strides[-1] != 1:
            raise ValueError(f"{i.name}: the head_dim axis must be contiguous, got element strides {i.strides}")
        if any(st % 8 for st in i.strides[:-1]):
            raise ValueError(f"{i.name}: strides must be multiples of 8 elements (16-byte rows), got {i.strides}")
        check_pool_address(i.name, i.ptr)
    k, v = ins
    if k.ordinal is not None and v.ordinal is not None and k.ordinal != v.ordinal:
        raise ValueError(f"{v.name}: expected an array on {k.name}'s device {k.ordinal}, got device {v.ordinal}")
    if k.dtype != v.dtype:
        raise TypeError(f"{v.name}: expected dtype {k.dtype} ({k.name}'s), got {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{v.name}: expected shape {k.shape} ({k.name}'s), got {v.shape}")
    if layout == "nhd":
        num_pages, page_size, heads, dim = k.shape
        perm = (0, 1, 2)
    else:
        num_pages, heads, page_size, dim = k.shape
        perm = (0, 2, 1)
    if dim % 8 or not 8 <= dim <= 256:
        raise ValueError(f"{k.name}: head_dim must be a multiple of 8 in [8, 256], got {dim}")
    if num_pages < 1 or page_size < 1 or heads < 1:
        raise ValueError(f"{k.name}: expected at least one page, slot and head, got shape {k.shape}")
    if heads > _MAX_GRID_YZ:
        raise ValueError(f"{k.name}: at most {_MAX_GRID_YZ} kv heads, got {heads}")
    strides = tuple(tuple(i.strides[a] for a in perm) for i in ins)
    return PoolInfo(num_pages, page_size, heads, dim, k.dtype, *strides)


def check_query(q, pool: PoolInfo, *, causal, window, softcap, alibi_slopes, scale, num_splits) -> DecodeProblem:
    """Validate q (an Arg, (batch, q_len, heads_q, head_dim)) against the pool and the options."""
    i = q
    if pool.kv:  # 8-bit codes dequantize to the query's fp16/bf16
        if i.dtype.name not in DECODE_DTYPES:
            raise TypeError(f"q: expected dtype float16 or bfloat16 over an 8-bit ({pool.kv}) cache, got {i.dtype}")
    elif i.dtype != pool.dtype:
        raise TypeError(f"q: expected dtype {pool.dtype} (the KV cache's), got {i.dtype}")
    if len(i.shape) != 4:
        raise ValueError(f"q: expected shape (batch, q_len, heads_q, head_dim), got {i.shape}")
    batch, q_len, heads_q, dim = i.shape
    if dim != pool.head_dim:
        raise ValueError(f"q: expected head_dim {pool.head_dim} (the KV cache's), got {dim}")
    if heads_q < 1 or heads_q % pool.heads_kv:
        raise ValueError(f"q: query heads ({heads_q}) must be a multiple of the cache's kv heads ({pool.heads_kv})")
    if q_len < 1:
        raise ValueError(f"q: expected q_len >= 1, got shape {i.shape}")
    if batch > _MAX_GRID_YZ:
        raise ValueError(f"q: batch must be <= {_MAX_GRID_YZ}, got {batch}")
    if i.on_device and (i.strides[-1] != 1 or any(st % 8 for st in i.strides[:-1])):
        raise ValueError(f"q: the head_dim axis must be contiguous and other strides multiples of 8 elements, "
                         f"got element strides {i.strides}")
    if i.on_device:
        check_q_address(i.ptr)
    if num_splits is not None:
        num_splits = check_int("num_splits", num_splits, 1, MAX_SPLITS)
    alibi = check_alibi(alibi_slopes, batch, heads_q)
    strides = tuple(i.strides[:3]) if i.on_device else (q_len * heads_q * dim, heads_q * dim, dim)
    return DecodeProblem(batch, q_len, heads_q, pool.heads_kv, dim, i.dtype, strides, i.on_device,
                         check_causal(causal), check_window(window), check_softcap(softcap), check_scale(scale, dim),
                         alibi, num_splits, pool)


def check_layout(layout) -> str:
    """A pool layout (``paged_decode``'s, ``contiguous_decode``'s): ``"nhd"`` or ``"hnd"``."""
    if not isinstance(layout, str) or layout not in POOL_LAYOUTS:
        raise ValueError(f"layout: expected one of {POOL_LAYOUTS}, got {layout!r}")
    return layout


def check_pool_address(name: str, ptr: int) -> None:
    """A K/V pool's address must be 16-byte aligned (the kernels copy 16-byte rows): checked by
    :func:`check_pools` and on every repeat call over pools whose layout was checked before."""
    if ptr % 16:
        raise ValueError(f"{name}: the kernel copies 16-byte rows; the address must be 16-byte aligned, got {ptr:#x}")


def check_q_address(ptr: int) -> None:
    """A device q's address must be 16-byte aligned (the kernel reads 16-byte chunks): checked on
    every call, since a memoised problem is shared by calls with other addresses."""
    if ptr % 16:
        raise ValueError(f"q: the address must be 16-byte aligned, got {ptr:#x} (copy the array to make it aligned)")


def check_pool_call_addresses(P, ptrs) -> None:
    """A repeat call's address checks over pools (``paged_decode``, ``paged_prefill``: the bound
    arrays' addresses, q, k_pool, v_pool first): q's alignment and the pools'."""
    check_q_address(ptrs[0])
    check_pool_address("k_pool", ptrs[1])
    check_pool_address("v_pool", ptrs[2])


def check_table_form(block_table, seq_lens, indptr, indices, last_page_len) -> None:
    """Exactly one page-table form: ``block_table`` + ``seq_lens``, or ``indptr`` + ``indices`` +
    ``last_page_len`` (vLLM's or FlashInfer's)."""
    if (block_table is None) == (indptr is None):
        raise ValueError("block_table/indptr: pass exactly one page table: block_table with seq_lens, or "
                         "indptr with indices and last_page_len")
    if block_table is not None:
        if indices is not None or last_page_len is not None:
            raise ValueError("indices/last_page_len: these belong to the CSR form; not with block_table")
        if seq_lens is None:
            raise ValueError("seq_lens: required with block_table")
    elif indices is None or last_page_len is None or seq_lens is not None:
        raise ValueError("indices/last_page_len: the CSR form needs indptr, indices and last_page_len "
                         "(and no seq_lens)")


def check_max_seqlen(max_seqlen, lengths, name: str, top: int, param: str = "max_seqlen") -> int:
    """``max_seqlen`` (parameter ``param``): a host bound in ``[0, top]`` on the device lengths
    ``lengths`` (the Arg of parameter ``name``), which the kernel then reads unchecked, clamped to
    the bound."""
    if not getattr(lengths, "on_device", False):
        raise ValueError(f"{param}: bounds device lengths read unchecked, so {name} must then be a device "
                         f"int32 array, got {type(getattr(lengths, 'obj', lengths)).__name__}")
    return check_int(param, max_seqlen, 0, top)


def _int32_meta(i, ndim: int = 1) -> None:
    """Metadata checks of an int32 index array Arg."""
    if i.dtype != np.int32:
        raise TypeError(f"{i.name}: expected dtype int32, got {i.dtype}")
    if len(i.shape) != ndim:
        raise ValueError(f"{i.name}: expected {ndim} dim(s), got shape {i.shape}")
    if i.on_device and i.strides[-1] != 1 and i.shape[-1] > 1:
        raise ValueError(f"{i.name}: the last axis must be contiguous, got element strides {i.strides}")


def _values(args, fetch) -> list:
    """Host values of index Args, called once all their metadata checks have passed: a device
    array's values come back through ``fetch`` (the one piece of device work before the range check)."""
    return [fetch(a) if a.on_device else np.asarray(a.obj) for a in args]


def check_block_table(block_table, seq_lens, batch: int, pool: PoolInfo, fetch) -> tuple:
    """Range-check a vLLM-style block table (batch, max_pages) and seq_lens (batch,), both Args.

    Only the entries a sequence uses are checked (padding may hold anything). Returns the host
    values ``(table, lens)``; ``fetch`` None (``max_seqlen``'s tables, read unchecked): the
    metadata alone, and ``(None, None)``.
    """
    ti, li = block_table, seq_lens
    _int32_meta(ti, 2)
    _int32_meta(li)
    if ti.shape[0] != batch or li.shape != (batch,):
        raise ValueError(f"block_table, seq_lens: expected {batch} rows (q's batch), got shapes {ti.shape}, {li.shape}")
    if fetch is None:
        return None, None
    table, lens = _values((ti, li), fetch)
    if (lens < 0).any() or (lens > ti.shape[1] * pool.page_size).any():
        bad = int(np.flatnonzero((lens < 0) | (lens > ti.shape[1] * pool.page_size))[0])
        raise ValueError(f"seq_lens: expected 0 <= seq_lens[i] <= {ti.shape[1]} pages x {pool.page_size} = "
                         f"{ti.shape[1] * pool.page_size}, got seq_lens[{bad}] = {int(lens[bad])}")
    used = -(-lens.astype(np.int64) // pool.page_size)
    cols = np.arange(ti.shape[1])[None, :]
    entries = table[cols < used[:, None]] if table.size else np.empty(0, np.int32)
    _check_pages("block_table", entries, pool.num_pages)
    return table, lens


def check_csr(indptr, indices, last_page_len, batch: int, pool: PoolInfo, fetch) -> tuple:
    """Range-check FlashInfer's CSR page table (Args) and return host ``(indptr, indices, kv_len)``;
    ``fetch`` None: the metadata alone, and ``(None, None, None)``."""
    for a in (indptr, indices, last_page_len):
        _int32_meta(a)
    if indptr.shape != (batch + 1,) or last_page_len.shape != (batch,):
        raise ValueError(f"indptr, last_page_len: expected shapes ({batch + 1},), ({batch},) for batch {batch}, "
                         f"got {indptr.shape}, {last_page_len.shape}")
    if fetch is None:
        return None, None, None
    ip, ix, lp = _values((indptr, indices, last_page_len), fetch)
    if ip[0] != 0 or (np.diff(ip) < 0).any() or ip[-1] > indices.shape[0]:
        raise ValueError(f"indptr: must start at 0, be non-decreasing and end at most at len(indices) = "
                         f"{indices.shape[0]}, got {ip.tolist() if ip.size <= 16 else ip}")
    n_pages = np.diff(ip).astype(np.int64)
    lo, hi = np.where(n_pages > 0, 1, 0), np.where(n_pages > 0, pool.page_size, 0)
    if ((lp < lo) | (lp > hi)).any():
        bad = int(np.flatnonzero((lp < lo) | (lp > hi))[0])
        raise ValueError(f"last_page_len: expected 1 to page_size = {pool.page_size} for a sequence with pages "
                         f"(0 without), got last_page_len[{bad}] = {int(lp[bad])} with {int(n_pages[bad])} page(s)")
    _check_pages("indices", ix[: ip[-1]], pool.num_pages)
    kv_len = np.where(n_pages > 0, (n_pages - 1) * pool.page_size + lp, 0)
    if (kv_len >= 2**31).any():
        raise ValueError("indptr: a sequence of 2**31 or more tokens")
    return ip, ix, kv_len.astype(np.int32)


def _check_pages(name: str, pages: np.ndarray, num_pages: int) -> None:
    bad = (pages < 0) | (pages >= num_pages)
    if bad.any():
        j = int(np.flatnonzero(bad.ravel())[0])
        raise ValueError(f"{name}: page indices must be in [0, {num_pages}) (the pool's pages), "
                         f"got {int(pages.ravel()[j])} among the used entries")


def check_cache_options(key_scales, sparq, kv: str, num_pages: int, page_size: int, heads_kv: int) -> tuple:
    """Validate ``PagedKVCache``'s ``key_scales`` and ``sparq``; returns ``(per-channel keys, sparq)``."""
    if key_scales not in KEY_SCALES:
        raise ValueError(f"key_scales: expected one of {KEY_SCALES}, got {key_scales!r}")
    channel = key_scales == "channel"
    if channel and not kv:
        raise ValueError("key_scales: per-channel key scales are for 8-bit caches (dtype int8 or fp8_e4m3), "
                         "got a 16-bit cache")
    if channel and page_size % 16:
        raise ValueError(f"page_size: key_scales='channel' needs a multiple of 16 (the decode kernel rescales "
                         f"its query per 16-key segment, which must lie in one page), got {page_size}")
    if not isinstance(sparq, (bool, np.bool_)):
        raise TypeError(f"sparq: expected a bool, got {type(sparq).__name__}")
    if sparq and kv:
        raise ValueError(f"sparq: SparQ reads 16-bit caches (float16 / bfloat16), got an 8-bit ({kv}) cache")
    if sparq and page_size % 8:
        raise ValueError(f"page_size: sparq=True needs a multiple of 8 (the approximate scores read 4 keys of a "
                         f"page at a time), got {page_size}")
    if sparq and num_pages * page_size * heads_kv > 2**31 - 1:
        raise ValueError(f"num_pages: sparq=True needs num_pages * page_size * num_kv_heads < 2**31 (its decode "
                         f"addresses key rows by an int32), got {num_pages} x {page_size} x {heads_kv}")
    return channel, bool(sparq)


def check_append(ki, vi, counts, n_seqs: int, heads: int, head_dim: int, kv: str, dtype) -> list:
    """``PagedKVCache.append``'s token arrays (Args) and counts, checked; returns the tokens per
    sequence.

    ``k`` / ``v``: (n_seqs, t, heads, head_dim), or packed (total, heads, head_dim) with ``counts``;
    the cache's ``dtype`` for a 16-bit cache, float16 or bfloat16 for an 8-bit one (``kv``).
    """
    for i in (ki, vi):
        if kv and i.dtype.name not in DECODE_DTYPES:
            raise TypeError(f"{i.name}: expected dtype float16 or bfloat16 (quantized into the {kv} "
                            f"cache), got {i.dtype}")
        if not kv and i.dtype != dtype:
            raise TypeError(f"{i.name}: expected dtype {dtype} (the cache's), got {i.dtype}")
    if vi.dtype != ki.dtype:
        raise TypeError(f"v: expected dtype {ki.dtype} (k's), got {vi.dtype}")
    if ki.shape != vi.shape or ki.on_device != vi.on_device:
        raise ValueError(f"v: expected k's shape {ki.shape} and place, got {vi.shape}")
    H, D = heads, head_dim
    if len(ki.shape) == 4:
        if counts is not None:
            raise ValueError("counts: only for packed (total, heads, dim) k/v")
        if ki.shape[0] != n_seqs or ki.shape[2:] != (H, D):
            raise ValueError(f"k: expected shape ({n_seqs}, t, {H}, {D}), got {ki.shape}")
        return [ki.shape[1]] * n_seqs
    if len(ki.shape) == 3:
        if counts is None:
            raise ValueError("counts: required for packed (total, heads, dim) k/v")
        try:  # once, as a list: a generator would be used up by the checks below
            counts = list(counts)
        except TypeError:
            raise TypeError(f"counts: expected a sequence of ints, got {type(counts).__name__}") from None
        if any(isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)) for c in counts):
            raise TypeError(f"counts: expected ints, got {list(counts)}")
        counts = [int(c) for c in counts]
        if ki.shape[1:] != (H, D) or len(counts) != n_seqs or sum(counts) != ki.shape[0]:
            raise ValueError(f"k: expected shape (sum(counts) = {sum(counts)}, {H}, {D}) with one count per "
                             f"sequence ({n_seqs}), got shape {ki.shape} and {len(counts)} counts")
        return counts
    raise ValueError(f"k: expected (batch, t, {H}, {D}) or packed (total, {H}, {D}), got {ki.shape}")


def _chunks_error(name: str, got: str) -> ValueError:
    return ValueError(f"{name}: the append kernel copies 16-byte chunks: head_dim contiguous, other strides "
                      f"multiples of 8 elements and a 16-byte aligned address; got {got}")


def check_token_address(name: str, ptr: int) -> None:
    """The per-call part of :func:`check_token_rows`: a 16-byte aligned address (a repeat append,
    whose layout was checked at its first call, checks only this)."""
    if ptr % 16:
        raise _chunks_error(name, f"address {ptr:#x}")


def check_token_chunks(i) -> None:
    """A device token array (an Arg) read in 16-byte chunks: head_dim contiguous, other strides
    multiples of 8 elements, a 16-byte aligned address."""
    st = i.strides
    if st[-1] != 1 or any(x % 8 for x in st[:-1]):
        raise _chunks_error(i.name, f"element strides {st}")
    check_token_address(i.name, i.ptr)


def check_token_rows(i) -> None:
    """A device token array (an Arg) the append kernel can read: 16-byte chunks, collapsible rows."""
    check_token_chunks(i)
    st = i.strides
    if len(i.shape) == 4 and i.shape[0] > 1 and i.shape[1] > 0 and st[0] != i.shape[1] * st[1]:
        # (batch, t, H, D): token row r = b * t + i needs stride_b == t * stride_t
        raise ValueError(f"{i.name}: (batch, t) must collapse into one token axis (stride_b == t * "
                         f"stride_t), got element strides {st}; pass a contiguous array")

"""``pyattn.decode`` and ``pyattn.paged_decode``: attention of new query tokens over a paged KV cache.

Flash-decoding: one block per (split, kv head, row block, sequence) reads its keys once for the
whole GQA group; when batch x kv heads is too small to fill the GPU, each sequence's keys are
split across blocks and the fp32 partials merged by LSE (``merge_states<float, T>``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..array import _c_strides, allocate, asarray
from ..kernels.registry import get_kernel
from ..kernels.specs import DTYPES, HEAD_DIM_BUCKETS, KV_HEAD_DIM_BUCKETS, KernelSpec, decode_max_q_tiles
from ..runtime.launch import launch
from ..runtime.memory import Allocation
from ..runtime.stream import as_stream
from .attention import upload_extras
from ._paged import check_block_table, check_csr, check_pools, check_query, choose_num_splits
from ._plan import ptx_requested

__all__ = ["decode", "paged_decode"]

_LOG2E = 1.4426950408889634
_F32 = np.dtype(np.float32)


@functools.lru_cache(maxsize=256)
def _specs(dtype: str, head_dim: int, arch: str, ptx: bool, rows: int, softcap: bool, alibi: bool,
           kv: str = "") -> tuple:
    """(decode spec, combine spec) for ``rows`` = group * q_len query rows per kv head; ``kv``: the
    cache's 8-bit kind ("" for 16-bit caches)."""
    tag = DTYPES[dtype][0]
    bucket = next(b for b in (KV_HEAD_DIM_BUCKETS if kv else HEAD_DIM_BUCKETS) if b >= head_dim)
    q_tiles = min(-(-rows // 16), decode_max_q_tiles(arch, bucket, kv))
    return (KernelSpec("attn_decode", tag, bucket, arch, ptx, softcap=softcap, alibi=alibi, q_tiles=q_tiles, kv=kv),
            KernelSpec("decode_combine", tag, next(b for b in HEAD_DIM_BUCKETS if b >= head_dim), arch, ptx))


def _blocks_per_sm(spec, kernel) -> int:
    """Concurrent blocks of ``spec`` per SM: registers bound the 8-bit kernels (shared memory alone
    said 3 where 2 fit, and the split choice then planned waves that did not exist)."""
    return max(1, kernel.max_active_blocks(spec.threads, spec.shared_bytes))


_num_splits = functools.lru_cache(maxsize=4096)(choose_num_splits)


class DecodePlan(NamedTuple):
    """What a validated decode needs besides pointers, the page table and the split count."""

    kernel: object
    ckernel: object  # the split combine
    block: tuple
    shared_bytes: int
    grid_yz: tuple  # (kv heads x row blocks, batch)
    packer: object  # PartialPack: pointers, num_splits, table_stride -> DecodeParams bytes
    cpacker: object  # PartialPack: pointers, n_b -> MergeStatesParams bytes
    cgrid: tuple
    cblock: tuple
    block_n: int
    units: int  # independent blocks before splitting
    slots: int  # concurrent blocks on the GPU
    out_shape: tuple
    lse_shape: tuple
    n_rows: int  # batch x q_len x heads_q
    head_dim: int
    dtype: np.dtype


_plans: dict = {}
_MAX_PLANS = 1024


def decode_plan(P, pool, device) -> DecodePlan:
    """The plan of problem ``P`` over ``pool`` on ``device`` (cached: a decode loop repeats one shape)."""
    key = (P, pool, device.ordinal, ptx_requested())
    plan = _plans.get(key)
    if plan is not None:
        return plan
    rows = P.group * P.q_len
    kv = pool.kv
    spec, cspec = _specs(P.dtype.name, P.head_dim, device.arch, ptx_requested(), rows, P.softcap > 0,
                         P.alibi is not None, kv)
    kernel, ckernel = get_kernel(spec, device), get_kernel(cspec, device)
    t = spec.tiles
    row_blocks = -(-rows // t.block_m)
    if P.heads_kv * row_blocks > 65535:
        raise ValueError(f"q: heads_kv x row blocks must be <= 65535, got {P.heads_kv} x {row_blocks}")
    out_shape = (P.batch, P.q_len, P.heads_q, P.head_dim)
    qs, os_ = P.q_strides, _c_strides(out_shape, 1)
    ks, vs = pool.k_strides, pool.v_strides
    kss, vss = pool.ks_strides, pool.vs_strides  # (0, 0, 0) for 16-bit pools
    packer = spec.params.partial({
        "ks_stride_page": kss[0], "ks_stride_slot": kss[1], "ks_stride_h": kss[2],
        "vs_stride_page": vss[0], "vs_stride_slot": vss[1], "vs_stride_h": vss[2],
        "q_stride_b": qs[0], "q_stride_s": qs[1], "q_stride_h": qs[2],
        "o_stride_b": os_[0], "o_stride_s": os_[1], "o_stride_h": os_[2],
        "k_stride_page": ks[0], "k_stride_slot": ks[1], "k_stride_h": ks[2],
        "v_stride_page": vs[0], "v_stride_slot": vs[1], "v_stride_h": vs[2],
        "lse_stride_b": P.heads_q * P.q_len, "lse_stride_h": P.q_len,
        "batch": P.batch, "q_len": P.q_len, "heads_q": P.heads_q, "heads_kv": P.heads_kv, "group": P.group,
        "head_dim": P.head_dim, "page_size": pool.page_size,
        "page_shift": pool.page_size.bit_length() - 1 if pool.page_size & (pool.page_size - 1) == 0 else -1,
        "row_blocks": row_blocks, "causal": P.causal, "window_left": P.window[0], "window_right": P.window[1],
        "alibi_stride_b": P.alibi.stride_b if P.alibi is not None else 0,
        "scale_log2": P.scale * _LOG2E, "scale": P.scale, "softcap": P.softcap,
    })
    # The combine reads the fp32 partials (split, batch, q_len, heads_q, D) and writes rows (batch,
    # q_len, heads_q) of out and of lse, which is (batch, heads_q, q_len).
    D, H, L = P.head_dim, P.heads_q, P.q_len
    n_rows = P.batch * L * H
    cstatic = {"o_b_stride_n": n_rows * D, "lse_b_stride_n": n_rows, "dim0": P.batch, "dim1": L, "dim2": H,
               "head_dim": D}
    for name, st in (("o_a", (L * H * D, H * D, D)), ("o_b", (L * H * D, H * D, D)), ("out", os_[:3]),
                     ("lse_a", (L * H, H, 1)), ("lse_b", (L * H, H, 1)), ("out_lse", (H * L, 1, L))):
        cstatic.update({f"{name}_stride_{i}": v for i, v in enumerate(st)})
    plan = DecodePlan(kernel, ckernel, (spec.threads, 1, 1), spec.shared_bytes, (P.heads_kv * row_blocks, P.batch),
                      packer, cspec.params.partial(cstatic), (-(-n_rows // cspec.tiles.warps), 1, 1),
                      (cspec.threads, 1, 1), t.block_n, P.batch * P.heads_kv * row_blocks,
                      device.sm_count * _blocks_per_sm(spec, kernel), out_shape, (P.batch, P.heads_q, P.q_len),
                      n_rows, D, P.dtype)
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan
    return plan


def run_decode(P, pool, dq, dk, dv, tables, max_len: int, dalibi, s, return_lse: bool, scales=(None, None)):
    """Launch decode (and the split combine) for a validated problem.

    Parameters
    ----------
    P : DecodeProblem
    pool : PoolInfo
    dq, dk, dv : DeviceArray
    tables : (indices, indptr or None, table_stride, kv_len) with DeviceArray int32 arrays
    max_len : int
        The longest sequence (host value) for the split heuristic.
    dalibi : DeviceArray or None
    s : Stream
    return_lse : bool
    scales : (DeviceArray, DeviceArray)
        The K and V scale pools of an 8-bit cache; (None, None) for 16-bit ones.

    Returns
    -------
    (out, lse or None) as DeviceArrays
    """
    device = dq.device
    plan = decode_plan(P, pool, device)
    if P.num_splits:
        splits = P.num_splits
    else:
        visible = max_len if P.window[0] < 0 else min(max_len, P.window[0] + P.q_len + plan.block_n)
        splits = _num_splits(plan.units, -(-visible // plan.block_n), plan.slots)
    dt, n_rows, D = plan.dtype, plan.n_rows, plan.head_dim
    out = allocate(device, s, plan.out_shape, dt, _c_strides(plan.out_shape, dt.itemsize),
                   _c_strides(plan.out_shape, 1), n_rows * D * dt.itemsize)
    lse = None
    if return_lse:
        lse = allocate(device, s, plan.lse_shape, _F32, _c_strides(plan.lse_shape, 4), _c_strides(plan.lse_shape, 1),
                       4 * n_rows)
    part = None
    if splits > 1:  # one block for both partials: one allocation, one free
        part = allocate(device, s, (splits * n_rows * (D + 1),), _F32, (4,), (1,), 4 * splits * n_rows * (D + 1))
        lpart_ptr = part.ptr + 4 * splits * n_rows * D
    indices, indptr, table_stride, kv_len = tables
    params = plan.packer.pack(dq.ptr, dk.ptr, dv.ptr, out.ptr, lse.ptr if lse is not None else 0,
                              part.ptr if part is not None else 0, lpart_ptr if part is not None else 0,
                              indices.ptr, indptr.ptr if indptr is not None else 0, kv_len.ptr,
                              dalibi.ptr if dalibi is not None else 0,
                              *(a.ptr if a is not None else 0 for a in scales), splits, table_stride)
    launch(plan.kernel, (splits, *plan.grid_yz), plan.block, plan.shared_bytes, s, params)
    if splits > 1:
        cparams = plan.cpacker.pack(part.ptr, lpart_ptr, part.ptr + 4 * n_rows * D, lpart_ptr + 4 * n_rows, out.ptr,
                                    lse.ptr if lse is not None else 0, splits - 1)
        launch(plan.ckernel, plan.cgrid, plan.cblock, 0, s, cparams)
    for a in (dq, dk, dv, indices, indptr, kv_len, dalibi, *scales):
        owner = a.owner if a is not None else None
        if type(owner) is Allocation and owner.stream is not s:
            owner.record_stream(s)  # the block's free must wait for this stream's use
    return out, lse


def _upload_i32(x, host: np.ndarray, device, s):
    """A device int32 array: ``x`` itself when it is one with a contiguous last axis, else ``host``
    (its validated host copy) copied up."""
    if x is not None and not isinstance(x, np.ndarray):
        d = asarray(x, stream=s)
        if d.elem_strides[-1] == 1 or d.shape[-1] <= 1:
            return d
    return asarray(np.ascontiguousarray(host, dtype=np.int32), device=device, stream=s)


def _alibi(alibi_slopes, P, device, s):
    """ALiBi slopes on the device: attention's upload (float32, contiguous, same-device check)."""
    return upload_extras(P, None, alibi_slopes, device, s)[1]


def _finish(q, out, lse, return_lse: bool, s):
    """Host queries get host results; device queries get DeviceArrays."""
    if isinstance(q, np.ndarray):
        out = out.numpy(s)
        lse = lse.numpy(s) if lse is not None else None
    return (out, lse) if return_lse else out


def paged_decode(q, k_pool, v_pool, *, block_table=None, seq_lens=None, indptr=None, indices=None,
                 last_page_len=None, layout="nhd", causal=True, window=None, softcap=None, alibi_slopes=None,
                 scale=None, num_splits=None, return_lse=False, stream=None):
    """Decode attention over K/V page pools you manage yourself (FlashInfer / vLLM page tables).

    Parameters
    ----------
    q : array, shape (batch, q_len, heads_q, head_dim)
        New query tokens (float16/bfloat16, the pools' dtype), NumPy or device. Query token ``i``
        of a sequence of ``n`` cached tokens sits at position ``n - q_len + i``.
    k_pool, v_pool : device arrays
        ``layout="nhd"``: (num_pages, page_size, heads_kv, head_dim); ``"hnd"``:
        (num_pages, heads_kv, page_size, head_dim). Read in place through their strides (head_dim
        contiguous, other strides multiples of 8 elements). Any page size.
    block_table, seq_lens : int32 arrays (batch, max_pages) and (batch,)
        vLLM's form: sequence ``b`` holds ``seq_lens[b]`` tokens, token ``t`` in page
        ``block_table[b, t // page_size]``. Entries past a sequence's pages are ignored.
    indptr, indices, last_page_len : int32 arrays (batch + 1,), (nnz,), (batch,)
        FlashInfer's CSR form, instead of ``block_table``: sequence ``b`` owns pages
        ``indices[indptr[b]:indptr[b+1]]``, its last page holding ``last_page_len[b]`` tokens.
    layout : {"nhd", "hnd"}
    causal : bool or {"bottom_right", "top_left"}, default True
        Causal among the new tokens, bottom-right against the cache (speculative verification).
    window : (int, int), optional
        Sliding window ``(left, right)`` around the bottom-right diagonal; -1 unbounded.
    softcap : float, optional
    alibi_slopes : array, shape (heads_q,) or (batch, heads_q), optional
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    num_splits : int, optional
        Key splits per sequence (flash-decoding); default from the SM count and the work size.
    return_lse : bool
        Also return the natural-log LSE, float32 (batch, heads_q, q_len).
    stream : optional

    Returns
    -------
    out : array (batch, q_len, heads_q, head_dim), q's dtype; NumPy for NumPy q
    lse : array, only with ``return_lse``

    Notes
    -----
    Every page index a sequence uses is range-checked before launch; device page tables are
    copied to the host for that check (a few bytes, one synchronisation).
    """
    pool = check_pools(k_pool, v_pool, layout)
    P = check_query(q, pool, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    scale=scale, num_splits=num_splits)
    dk = asarray(k_pool, stream=stream)
    device = dk.device
    s = as_stream(stream, device)
    device.activate()
    fetch = lambda x: asarray(x, stream=s).numpy(s)  # noqa: E731 - a device table's values for the range check
    if (block_table is None) == (indptr is None):
        raise ValueError("block_table/indptr: pass exactly one page table: block_table with seq_lens, or "
                         "indptr with indices and last_page_len")
    if block_table is not None:
        if indices is not None or last_page_len is not None:
            raise ValueError("indices/last_page_len: these belong to the CSR form; not with block_table")
        if seq_lens is None:
            raise ValueError("seq_lens: required with block_table")
        table, lens, ti, _ = check_block_table(block_table, seq_lens, P.batch, pool, fetch)
        d_table = _upload_i32(block_table, table, device, s)
        tables = (d_table, None, d_table.elem_strides[0], _upload_i32(seq_lens, lens, device, s))
        max_len = int(lens.max(initial=0))
    else:
        if indices is None or last_page_len is None or seq_lens is not None:
            raise ValueError("indices/last_page_len: the CSR form needs indptr, indices and last_page_len "
                             "(and no seq_lens)")
        ip, ix, kv_len = check_csr(indptr, indices, last_page_len, P.batch, pool, fetch)
        tables = (_upload_i32(indices, ix, device, s), _upload_i32(indptr, ip, device, s), 0,
                  _upload_i32(None, kv_len, device, s))
        max_len = int(kv_len.max(initial=0))
    dq = asarray(q, device=device, stream=s)
    dv = asarray(v_pool, stream=s)
    if not (dq.device is dk.device is dv.device):
        raise ValueError("q, k_pool, v_pool: expected arrays on one device")
    out, lse = run_decode(P, pool, dq, dk, dv, tables, max_len, _alibi(alibi_slopes, P, device, s), s, return_lse)
    return _finish(q, out, lse, return_lse, s)


def decode(q, cache, seq_ids, *, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None,
           num_splits=None, return_lse=False, stream=None):
    """Decode attention of new query tokens over the sequences of a :class:`pyattn.PagedKVCache`.

    Parameters
    ----------
    q : array, shape (batch, q_len, heads_q, head_dim)
        The queries of ``len(seq_ids)`` sequences, the cache's dtype, NumPy or device. Append the
        new tokens' K/V to the cache first: query token ``i`` sits at position
        ``length - q_len + i`` of its sequence.
    cache : PagedKVCache
    seq_ids : sequence of int
        One live sequence per batch row, no repeats.
    causal, window, softcap, alibi_slopes, scale, num_splits, return_lse, stream
        As in :func:`paged_decode`.

    Returns
    -------
    out : array (batch, q_len, heads_q, head_dim); NumPy for NumPy q
    lse : array (batch, heads_q, q_len), float32, only with ``return_lse``
    """
    from ..paged.cache import PagedKVCache

    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a pyattn.PagedKVCache, got {type(cache).__name__}")
    seq_ids = list(seq_ids) if not isinstance(seq_ids, (int, np.integer)) else [seq_ids]
    pool = cache.pool_info
    P = check_query(q, pool, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    scale=scale, num_splits=num_splits)
    if len(seq_ids) != P.batch:
        raise ValueError(f"seq_ids: expected {P.batch} ids (q's batch), got {len(seq_ids)}")
    s = as_stream(stream, cache.device)
    cache.device.activate()
    tables, max_len = cache.device_tables(seq_ids, s)
    dq = asarray(q, device=cache.device, stream=s)
    if dq.device is not cache.device:
        raise ValueError(f"q: expected an array on the cache's device {cache.device.ordinal}, got {dq.device.ordinal}")
    scales = (cache.k_scale, cache.v_scale) if cache.kv else (None, None)
    out, lse = run_decode(P, pool, dq, cache.k, cache.v, tables, max_len, _alibi(alibi_slopes, P, cache.device, s), s,
                          return_lse, scales)
    return _finish(q, out, lse, return_lse, s)

"""``pyattn.decode`` and ``pyattn.paged_decode``: attention of new query tokens over a paged KV cache.

Flash-decoding: one block per (split, kv head, row block, sequence) reads its keys once for the
whole GQA group; when batch x kv heads is too small to fill the GPU, each sequence's keys are
split across blocks and the fp32 partials merged by LSE (``merge_states<float, T>``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from ..array import c_strides
from ..interop.inputs import read, read_optional
from ..interop.streams import order_inputs
from ..kernels.registry import generation, get_kernel
from ..kernels.specs import DTYPES, HEAD_DIM_BUCKETS, KV_HEAD_DIM_BUCKETS, KernelSpec, decode_max_q_tiles
from ..paged.cache import PagedKVCache
from ..pipeline import host
from ..pipeline.device import fetch_values, finish, output, start
from ..pipeline.host import upload
from ..pipeline.plans import Memo, get_plan, ptx_requested, signature
from ..runtime.launch import launch
from ..runtime.stream import check_stream_arg
from ..validate.options import check_bool
from ..validate.paged import MAX_SPLITS, check_block_table, check_csr, check_pools, check_query, check_table_form

__all__ = ["decode", "paged_decode", "choose_num_splits"]

_LOG2E = 1.4426950408889634
_F32 = np.dtype(np.float32)
_memo = Memo()


@functools.lru_cache(maxsize=256)
def _specs(dtype: str, head_dim: int, arch: str, ptx: bool, rows: int, softcap: bool, alibi: bool,
           kv: str = "", generation: int = 0) -> tuple:
    """(decode spec, combine spec) for ``rows`` = group * q_len query rows per kv head; ``kv``: the
    cache's 8-bit kind ("" for 16-bit caches); ``generation``: the registry's, so that a tile table
    replaced by ``override_tiles`` is read again."""
    tag = DTYPES[dtype][0]
    bucket = next(b for b in (KV_HEAD_DIM_BUCKETS if kv else HEAD_DIM_BUCKETS) if b >= head_dim)
    q_tiles = min(-(-rows // 16), decode_max_q_tiles(arch, bucket, kv))
    return (KernelSpec("attn_decode", tag, bucket, arch, ptx, softcap=softcap, alibi=alibi, q_tiles=q_tiles, kv=kv),
            KernelSpec("decode_combine", tag, next(b for b in HEAD_DIM_BUCKETS if b >= head_dim), arch, ptx))


def _blocks_per_sm(spec, kernel) -> int:
    """Concurrent blocks of ``spec`` per SM: registers bound the 8-bit kernels (shared memory alone
    said 3 where 2 fit, and the split choice then planned waves that did not exist)."""
    return max(1, kernel.max_active_blocks(spec.threads, spec.shared_bytes))




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


def _build(P, device) -> DecodePlan:
    """The plan of decode problem ``P`` (its pools included) on ``device``."""
    pool = P.pool
    rows = P.group * P.q_len
    kv = pool.kv
    spec, cspec = _specs(P.dtype.name, P.head_dim, device.arch, ptx_requested(), rows, P.softcap > 0,
                         P.alibi is not None, kv, generation())
    kernel, ckernel = get_kernel(spec, device), get_kernel(cspec, device)
    t = spec.tiles
    row_blocks = -(-rows // t.block_m)
    if P.heads_kv * row_blocks > 65535:
        raise ValueError(f"q: heads_kv x row blocks must be <= 65535, got {P.heads_kv} x {row_blocks}")
    out_shape = (P.batch, P.q_len, P.heads_q, P.head_dim)
    qs, os_ = P.q_strides, c_strides(out_shape)
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
    return plan


def run_decode(P, device, dq, dk, dv, tables, max_len: int, alibi_ptr: int, s, return_lse: bool,
               scales=(None, None)):
    """Launch decode (and the split combine) for a validated problem.

    Parameters
    ----------
    P : DecodeProblem
    device : Device
    dq, dk, dv : device arrays (anything with ``.ptr``)
    tables : (indices, indptr or None, table_stride, kv_len): device int32 arrays (``.ptr``)
    max_len : int
        The longest sequence (host value) for the split heuristic.
    alibi_ptr : int
        Device float32 ALiBi slopes, or 0.
    s : Stream
    return_lse : bool
    scales : (DeviceArray, DeviceArray)
        The K and V scale pools of an 8-bit cache; (None, None) for 16-bit ones.

    Returns
    -------
    (out, lse or None) as DeviceArrays
    """
    plan = get_plan(_build, P, device)
    if P.num_splits:
        splits = P.num_splits
    else:
        visible = max_len if P.window[0] < 0 else min(max_len, P.window[0] + P.q_len + plan.block_n)
        splits = _num_splits(plan.units, -(-visible // plan.block_n), plan.slots)
    dt, n_rows, D = plan.dtype, plan.n_rows, plan.head_dim
    out = output(device, s, plan.out_shape, dt)
    lse = output(device, s, plan.lse_shape, _F32) if return_lse else None
    part = None
    if splits > 1:  # one block for both partials: one allocation, one free
        part = output(device, s, (splits * n_rows * (D + 1),), _F32)
        lpart_ptr = part.ptr + 4 * splits * n_rows * D
    indices, indptr, table_stride, kv_len = tables
    params = plan.packer.pack(dq.ptr, dk.ptr, dv.ptr, out.ptr, lse.ptr if lse is not None else 0,
                              part.ptr if part is not None else 0, lpart_ptr if part is not None else 0,
                              indices.ptr, indptr.ptr if indptr is not None else 0, kv_len.ptr,
                              alibi_ptr,
                              *(a.ptr if a is not None else 0 for a in scales), splits, table_stride)
    launch(plan.kernel, (splits, *plan.grid_yz), plan.block, plan.shared_bytes, s, params)
    if splits > 1:
        cparams = plan.cpacker.pack(part.ptr, lpart_ptr, part.ptr + 4 * n_rows * D, lpart_ptr + 4 * n_rows, out.ptr,
                                    lse.ptr if lse is not None else 0, splits - 1)
        launch(plan.ckernel, plan.cgrid, plan.cblock, 0, s, cparams)
    return out, lse


def choose_num_splits(units: int, max_tiles: int, slots: int) -> int:
    """Split count for ``units`` independent blocks over ``slots`` concurrent block slots (SMs x
    blocks per SM) when the longest sequence has ``max_tiles`` key tiles.

    Every block of a decode does the same work, so the grid runs in waves: the smallest split
    count whose last-wave efficiency (busy fraction of the block slots) is within 85% of the best
    (FlashAttention's rule, applied past one wave too: 512 blocks on 396 slots run 65% busy
    unsplit). At least 2 key tiles per split keep the combine cheap next to the attention.
    """
    limit = max(1, min(MAX_SPLITS, max_tiles // 2))
    effs = []
    for s in range(1, limit + 1):
        waves = units * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    return next(s for s, e in enumerate(effs, 1) if e >= 0.85 * best)


_num_splits = functools.lru_cache(maxsize=4096)(choose_num_splits)


def _host_q(P, q_arg, alibi, stream, launch_fn, return_lse):
    """NumPy queries: upload q (and host ALiBi slopes), decode, and copy the results back."""
    ins = [q_arg.obj, np.asarray(alibi.obj, np.float32) if alibi is not None and not alibi.on_device else None]

    def run(dev, s):
        dq, dal = dev
        if alibi is not None and alibi.on_device:
            order_inputs(s, dq.device, [alibi])
        return launch_fn(dq.device, s, dq, dal.ptr if dal is not None else (alibi.ptr if alibi else 0))

    o, lse = host.call(run, ins, [], stream)
    return (o, lse) if return_lse else o


def _alibi_ptr(alibi, device, s):
    """Device slopes read in place; host ones uploaded as float32. Returns (pointer, keep-alive)."""
    if alibi is None:
        return 0, None
    if alibi.on_device:
        return alibi.ptr, None
    (d,) = upload([np.asarray(alibi.obj, np.float32)], device, s)
    return d.ptr, d


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
    copied to the host for that check, after every other check (a few bytes, one synchronisation:
    a decode loop should use :func:`decode` on a :class:`pyattn.PagedKVCache`, whose tables are
    known valid).
    """
    check_stream_arg(stream)
    params = locals()
    names = ("q", "k_pool", "v_pool", "block_table", "seq_lens", "indptr", "indices", "last_page_len",
             "alibi_slopes")
    a = {n: (read if n in ("q", "k_pool", "v_pool") else read_optional)(n, params[n]) for n in names}
    return_lse = check_bool("return_lse", return_lse)
    pool = check_pools(a["k_pool"], a["v_pool"], layout)
    P = check_query(a["q"], pool, causal=causal, window=window, softcap=softcap, alibi_slopes=a["alibi_slopes"],
                    scale=scale, num_splits=num_splits)
    check_table_form(block_table, seq_lens, indptr, indices, last_page_len)
    fetch = fetch_values  # a device table's values, after every metadata check (see validate.paged)
    if block_table is not None:
        table, lens = check_block_table(a["block_table"], a["seq_lens"], P.batch, pool, fetch)
        host_tables = (table, None, lens)
        dev_tables = (a["block_table"], None, a["seq_lens"])
        max_len = int(lens.max(initial=0))
    else:
        ip, ix, kv_len = check_csr(a["indptr"], a["indices"], a["last_page_len"], P.batch, pool, fetch)
        host_tables = (ix, ip, kv_len)
        dev_tables = (a["indices"], a["indptr"], None)  # kv_len is derived on the host: always uploaded
        max_len = int(kv_len.max(initial=0))

    def launch_fn(device, s, dq, alibi_ptr):
        on_dev = [t if t is not None and t.on_device else None for t in dev_tables]
        ups = upload([None if d is not None or h is None else np.ascontiguousarray(h, np.int32)
                      for d, h in zip(on_dev, host_tables)], device, s)
        idx, iptr, lens = (d if d is not None else u for d, u in zip(on_dev, ups))
        # A block table's row stride in elements: the device table's own, or the uploaded copy's width.
        stride = 0 if block_table is None else (on_dev[0].strides[0] if on_dev[0] is not None else table.shape[1])
        return run_decode(P, device, dq, kp, vp, (idx, iptr, stride, lens), max_len, alibi_ptr, s, return_lse)

    if not P.q_on_device:
        device, s, (kp, vp, *tabs) = start(stream, [a["k_pool"], a["v_pool"], *dev_tables])
        dev_tables = tuple(tabs)
        return _host_q(P, a["q"], a["alibi_slopes"], s, launch_fn, return_lse)
    device, s, (dq, kp, vp, dal, *tabs) = start(stream, [a["q"], a["k_pool"], a["v_pool"], a["alibi_slopes"],
                                                         *dev_tables])
    dev_tables = tuple(tabs)
    alibi_ptr, keep = _alibi_ptr(dal, device, s)
    out, lse = launch_fn(device, s, dq, alibi_ptr)
    finish(s, [dq, kp, vp, dal, *tabs])
    return (out, lse) if return_lse else out


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
    params = locals()
    check_stream_arg(stream)
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a pyattn.PagedKVCache, got {type(cache).__name__}")
    ids = cache.check_ids(seq_ids)
    params["seq_ids"] = len(ids)  # the problem depends on how many sequences, not which
    args = {"q": read("q", q), "alibi_slopes": read_optional("alibi_slopes", alibi_slopes)}
    key = signature(params, args)
    P = _memo.get(key)
    if P is None:
        check_bool("return_lse", return_lse)
        P = check_query(args["q"], cache.pool_info, causal=causal, window=window, softcap=softcap,
                        alibi_slopes=args["alibi_slopes"], scale=scale, num_splits=num_splits)
        if len(ids) != P.batch:
            raise ValueError(f"seq_ids: expected {P.batch} ids (q's batch), got {len(ids)}")
        if args["q"].on_device and args["q"].ordinal not in (None, cache.device.ordinal):
            raise ValueError(f"q: expected an array on the cache's device {cache.device.ordinal}, "
                             f"got device {args['q'].ordinal}")
        _memo.put(key, P)
    scales = (cache.k_scale, cache.v_scale) if cache.kv else (None, None)

    def launch_fn(device, s, dq, alibi_ptr):
        cache.order(s)
        tables, max_len = cache.device_tables(ids, s)
        return run_decode(P, device, dq, cache.k, cache.v, tables, max_len, alibi_ptr, s, return_lse, scales)

    if not P.q_on_device:
        return _host_q(P, args["q"], args["alibi_slopes"], stream, launch_fn, return_lse)
    device, s, (dq, dal) = start(stream, [args["q"], args["alibi_slopes"]])
    alibi_ptr, keep = _alibi_ptr(dal, device, s)
    out, lse = launch_fn(device, s, dq, alibi_ptr)
    finish(s, (dq, dal))
    return (out, lse) if return_lse else out

"""``pyattn.decode`` and ``pyattn.paged_decode``: attention of new query tokens over a paged KV cache.

The public functions: arguments read and validated (a repeat ``decode`` on a DeviceArray or torch
q is found by its quick key and reads only pointers and producer streams, as ``attention`` does),
then the plan and launches of :mod:`._decode`.
"""

from __future__ import annotations

import numpy as np

from ..interop.inputs import read_args
from ..interop.quick import quick_key
from ..interop.streams import order_inputs
from ..paged.book import longest_first
from ..paged.cache import PagedKVCache
from ..pipeline import host
from ..pipeline.device import begin, bind, fetch_values, finish, start
from ..pipeline.host import upload
from ..pipeline.plans import Memo, signature
from ..runtime.device import keeps_context
from ..runtime.stream import check_stream_arg, refuse_capture
from ..validate.options import check_bool
from ..validate.paged import (check_block_table, check_csr, check_max_seqlen, check_pool_call_addresses, check_pools,
                              check_q_address, check_query, check_table_form)
from ._decode import Ptr, choose_num_splits, keyed_splits, run_decode

__all__ = ["decode", "paged_decode", "choose_num_splits", "keyed_splits", "run_decode"]

_memo = Memo()  # signature -> problem
_quick = Memo()  # quick key -> pipeline.device.Bound
_paged_quick = Memo()  # quick key -> _PagedHit of a paged_decode under max_seqlen on device arrays


class _PagedHit:
    """What a repeat ``paged_decode`` under ``max_seqlen`` reuses: the bound problem, the block
    table's row stride (elements) and the bound."""

    __slots__ = ("bound", "stride", "max_len")

    def __init__(self, bound, stride: int, max_len: int):
        self.bound, self.stride, self.max_len = bound, stride, max_len


def _cache_tables(cache, ids, s) -> tuple:
    """The cache's decode tables, max and total length; when every sequence of the batch has the
    same length (a batch of one always), the length goes to the kernel by value: each block then
    starts without a dependent read of its length (H200, B1 x 4k bf16 page 16: BENCHMARKS.md,
    thirty-eighth session). The cache's host mirror holds what its device table holds."""
    tables, max_len, total_len = cache.decode_tables(ids, s)
    if max_len * len(ids) == total_len:
        tables = (*tables[:3], max_len, tables[4])
    return tables, max_len, total_len


def _check(P, ptrs) -> None:
    """The per-call address check of a repeat decode (q's; the slopes are read as float32 words)."""
    check_q_address(ptrs[0])


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


@keeps_context
def paged_decode(q, k_pool, v_pool, *, block_table=None, seq_lens=None, indptr=None, indices=None,
                 last_page_len=None, layout="nhd", causal=True, window=None, softcap=None, alibi_slopes=None,
                 scale=None, num_splits=None, return_lse=False, max_seqlen=None, stream=None):
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
    max_seqlen : int, optional
        With a device ``block_table`` and ``seq_lens``: a host bound on the lengths, at most the
        table's ``max_pages * page_size``. The tables are then not copied back for a range check:
        the kernel reads them as they are when it runs, each length clamped into ``[0,
        max_seqlen]`` and each page entry into the pool, and the splits are planned for
        ``max_seqlen``. This is how a decode step is captured in a CUDA graph (a copy-back cannot
        be captured) and replayed over tables that change, as vLLM's and FlashInfer's are. Bad
        entries then read the wrong pages instead of being refused.
    stream : optional

    Returns
    -------
    out : array (batch, q_len, heads_q, head_dim), q's dtype; NumPy for NumPy q
    lse : array, only with ``return_lse``

    Notes
    -----
    Every page index a sequence uses is range-checked before launch (``max_seqlen`` aside); device
    page tables are copied to the host for that check, after every other check (a few bytes, one
    synchronisation: a decode loop should use :func:`decode` on a :class:`pyattn.PagedKVCache`,
    whose tables are known valid, or ``max_seqlen``).
    """
    check_stream_arg(stream)
    params = locals()
    reads, qkey = {}, None
    if max_seqlen is not None:  # device tables read unchecked: a repeat call reads only the pointers
        qkey = quick_key(params, reads)
        hit = _paged_quick.get(qkey) if qkey is not None else None
        if hit is not None:
            return _paged_repeat(hit, (q, k_pool, v_pool, alibi_slopes, block_table, seq_lens), stream, return_lse,
                                 reads)
    names = ("q", "k_pool", "v_pool", "block_table", "seq_lens", "indptr", "indices", "last_page_len",
             "alibi_slopes")
    a = read_args(params, names, ("q", "k_pool", "v_pool"))
    return_lse = check_bool("return_lse", return_lse)
    pool = check_pools(a["k_pool"], a["v_pool"], layout)
    P = check_query(a["q"], pool, causal=causal, window=window, softcap=softcap, alibi_slopes=a["alibi_slopes"],
                    scale=scale, num_splits=num_splits)
    check_table_form(block_table, seq_lens, indptr, indices, last_page_len)
    trusted = max_seqlen is not None
    if trusted:  # device tables read unchecked under a host bound (the graph-captured decode step)
        if block_table is None:
            raise ValueError("max_seqlen: takes the block_table form (the CSR form's lengths are derived on the host)")
        if not a["block_table"].on_device:
            raise ValueError("max_seqlen: bounds device tables read unchecked, so block_table must then be a "
                             "device int32 array, got a host one")
        shape = a["block_table"].shape
        max_len = check_max_seqlen(max_seqlen, a["seq_lens"], "seq_lens",
                                   shape[1] * pool.page_size if len(shape) == 2 else 0)
    fetch = None if trusted else fetch_values  # a device table's values, after every metadata check (validate.paged)
    if block_table is not None:
        table, lens = check_block_table(a["block_table"], a["seq_lens"], P.batch, pool, fetch)
        host_tables = (table, None, lens)
        dev_tables = (a["block_table"], None, a["seq_lens"], None)
    else:
        ip, ix, lens = check_csr(a["indptr"], a["indices"], a["last_page_len"], P.batch, pool, fetch)
        host_tables = (ix, ip, lens)
        dev_tables = (a["indices"], a["indptr"], None, None)  # the lengths are derived on the host: uploaded
    if trusted:  # no host order (the batch's own) and no host lengths: the splits of an even batch of max_len
        host_tables, total_len = (None, None, None, None), None
    else:  # the batch order (longest first) and the lengths the split choice reads, from the host lengths
        host_tables += (longest_first(lens),)
        max_len, total_len = int(lens.max(initial=0)), int(lens.sum(dtype=np.int64))

    def launch_fn(device, s, dq, alibi_ptr):
        on_dev = [t if t is not None and t.on_device else None for t in dev_tables]
        sent = [None if d is not None or h is None else np.ascontiguousarray(h, np.int32)
                for d, h in zip(on_dev, host_tables)]
        ups = upload(sent, device, s) if any(h is not None for h in sent) else sent
        idx, iptr, lens, order = (d if d is not None else u for d, u in zip(on_dev, ups))
        # A block table's row stride in elements: the device table's own, or the uploaded copy's width.
        stride = 0 if block_table is None else (on_dev[0].strides[0] if on_dev[0] is not None else table.shape[1])
        return run_decode(P, device, dq.ptr, kp.ptr, vp.ptr, (idx, iptr, stride, lens, order), max_len, alibi_ptr, s,
                          return_lse, total_len=total_len)

    if not P.q_on_device:
        device, s, (kp, vp, *tabs) = start(stream, [a["k_pool"], a["v_pool"], *dev_tables])
        dev_tables = tuple(tabs)
        return _host_q(P, a["q"], a["alibi_slopes"], s, launch_fn, return_lse)
    device, s, (dq, kp, vp, dal, *tabs) = start(stream, [a["q"], a["k_pool"], a["v_pool"], a["alibi_slopes"],
                                                         *dev_tables])
    if not trusted and any(t is not None for t in tabs):
        refuse_capture(s, "the device page tables were read on the host for their range check, and a replay "
                          "would keep what was planned from them: pass max_seqlen= to read them on the device")
    if qkey is not None:  # (trusted: the block table's and the lengths' pointers read per call)
        bound = bind(P, device, [a[n] for n in ("q", "k_pool", "v_pool", "alibi_slopes", "block_table", "seq_lens")],
                     check_pool_call_addresses)
        if bound is not None:
            _paged_quick.put(qkey, _PagedHit(bound, a["block_table"].strides[0], max_len))
    dev_tables = tuple(tabs)
    alibi_ptr, keep = _alibi_ptr(dal, device, s)
    out, lse = launch_fn(device, s, dq, alibi_ptr)
    finish(s, [dq, kp, vp, dal, *tabs])
    return (out, lse) if return_lse else out


def _paged_repeat(hit, arrays, stream, return_lse, reads):
    """A ``paged_decode`` under ``max_seqlen`` whose quick key was seen: pointers and producers read,
    then the launch over the block table and lengths as the kernel finds them."""
    P, device = hit.bound.problem, hit.bound.device
    s, (q, kp, vp, alibi, table, lens) = begin(hit.bound, stream, arrays, reads)
    out, lse = run_decode(P, device, q, kp, vp, (Ptr(table), None, hit.stride, Ptr(lens), None), hit.max_len, alibi,
                          s, return_lse)
    return (out, lse) if return_lse else out


@keeps_context
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
    params = locals()  # first thing: the parameters and nothing else
    check_stream_arg(stream)
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a pyattn.PagedKVCache, got {type(cache).__name__}")
    ids = cache.check_ids(seq_ids)  # every call: which sequences are live is not part of any key
    # The problem depends on the cache's layout and device and on how many sequences, not which (a
    # copy: the frame's own locals() must not change, and keys must not hold the cache alive).
    keyed = dict(params, cache=cache.layout_key, seq_ids=len(ids))
    reads = {}  # (the pointers and producers of CUDA array interfaces, read with the key)
    qkey = quick_key(keyed, reads)
    bound = _quick.get(qkey)
    if bound is not None:  # a repeat call: only pointers and producer streams are read
        return _repeat(bound, cache, ids, (q, alibi_slopes), stream, return_lse, reads)
    return _full(qkey, keyed, cache, ids, q, alibi_slopes, stream, return_lse)


def _full(qkey, keyed, cache, ids, q, alibi_slopes, stream, return_lse):
    """A decode read into Args: validated (or found by its signature), then run; binds its quick key."""
    args = read_args(keyed, ("q", "alibi_slopes"), ("q",))
    key = signature(keyed, args, host_ok=("q",))
    P = _memo.get(key)
    if P is None:
        check_bool("return_lse", return_lse)
        P = check_query(args["q"], cache.pool_info, causal=keyed["causal"], window=keyed["window"],
                        softcap=keyed["softcap"], alibi_slopes=args["alibi_slopes"], scale=keyed["scale"],
                        num_splits=keyed["num_splits"])
        if len(ids) != P.batch:
            raise ValueError(f"seq_ids: expected {P.batch} ids (q's batch), got {len(ids)}")
        if args["q"].on_device and args["q"].ordinal not in (None, cache.device.ordinal):
            raise ValueError(f"q: expected an array on the cache's device {cache.device.ordinal}, "
                             f"got device {args['q'].ordinal}")
        _memo.put(key, P)
    elif P.q_on_device:
        check_q_address(args["q"].ptr)
    scales = (cache.k_scale.ptr, cache.v_scale.ptr) if cache.kv else (0, 0)

    def launch_fn(device, s, dq, alibi_ptr):
        capture = cache.order(s)
        tables, max_len, total_len = _cache_tables(cache, ids, s)
        return run_decode(P, device, dq.ptr, cache.k.ptr, cache.v.ptr, tables, max_len, alibi_ptr, s, return_lse,
                          scales, total_len, capture)

    if not P.q_on_device:
        return _host_q(P, args["q"], args["alibi_slopes"], stream, launch_fn, return_lse)
    ordered = [args["q"], args["alibi_slopes"]]
    device, s, (dq, dal) = start(stream, ordered)
    _quick.put(qkey, bind(P, device, ordered, _check))
    alibi_ptr, keep = _alibi_ptr(dal, device, s)
    out, lse = launch_fn(device, s, dq, alibi_ptr)
    finish(s, (dq, dal))
    return (out, lse) if return_lse else out


def _repeat(bound, cache, ids, arrays, stream, return_lse, reads):
    """A decode whose quick key was seen: q (and the slopes) are DeviceArrays, torch tensors or CUDA
    array interfaces on the cache's device; the cache's own order and tables are kept by the cache."""
    P, device = bound.problem, bound.device
    s, (q, alibi) = begin(bound, stream, arrays, reads)  # (q's address checked: _check)
    capture = cache.order(s)  # (0: refused otherwise)
    tables, max_len, total_len = _cache_tables(cache, ids, s)
    scales = (cache.k_scale.ptr, cache.v_scale.ptr) if cache.kv else (0, 0)
    out, lse = run_decode(P, device, q, cache.k.ptr, cache.v.ptr, tables, max_len, alibi, s, return_lse, scales,
                          total_len, capture)
    return (out, lse) if return_lse else out

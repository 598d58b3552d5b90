"""``pyattn.paged_prefill``: chunked prefill over K/V page pools the caller manages (vLLM / FlashInfer tables).

:func:`pyattn.prefill` serves a :class:`~pyattn.PagedKVCache`. An engine with its own cache manager
(vLLM's block manager, SGLang's, a FlashInfer-based one) holds raw page pools and page tables
instead, and its prefill and mixed prefill/decode steps need what FlashAttention's
``flash_attn_varlen_func(..., block_table=)`` and FlashInfer's ``BatchPrefillWithPagedKVCache``
give: each sequence's new tokens (a ragged batch, thousands a sequence) against everything its
pages hold, on the tensor-core prefill tiles. This is that call, on the same kernels as
:func:`pyattn.prefill` (the page table is the only difference), with the page tables in
:func:`pyattn.paged_decode`'s two forms.

By default the tables and a device ``cu_seqlens_q`` are copied back and range-checked before the
launch: one synchronisation, which costs an engine calling it once a layer its host/GPU overlap
(H200, 64 x 512 tokens: 4.94 ms wall a call against 4.49 for the same launch over a cache). With
``max_seqlen_k`` (and ``max_seqlen_q`` for a device ``cu_seqlens_q``), FlashAttention's varlen
contract, nothing is read on the host: the kernels clamp each sequence's rows (as varlen's offsets),
its length into ``[0, max_seqlen_k]`` and each page entry into the pool, so a CUDA graph captures the
call and wrong tables read wrong pages, never outside the arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..interop.inputs import read_args
from ..interop.quick import quick_key
from ..interop.streams import order_inputs
from ..pipeline import host
from ..pipeline.device import begin, bind, fetch_values, finish, start
from ..pipeline.host import upload
from ..pipeline.plans import Memo
from ..runtime.device import keeps_context
from ..runtime.stream import check_stream_arg, refuse_capture
from ..validate.options import check_bool, check_int
from ..validate.paged import (check_block_table, check_csr, check_max_seqlen, check_pool_call_addresses, check_pools,
                              check_table_form)
from ..validate.serving import check_cu_seqlens_q, check_new_tokens, check_prefill
from ._decode import Ptr
from ._prefill import KVTables, run_prefill

__all__ = ["paged_prefill"]

_quick = Memo()  # quick key -> _Hit of a bounded call on device arrays
# The arrays a repeat call reads, in the order bind / begin take them.
_REPEAT = ("q", "k_pool", "v_pool", "alibi_slopes", "block_table", "seq_lens", "cu_seqlens_q")
_NAMES = ("q", "k_pool", "v_pool", "cu_seqlens_q", "block_table", "seq_lens", "indptr", "indices", "last_page_len",
          "alibi_slopes")


class _Hit(NamedTuple):
    """What a repeat bounded call reuses: the bound problem, the host offsets (None: a device
    cu_seqlens_q, read per call), the grid's bound on the new tokens, the lengths' bound and the
    block table's row stride."""

    bound: object
    cu: object
    max_q: int
    max_len: int
    stride: int


def _repeat(hit: _Hit, arrays, stream, return_lse, reads):
    """A bounded call whose quick key was seen: pointers and producers read, then the launch over the
    tables as the kernel finds them."""
    P, device = hit.bound.problem, hit.bound.device
    s, (q, kp, vp, alibi, table, lens, cu) = begin(hit.bound, stream, arrays, reads)
    tables = (lambda s_: KVTables(kp, vp, Ptr(table), None, Ptr(lens), hit.max_len, hit.stride))  # noqa: E731
    out, lse = run_prefill(P, device, s, q, tables, Ptr(cu) if hit.cu is None else hit.cu, None, alibi, return_lse,
                           hit.max_q)
    return (out, lse) if return_lse else out


def _batch(a, block_table) -> tuple:
    """(sequences, the argument that says so): a block table's rows, or one fewer than indptr's entries."""
    t, name, rank = (a["block_table"], "block_table", 2) if block_table is not None else (a["indptr"], "indptr", 1)
    if len(t.shape) != rank:
        raise ValueError(f"{name}: expected {rank} dim(s), got shape {t.shape}")
    return (t.shape[0], name) if rank == 2 else (t.shape[0] - 1, name)


def _check_tables(a, block_table, P, max_seqlen_q, max_seqlen_k) -> tuple:
    """Every table's metadata, then cu_seqlens_q's, then (unless read unchecked) their values: the
    only device work before the launch. Returns ``(cu, max_q, tables)``: ``cu`` host int64 values or
    the device Arg read unchecked, ``max_q`` the grid's bound on the new tokens (0: from ``cu``),
    ``tables`` (indices, indptr, lengths) each a device Arg (read in place) or host int32 values
    (uploaded), then the lengths' bound and a block table's row stride."""
    pool, cu_arg, bt = P.pool, a["cu_seqlens_q"], block_table is not None
    if bt:
        check_block_table(a["block_table"], a["seq_lens"], P.batch, pool, None)
    else:
        check_csr(a["indptr"], a["indices"], a["last_page_len"], P.batch, pool, None)
    if cu_arg is not None:
        check_cu_seqlens_q(cu_arg, P.batch, P.total_q, None)
    unchecked = max_seqlen_k is not None
    max_q = 0
    if max_seqlen_q is not None:
        if not unchecked:
            raise ValueError("max_seqlen_q: bounds a device cu_seqlens_q read unchecked, which takes max_seqlen_k "
                             "(and device block_table / seq_lens) too")
        if cu_arg is None or not cu_arg.on_device:
            raise ValueError("max_seqlen_q: bounds a device cu_seqlens_q read unchecked; a host one (or 4-D q) is "
                             "read on the host")
        # (any int32 bound, as FlashAttention takes it: an engine passes its token budget. The grid
        # needs no more than q's rows.)
        max_q = min(check_int("max_seqlen_q", max_seqlen_q, 0, 2**31 - 1), P.total_q)
    if unchecked:  # FlashAttention's varlen contract: the tables are read as they are when the kernel runs
        if not bt:
            raise ValueError("max_seqlen_k: takes the block_table form (the CSR form's lengths are derived on "
                             "the host)")
        if not a["block_table"].on_device:
            raise ValueError("max_seqlen_k: bounds device tables read unchecked, so block_table must then be a "
                             "device int32 array, got a host one")
        # (any int32 bound, as max_seqlen_q; the lengths are clamped to the table's pages too)
        max_len = min(check_max_seqlen(max_seqlen_k, a["seq_lens"], "seq_lens", 2**31 - 1, "max_seqlen_k"),
                      a["block_table"].shape[1] * pool.page_size)
        if cu_arg is not None and cu_arg.on_device and max_seqlen_q is None:
            raise ValueError("max_seqlen_q: required with max_seqlen_k and a device cu_seqlens_q (the grid is "
                             "sized by it; the offsets are not read on the host)")
    rows = (a["block_table"].strides[0] if a["block_table"].on_device else a["block_table"].shape[1]) if bt else 0
    if rows * P.batch >= 2**31:
        raise ValueError(f"block_table: the kernel indexes its rows with 32-bit offsets, so rows x row stride "
                         f"must stay below 2**31, got {P.batch} x {rows}")
    fetch = fetch_values
    if bt:
        table, lens = (None, None) if unchecked else check_block_table(a["block_table"], a["seq_lens"], P.batch,
                                                                       pool, fetch)
        tables = (a["block_table"] if a["block_table"].on_device else table, None,
                  a["seq_lens"] if a["seq_lens"].on_device else lens)
    else:
        ip, ix, lens = check_csr(a["indptr"], a["indices"], a["last_page_len"], P.batch, pool, fetch)
        tables = (a["indices"] if a["indices"].on_device else ix, a["indptr"] if a["indptr"].on_device else ip, lens)
    if max_seqlen_q is not None:  # a device cu_seqlens_q read unchecked (max_q 0: nothing is launched)
        cu = cu_arg
    elif cu_arg is not None:
        cu = check_cu_seqlens_q(cu_arg, P.batch, P.total_q, fetch)
    else:
        cu = np.arange(P.batch + 1, dtype=np.int64) * (P.total_q // P.batch)
    if not unchecked:
        check_new_tokens(np.diff(cu), lens.astype(np.int64), False, pools=True)
        max_len = int(lens.max(initial=0))
    return cu, max_q, tables, max_len, rows


@keeps_context
def paged_prefill(q, k_pool, v_pool, cu_seqlens_q=None, *, block_table=None, seq_lens=None, indptr=None,
                  indices=None, last_page_len=None, layout="nhd", causal=True, window=None, softcap=None,
                  alibi_slopes=None, scale=None, num_splits=None, return_lse=False, max_seqlen_q=None,
                  max_seqlen_k=None, stream=None):
    """Attention of each sequence's new tokens over K/V page pools you manage (chunked prefill).

    Parameters
    ----------
    q : array
        ``(total, heads_q, head_dim)``: every sequence's new tokens packed, with ``cu_seqlens_q``;
        or ``(batch, t, heads_q, head_dim)``: ``t`` new tokens a sequence. The pools' dtype
        (float16 / bfloat16), NumPy or device (DeviceArray, torch, CuPy, ...).
    k_pool, v_pool : device arrays
        ``layout="nhd"``: (num_pages, page_size, heads_kv, head_dim); ``"hnd"``:
        (num_pages, heads_kv, page_size, head_dim); as :func:`pyattn.paged_decode` takes them, and
        holding the new tokens' K/V already: sequence ``b``'s ``n_b`` new tokens are the last
        ``n_b`` of its tokens.
    cu_seqlens_q : int32 array (batch + 1,), optional
        Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; starts at 0, is
        non-decreasing, ends at ``total``. Host or device.
    block_table, seq_lens : int32 arrays (batch, max_pages) and (batch,)
        vLLM's form: sequence ``b`` holds ``seq_lens[b]`` tokens (the new ones included), token
        ``t`` in page ``block_table[b, t // page_size]``; entries past its pages are ignored.
    indptr, indices, last_page_len : int32 arrays (batch + 1,), (nnz,), (batch,)
        FlashInfer's CSR form, instead of ``block_table``.
    layout : {"nhd", "hnd"}
    causal, window, softcap, alibi_slopes, scale, num_splits, return_lse
        As in :func:`pyattn.prefill` (a sequence's length is its ``seq_lens`` entry).
    max_seqlen_q, max_seqlen_k : int, optional
        Host bounds that make the call read its tables on the device only (no copy-back, no
        synchronisation; capturable in a CUDA graph), as FlashAttention's varlen call does.
        ``max_seqlen_k`` bounds device ``seq_lens`` (the block-table form only; above the table's
        ``max_pages * page_size`` it acts as that); ``max_seqlen_q`` bounds the new tokens of a
        device ``cu_seqlens_q`` (required with one; above q's rows it acts as that). Any int32
        bound is taken, as FlashAttention takes it (an engine may pass its token budget). The
        kernels clamp what they read to these bounds, to q's rows and to the pool's pages;
        nothing checks that each sequence's new tokens are among its ``seq_lens`` tokens (a query
        before its sequence's first key sees no key: zeros). Rows no clamped sequence covers are
        left unwritten.
    stream : optional

    Returns
    -------
    out : array, q's shape and dtype; NumPy for NumPy q
    lse : array, only with ``return_lse``

    Notes
    -----
    Equal to :func:`pyattn.prefill` on a cache holding the same pages, bitwise, and to
    :func:`pyattn.attention_varlen` over each sequence's gathered keys. Every page entry a sequence
    uses is range-checked before the launch (unless ``max_seqlen_k``): device tables and a device
    ``cu_seqlens_q`` are copied back for that, after every other check (a synchronisation, which
    no CUDA graph capture can hold). Pools are read in place; the slots of a sequence's last,
    partly filled page past its length may hold anything (NaN included). A repeat bounded call on
    device arrays (an engine's per-layer call) reuses the first one's validation and reads only the
    arrays' addresses and producers, as :func:`pyattn.attention` does.
    """
    check_stream_arg(stream)
    params = locals()
    reads, qkey = {}, None
    if max_seqlen_k is not None:  # tables read on the device: a repeat call reads only the pointers
        qkey = quick_key(params, reads)
        hit = _quick.get(qkey) if qkey is not None else None
        if hit is not None:
            return _repeat(hit, (q, k_pool, v_pool, alibi_slopes, block_table, seq_lens, cu_seqlens_q), stream,
                           return_lse, reads)
    return_lse = check_bool("return_lse", return_lse)
    a = read_args(params, _NAMES, ("q", "k_pool", "v_pool"))
    pool = check_pools(a["k_pool"], a["v_pool"], layout)
    check_table_form(block_table, seq_lens, indptr, indices, last_page_len)
    batch, seqs = _batch(a, block_table)
    P = check_prefill(a["q"], pool, batch, has_cu=cu_seqlens_q is not None, tree=False, seqs=seqs,
                      pools="k_pool", causal=causal, window=window, softcap=softcap,
                      alibi_slopes=a["alibi_slopes"], scale=scale, num_splits=num_splits)
    cu, max_q, tabs, max_len, stride = _check_tables(a, block_table, P, max_seqlen_q, max_seqlen_k)
    unread = not isinstance(cu, np.ndarray)  # a device cu_seqlens_q, read by the kernel only: ordered with the rest
    # Device tables are read in place, host ones (a CSR form's lengths among them) go up with the call.
    dev = [t if t is not None and not isinstance(t, np.ndarray) else None for t in tabs] + [cu if unread else None]
    sent = [np.ascontiguousarray(t, np.int32) if isinstance(t, np.ndarray) else None for t in tabs]

    def tables(device, kp, vp, on_dev):
        """run_prefill's tables: the device ones in place, the rest uploaded on the launch's stream."""
        def on_stream(s_):
            ups = upload(sent, device, s_) if any(x is not None for x in sent) else sent
            idx, iptr, lens = (d if d is not None else u for d, u in zip(on_dev, ups))
            return KVTables(kp.ptr, vp.ptr, idx, iptr, lens, max_len, stride)
        return on_stream

    alibi = a["alibi_slopes"]
    if not P.q_on_device:
        device, s, (kp, vp, *on_dev) = start(stream, [a["k_pool"], a["v_pool"], *dev])

        def run(d_in, s_):
            dq, dal = d_in
            if alibi is not None and alibi.on_device:
                order_inputs(s_, device, [alibi])
            al = dal.ptr if dal is not None else (alibi.ptr if alibi is not None else 0)
            return run_prefill(P, device, s_, dq.ptr, tables(device, kp, vp, on_dev[:3]), on_dev[3] if unread else cu,
                               None, al, return_lse, max_q)

        ins = [a["q"].obj, np.asarray(alibi.obj, np.float32) if alibi is not None and not alibi.on_device else None]
        o, lse = host.call(run, ins, [], s)
        finish(s, [kp, vp, *on_dev])
        return (o, lse) if return_lse else o
    device, s, (dq, kp, vp, dal, *on_dev) = start(stream, [a["q"], a["k_pool"], a["v_pool"], alibi, *dev])
    if qkey is not None:
        bound = bind(P, device, [a[n] for n in _REPEAT], check_pool_call_addresses)
        if bound is not None:
            _quick.put(qkey, _Hit(bound, None if unread else cu, max_q, max_len, stride))
    if max_seqlen_k is None and any(t is not None and t.on_device for t in (*dev, a["cu_seqlens_q"])):
        refuse_capture(s, "paged_prefill copied its device page tables (or cu_seqlens_q) back for their range "
                          "check, and a replay would keep what was planned from them: pass max_seqlen_k= (and "
                          "max_seqlen_q=) to have them read on the device")
    keep = None
    if dal is not None and not dal.on_device:
        (keep,) = upload([np.asarray(dal.obj, np.float32)], device, s)
    al = keep.ptr if keep is not None else (dal.ptr if dal is not None else 0)
    out, lse = run_prefill(P, device, s, dq.ptr, tables(device, kp, vp, on_dev[:3]), on_dev[3] if unread else cu,
                           None, al, return_lse, max_q)
    finish(s, [dq, kp, vp, dal, *on_dev])
    return (out, lse) if return_lse else out

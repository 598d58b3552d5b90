"""``pyattn.paged_prefill``: chunked prefill over K/V page pools the caller manages (vLLM / FlashInfer tables).

:func:`pyattn.prefill` serves a :class:`~pyattn.PagedKVCache`. An engine with its own cache manager
(vLLM's block manager, SGLang's, a FlashInfer-based one) holds raw page pools and page tables
instead, and its prefill and mixed prefill/decode steps need what FlashAttention's
``flash_attn_varlen_func(..., block_table=)`` and FlashInfer's ``BatchPrefillWithPagedKVCache``
give: each sequence's new tokens (a ragged batch, thousands a sequence) against everything its
pages hold, on the tensor-core prefill tiles. This is that call, on the same kernels as
:func:`pyattn.prefill` (the page table is the only difference), with the page tables in
:func:`pyattn.paged_decode`'s two forms.

The tables and a device ``cu_seqlens_q`` are copied back and range-checked before the launch (one
synchronisation; the chunk's own work is milliseconds). A form read unchecked on the device, for
graph capture as ``paged_decode(max_seqlen=)`` does, would need the prefill kernels to clamp their
page entries: not offered yet.
"""

from __future__ import annotations

import numpy as np

from ..interop.inputs import read_args
from ..interop.streams import order_inputs
from ..pipeline import host
from ..pipeline.device import fetch_values, finish, start
from ..pipeline.host import upload
from ..runtime.stream import check_stream_arg, refuse_capture
from ..validate.options import check_bool
from ..validate.paged import check_block_table, check_csr, check_pools, check_table_form
from ..validate.serving import check_cu_seqlens_q, check_new_tokens, check_prefill
from ._prefill import KVTables, run_prefill

__all__ = ["paged_prefill"]

_NAMES = ("q", "k_pool", "v_pool", "cu_seqlens_q", "block_table", "seq_lens", "indptr", "indices", "last_page_len",
          "alibi_slopes")
_TABLES = ("block_table", "seq_lens", "indptr", "indices", "last_page_len")


def _batch(a, block_table) -> tuple:
    """(sequences, the argument that says so): a block table's rows, or one fewer than indptr's entries."""
    t, name, rank = (a["block_table"], "block_table", 2) if block_table is not None else (a["indptr"], "indptr", 1)
    if len(t.shape) != rank:
        raise ValueError(f"{name}: expected {rank} dim(s), got shape {t.shape}")
    return (t.shape[0], name) if rank == 2 else (t.shape[0] - 1, name)


def _host_tables(a, block_table, P, fetch) -> tuple:
    """Every table's metadata, then cu_seqlens_q's, then their values (the only device work before the
    launch): ``(cu int64, lengths int32, host values of the table (kind, arrays))``."""
    pool, cu_arg = P.pool, a["cu_seqlens_q"]
    if block_table is not None:
        check_block_table(a["block_table"], a["seq_lens"], P.batch, pool, None)
    else:
        check_csr(a["indptr"], a["indices"], a["last_page_len"], P.batch, pool, None)
    if cu_arg is not None:
        check_cu_seqlens_q(cu_arg, P.batch, P.total_q, None)
    if block_table is not None:
        table, lens = check_block_table(a["block_table"], a["seq_lens"], P.batch, pool, fetch)
        rows = a["block_table"].strides[0] if a["block_table"].on_device else table.shape[1]
        if rows * P.batch >= 2**31:
            raise ValueError(f"block_table: the kernel indexes its rows with 32-bit offsets, so rows x row stride "
                             f"must stay below 2**31, got {P.batch} x {rows}")
        # vLLM's table as the kernel's CSR form: row b starts at b * (its row stride).
        csr = (table, np.arange(P.batch + 1, dtype=np.int64) * rows)
    else:
        ip, ix, lens = check_csr(a["indptr"], a["indices"], a["last_page_len"], P.batch, pool, fetch)
        csr = (ix, ip)
    if cu_arg is not None:
        cu = check_cu_seqlens_q(cu_arg, P.batch, P.total_q, fetch)
    else:
        cu = np.arange(P.batch + 1, dtype=np.int64) * (P.total_q // P.batch)
    check_new_tokens(np.diff(cu), lens.astype(np.int64), False, pools=True)
    return cu, lens, csr


def paged_prefill(q, k_pool, v_pool, cu_seqlens_q=None, *, block_table=None, seq_lens=None, indptr=None,
                  indices=None, last_page_len=None, layout="nhd", causal=True, window=None, softcap=None,
                  alibi_slopes=None, scale=None, num_splits=None, return_lse=False, stream=None):
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
    causal : bool or {"bottom_right", "top_left"}, default True
        Bottom-right: new token ``i`` of a sequence of ``L`` tokens sees keys ``0 .. L - n_b + i``.
    window : (int, int), optional
        Sliding window ``(left, right)`` around that diagonal; -1 unbounded.
    softcap : float, optional
    alibi_slopes : array (heads_q,) or (batch, heads_q), optional
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    num_splits : int, optional
        Key splits per block; default: split only when the grid would not fill the GPU.
    return_lse : bool
        Also return the natural-log LSE, float32: ``(heads_q, total)`` for packed q (FlashAttention's
        varlen layout), ``(batch, heads_q, t)`` for 4-D q.
    stream : optional

    Returns
    -------
    out : array, q's shape and dtype; NumPy for NumPy q
    lse : array, only with ``return_lse``

    Notes
    -----
    Equal to :func:`pyattn.prefill` on a cache holding the same pages, bitwise, and to
    :func:`pyattn.attention_varlen` over each sequence's gathered keys. Every page entry a sequence
    uses is range-checked before the launch: device tables and a device ``cu_seqlens_q`` are copied
    back for that, after every other check (a synchronisation, which no CUDA graph capture can
    hold). Pools are read in place; the pages of a sequence's last, partly filled page past its
    length may hold anything (NaN included).
    """
    check_stream_arg(stream)
    return_lse = check_bool("return_lse", return_lse)
    given = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "cu_seqlens_q": cu_seqlens_q, "block_table": block_table,
             "seq_lens": seq_lens, "indptr": indptr, "indices": indices, "last_page_len": last_page_len,
             "alibi_slopes": alibi_slopes}
    a = read_args(given, _NAMES, ("q", "k_pool", "v_pool"))
    pool = check_pools(a["k_pool"], a["v_pool"], layout)
    check_table_form(block_table, seq_lens, indptr, indices, last_page_len)
    batch, seqs = _batch(a, block_table)
    P = check_prefill(a["q"], pool, batch, has_cu=cu_seqlens_q is not None, tree=False, seqs=seqs,
                      pools="k_pool", causal=causal, window=window, softcap=softcap,
                      alibi_slopes=a["alibi_slopes"], scale=scale, num_splits=num_splits)
    cu, lens, csr = _host_tables(a, block_table, P, fetch_values)
    kv_len = lens if block_table is None or not a["seq_lens"].on_device else None
    # Device tables are read in place; the rest (a host table, vLLM's row offsets, CSR lengths) go up.
    dev = [a["block_table"] if block_table is not None else a["indices"],
           None if block_table is not None else a["indptr"], None if kv_len is not None else a["seq_lens"]]
    dev = [t if t is not None and t.on_device else None for t in dev]
    sent = [None if d is not None else np.ascontiguousarray(h, np.int32) for d, h in zip(dev, (*csr, kv_len))]
    max_len = int(lens.max(initial=0))

    def tables(device, kp, vp, on_dev):
        """run_prefill's tables: the device ones in place, the rest uploaded on the launch's stream."""
        def on_stream(s_):
            ups = upload(sent, device, s_) if any(x is not None for x in sent) else sent
            return KVTables(kp.ptr, vp.ptr, *(d if d is not None else u for d, u in zip(on_dev, ups)), max_len)
        return on_stream

    alibi = a["alibi_slopes"]
    if not P.q_on_device:
        device, s, (kp, vp, *on_dev) = start(stream, [a["k_pool"], a["v_pool"], *dev])
        ins = [a["q"].obj, np.asarray(alibi.obj, np.float32) if alibi is not None and not alibi.on_device else None]

        def run(d_in, s_):
            dq, dal = d_in
            if alibi is not None and alibi.on_device:
                order_inputs(s_, device, [alibi])
            al = dal.ptr if dal is not None else (alibi.ptr if alibi is not None else 0)
            return run_prefill(P, device, s_, dq.ptr, tables(device, kp, vp, on_dev), cu, None, al, return_lse)

        o, lse = host.call(run, ins, [], s)
        finish(s, [kp, vp, *on_dev])
        return (o, lse) if return_lse else o
    device, s, (dq, kp, vp, dal, *on_dev) = start(stream, [a["q"], a["k_pool"], a["v_pool"], alibi, *dev])
    if any(t is not None and t.on_device for t in (*dev, a["cu_seqlens_q"])):
        refuse_capture(s, "paged_prefill copied its device page tables (or cu_seqlens_q) back for their range "
                          "check, and a replay would keep what was planned from them")
    keep = None
    if dal is not None and not dal.on_device:
        (keep,) = upload([np.asarray(dal.obj, np.float32)], device, s)
    al = keep.ptr if keep is not None else (dal.ptr if dal is not None else 0)
    out, lse = run_prefill(P, device, s, dq.ptr, tables(device, kp, vp, on_dev), cu, None, al, return_lse)
    finish(s, [dq, kp, vp, dal, *on_dev])
    return (out, lse) if return_lse else out

"""``pyattn.contiguous_decode``: decode over contiguous per-sequence K/V caches.

FlashAttention's ``flash_attn_with_kvcache`` form, for scripts and models that keep one
preallocated (batch, max_len, heads_kv, head_dim) cache per layer (or HF's (batch, heads_kv,
max_len, head_dim) static cache) instead of a page pool. It runs the paged decode kernels with no
per-call page table:

- The caches are read as a pool of pages of ``P`` slots (the largest power of two from 16 up to
  :data:`VIEW_PAGE` that divides ``max_len`` and the sequence stride): sequence ``b``'s page ``j``
  is pool page ``b * per + j``. That table is the same at every call on caches of one geometry, so
  it is built and uploaded once (one synchronisation) and kept, as the TMA decode's tensor maps are.
  Where no such ``P`` exists, each sequence is one page of ``max_len`` slots (on sm_90a the TMA
  kernel takes only power-of-two pages from 16; other pages run on the cp.async kernel).
- One length for every sequence (an int ``cache_seqlens``, or an array whose values are all
  equal) reaches the kernel by value. Ragged lengths from NumPy are uploaded with the call (a few
  bytes); device ones are read in place after their range check copies them back (one
  synchronisation, as :func:`pyattn.paged_decode`'s device tables).
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from ..interop.inputs import read, read_args
from ..interop.quick import quick_key
from ..paged.book import longest_first
from ..pipeline.device import begin, bind, fetch_values, finish, start
from ..pipeline.host import upload
from ..pipeline.plans import Memo
from ..runtime.stream import check_stream_arg
from ..validate.contiguous import check_caches, check_seqlens
from ..validate.options import check_bool
from ..validate.paged import PoolInfo, check_q_address, check_query
from ._decode import run_decode
from .decode import _alibi_ptr, _host_q

__all__ = ["contiguous_decode", "VIEW_PAGE", "paged_view"]

# The largest page the caches are viewed as. On an H200 (bf16 GQA 32/8 D 128) the TMA decode over
# pages of 128 slots ran at or ahead of pages of 16 at every batch (BENCHMARKS.md, "page 128
# reaches 0.99-1.00x cuDNN"); ``dev/probe_contiguous.py`` measures this choice against others.
VIEW_PAGE = 128

# (device ordinal, batch, pages a sequence stride spans, pages a sequence holds) -> DeviceArray:
# the view's page table, built once per cache geometry (bounded: caches that come and go push the
# oldest out).
_tables: dict = {}
_MAX_TABLES = 32
_quick = Memo()  # quick key -> (pipeline.device.Bound, per, cols, max_len) of a call with an int length


def paged_view(pool: PoolInfo, max_page: int = VIEW_PAGE) -> tuple:
    """``(pool, per, cols)``: validated caches (one page of ``max_len`` slots per sequence) seen
    as a pool of pages of a power of two ``P`` in ``[16, max_page]``, sequence ``b``'s page ``j``
    being pool page ``b * per + j`` (``cols = max_len / P`` pages a sequence). ``P`` must divide
    ``max_len``, and both caches' sequence strides must be the same whole number ``per`` of
    ``P``-slot spans; else ``(pool, 1, 1)``."""
    L, ks, vs = pool.page_size, pool.k_strides, pool.v_strides  # strides (sequence, slot, head)
    P = max_page
    while P >= 16:
        if L % P == 0 and ks[1] > 0 and vs[1] > 0 and ks[0] > 0 and ks[0] % (P * ks[1]) == 0 \
                and vs[0] % (P * vs[1]) == 0 and ks[0] // (P * ks[1]) == vs[0] // (P * vs[1]):
            per, cols = ks[0] // (P * ks[1]), L // P
            view = PoolInfo((pool.num_pages - 1) * per + cols, P, pool.heads_kv, pool.head_dim, pool.dtype,
                            (P * ks[1], ks[1], ks[2]), (P * vs[1], vs[1], vs[2]))
            return view, per, cols
        P //= 2
    return pool, 1, 1


def _table(device, batch: int, per: int, cols: int, s):
    """The view's (batch, cols) page table on ``device``: row b = b * per + [0, cols)."""
    key = (device.ordinal, batch, per, cols)
    table = _tables.get(key)
    if table is None:
        host = (np.arange(batch, dtype=np.int64)[:, None] * per + np.arange(cols)).astype(np.int32)
        (table,) = upload([host], device, s)
        s.synchronize()  # once per geometry: a later call on another stream then reads it safely
        if len(_tables) >= _MAX_TABLES:
            _tables.pop(next(iter(_tables)))
        _tables[key] = table
    return table


def contiguous_decode(q, k_cache, v_cache, cache_seqlens, *, layout="nhd", causal=True, window=None, softcap=None,
                      alibi_slopes=None, scale=None, num_splits=None, return_lse=False, stream=None):
    """Decode attention over contiguous per-sequence K/V caches (``flash_attn_with_kvcache``'s form).

    Parameters
    ----------
    q : array, shape (batch, q_len, heads_q, head_dim)
        New query tokens (float16/bfloat16, the caches' dtype), NumPy or device. Query token ``i``
        of a sequence of ``n`` cached tokens sits at position ``n - q_len + i``: write the new
        tokens' K/V into the caches first.
    k_cache, v_cache : device arrays
        ``layout="nhd"``: (batch, max_len, heads_kv, head_dim); ``"hnd"``: (batch, heads_kv,
        max_len, head_dim) (HF's static cache). Read in place through their strides (head_dim
        contiguous, other strides multiples of 8 elements).
    cache_seqlens : int or int32 array (batch,)
        Tokens cached per sequence, each in ``[0, max_len]``. An int (or equal values) reaches the
        kernel by value; ragged NumPy lengths are uploaded with the call; device lengths are
        copied back for their range check (one synchronisation) and read in place.
    layout : {"nhd", "hnd"}
    causal, window, softcap, alibi_slopes, scale, num_splits, return_lse, stream
        As in :func:`pyattn.paged_decode`.

    Returns
    -------
    out : array (batch, q_len, heads_q, head_dim), q's dtype; NumPy for NumPy q
    lse : array (batch, heads_q, q_len), float32, only with ``return_lse``

    Notes
    -----
    The caches are read as pages of up to 128 slots through a page table built once per cache
    geometry (see the module's notes); on sm_90a a ``max_len`` that is a multiple of 16 lets the TMA
    decode read them.
    """
    params = locals()  # first thing: the parameters and nothing else
    check_stream_arg(stream)
    reads, qkey = {}, None
    if type(cache_seqlens) is int:  # one length by value: a repeat call reuses the validation (its key
        # leaves the length out, which changes every step, and takes in the view page a probe may set)
        qkey = quick_key(dict(params, cache_seqlens=None, view_page=VIEW_PAGE), reads)
        hit = _quick.get(qkey) if qkey is not None else None
        if hit is not None and 0 <= cache_seqlens <= hit[3]:
            return _repeat(hit, cache_seqlens, (q, k_cache, v_cache, alibi_slopes), stream, return_lse, reads)
    return _full(params, qkey)


def _check(P, ptrs) -> None:
    """The per-call address checks of a repeat call (q, k_cache, v_cache, alibi_slopes)."""
    check_q_address(ptrs[0])
    for name, ptr in (("k_cache", ptrs[1]), ("v_cache", ptrs[2])):
        if ptr % 16:
            raise ValueError(f"{name}: the kernel copies 16-byte rows; the address must be 16-byte aligned, "
                             f"got {ptr:#x}")


def _repeat(hit, length: int, arrays, stream, return_lse, reads):
    """A call whose quick key was seen, with one int length: pointers and producers read, then the
    launch on the geometry's kept page table."""
    bound, per, cols, _ = hit
    P, device = bound.problem, bound.device
    s, (q, kc, vc, alibi) = begin(bound, stream, arrays, reads)
    table = _table(device, P.batch, per, cols, s)
    out, lse = run_decode(P, device, q, kc, vc, (table, None, cols, length, None), length, alibi, s, return_lse,
                          total_len=length * P.batch)
    return (out, lse) if return_lse else out


def _full(params, qkey):
    """A call validated from its arguments; one with an int length binds ``qkey`` for its repeats."""
    cache_seqlens, stream, return_lse = params["cache_seqlens"], params["stream"], params["return_lse"]
    a = read_args(params, ("q", "k_cache", "v_cache", "alibi_slopes"), ("q", "k_cache", "v_cache"))
    return_lse = check_bool("return_lse", return_lse)
    layout = params["layout"]
    whole = check_caches(a["k_cache"], a["v_cache"], layout)
    pool, per, cols = paged_view(whole, VIEW_PAGE)  # (read per call: dev/probe_contiguous.py sets it)
    P = check_query(a["q"], pool, causal=params["causal"], window=params["window"], softcap=params["softcap"],
                    alibi_slopes=a["alibi_slopes"], scale=params["scale"], num_splits=params["num_splits"])
    if whole.num_pages != P.batch:
        raise ValueError(f"k_cache: expected {P.batch} sequences (q's batch), got shape {a['k_cache'].shape}")
    lens_arg = cache_seqlens if isinstance(cache_seqlens, (Integral, np.bool_)) else read("cache_seqlens",
                                                                                          cache_seqlens)
    lens = check_seqlens(lens_arg, P.batch, whole.page_size, fetch_values)
    if not isinstance(lens, int) and (P.batch == 0 or int(lens.min()) == int(lens.max())):
        lens = int(lens[0]) if P.batch else 0  # equal lengths: by value
    if isinstance(lens, int):
        max_len, total_len, order, dev_lens = lens, lens * P.batch, None, None
    else:
        max_len, total_len, order = int(lens.max()), int(lens.sum(dtype=np.int64)), longest_first(lens)
        dev_lens = lens_arg if lens_arg.on_device else None

    def launch_fn(device, s, dq, alibi_ptr):
        table, kv_len, ordr = _table(device, P.batch, per, cols, s), lens, None
        if not isinstance(lens, int):  # ragged: device lengths in place, host ones (and the order) uploaded
            host = [None if dev_lens is not None else np.ascontiguousarray(lens, np.int32), order]
            up, ordr = upload(host, device, s) if any(h is not None for h in host) else (None, None)
            kv_len = dv_lens if dev_lens is not None else up
        return run_decode(P, device, dq.ptr, kc.ptr, vc.ptr, (table, None, cols, kv_len, ordr), max_len, alibi_ptr, s,
                          return_lse, total_len=total_len)

    if not P.q_on_device:
        device, s, (kc, vc, dv_lens) = start(stream, [a["k_cache"], a["v_cache"], dev_lens])
        return _host_q(P, a["q"], a["alibi_slopes"], s, launch_fn, return_lse)
    ordered = [a["q"], a["k_cache"], a["v_cache"], a["alibi_slopes"]]
    device, s, (dq, kc, vc, dal, dv_lens) = start(stream, ordered + [dev_lens])
    if qkey is not None and type(cache_seqlens) is int:
        bound = bind(P, device, ordered, _check)
        if bound is not None:
            _quick.put(qkey, (bound, per, cols, whole.page_size))
    alibi_ptr, keep = _alibi_ptr(dal, device, s)
    out, lse = launch_fn(device, s, dq, alibi_ptr)
    finish(s, [dq, kc, vc, dal, dv_lens])
    return (out, lse) if return_lse else out

"""``pyattn.contiguous_decode``: decode over contiguous per-sequence K/V caches.

FlashAttention's ``flash_attn_with_kvcache`` form, for scripts and models that keep one
preallocated (batch, max_len, heads_kv, head_dim) cache per layer (or HF's (batch, heads_kv,
max_len, head_dim) static cache) instead of a page pool: the new tokens' K/V optionally written
into the caches, then the paged decode kernels over them with no per-call page table (the caches
seen as a page pool: :mod:`._contiguous`). One length for every sequence (an int
``cache_seqlens``, or an array whose values are all equal) reaches the kernel by value, and a
repeat call with an int length reuses the first call's validation. Ragged lengths from NumPy are
uploaded with the call (a few bytes); device ones are read in place after their range check
copies them back (one synchronisation, as :func:`pyattn.paged_decode`'s device tables), or, with
``max_seqlen``, unchecked: clamped in the kernel, which a CUDA graph's decode step needs.
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
from ..runtime.device import keeps_context
from ..runtime.stream import capture_id, check_stream_arg, refuse_capture
from ..validate.contiguous import check_caches, check_new_tokens, check_seqlens
from ..validate.options import check_bool
from ..validate.paged import check_max_seqlen, check_pool_address, check_q_address, check_query, check_token_address
from . import _contiguous as C
from ._decode import Ptr, run_decode
from .decode import _alibi_ptr, _host_q

__all__ = ["contiguous_decode"]

# quick key -> _Hit of a call with device arrays and an int length, or device lengths under max_seqlen
_quick = Memo()


class _Hit:
    """What a repeat call reuses: the bound problem, the view's geometry, the caches' max_len (an
    int length's bound; with device lengths, ``max_seqlen``) and the new tokens' Append (or None)."""

    __slots__ = ("bound", "per", "cols", "max_len", "append")

    def __init__(self, bound, per, cols, max_len, append):
        self.bound, self.per, self.cols, self.max_len, self.append = bound, per, cols, max_len, append


@keeps_context
def contiguous_decode(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, layout="nhd", causal=True,
                      window=None, softcap=None, alibi_slopes=None, scale=None, num_splits=None, return_lse=False,
                      max_seqlen=None, stream=None):
    """Decode attention over contiguous per-sequence K/V caches (``flash_attn_with_kvcache``'s form).

    Parameters
    ----------
    q : array, shape (batch, q_len, heads_q, head_dim)
        New query tokens (float16/bfloat16, the caches' dtype), NumPy or device. Query token ``i``
        of a sequence of ``n`` keys (``cache_seqlens`` plus ``n_new``) sits at position
        ``n - q_len + i``.
    k_cache, v_cache : device arrays
        ``layout="nhd"``: (batch, max_len, heads_kv, head_dim); ``"hnd"``: (batch, heads_kv,
        max_len, head_dim) (HF's static cache). Read in place through their strides (head_dim
        contiguous, other strides multiples of 8 elements).
    cache_seqlens : int or int32 array (batch,)
        Tokens cached per sequence before ``k_new``, each in ``[0, max_len - n_new]``. An int (or
        equal values) reaches the kernel by value; ragged NumPy lengths are uploaded with the call;
        device lengths are copied back for their range check (one synchronisation) and read in
        place.
    k_new, v_new : arrays, shape (batch, n_new, heads_kv, head_dim), optional
        New tokens' K/V (the caches' dtype, NumPy or device), written into the caches at positions
        ``cache_seqlens[b]`` to ``cache_seqlens[b] + n_new - 1`` before the attention, which then
        covers ``cache_seqlens[b] + n_new`` keys (a prompt's K/V too: any ``n_new``). Device ones
        need 16-byte rows and the same strides for K and V.
    layout : {"nhd", "hnd"}
    causal, window, softcap, alibi_slopes, scale, num_splits, return_lse, stream
        As in :func:`pyattn.paged_decode`.
    max_seqlen : int, optional
        With device ``cache_seqlens``: a host bound on the lengths after the new tokens, at most
        ``max_len``. The lengths are then not copied back for a range check: the kernels read them
        as they are when they run, each clamped into ``[0, max_seqlen - n_new]``, write the new
        tokens from there (device ``k_new`` / ``v_new``) and attend over the clamped length plus
        ``n_new``; the splits are planned for ``max_seqlen``. This is how a decode step is captured
        in a CUDA graph (a copy-back cannot be captured) and replayed over lengths that grow: pass
        the caches' ``max_len``, and advance the lengths yourself after each step. A length over
        the bound is taken as the bound, not refused.

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
        qkey = quick_key(dict(params, cache_seqlens=None, view_page=C.VIEW_PAGE), reads)
        hit = _quick.get(qkey) if qkey is not None else None
        if hit is not None and 0 <= cache_seqlens <= hit.max_len - (hit.append.n_new if hit.append else 0):
            return _repeat(hit, cache_seqlens, (q, k_cache, v_cache, alibi_slopes, k_new, v_new), stream, return_lse,
                           reads)
    elif max_seqlen is not None:  # device lengths read unchecked: keyed with their layout and the bound
        qkey = quick_key(dict(params, view_page=C.VIEW_PAGE), reads)
        hit = _quick.get(qkey) if qkey is not None else None
        if hit is not None:
            return _repeat_unchecked(hit, (q, k_cache, v_cache, alibi_slopes, k_new, v_new, cache_seqlens), stream,
                                     return_lse, reads)
    return _full(params, qkey)


def _check(P, ptrs) -> None:
    """The per-call address checks of a repeat call (q, k_cache, v_cache, alibi_slopes, k_new, v_new)."""
    check_q_address(ptrs[0])
    check_pool_address("k_cache", ptrs[1])
    check_pool_address("v_cache", ptrs[2])
    check_token_address("k_new", ptrs[4])  # (0 when absent)
    check_token_address("v_new", ptrs[5])


def _repeat(hit, length: int, arrays, stream, return_lse, reads):
    """A call whose quick key was seen, with one int length: pointers and producers read, the new
    tokens written, then the launch on the geometry's kept page table."""
    P, device = hit.bound.problem, hit.bound.device
    s, (q, kc, vc, alibi, kn, vn) = begin(hit.bound, stream, arrays, reads)
    if hit.append is not None:
        C.launch_append(device, s, P.pool, kc, vc, hit.append, length, kn, vn)
        length += hit.append.n_new
    table = C.page_table(device, P.batch, hit.per, hit.cols, s)
    out, lse = run_decode(P, device, q, kc, vc, (table, None, hit.cols, length, None), length, alibi, s, return_lse,
                          total_len=length * P.batch)
    return (out, lse) if return_lse else out


def _repeat_unchecked(hit, arrays, stream, return_lse, reads):
    """A call whose quick key was seen, with device lengths under ``max_seqlen``: pointers and
    producers read, the new tokens written from the lengths as the kernel finds them, then the
    launch (the graph-captured step's eager form, whose full path is ~130 us of host time)."""
    P, device = hit.bound.problem, hit.bound.device
    s, (q, kc, vc, alibi, kn, vn, lens) = begin(hit.bound, stream, arrays, reads)
    capture = capture_id(s.handle)  # (asked once: the append's lengths out and the decode's allocations take it)
    if hit.append is not None:  # (after: the lengths after the append, kept to the decode's launch)
        after = C.launch_append_on_device(device, s, P.pool, kc, vc, hit.append, lens, hit.max_len, kn, vn, capture)
        lens = after.ptr
    table = C.page_table(device, P.batch, hit.per, hit.cols, s)
    out, lse = run_decode(P, device, q, kc, vc, (table, None, hit.cols, Ptr(lens), None), hit.max_len, alibi, s,
                          return_lse, capture=capture)
    return (out, lse) if return_lse else out


def _full(params, qkey):
    """A call validated from its arguments; one with an int length and device arrays binds ``qkey``
    for its repeats."""
    cache_seqlens, stream, return_lse = params["cache_seqlens"], params["stream"], params["return_lse"]
    a = read_args(params, ("q", "k_cache", "v_cache", "alibi_slopes", "k_new", "v_new"),
                  ("q", "k_cache", "v_cache"))
    return_lse = check_bool("return_lse", return_lse)
    whole = check_caches(a["k_cache"], a["v_cache"], params["layout"])
    pool, per, cols = C.paged_view(whole, C.VIEW_PAGE)  # (read per call: dev/probe_contiguous.py sets it)
    P = check_query(a["q"], pool, causal=params["causal"], window=params["window"], softcap=params["softcap"],
                    alibi_slopes=a["alibi_slopes"], scale=params["scale"], num_splits=params["num_splits"])
    if whole.num_pages != P.batch:
        raise ValueError(f"k_cache: expected {P.batch} sequences (q's batch), got shape {a['k_cache'].shape}")
    n_new, rows, new_strides = check_new_tokens(a["k_new"], a["v_new"], pool, P.batch)
    lens_arg = cache_seqlens if isinstance(cache_seqlens, (Integral, np.bool_)) else read("cache_seqlens",
                                                                                          cache_seqlens)
    trusted = params["max_seqlen"] is not None
    if trusted:  # device lengths read unchecked under a host bound (the graph-captured decode step)
        top = check_max_seqlen(params["max_seqlen"], lens_arg, "cache_seqlens", whole.page_size)
        if top < n_new:
            raise ValueError(f"max_seqlen: bounds the lengths after the {n_new} new tokens, so expected at least "
                             f"{n_new}, got {top}")
    lens = check_seqlens(lens_arg, P.batch, whole.page_size, None if trusted else fetch_values, n_new)
    if lens is not None and not isinstance(lens, int) and (P.batch == 0 or int(lens.min()) == int(lens.max())):
        lens = int(lens[0]) if P.batch else 0  # equal lengths: by value
    host_new = n_new > 0 and not a["k_new"].on_device
    ap = C.new_tokens(pool, per, P.batch, n_new, rows, new_strides) if n_new else None
    if trusted:
        max_len, total_len, order, dev_lens = top, None, None, lens_arg
    elif isinstance(lens, int):
        max_len, total_len, order, dev_lens = lens + n_new, (lens + n_new) * P.batch, None, None
    else:
        max_len, total_len = int(lens.max()) + n_new, int(lens.sum(dtype=np.int64)) + n_new * P.batch
        order, dev_lens = longest_first(lens), (lens_arg if lens_arg.on_device and not n_new else None)

    def launch_fn(device, s, dq, alibi_ptr):
        table, ordr = C.page_table(device, P.batch, per, cols, s), None
        if ap is not None:
            kn, vn = new
            if host_new:  # (uploaded C-contiguous)
                kn, vn = upload([np.ascontiguousarray(a["k_new"].obj), np.ascontiguousarray(a["v_new"].obj)],
                                device, s)
            if trusted:  # slots from the device lengths; the lengths after the append written for the decode
                after = C.launch_append_on_device(device, s, pool, kc.ptr, vc.ptr, ap, dv_lens.ptr, max_len, kn.ptr,
                                                  vn.ptr)
            else:
                C.launch_append(device, s, pool, kc.ptr, vc.ptr, ap, lens, kn.ptr, vn.ptr)
        if trusted:
            kv_len = after if ap is not None else dv_lens
        elif isinstance(lens, int):
            kv_len = lens + n_new
        else:  # ragged: device lengths in place (without new tokens), else uploaded with the order
            host = [None if dev_lens is not None else (np.asarray(lens, np.int64) + n_new).astype(np.int32), order]
            up, ordr = upload(host, device, s) if any(h is not None for h in host) else (None, None)
            kv_len = dv_lens if dev_lens is not None else up
        return run_decode(P, device, dq.ptr, kc.ptr, vc.ptr, (table, None, cols, kv_len, ordr), max_len, alibi_ptr, s,
                          return_lse, total_len=total_len)

    dev_new = [a["k_new"], a["v_new"]] if n_new and not host_new else [None, None]
    if not P.q_on_device:
        device, s, (kc, vc, dv_lens, *new) = start(stream, [a["k_cache"], a["v_cache"], dev_lens, *dev_new])
        return _host_q(P, a["q"], a["alibi_slopes"], s, launch_fn, return_lse)
    ordered = [a["q"], a["k_cache"], a["v_cache"], a["alibi_slopes"], *dev_new]
    device, s, (dq, kc, vc, dal, *new, dv_lens) = start(stream, ordered + [dev_lens])
    if not trusted and not isinstance(lens_arg, Integral) and lens_arg.on_device:
        refuse_capture(s, "cache_seqlens were read on the host for their range check, and a replay would keep "
                          "the splits planned for them: pass max_seqlen= to read them on the device")
    if qkey is not None and type(cache_seqlens) is int and not host_new:
        bound = bind(P, device, ordered, _check)
        if bound is not None:
            _quick.put(qkey, _Hit(bound, per, cols, whole.page_size, ap))
    elif qkey is not None and trusted and not host_new:  # (the lengths' pointer read per call, after the others)
        bound = bind(P, device, ordered + [dev_lens], _check)
        if bound is not None:
            _quick.put(qkey, _Hit(bound, per, cols, max_len, ap))
    alibi_ptr, keep = _alibi_ptr(dal, device, s)
    out, lse = launch_fn(device, s, dq, alibi_ptr)
    finish(s, [dq, kc, vc, dal, dv_lens, *new])
    return (out, lse) if return_lse else out

"""``pyattn.PagedKVCache``: a device-resident K/V page pool plus its bookkeeping.

The pools are two device arrays of shape (num_pages, page_size, num_kv_heads, head_dim) (the
"NHD" layout of vLLM and FlashInfer); :class:`~pyattn.paged.book.PageBook` decides which slots
each sequence's tokens occupy, and one ``kv_append`` launch per :meth:`PagedKVCache.append`
writes the new tokens and performs that call's copy-on-write page copies. Quantized caches
(int8 / fp8 e4m3) add two float32 scale pools and quantize on append (:mod:`pyattn.quant`).

Thread safety: a cache is not thread-safe; serialise calls on one cache (appends and decodes
are ordered on the stream they are given).
"""

from __future__ import annotations

import itertools

import numpy as np

from ..array import DeviceArray, empty
from ..interop.inputs import numpy_dtype, read
from ..interop.quick import quick_key
from ..interop.streams import note_use
from ..pipeline.device import begin, bind, finish, start
from ..pipeline.host import upload
from ..quant import KEPT_CHANNELS, code_dtype, kind_of
from ..runtime.device import Device, get_device, keeps_context
from ..runtime.stream import as_stream, check_stream_arg
from ..validate.paged import (DECODE_DTYPES, PoolInfo, check_append, check_cache_options,
                              check_token_address, check_token_rows)
from .book import PageBook, longest_first
from .appender import Appender
from .bookkeeping import CacheBookkeeping
from .decode_table import DecodeTable
from .keypages import KeyStager
from .side_state import SideStateMethods
from .sparq_state import SparqRows

__all__ = ["PagedKVCache"]


def _check_rows(problem, ptrs) -> None:
    """A repeat append's per-call check: its tokens' addresses (the layout was checked at the first call)."""
    check_token_address("k", ptrs[0])
    check_token_address("v", ptrs[1])

_layout_tokens: dict = {}  # PoolInfo -> a number naming that layout in memo keys (see layout_key)
_token_counter = itertools.count()


# The host-only bookkeeping (sizes, sequence lifecycle, NumPy page tables, stream order) and the
# side-state methods (per-channel key scales, SparQ) are mixins in their own modules, so that this
# one holds the constructor and the device work and stays short enough to read at once.
class PagedKVCache(CacheBookkeeping, SideStateMethods):
    """A paged KV cache on one GPU.

    Parameters
    ----------
    num_pages : int
        Pages in the pool.
    page_size : int
        Token slots per page, 1 to 256.
    num_kv_heads, head_dim : int
        head_dim is a multiple of 8 up to 256 (of 16 for 8-bit caches).
    dtype : {"float16", "bfloat16", "int8", "fp8_e4m3"} or a NumPy dtype
        The pools' element type. ``"int8"`` (``numpy.int8``) and ``"fp8_e4m3"``
        (``ml_dtypes.float8_e4m3fn``; ``"float8_e4m3fn"`` and ``"fp8e4m3"`` are accepted too) make
        a quantized cache: 8-bit codes plus one float32 scale per (page, slot, kv head) for K and
        one for V, computed when tokens are appended (see :mod:`pyattn.quant` for the rules, the
        error bounds and the handling of NaN/inf).
    device : int or Device, optional
        Default: the current device.
    key_scales : {"token", "channel"}, default "token"
        8-bit caches: how keys are scaled. ``"token"``: one scale per (token, kv head), as values.
        ``"channel"`` (KIVI-style): one scale per (page, kv head, channel), so keys with a few
        large channels keep their precision in the others, and each page's 4 largest channels kept
        in float16; page_size must be a multiple of 16.
        See Notes.
    sparq : bool, default False
        Keep what :func:`pyattn.sparq_decode` needs (16-bit caches, page_size a multiple of 8): a
        second, transposed copy of the keys (``kt``) and each sequence's running sum of V.

    Attributes
    ----------
    k, v : DeviceArray
        The pools, (num_pages, page_size, num_kv_heads, head_dim), of ``dtype`` (the codes, for a
        quantized cache); slots not covered by a sequence hold stale data.
    k_scale, v_scale : DeviceArray or None
        Quantized caches: float32 (num_pages, num_kv_heads, page_size), the scale of each code
        row (value = code * scale; slot ``s`` of kv head ``h`` of page ``p`` at ``[p, h, s]``). None
        for float16 / bfloat16 caches. With
        ``key_scales="channel"``, ``k_scale`` is float32 (num_pages, num_kv_heads, 4 + head_dim / 2
        + 2 page_size): per (page, kv head) the page scale ``S`` at ``[..., 0]``, the kept channels'
        indices (4 bytes) at ``[..., 1]``, from ``[..., 4]`` on the float16 relative channel scales
        ``r`` (value = code * S * r[channel]), then the kept channels' float16 values over ``S``,
        (page_size, 4) (see :meth:`read_key_scales` and :func:`pyattn.quant.quantize_page`).
    kt : DeviceArray or None
        ``sparq=True``: the keys again, (num_pages, num_kv_heads, head_dim, page_size).
    v_sum : DeviceArray or None
        ``sparq=True``: float32 (rows, num_kv_heads, head_dim), each sequence's sum of V in token
        order (a row per sequence; None until the first append).
    key_scales : str
        ``"token"`` or ``"channel"``.
    dtype : numpy.dtype
        float16, bfloat16, int8 or float8_e4m3fn.
    kv : str
        ``""`` (float16 / bfloat16), ``"int8"`` or ``"fp8e4m3"``.

    Notes
    -----
    Why one scale per token and kv head: quantizing on append never revisits earlier tokens, an
    outlier token only costs its own precision, and the scales add 4 / head_dim of the code bytes
    (3% at head_dim 128).

    Per-channel key scales: a page's channel scales depend on every key it holds, so each append
    requantizes the pages it writes from their keys' exact 16-bit values, which the cache keeps
    (float32, one page per partly filled page) until the page is full; its scales are fixed from
    then on. A page reopened by :meth:`truncate` or a partial :meth:`fork` and then appended to is
    requantized from its dequantized keys (one more rounding for those). Values keep per-token
    scales. Why: :mod:`pyattn.paged.keypages`.

    Sequences are created with :meth:`add_sequence` or :meth:`fork`, grown with :meth:`append`,
    rolled back with :meth:`truncate` and released with :meth:`free`. Forks share pages by
    reference count; a shared page is copied when a sequence next writes into it. Running out of
    pages raises :class:`~pyattn.paged.book.OutOfPagesError` and changes nothing.

    Threads: a cache is one serving loop's state, not a shared structure. Every call on it, reads
    included, orders the cache's stream (:meth:`order`) and may keep tables or side state on it,
    so calls on one cache from several threads need the caller's own lock; separate caches are
    independent. (The ops themselves are thread-safe.)
    """

    @keeps_context
    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, dtype, *, device=None, key_scales="token",
                 sparq=False):
        self.book = PageBook(num_pages, page_size)
        for name, val in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(val).__name__}")
        if not 1 <= num_kv_heads <= 65535:
            raise ValueError(f"num_kv_heads: expected 1 to 65535, got {num_kv_heads}")
        if head_dim % 8 or not 8 <= head_dim <= 256:
            raise ValueError(f"head_dim: expected a multiple of 8 in [8, 256], got {head_dim}")
        kv = kind_of(dtype)
        if kv and head_dim % 16:
            raise ValueError(f"head_dim: an 8-bit cache needs a multiple of 16 (its decode kernel copies "
                             f"16-byte rows of codes), got {head_dim}")
        if kv:
            dt = code_dtype(kv)
        else:
            try:  # dtype instances and scalar types (np.float16, ml_dtypes.bfloat16); names go below
                dt = numpy_dtype("dtype", dtype) if isinstance(dtype, str) else np.dtype(dtype)
            except TypeError:
                dt = numpy_dtype("dtype", dtype)  # e.g. torch.float16
        if not kv and dt.name not in DECODE_DTYPES:
            raise TypeError(f"dtype: expected float16, bfloat16, int8 or fp8_e4m3 (ml_dtypes.float8_e4m3fn), "
                            f"got {dt}")
        channel, sparq = check_cache_options(key_scales, sparq, kv, self.book.num_pages, self.book.page_size,
                                             int(num_kv_heads))
        if device is None or isinstance(device, (int, np.integer)):
            device = get_device(None if device is None else int(device))
        elif not isinstance(device, Device):
            raise TypeError(f"device: expected an int or a pyattn.Device, got {type(device).__name__}")
        self.device, self.dtype, self._kv = device, dt, kv
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        shape = (self.book.num_pages, self.book.page_size, self.num_kv_heads, self.head_dim)
        self.k = empty(shape, dt, device=device)
        self.v = empty(shape, dt, device=device)
        # Scales head-major: a decode block (one kv head) reads its page's scales as one contiguous
        # run. Slot-major, each block's 4-byte scale shared a 32-byte sector with the other heads',
        # read by other blocks at other times; at pages of 128 the int8 decode was 3% slower (H200,
        # B64 x 32k: 1034 -> 1000 us; pages of 16 level; BENCHMARKS.md, thirty-sixth session).
        sshape = (shape[0], shape[2], shape[1])
        self.k_scale = empty(sshape, np.float32, device=device) if kv else None
        self.v_scale = empty(sshape, np.float32, device=device) if kv else None
        self.key_scales, self._keys, self._stage, self._kscratch = "token", None, None, None
        if channel:  # one record per (page, kv head): [S, idx, 0, 0, fp16 r[head_dim], fp16 kept[page_size][4]]
            self.key_scales, self._keys = "channel", KeyStager(self.book.page_size)
            rec = 4 + shape[3] // 2 + shape[1] * KEPT_CHANNELS // 2  # 16-byte aligned pieces
            self.k_scale = empty((shape[0], shape[2], rec), np.float32, device=device)
            self._kscratch = empty((4,), np.float32, device=device)  # kv_append's per-token K scales land here
        self.kt = empty((shape[0], shape[2], shape[3], shape[1]), dt, device=device) if sparq else None
        self._sq, self.v_sum, self._vrows = (SparqRows() if sparq else None), None, None
        self.k.stream.synchronize()  # allocated on pyattn's stream; appends and decodes may use others
        st = self.k.elem_strides[:3]
        # The kernels read scales by (page, slot, head) strides: per-token scales are head-major
        # (page, head, slot); a per-channel record is (page, head), read at any slot of its page.
        ks, vs = (self.k_scale.elem_strides, self.v_scale.elem_strides) if kv else ((0, 0, 0), (0, 0, 0))
        sst = (ks[0], 0, ks[1]) if channel else (ks[0], ks[2], ks[1])
        vst = (vs[0], vs[2], vs[1])
        self.pool_info = PoolInfo(shape[0], shape[1], shape[2], shape[3], dt, st, st, kv, sst, vst, channel)
        # What a decode's problem takes from the cache, for memo keys: not the cache (a key would
        # keep its pools alive), and the layout as a number (hashing the dataclass costs ~0.4 us).
        token = _layout_tokens.get(self.pool_info)
        if token is None:
            token = _layout_tokens.setdefault(self.pool_info, next(_token_counter))
        self.layout_key = (token, device.ordinal)
        self._tables = None  # (key, tables, max_len): the last CSR device page table (prefill, SparQ)
        self._dtab = None  # the last decode's DecodeTable, patched by one-token appends
        self._appender = Appender(self)  # kv_append's kernels, struct and mailbox for this cache
        self._quick: dict = {}  # append's quick key -> pipeline.device.Bound (see append)
        self._stream = self.k.stream  # the stream of the last op on the cache (see order)

    # -- data --------------------------------------------------------------------------------
    @keeps_context
    def append(self, seq_ids, k, v, *, counts=None, stream=None) -> None:
        """Append new tokens' keys and values to several sequences in one kernel launch.

        Parameters
        ----------
        seq_ids : sequence of int
            Distinct live sequences.
        k, v : array
            (len(seq_ids), t, num_kv_heads, head_dim): ``t`` tokens for each sequence; or packed
            (total, num_kv_heads, head_dim) with ``counts``. NumPy or device, the cache's dtype;
            for a quantized cache float16 or bfloat16 (both the same), quantized as they are
            written (float32 is refused: the kernel reads 16-bit tokens; convert first).
        counts : sequence of int, optional
            Tokens per sequence for packed ``k``/``v`` (sum = total).
        stream : optional
            The copy is ordered on this stream (later decodes on it see the tokens).

        Raises
        ------
        OutOfPagesError
            Too few free pages; the cache is unchanged.
        """
        check_stream_arg(stream)
        seq_ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
        seqs = self.book.seq_list(seq_ids)  # ids first: an unknown id is the likelier mistake than a shape
        # A repeat of a device-array append (a decode loop's) is found by its quick key, as an op's
        # repeat call is (pyattn.pipeline.device.begin): only pointers and producer streams are read.
        plain = self._keys is None and self._sq is None and counts is None
        reads = {}  # (the pointers and producers of CUDA array interfaces, read with the key)
        qkey = quick_key({"k": k, "v": v, "n": len(seq_ids), "stream": stream}, reads) if plain else None
        bound = self._quick.get(qkey) if qkey is not None else None
        if bound is not None:
            s, (kp, vp) = begin(bound, stream, (k, v), reads)  # (addresses checked: _check_rows)
            self.order(s)
            counts, total, ks, vs, dtype = bound.problem
            kernel, spec = self._appender.kernel(dtype)
            self._appender.write(seq_ids, seqs, counts, total, s, ((kp, ks), (vp, vs)), kernel, spec)
            return
        ki, vi = read("k", k), read("v", v)
        counts = check_append(ki, vi, counts, len(seq_ids), self.num_kv_heads, self.head_dim, self._kv, self.dtype)
        total = sum(counts)
        for i in (ki, vi):
            if i.on_device:
                check_token_rows(i)
        strides = self._row_strides(ki), self._row_strides(vi)
        if ki.on_device:
            device, s, (ki, vi) = start(stream, [ki, vi])
            if device is not self.device:
                raise ValueError(f"k: expected an array on the cache's device {self.device.ordinal}, "
                                 f"got device {device.ordinal}")
            if qkey is not None:
                if len(self._quick) >= 64:
                    self._quick.clear()
                problem = (counts, total, *strides, ki.dtype.name)
                self._quick[qkey] = bind(problem, device, [ki, vi], _check_rows)
        else:
            self.device.activate()
            s = as_stream(stream, self.device)
        self.order(s)
        dk, dv = self._token_rows(ki, total, s), self._token_rows(vi, total, s)  # (host tokens are uploaded)
        kernel, spec = self._appender.kernel(ki.dtype.name)
        rows = (dk.ptr if dk is not None else 0, strides[0]), (dv.ptr if dv is not None else 0, strides[1])
        self._appender.write(seq_ids, seqs, counts, total, s, rows, kernel, spec, dk)
        finish(s, [ki, vi])

    @keeps_context
    def accept(self, seq_ids, paths, tree_sizes, *, stream=None) -> None:
        """Keep the accepted branch of each sequence's draft tree; drop the other draft tokens.

        After :func:`pyattn.verify_tree`, sequence ``seq_ids[i]`` ends with the ``tree_sizes[i]``
        tree tokens appended for it; ``paths[i]`` (ascending tree indices, e.g. the accepted
        root-to-leaf branch) are kept, in order, right after the tokens before the tree.

        Parameters
        ----------
        seq_ids : sequence of int
            Distinct live sequences.
        paths : sequence of sequences of int
            One per sequence: ascending indices into its tree (empty: keep none).
        tree_sizes : int or sequence of int
            Tree tokens at the end of each sequence (one int for all).
        stream : optional
            The copies are ordered on this stream.

        Raises
        ------
        OutOfPagesError
            Too few free pages for the moved tokens' fresh pages; the cache is unchanged.
        ValueError
            Bad arguments, or a cache with per-channel key scales or SparQ state (not supported).

        Notes
        -----
        One ``kv_append`` launch copies, for all sequences, the kept tokens that must move (an
        8-bit cache's codes and scales unchanged); tokens already in place are not copied. From
        the first moved token on, a sequence takes fresh pages and releases its old ones, so
        pages shared with forks are never written (see :meth:`PageBook.plan_accept`).
        """
        check_stream_arg(stream)
        if self.key_scales == "channel" or self.kt is not None:
            # Moving slots would leave the per-page key scales (and the open page's exact copy) or
            # SparQ's transposed keys and V sums describing tokens that are no longer there.
            raise ValueError(f"accept: not supported on caches made with key_scales='channel' or sparq=True, got "
                             f"key_scales={self.key_scales!r}, sparq={self.kt is not None}")
        seq_ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
        checked = self.book.check_accept(seq_ids, paths, tree_sizes)  # every check before any device work
        self.device.activate()
        s = as_stream(stream, self.device)
        # The kernel before the plan: a compile error leaves the cache as it was.
        kernel, spec = self._appender.kernel("bfloat16" if self._kv else self.dtype.name)
        plan = self.book.plan_accept(seq_ids, paths, tree_sizes, checked=checked)
        n_items = len(plan.copy_dst)
        if n_items == 0:
            return
        self.order(s)
        (d_items,) = upload([np.stack([plan.copy_dst, -1 - plan.copy_src]).astype(np.int32)], self.device, s)
        self._appender.launch(spec, kernel, s, d_items.ptr, n_items)  # pool slots only: no new tokens
        finish(s, [d_items])

    def _token_rows(self, i, total: int, s):
        """The new tokens on the device (the Arg itself, or host data uploaded), None for none."""
        if total == 0:
            return None
        if not i.on_device:
            host = np.ascontiguousarray(np.asarray(i.obj).reshape(total, self.num_kv_heads, self.head_dim))
            (d,) = upload([host], self.device, s)
            return d
        return i

    @staticmethod
    def _row_strides(i) -> tuple:
        """(token stride, head stride) in elements of new tokens as rows: (b, t, H, D) arrays collapse
        (b, t) (checked: check_token_rows), packed ones are (total, H, D); host ones are uploaded
        C-contiguous (:meth:`_token_rows`)."""
        if not i.on_device:
            return i.shape[-2] * i.shape[-1], i.shape[-1]
        st = i.strides
        return (st[1], st[2]) if len(i.shape) == 4 else (st[0], st[1])

    def device_tables(self, seq_ids, s) -> tuple:
        """Device CSR page table of ``seq_ids`` (paged prefill, tree verification, SparQ), reused while
        nothing changed (the decode reads :meth:`decode_tables`).

        Returns ``((indices, indptr, 0, kv_len), max_len, total_len)``: the lengths of the longest
        sequence and of all together (the split choice of a ragged batch needs both).
        """
        key = (tuple(seq_ids), self.book.version)
        if self._tables is not None and self._tables[0] == key:
            note_use(s, self._tables[1][:1])  # its block's free must wait for this stream's use too
            return self._tables[1:]
        indptr, indices, _ = self.book.csr(seq_ids)
        lens = self.book.lengths(seq_ids)
        order = longest_first(lens)
        n, m = len(seq_ids), max(len(indices), 1)
        packed = np.concatenate([indptr, lens, indices if len(indices) else np.zeros(1, np.int32),
                                 order if order is not None else np.zeros(0, np.int32)]).astype(np.int32)
        (d,) = upload([packed], self.device, s)  # one upload for all four
        views = [DeviceArray(d.ptr + 4 * off, (k,), np.int32, self.device, owner=d, stream=s)
                 for off, k in ((0, n + 1), (n + 1, n), (2 * n + 1, m), (2 * n + 1 + m, n))]
        tables = (views[2], views[0], 0, views[1], views[3] if order is not None else None)
        self._tables = (key, tables, int(lens.max(initial=0)), int(lens.sum(dtype=np.int64)))
        return self._tables[1:]

    def decode_tables(self, seq_ids, s) -> tuple:
        """The decode's device page table of ``seq_ids`` (block-table form), kept current by one-token
        appends (:class:`~pyattn.paged.decode_table.DecodeTable`); built anew after any other change.

        Returns ``((pages, None, row stride, kv_len, order), max_len, total_len)`` as
        :meth:`device_tables` does.
        """
        ids = tuple(seq_ids)
        t = self._dtab
        if t is None or t.version != self.book.version or t.ids != ids:
            t = self._dtab = DecodeTable(self.book, ids, self.device, s)
        else:
            t.use(s)
        return (t.tables, *t.span)

    def __repr__(self) -> str:
        dt = f"{self.dtype} codes + float32 scales per token and kv head" if self._kv else str(self.dtype)
        return (f"PagedKVCache({self.num_pages} pages x {self.page_size} tokens, {self.num_kv_heads} kv heads, "
                f"head_dim {self.head_dim}, {dt}, {self.num_free_pages} pages free)")

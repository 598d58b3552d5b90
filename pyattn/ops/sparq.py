"""``pyattn.sparq_decode``: SparQ attention over a :class:`pyattn.PagedKVCache` (approximate decode).

The plan and launches: the ``sparq_score`` and ``sparq_select`` kernels choose each (sequence, kv
head)'s keys reading only r of the transposed keys' channels; the paged decode kernel attends over
the chosen keys (each a one-slot "page" of the pools) for the queries and, in the tile's spare
rows, for q~ (whose log-sum-exp gives alpha), and as its last step blends in the mean of V. See
``kernels_src/sparq.cuh`` and :mod:`pyattn.reference_sparq`. A repeat call on a device q is found by
its quick key and reads only q's pointer and producer, as ``decode`` does.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..array import DeviceArray
from ..interop.inputs import read_args
from ..interop.quick import quick_key
from ..kernels.registry import get_kernel
from ..kernels.specs import DTYPES, KernelSpec, decode_max_q_tiles
from ..paged.cache import PagedKVCache
from ..pipeline.device import begin, bind, finish, output, start
from ..pipeline import host
from ..pipeline.plans import Memo, get_plan, ptx_requested
from ..runtime.device import keeps_context
from ..runtime.launch import launch
from ..runtime.memory import get_pool
from ..runtime.stream import check_stream_arg
from ..validate.options import LOG2E, check_bool
from ..validate.paged import DecodeProblem, PoolInfo
from ..validate.sparq import check_sparq
from ._decode import blocks_per_sm, run_decode

__all__ = ["sparq_decode"]

_CHUNK = 2048  # keys a block of the score / select stages takes per step (kSparqChunk)
_MAX_STEPS = 16  # steps a block takes at most (the select stage's per-block counts stay < 2**15)
_BINS = 4096
_quick = Memo()  # quick key -> pipeline.device.Bound of a call on a device q


class _Plan(NamedTuple):
    kernels: tuple  # score, select
    packer: object  # PartialPack: the per-call fields -> SparqParams bytes
    threads: int
    decode: DecodeProblem  # the attention over the chosen keys
    rows: int
    slots: tuple  # concurrent blocks on the GPU of the score and the select kernels


def _build(P, device) -> _Plan:
    specs = [KernelSpec(f"sparq_{stage}", DTYPES[P.dtype.name][0], 32, device.arch, ptx_requested())
             for stage in ("score", "select")]
    spec = specs[0]
    pool, D, G = P.pool, P.head_dim, P.row_group
    H = pool.heads_kv
    kt = (H * D * pool.page_size, D * pool.page_size)  # the cache's kt pool, C-contiguous
    packer = spec.params.partial({
        "q_stride_b": P.q_strides[0], "q_stride_h": P.q_strides[1], "kt_stride_page": kt[0], "kt_stride_h": kt[1],
        "vsum_stride_row": H * D,
        "batch": P.batch, "heads_kv": H, "group": G, "head_dim": D, "page_size": pool.page_size, "r": P.r, "k": P.k,
        "scale_log2": P.scale * LOG2E, "row_heads": P.row_heads, "kv_div": P.group if P.per_head else 1})
    # Each chosen key is its own page of one slot: row (slot * H + kv head) of the NHD pools. The
    # decode's rows are (q_0 .. q_{G-1}, q~_0 .. q~_{G-1}), and its output SparQ's: (rows, G, D).
    rows_pool = PoolInfo(pool.num_pages * pool.page_size * H, 1, 1, D, pool.dtype, (D, D, D), (D, D, D))
    rows = P.batch * P.row_heads
    dec = DecodeProblem(rows, 1, 2 * G, 1, D, P.dtype, (2 * G * D, 2 * G * D, D), True, 0, (-1, -1), 0.0,
                        P.scale, None, None, rows_pool)
    kernels = tuple(get_kernel(sp, device) for sp in specs)
    slots = tuple(device.sm_count * blocks_per_sm(sp, k) for sp, k in zip(specs, kernels))
    return _Plan(kernels, packer, spec.threads, dec, rows, slots)


def _workspace(rows: int, G: int, D: int, n_chunks: int, steps: int) -> tuple:
    """Byte offsets of the workspace's parts (``SparqParams.off_*``), in order, and the row stride
    ``lpad`` of its per-key arrays; ``offs["end"]`` is its size. ``n_chunks``: blocks a row; the
    rows' finish records hold a float a head and ``D``, the mean of the row's values."""
    lpad = n_chunks * steps * _CHUNK
    # (The histograms and counters are not here: they live in the stream's zeroed counter block.)
    parts = [("part", rows * n_chunks * G * 2), ("score", rows * lpad), ("info", rows * 4), ("cand_u", rows * lpad),
             ("cand_i", rows * lpad), ("fin", rows * (G + D))]
    offs, at = {}, 0
    for name, words in parts:  # 4-byte words, each part 256-byte aligned
        offs[name] = at
        at += -(-4 * words // 256) * 256
    offs["end"] = at
    return offs, lpad


def _run(P, plan, cache, ids, q_ptr, s, return_indices):
    """Launch every stage for validated problem ``P``; returns (out, positions or None)."""
    device = cache.device
    capture = cache.order(s)  # (0: refused otherwise)
    (indices, indptr, _, kv_len, _), max_len, _ = cache.device_tables(ids, s)
    vrow = cache.sparq_rows(ids, s)
    G, D, rows = P.row_group, P.head_dim, plan.rows
    # Steps of 2048 keys a block: enough that the score and select grids are each about one wave of
    # their kernel (a block's fixed work, its histogram and its counter claims, then recurs once a
    # row and wave). The scores' layout (lpad) follows the score stage's blocks.
    chunks = -(-max_len // _CHUNK)
    steps, steps_sel = (max(1, min(chunks, _MAX_STEPS, -(-rows * chunks // slots))) for slots in plan.slots)
    n_chunks, n_sel = -(-chunks // steps), -(-chunks // steps_sel)
    k_max = min(P.k, max_len)
    offs, lpad = _workspace(rows, G, D, n_chunks, steps)
    isz = P.dtype.itemsize
    qx_bytes = -(-rows * 2 * G * D * isz // 256) * 256
    idx_bytes = -(-rows * k_max * 4 // 256) * 256
    ws = output(device, s, (offs["end"] + qx_bytes + 2 * idx_bytes + 4 * rows,), np.uint8, capture)
    qx, sel = ws.ptr + offs["end"], ws.ptr + offs["end"] + qx_bytes
    sel_pos, dec_len = sel + idx_bytes, sel + 2 * idx_bytes
    out = output(device, s, (P.batch, 1, P.heads_q, D), P.dtype, capture)

    def go(kernel, grid, block_steps):
        params = plan.packer.pack(q_ptr, qx, cache.kt.ptr, indices.ptr, indptr.ptr, kv_len.ptr, ws.ptr, sel, sel_pos,
                                  dec_len, cache.v_sum.ptr, vrow.ptr, zeroed, lpad, offs["part"], offs["score"],
                                  offs["info"], offs["cand_u"], offs["cand_i"], offs["fin"], n_chunks, block_steps,
                                  k_max)
        launch(kernel, grid, (plan.threads, 1, 1), 0, s, params)

    # The rows' histograms and counters (the score blocks add into them): the stream's counter
    # block, zero when the score stage starts and left zero by the select stage (sparq_common.cuh's
    # sparq_ctr), so a call needs no memset of its own. The chosen-key decode takes the same block
    # for its split counters after the select stage, and leaves them zero as well. (When the block
    # grows, its memset comes right before the score stage: the driver lets a programmatic launch
    # overlap only a previous kernel that asks for it, so the score stage still follows the memset.)
    zeroed, _ = get_pool(device).counters(rows * (_BINS + 4), s, capture)  # (no capture: nothing to keep)
    score_k, select_k = plan.kernels
    # On sm_90+ every stage and the decode launch as the kernel before's programmatic dependent
    # (each entry waits for it: kernels_src/pdl.cuh), so that each launch overlaps that kernel's tail.
    go(score_k, (n_chunks, rows, 1), steps)
    go(select_k, (n_sel, rows, 1), steps_sel)
    tables = (DeviceArray(sel, (rows * k_max,), np.int32, device, owner=ws, stream=s), None, k_max,
              DeviceArray(dec_len, (rows,), np.int32, device, owner=ws, stream=s), None)
    run_decode(plan.decode, device, qx, cache.k.ptr, cache.v.ptr, tables, k_max, 0, s, False, capture=capture,
               sparq=(ws.ptr + offs["fin"], out))
    finish(s, [ws, vrow])
    pos = DeviceArray(sel_pos, (P.batch, P.row_heads, k_max), np.int32, device, owner=ws, stream=s) \
        if return_indices else None
    return out, pos


def _check_lengths(cache, ids) -> None:
    """Every call: each sequence must hold a token (its length changes between calls)."""
    empty = [sid for sid, n in zip(ids, cache.book.lengths(ids)) if n == 0]
    if empty:
        raise ValueError(f"seq_ids: SparQ needs at least one cached token per sequence; empty: {empty}")


def _no_address_check(P, ptrs) -> None:
    """A repeat call's address checks: none, q is read element by element (sparq_choose)."""


@keeps_context
def sparq_decode(q, cache, seq_ids, *, r, k, scale=None, select="group", return_indices=False, stream=None):
    """SparQ attention (Ribar et al., 2024) of one new query token per sequence over a paged cache.

    Per sequence and kv head (``select="group"``) or query head (``"head"``): the ``r`` query
    channels of largest magnitude (summed over the GQA group) approximate the scores against the
    keys, reading only those ``r`` rows of the cache's transposed key copy; the ``k`` keys with the
    largest approximate scores are attended exactly, and the result is blended with the mean of all
    the sequence's values by the approximate softmax mass of the chosen keys (alpha). The algorithm
    is :func:`pyattn.reference.sparq_ref`.

    Parameters
    ----------
    q : array, (batch, 1, heads_q, head_dim)
        The cache's dtype (float16 / bfloat16), NumPy or device; append the tokens' K/V first.
    cache : PagedKVCache
        Made with ``sparq=True``.
    seq_ids : sequence of int
        One live, non-empty sequence per batch row, no repeats.
    r : int
        Query channels of the approximate scores, 1 to head_dim (the paper's r; ``head_dim / 4``
        reads a quarter of the keys' bytes).
    k : int
        Keys attended per (sequence, kv head), >= 1; a sequence with at most k tokens attends to all
        of them exactly (alpha = 1).
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    select : {"group", "head"}
        ``"group"``: a GQA group's query heads share the chosen channels and keys, so a step reads what
        a multi-head model's would (the bandwidth SparQ saves); less accurate when the heads attend
        differently (BENCHMARKS.md). ``"head"``: every query head chooses its own, the paper's
        algorithm, reading up to ``group`` times the channels and keys. The same for group 1.
    return_indices : bool
        Also return the chosen positions, int32 (batch, heads_kv or heads_q, min(k, longest length)):
        row (b, h) holds ``min(k, length_b)`` distinct positions in no particular order, then
        unspecified values.
    stream : optional

    Returns
    -------
    out : array (batch, 1, heads_q, head_dim), q's dtype; NumPy for NumPy q
    positions : array, only with ``return_indices``

    Notes
    -----
    Bytes read per (sequence, kv head) and step: ``r`` of the ``head_dim`` channels of the keys,
    ``k`` full key and value rows, and small per-key scores (8 bytes); at ``r = head_dim / 4`` and
    ``k = L / 8``, about a quarter of exact decode's. The scoring reads the transposed keys a
    page's channel row at a time (``2 * page_size`` bytes), so pages of 64 tokens or more serve it
    best: on an H200 at batch 8 x 32k the scoring takes 1.6x as long at page 16 as at page 64, a
    call 1.25x (BENCHMARKS.md, sixty-ninth session). The chosen set depends on the approximate
    scores' float32 rounding, so keys whose scores tie within that rounding may be swapped against
    the float64 reference.
    """
    params = locals()  # first thing: the parameters and nothing else
    check_stream_arg(stream)
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a pyattn.PagedKVCache, got {type(cache).__name__}")
    if cache.kt is None:
        raise ValueError("cache: sparq_decode needs a PagedKVCache made with sparq=True")
    ids = cache.check_ids(seq_ids)  # every call: which sequences are live is not part of any key
    # The problem depends on the cache's layout and on how many sequences, not which (a copy: the
    # frame's own locals() must not change, and keys must not hold the cache alive). A repeat call
    # on a device q (its quick key seen) reads only q's pointer and producer, as decode does: the
    # full path's reading and validation were a fifth of the call's host time (dev/host_cost_cpu.py).
    keyed = dict(params, cache=cache.layout_key, seq_ids=len(ids))
    reads = {}
    qkey = quick_key(keyed, reads)
    bound = _quick.get(qkey)
    if bound is not None:
        _check_lengths(cache, ids)
        P = bound.problem
        s, (q_ptr,) = begin(bound, stream, (q,), reads)
        out, pos = _run(P, get_plan(_build, P, bound.device), cache, ids, q_ptr, s, return_indices)
        return (out, pos) if return_indices else out
    a = read_args(keyed, ("q",), ("q",))
    return_indices = check_bool("return_indices", return_indices)
    pool = cache.pool_info
    bucket = next(b for b in (32, 64, 96, 128, 160, 192, 224, 256) if b >= pool.head_dim)
    P = check_sparq(a["q"], pool, r=r, k=k, scale=scale, select=select,
                    max_rows_per_tile=16 * decode_max_q_tiles(cache.device.arch, bucket))
    if len(ids) != P.batch:
        raise ValueError(f"seq_ids: expected {P.batch} ids (q's batch), got {len(ids)}")
    _check_lengths(cache, ids)
    if a["q"].on_device:
        device, s, (dq,) = start(stream, [a["q"]])
        if device is not cache.device:
            raise ValueError(f"q: expected an array on the cache's device {cache.device.ordinal}, "
                             f"got device {device.ordinal}")
        _quick.put(qkey, bind(P, device, [a["q"]], _no_address_check))
        out, pos = _run(P, get_plan(_build, P, device), cache, ids, dq.ptr, s, return_indices)
        finish(s, [dq])
        return (out, pos) if return_indices else out

    def run(dev, s):  # NumPy q: uploaded, results copied back (pyattn.pipeline.host.call)
        out, pos = _run(P, get_plan(_build, P, dev[0].device), cache, ids, dev[0].ptr, s, return_indices)
        return (out, pos) if return_indices else (out,)

    res = host.call(run, [np.ascontiguousarray(a["q"].obj)], [], stream)
    return tuple(res) if return_indices else res[0]

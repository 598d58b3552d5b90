"""contiguous_decode's plan pieces: the caches seen as a page pool, its kept page table, and the
append of new tokens into the caches (the paged cache's kv_append kernel over that pool).

- The caches are read as a pool of pages of ``P`` slots (the largest power of two from 16 up to
  :data:`VIEW_PAGE` that divides ``max_len`` and the sequence stride): sequence ``b``'s page ``j``
  is pool page ``b * per + j``. That table is the same at every call on caches of one geometry, so
  it is built and uploaded once (one synchronisation) and kept, as the TMA decode's tensor maps are.
  Where no such ``P`` exists, each sequence is one page of ``max_len`` slots (on sm_90a the TMA
  kernel takes only power-of-two pages from 16; other pages run on the cp.async kernel).
- Token ``t`` of sequence ``b`` is pool slot ``b * per * P + t`` either way (the table is
  linear), so the append's destinations need no table lookup.
- Under ``max_seqlen`` the lengths stay on the device: the append's items are then the same at
  every call of one geometry (slots at length 0, and sources), uploaded once and kept, and the
  kernel shifts each by its sequence's length as it finds it and writes the lengths after the
  append for the decode (``KV_APPEND_PARAMS``'s ``dst_base``): a CUDA graph replays that step.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np

from ..kernels.registry import generation, get_kernel
from ..kernels.specs import DTYPES, KernelSpec
from ..paged.appender import launch_kv_append, pool_fields, post_items
from ..pipeline.device import output
from ..pipeline.host import upload
from ..pipeline.plans import ptx_requested
from ..runtime.mailbox import Mailbox
from ..validate.paged import PoolInfo

__all__ = ["VIEW_PAGE", "paged_view", "page_table", "Append", "new_tokens", "launch_append", "launch_append_on_device"]

# The largest page the caches are viewed as. On an H200 (bf16 GQA 32/8 D 128) the TMA decode over
# pages of 64 to 256 slots ran level with each other and 1-3% ahead of pages of 16 (BENCHMARKS.md,
# thirty-eighth session, dev/probe_contiguous.py, which sets this to compare).
VIEW_PAGE = 128

# (device ordinal, batch, pages a sequence stride spans, pages a sequence holds) -> DeviceArray:
# the view's page table, built once per cache geometry (bounded: caches that come and go push the
# oldest out).
_tables: dict = {}
_MAX_TABLES = 32


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


def page_table(device, batch: int, per: int, cols: int, s):
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


class Append(NamedTuple):
    """What a call's append of new tokens keeps between calls (one geometry, one new-token layout)."""

    n_new: int
    dst0: np.ndarray  # int32 (batch * n_new,): the new tokens' pool slots at length 0 (add the length)
    src: np.ndarray  # int32 (batch * n_new,): their rows of the new tokens' token stride
    strides: tuple  # (token, head) element strides of the new K and V tokens on the device
    packers: dict  # (device ordinal, K / V cache addresses, kernel generation) -> (kernel, PartialPack, threads)
    kept: dict  # device ordinal -> DeviceArray of dst0 then src (launch_append_on_device's items)


def new_tokens(view: PoolInfo, per: int, batch: int, n_new: int, rows: int, strides: tuple) -> Append:
    """The :class:`Append` of ``n_new`` tokens a sequence, token i of sequence b being row
    ``b * rows + i`` of the new tokens (:func:`pyattn.validate.contiguous.check_new_tokens`)."""
    b, i = np.arange(batch, dtype=np.int64)[:, None], np.arange(n_new)
    dst0 = (b * (per * view.page_size) + i).ravel()
    if view.num_pages * view.page_size >= 2**31:
        raise ValueError(f"k_cache: the append addresses pool slots in int32; these caches hold "
                         f"{view.num_pages * view.page_size} slots")
    return Append(n_new, dst0.astype(np.int32), (b * rows + i).ravel().astype(np.int32), strides, {}, {})


@functools.lru_cache(maxsize=16)
def _append_spec(dtype: str, arch: str, ptx: bool) -> KernelSpec:
    """kv_append's spec for a 16-bit pool of ``dtype`` (a spec costs microseconds a decode step)."""
    return KernelSpec("kv_append", DTYPES[dtype][0], 32, arch, ptx)


def _packer(device, view: PoolInfo, k: int, v: int, ap: Append):
    """kv_append's kernel, the struct with the caches' fields packed and the block size, once per
    cache pair (a model's layers) and kernel generation (``override_tiles``). A step that appends
    looked the spec, its tiles and the kernel up each call before: ~3 us of its host time."""
    key = (device.ordinal, k, v, generation())
    hit = ap.packers.get(key)
    if hit is None:
        spec = _append_spec(view.dtype.name, device.arch, ptx_requested())
        if len(ap.packers) >= _MAX_PACKERS:
            ap.packers.pop(next(iter(ap.packers)))
        hit = ap.packers[key] = (get_kernel(spec, device), spec.params.partial(pool_fields(view, k, v)), spec.threads)
    return hit


def launch_append_on_device(device, s, view: PoolInfo, k: int, v: int, ap: Append, lens: int, bound: int,
                            k_src: int, v_src: int, capture=None):
    """Write the new tokens into the caches from each sequence's length as the kernel reads it at
    device address ``lens`` (clamped into ``[0, bound - n_new]``): one kv_append launch over the
    geometry's kept items, with no host data per call (what a CUDA graph can replay). The items
    are uploaded at the first call (one synchronisation, refused inside a capture: make one call
    before it). Returns the lengths after the append, an int32 (batch,) DeviceArray the kernel
    writes, for the decode behind it (hold it until that launch); ``capture`` as
    :meth:`~pyattn.runtime.memory.DevicePool.allocate`'s, for its allocation."""
    items = ap.kept.get(device.ordinal)
    if items is None:
        (items,) = upload([np.concatenate([ap.dst0, ap.src])], device, s)
        s.synchronize()  # once per geometry: a later call on another stream then reads it safely
        ap.kept[device.ordinal] = items
    kernel, packer, threads = _packer(device, view, k, v, ap)
    after = output(device, s, (len(ap.src) // ap.n_new,), np.int32, capture)
    launch_kv_append(kernel, packer, view.heads_kv * (view.head_dim // 8), threads, device.sm_count, s, items.ptr,
                     len(ap.src), (k_src, ap.strides), (v_src, ap.strides),
                     base=(lens, after.ptr, ap.n_new, bound - ap.n_new))
    return after


def launch_append(device, s, view: PoolInfo, k: int, v: int, ap: Append, lens, k_src: int, v_src: int) -> None:
    """Write the new tokens (device addresses ``k_src``, ``v_src``) into the caches ``k``, ``v``
    from position ``lens[b]`` of each sequence b on (``lens``: an int, or a host int array
    (batch,)): one kv_append launch, its items through this thread's mailbox (an upload was ~30 us
    of a decode step's host time on the fake driver, ``dev/host_cost_cpu.py``)."""
    kernel, packer, threads = _packer(device, view, k, v, ap)
    shift = lens if isinstance(lens, int) else np.repeat(np.asarray(lens, np.int32), ap.n_new)
    box = _mailbox(device)
    items, slot, keep = post_items(box, [ap.dst0 + shift, ap.src], device, s)
    # 16-bit caches: one thread a 16-byte chunk of a token's row of every kv head
    launch_kv_append(kernel, packer, view.heads_kv * (view.head_dim // 8), threads, device.sm_count, s, items,
                     len(ap.src), (k_src, ap.strides), (v_src, ap.strides))
    if slot is not None:
        box.sent(slot, s)


_MAX_PACKERS = 256
_boxes = threading.local()  # .by_device: device ordinal -> this thread's Mailbox


def _mailbox(device) -> Mailbox:
    """This thread's mailbox for ``device`` (a Mailbox has one user at a time), made at first use."""
    boxes = getattr(_boxes, "by_device", None)
    if boxes is None:
        boxes = _boxes.by_device = {}
    box = boxes.get(device.ordinal)
    if box is None:
        box = boxes[device.ordinal] = Mailbox()
    return box

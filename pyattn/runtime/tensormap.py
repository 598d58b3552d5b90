"""TMA tensor maps (``CUtensorMap``) for the kernels that load through the Tensor Memory Accelerator.

A tensor map describes a strided tensor in global memory and the box one copy instruction moves
(for q, k and v: 64 elements of the contiguous head dim, i.e. one 128-byte swizzle row, times a
tile of rows; for a mask tensor: a 32- to 128-byte run of keys times the tile's query rows). The driver encodes it on the host (``cuTensorMapEncodeTiled``, no device work, no
context needed); the kernel receives its 128 bytes inside the parameter struct. It holds the
array's address, so a call with new arrays needs new maps: :func:`encode_tiled` keeps the last
maps it made (most calls repeat the addresses of their buffers: a framework's allocator hands the
same blocks back, serving loops reuse theirs), and a miss costs one driver call per map.
"""

from __future__ import annotations

import struct
import threading

from .errors import check

__all__ = ["MAX_MEMO", "rank4", "page_rank5", "encode_tiled"]

MAX_MEMO = 256  # maps kept; each is 128 bytes (the key a few more): a bounded, small cache

_memo: dict = {}
_args: dict = {}  # (dtype, layout, box, swizzle, l2_promotion) -> the encode call's arguments but the address
_lock = threading.Lock()
_enums = None
_OPAQUE = struct.Struct("16Q")


def rank4(head_dim: int, rows: int, heads: int, batch: int, strides: tuple, itemsize: int):
    """``(dims, byte_strides)`` of the rank-4 map (head dim, rows, heads, batch) of a (batch, rows,
    heads, head_dim) tensor with element ``strides`` (batch, rows, heads) and a contiguous head
    dim; None when TMA cannot read it.

    An axis whose stride is 0 (varlen's batch axis, a broadcast) becomes an axis of size 1 and the
    kernel reads index 0 on it; an axis of size 1 is never stepped, so it gets 16 bytes (TMA wants
    strides that are positive multiples of 16). None when the rows axis is broadcast (stride 0
    over several rows: the kernel steps rows by coordinates) or a stepped stride is not a multiple
    of 16 bytes.
    """
    dims, out = [head_dim], []
    for axis, (size, stride) in enumerate(((rows, strides[1]), (heads, strides[2]), (batch, strides[0]))):
        if stride == 0 and size > 1:
            if axis == 0:
                return None
            size = 1
        step = stride * itemsize if size > 1 else 16
        if step % 16 or step <= 0:
            return None
        dims.append(max(size, 1))  # TMA wants sizes >= 1; an empty axis is never read (no tiles)
        out.append(step)
    return tuple(dims), tuple(out)


def page_rank5(head_dim: int, page_size: int, pages: int, strides: tuple, itemsize: int):
    """``(dims, byte_strides)`` of the rank-5 map (64 columns, 16 slots, column block, slot / 16,
    page) of ONE kv head of a paged pool with element ``strides`` (page, slot, head): its address is
    the head's first element. A box (64, 16, head_dim / 64, n / 16) brings n slots' rows whole, as
    [n / 16][head_dim / 64][16][64] (the 16-bit TMA decode's ring); ``head_dim`` a multiple of 64
    and ``page_size`` of 16 (the columns then never run past the head, nor the slots past a page).
    An axis of one index (one slot group, one page) is never stepped and gets 16 bytes, as in
    :func:`rank4`.
    """
    slot, page = strides[1] * itemsize, strides[0] * itemsize
    return ((64, 16, head_dim // 64, page_size // 16, pages),
            (slot, 128, 16 * slot if page_size > 16 else 16, page if pages > 1 else 16))


def _driver_enums():
    global _enums
    if _enums is None:
        from cuda.bindings import driver as d

        t, sw = d.CUtensorMapDataType, d.CUtensorMapSwizzle
        types = {"f16": t.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, "bf16": t.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                 "f32": t.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, "u8": t.CU_TENSOR_MAP_DATA_TYPE_UINT8,
                 "u32": t.CU_TENSOR_MAP_DATA_TYPE_UINT32}
        swizzles = {0: sw.CU_TENSOR_MAP_SWIZZLE_NONE, 32: sw.CU_TENSOR_MAP_SWIZZLE_32B,
                    64: sw.CU_TENSOR_MAP_SWIZZLE_64B, 128: sw.CU_TENSOR_MAP_SWIZZLE_128B}
        l2 = d.CUtensorMapL2promotion
        promotions = {0: l2.CU_TENSOR_MAP_L2_PROMOTION_NONE, 64: l2.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
                      128: l2.CU_TENSOR_MAP_L2_PROMOTION_L2_128B, 256: l2.CU_TENSOR_MAP_L2_PROMOTION_L2_256B}
        _enums = (d, types, d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzles, promotions,
                  d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return _enums


def encode_tiled(dtype: str, ptr: int, layout: tuple, box: tuple, swizzle: int = 128,
                 l2_promotion: int = 256) -> bytes:
    """The 128 bytes of a tensor map over ``layout`` at address ``ptr``.

    One copy moves ``box = (inner, rows)``: ``inner`` elements of the contiguous axis (``swizzle``
    bytes: one row of that swizzle, which the copy applies) by ``rows`` rows of one index of the
    two outer axes. Elements outside the tensor arrive as zeros.

    Parameters
    ----------
    dtype : str
        ``"f16"``, ``"bf16"``, ``"f32"``, ``"u8"`` (a bool mask's bytes) or ``"u32"`` (its packed words).
    ptr : int
        The tensor's device address (16-byte aligned).
    layout : tuple
        ``(dims, byte_strides)`` from :func:`rank4` or :func:`page_rank5`.
    box : tuple
        ``(inner, rows, ...)``: elements along each axis per copy, each at most 256 (axes left out:
        1).
    swizzle : int
        32, 64 or 128: the swizzle span in bytes (``inner`` elements fill it); 0: none (then
        ``inner`` elements are any multiple of 16 bytes).
    l2_promotion : int
        0, 64, 128 or 256: the bytes the L2 fetches for each box row it misses (0: the row's own
        sectors). 256 (the default, the dense prefill maps') may fetch a neighbouring head's row
        along; maps whose boxes other blocks do not read soon after (the decode pools') want the
        row's own 128 (see ``pyattn.ops._decode.pool_maps``).

    Raises
    ------
    CudaError
        When the driver refuses the map (its error name says why).
    """
    key = (dtype, ptr, layout, box, swizzle, l2_promotion)
    found = _memo.get(key)
    if found is not None:
        return found
    d = _driver_enums()[0]
    shape_key = (dtype, layout, box, swizzle, l2_promotion)  # everything but the address
    args = _args.get(shape_key)
    if args is None:  # the binding takes its own integer wrappers, not ints: made once per layout
        _, types, interleave, swizzles, promotions, fill = _driver_enums()
        u64, u32 = d.cuuint64_t, d.cuuint32_t
        dims, strides = layout
        rank = len(dims)
        args = ((types[dtype], u32(rank)),
                ([u64(x) for x in dims], [u64(x) for x in strides], [u32(x) for x in box + (1,) * (rank - len(box))],
                 [u32(1)] * rank, interleave, swizzles[swizzle], promotions[l2_promotion], fill))
        with _lock:
            if len(_args) >= MAX_MEMO:
                _args.clear()
            _args[shape_key] = args
    head, tail = args
    tmap = check(d.cuTensorMapEncodeTiled(*head, ptr, *tail),
                 f"cuTensorMapEncodeTiled(dtype={dtype}, layout={layout}, box={box}, swizzle={swizzle})")
    raw = _OPAQUE.pack(*[int(x) for x in tmap.opaque])
    with _lock:
        if len(_memo) >= MAX_MEMO:
            _memo.clear()  # a bounded cache; refilling it costs one driver call per map
        _memo[key] = raw
    return raw

"""GPU tests of the TMA-fed sm_90a kernel (attn_fwd_tma) against the fp64 reference; marked ``gpu``,
skipped without an sm_90a GPU.

The other GPU modules reach it too (every 16-bit call on sm_90a whose bucket its table has);
these aim at what is new on its path: tensor maps over strided views, broadcast (stride 0) axes,
head dims below and between the 64-wide boxes, GQA, varlen rows read past a sequence's end, maps
re-encoded when the same layout comes with other arrays, and mask tensors: float masks' swizzled
tiles, bool masks packed to bits, key-padding masks (one row for all), tiles the mask leaves
untouched (skipped work) next to mixed and fully masked ones, and mask views TMA cannot read.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.array import DeviceArray
from pyattn.kernels.families import tile_table
from pyattn.kernels.specs import select_attention_spec
from pyattn.reference import error_bound

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_gpu_attention import DTYPES, _check, _inputs  # noqa: E402
from test_gpu_wgmma_ws import _is_sm90a  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = st.sampled_from([1, 63, 64, 65, 127, 128, 129, 300]) | st.integers(1, 400)
TMA_DIMS = [d for d in (32, 40, 64, 72, 96, 128, 136, 160, 192, 200, 256)
            if select_attention_spec("bfloat16", d, "sm_90a").family == "attn_fwd_tma"]


def _view(base: DeviceArray, offset_elems: int, shape: tuple, strides: tuple) -> DeviceArray:
    """A view of ``base`` at an element offset with element ``strides`` (DeviceArray takes bytes)."""
    size = base.dtype.itemsize
    return DeviceArray(base.ptr + offset_elems * size, shape, base.dtype, base.device,
                       strides=tuple(s * size for s in strides), owner=base.owner, stream=base.stream)


def _tma_row(head_dim: int, table: str = "dense"):
    """attn_fwd_tma's tile-table row for ``head_dim``'s bucket (None without one)."""
    from pyattn.kernels.families import tile_table

    bucket = select_attention_spec("bfloat16", head_dim, "sm_90a", keys=1 << 20).head_dim
    return next((r for r in tile_table("attn_fwd_tma", "sm_90a", table=table) if r.max_head_dim == bucket), None)


def test_the_dense_path_is_the_tma_kernel():
    assert TMA_DIMS, "attn_fwd_tma serves no head dim"
    assert select_attention_spec("bfloat16", 128, "sm_90a", mask="bool").family == "attn_fwd_tma"


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk=LENGTHS, Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       D=st.sampled_from(TMA_DIMS or [128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       causal=st.sampled_from([False, True, "top_left"]), window=st.sampled_from([None, (100, 0), (37, 11)]),
       softcap=st.sampled_from([None, 15.0]), alibi=st.booleans(), layout=st.sampled_from(["bshd", "bhsd"]),
       seed=st.integers(0, 2**31 - 1))
def test_tma_kernel_matches_the_reference(B, Sq, Sk, Hkv, group, D, dtype, causal, window, softcap, alibi, layout,
                                          seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype, layout)
    opts = dict(causal=causal, window=window, softcap=softcap, layout=layout)
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, Hkv * group).astype(np.float32)
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    _check(out, lse, q, k, v, **opts)


@SETTINGS
@given(B=st.integers(1, 3), S=LENGTHS, H=st.integers(1, 3), D=st.sampled_from(TMA_DIMS or [128]),
       dtype=st.sampled_from(["float16", "bfloat16"]), causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_packed_qkv_views(B, S, H, D, dtype, causal, seed):
    """q, k, v as views into one (B, S, 3, H, D + 8) buffer: row strides of 3 H (D + 8) elements,
    a head stride that is not the head dim, and the padding columns never read."""
    rng = np.random.default_rng(seed)
    host = rng.standard_normal((B, S, 3, H, D + 8)).astype(DTYPES[dtype])
    base = pyattn.asarray(host)
    st_ = (S * 3 * H * (D + 8), 3 * H * (D + 8), D + 8, 1)
    q, k, v = (_view(base, i * H * (D + 8), (B, S, H, D), st_) for i in range(3))
    out = pyattn.attention(q, k, v, causal=causal)
    _check(out.numpy(), None, *(np.ascontiguousarray(host[:, :, i, :, :D]) for i in range(3)), causal=causal)


@pytest.mark.parametrize("Sk", [300, 4096])  # d = 64: the short row below 2048 keys, the dense row from there
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_outputs_through_views_4_bytes_aligned(D, Sk):
    """The warp-specialized rows store O in 16-byte pieces when the output's rows are 16-byte
    aligned, else in 4-byte pairs (the others always in pairs): an ``out=`` view 4 bytes off with a
    row stride of D + 2 elements takes the pairs (and the columns between the rows stay untouched);
    the same call into a fresh output takes the 16-byte stores, with the same result."""
    rng = np.random.default_rng(D + Sk)
    B, Sq, H = 2, 333, 2
    q, k, v = (pyattn.asarray(x) for x in _inputs(rng, B, Sq, Sk, H, H, D, "bfloat16"))
    row = H * (D + 2)
    base = pyattn.asarray(np.full((B * Sq * row + 2,), 7.0, dtype=ml_dtypes.bfloat16))
    out = _view(base, 2, (B, Sq, H, D), (Sq * row, row, D + 2, 1))
    assert out.ptr % 16 == 4
    res, lse = pyattn.attention(q, k, v, causal=True, out=out, return_lse=True)
    fresh = pyattn.attention(q, k, v, causal=True)
    hq, hk, hv = (x.numpy() for x in (q, k, v))
    _check(fresh.numpy(), None, hq, hk, hv, causal=True)
    got = base.numpy()[2:].reshape(B, Sq, H, D + 2)
    _check(got[..., :D], lse.numpy(), hq, hk, hv, causal=True)
    assert np.array_equal(got[..., :D].astype(np.float32), fresh.numpy().astype(np.float32))
    assert (got[..., D:].astype(np.float32) == 7.0).all() and base.numpy()[:2].astype(np.float32).tolist() == [7, 7]


@pytest.mark.parametrize("D", [64, 128])
def test_keys_broadcast_over_the_batch(D):
    """K and V with batch stride 0 (one cache shared by every batch entry): a map axis of size 1."""
    if D not in TMA_DIMS:
        pytest.skip(f"attn_fwd_tma does not serve d={D}")
    rng = np.random.default_rng(D)
    B, Sq, Sk, H = 3, 77, 200, 2
    q = rng.standard_normal((B, Sq, H, D)).astype(ml_dtypes.bfloat16)
    kv1 = [rng.standard_normal((1, Sk, H, D)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    dk, dv = (pyattn.asarray(x) for x in kv1)
    k, v = (_view(x, 0, (B, Sk, H, D), (0, H * D, D, 1)) for x in (dk, dv))
    out, lse = pyattn.attention(pyattn.asarray(q), k, v, return_lse=True)
    kb, vb = (np.broadcast_to(x, (B, Sk, H, D)) for x in kv1)
    _check(out.numpy(), lse.numpy(), q, kb, vb)


def test_broadcast_sequence_axis_takes_the_cp_async_kernel():
    """A key axis of stride 0 cannot be a TMA map's row axis: the call runs attn_fwd_wgmma, correctly."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 40, 2, 128)).astype(ml_dtypes.bfloat16)
    row = [rng.standard_normal((1, 1, 2, 128)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    k, v = (_view(pyattn.asarray(x), 0, (1, 90, 2, 128), (2 * 128, 0, 128, 1)) for x in row)
    out = pyattn.attention(pyattn.asarray(q), k, v)
    _check(out.numpy(), None, q, *(np.broadcast_to(x, (1, 90, 2, 128)) for x in row))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cap", [15.0, 50.0, 51.0])
def test_softcap_at_its_range_ends(cap, dtype):
    """Rows whose logits all lie far below / above the cap (tanh saturated: every score at -cap or
    +cap, so the row max ties across keys) next to ordinary rows, causal so that rows see 1..S keys,
    at |logits| ~ 400."""
    rng = np.random.default_rng(int(cap))
    B, S, H, D = 1, 300, 2, 128
    u = np.ones(D) / np.sqrt(D)
    sign = np.where(np.arange(S) % 3 == 0, -1.0, np.where(np.arange(S) % 3 == 1, 1.0, 0.0))  # -, +, plain rows
    q = (2 * sign[None, :, None, None] * u + 0.3 * rng.standard_normal((B, S, H, D)) * (sign == 0)[None, :, None, None])
    k = 2 * u + 0.05 * rng.standard_normal((B, S, H, D))
    v = rng.standard_normal((B, S, H, D))
    q, k, v = (x.astype(DTYPES[dtype]) for x in (q, k, v))
    opts = dict(causal=True, softcap=cap, scale=100.0)  # |logits| ~ 400 on the saturated rows
    out, lse = pyattn.attention(q, k, v, return_lse=True, **opts)
    _check(out, lse, q, k, v, **opts)


def test_new_arrays_with_the_same_layout_get_their_own_maps():
    """The maps are memoised by address: a second call with other arrays must read those."""
    rng = np.random.default_rng(5)
    sets = [_inputs(rng, 1, 300, 300, 2, 1, 128, "bfloat16") for _ in range(3)]
    dev = [[pyattn.asarray(x) for x in s] for s in sets]
    for s, d in zip(sets * 2, dev * 2):
        _check(pyattn.attention(*d, causal=True).numpy(), None, *s, causal=True)


MASK_DTYPES = {"bool": np.bool_, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32}


def _block_mask(rng, shape: tuple, kind: str, block: int) -> np.ndarray:
    """A mask of ``shape`` made of ``block`` x ``block`` tiles, each all visible (True / 0), all
    masked (False / -inf) or mixed (random), so that a call meets every kind of tile."""
    *lead, sq, sk = shape
    out = np.empty(shape, np.float64)
    for i in range(0, sq, block):
        for j in range(0, sk, block):
            part = out[..., i:i + block, j:j + block]
            how = rng.integers(4)  # twice as many visible tiles as either other kind
            if how <= 1:
                part[...] = 0.0
            elif how == 2:
                part[...] = -np.inf
            else:
                part[...] = rng.standard_normal(part.shape) * 2
                part[rng.random(part.shape) < 0.3] = -np.inf
    if kind == "bool":
        return out > -np.inf
    return out.astype(MASK_DTYPES[kind])


@SETTINGS
@given(B=st.integers(1, 2), Sq=LENGTHS, Sk16=st.sampled_from([1, 3, 4, 8, 13, 20, 128, 131]),
       Hkv=st.integers(1, 2), group=st.sampled_from([1, 2]), D=st.sampled_from(TMA_DIMS or [128]),
       kind=st.sampled_from(sorted(MASK_DTYPES)), keep=st.tuples(st.booleans(), st.booleans(), st.booleans()),
       block=st.sampled_from([16, 64, 128]), causal=st.booleans(), softcap=st.sampled_from([None, 15.0]),
       alibi=st.booleans(), on_device=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_tma_masks_match_the_reference(B, Sq, Sk16, Hkv, group, D, kind, keep, block, causal, softcap, alibi,
                                       on_device, seed):
    """Every mask kind through the TMA kernel's swizzled tiles (keys a multiple of 16: rows of whole
    16 bytes), with broadcast batch / head / query axes and the other modifiers."""
    Sk = 16 * Sk16
    spec = select_attention_spec("bfloat16", D, "sm_90a", mask=kind, keys=Sk, mask_rows=not keep[2] or Sq == 1)
    rng = np.random.default_rng(seed)
    Hq = Hkv * group
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, "bfloat16")
    shape = tuple(n if kp else 1 for n, kp in zip((B, Hq, Sq), keep)) + (Sk,)
    mask = _block_mask(rng, shape, kind, block)
    opts = dict(causal=causal, softcap=softcap)
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, Hq).astype(np.float32)
    args = [pyattn.asarray(x) for x in (q, k, v, mask)] if on_device else [q, k, v, mask]
    out, lse = pyattn.attention(*args[:3], mask=args[3], return_lse=True, **opts)
    if on_device:
        out, lse = out.numpy(), lse.numpy()
    _check(out, lse, q, k, v, mask=mask, **opts)
    # What ran (the same selection as the call's): TMA unless its table lacks the bucket (d=256
    # with an f32 mask) or the call is shorter than the row's min_keys (d=64: then the short row
    # where the mask rides the dense rows); bool masks packed, float masks broadcast over the query
    # rows as one row a stage (both on the dense rows).
    rows = not keep[2] or Sq == 1
    dense = kind == "bool" or rows
    row = _tma_row(spec.head_dim, table="dense" if dense else {"f32": "mask4"}.get(kind, "mask2"))
    short = _tma_row(spec.head_dim, table="short") if dense else None
    short = short is not None and Sk < (short.max_keys_mods or short.max_keys)  # (a mask: max_keys_mods)
    assert spec.family == ("attn_fwd_tma" if short or (row is not None and Sk >= row.min_keys) else "attn_fwd_wgmma")
    assert spec.q_tiles == short
    if spec.family == "attn_fwd_tma":
        assert spec.mask == ("bits" if kind == "bool" else f"{kind}_row" if rows else kind)


@pytest.mark.parametrize("kind", sorted(MASK_DTYPES))
def test_key_padding_masks(kind):
    """(B, 1, 1, Sk) masks hiding each sequence's padded tail, the common serving mask: one row
    that every query row reads (float masks: one unswizzled row a stage, "<kind>_row"). A batch
    entry whose keys are all padding gets 0 / LSE -inf."""
    rng = np.random.default_rng(11)
    B, Sq, Sk, H, D = 3, 200, 2048 + 64, 2, 128
    q, k, v = _inputs(rng, B, Sq, Sk, H, H, D, "bfloat16")
    keep = np.arange(Sk)[None, :] < np.array([Sk, 1000, 0])[:, None]
    mask = keep[:, None, None, :] if kind == "bool" else \
        np.where(keep, 0.0, -np.inf)[:, None, None, :].astype(MASK_DTYPES[kind])
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), mask=pyattn.asarray(mask), return_lse=True)
    _check(out.numpy(), lse.numpy(), q, k, v, mask=mask)
    assert np.isneginf(lse.numpy()[2]).all()


def test_a_mask_view_off_16_bytes_runs_the_cp_async_kernel():
    """A float mask view one element into its buffer (rows still 16-byte strided): TMA cannot read
    it, so that call runs attn_fwd_wgmma, which reads such a mask in place; the same problem with
    an aligned mask runs attn_fwd_tma. Both are correct."""
    rng = np.random.default_rng(4)
    Sq, Sk = 150, 512
    q, k, v = _inputs(rng, 1, Sq, Sk, 2, 2, 128, "bfloat16")
    dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
    buf = np.where(rng.random((Sq, Sk + 16)) < 0.7, rng.standard_normal((Sq, Sk + 16)), -np.inf).astype(np.float16)
    base = pyattn.asarray(buf)
    for off in (1, 0):
        m = _view(base, off, (Sq, Sk), (Sk + 16, 1))
        out = pyattn.attention(dq, dk, dv, mask=m)
        _check(out.numpy(), None, q, k, v, mask=np.ascontiguousarray(buf[:, off:off + Sk]))


@SETTINGS
@given(Sq=LENGTHS, Sk=st.integers(1, 700), D=st.sampled_from(TMA_DIMS or [128]),
       view=st.sampled_from(["plain", "offset", "strided_keys", "keys_broadcast", "key_padding"]),
       causal=st.booleans(), visible=st.sampled_from([0.0, 0.5, 0.97, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_bool_masks_packed_to_bits(Sq, Sk, D, view, causal, visible, seed):
    """Bool masks reach attn_fwd_tma packed to bits by the mask_bits kernel, whatever their layout:
    any key count (words zero past the keys), a view one byte into its buffer, strided keys, a mask
    broadcast over keys or over query rows; all True (the skipped per-score work), all False (rows
    of 0 / LSE -inf) and mixed."""
    spec = select_attention_spec("bfloat16", D, "sm_90a", mask="bool", keys=Sk)
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, 1, Sq, Sk, 2, 1, D, "bfloat16")
    dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
    if view == "plain":
        mask = rng.random((1, 2, Sq, Sk)) < visible
        m = pyattn.asarray(mask)
    elif view == "offset":  # rows of Sk + 5 bytes, one byte in
        buf = rng.random((Sq, Sk + 5)) < visible
        m, mask = _view(pyattn.asarray(buf), 1, (Sq, Sk), (Sk + 5, 1)), buf[:, 1:Sk + 1]
    elif view == "strided_keys":
        buf = rng.random((Sq, 2 * Sk)) < visible
        m, mask = _view(pyattn.asarray(buf), 0, (Sq, Sk), (2 * Sk, 2)), buf[:, ::2]
    elif view == "keys_broadcast":  # one value a query row
        buf = rng.random((Sq, 1)) < visible
        m, mask = _view(pyattn.asarray(buf), 0, (Sq, Sk), (1, 0)), np.broadcast_to(buf, (Sq, Sk))
    else:  # (1, 1, 1, Sk)
        mask = rng.random((1, 1, 1, Sk)) < visible
        m = pyattn.asarray(mask)
    out, lse = pyattn.attention(dq, dk, dv, mask=m, causal=causal, return_lse=True)
    _check(out.numpy(), lse.numpy(), q, k, v, mask=np.ascontiguousarray(mask), causal=causal)
    assert spec.mask == ("bits" if spec.family == "attn_fwd_tma" else "bool")


# Persistent blocks (one an SM) walk work units (a query tile, or a causal pair of row blocks):
# these shapes have more units than any GPU has SMs, so each block carries its ring's phase bits,
# its query tile's barriers and its ping-pong turns from one tile to the next. 601 keys: d = 64 takes
# its short row (persistent), the other buckets their table's row.
PERSISTENT_DIMS = [d for d in (64, 128, 192, 256)
                   if select_attention_spec("bfloat16", d, "sm_90a", keys=601).tiles.persistent]


@pytest.mark.parametrize("D", PERSISTENT_DIMS or [128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B, H, Hkv", [(2, 48, 12), (1, 45, 15)])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_persistent_blocks_walk_many_tiles(D, causal, B, H, Hkv, launched):
    """B x H heads of 550 queries: an odd count of row blocks (3 of 192 rows, 5 of 128, the last
    partial), so causal units pair row blocks (n - 1 - i, i) of one (batch, head) and the middle
    blocks of two; with 45 (batch, head)s the last one's middle block goes alone (GQA 4 / 3)."""
    rng = np.random.default_rng(D + causal + H)
    Sq, Sk = 550, 601
    spec = select_attention_spec("bfloat16", D, "sm_90a", keys=Sk, causal=causal)
    assert spec.family == "attn_fwd_tma" and spec.tiles.persistent
    assert -(-Sq // spec.tiles.block_m) % 2 == 1
    q, k, v = _inputs(rng, B, Sq, Sk, H, Hkv, D, "bfloat16")
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), causal=causal, return_lse=True)
    assert spec.entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, causal=causal)


# Rows that bound their warpgroups' tiles (three warpgroups in persistent blocks: d = 64's short
# row; two on 64-key tiles): each warpgroup computes the key tiles up to the last its own 64 rows
# see and only waits for and frees the rest. (The other multi-warpgroup rows take the same shapes.)
MULTI_WG_DIMS = [r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a") if r.warpgroups >= 2]


@pytest.mark.parametrize("D", MULTI_WG_DIMS or [128])
@pytest.mark.parametrize("band", ["causal", "window", "causal_window"])
@pytest.mark.parametrize("offset", [0, 13, 64, 77, 200])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_warpgroups_end_at_their_own_last_tile(D, band, offset, launched):
    """Bottom-right bands whose diagonal (Sk - Sq = offset) falls at and off the warpgroups' 64-row
    edges, a window's right edge (41 past the diagonal) alike: a warpgroup whose rows end a tile
    early skips the block's last tiles, the others compute them (GQA 2, 24 heads so that
    persistent blocks take several tiles, a partial last row block)."""
    rng = np.random.default_rng(D + offset)
    Sq, Sk = 1000, 1000 + offset
    spec = select_attention_spec("bfloat16", D, "sm_90a", keys=Sk)
    assert spec.family == "attn_fwd_tma" and spec.tiles.block_m >= 128, spec
    opts = {"causal": {"causal": True}, "window": {"window": (300, 41)},
            "causal_window": {"causal": True, "window": (250, 0)}}[band]
    q, k, v = _inputs(rng, 1, Sq, Sk, 24, 12, D, "bfloat16")
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **opts)
    assert spec.entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)


SHORT_DIMS = [r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="short")]


@pytest.mark.parametrize("D", SHORT_DIMS or [64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (100, 7)])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_short_row_and_its_mods_row(D, causal, window, launched):
    """Calls of few keys take the short row (at d = 64 persistent blocks of three warpgroups; with
    ALiBi its mods_row: one consumer warpgroup a block, two blocks an SM). 2 x 48 heads of 333
    queries (GQA 4, the last row block partial: more query tiles than blocks); odd key count."""
    if D not in SHORT_DIMS:
        pytest.skip(f"attn_fwd_tma has no short row for d={D}")
    rng = np.random.default_rng(D + 2 * causal + (window is None))
    Sq, Sk = 333, 1001
    row = _tma_row(D, table="short")
    specs = []
    for alibi, want in ((False, row), (True, row.mods_row or row)):
        specs.append(select_attention_spec("bfloat16", D, "sm_90a", keys=Sk, alibi=alibi))
        assert (specs[-1].family, specs[-1].q_tiles, specs[-1].tiles) == ("attn_fwd_tma", 1, want.config())
    q, k, v = _inputs(rng, 2, Sq, Sk, 48, 12, D, "bfloat16")
    for spec, opts in zip(specs, (dict(causal=causal, window=window),
                                  dict(causal=causal, window=window,
                                       alibi_slopes=rng.uniform(0.01, 0.5, 48).astype(np.float32)))):
        on_device = {n: pyattn.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
        launched.clear()
        out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **on_device)
        assert spec.entry_name in launched, launched
        _check(out.numpy(), lse.numpy(), q, k, v, **opts)


SMALL_GRID_DIMS = [r.max_head_dim for r in tile_table("attn_fwd_tma", "sm_90a", table="short")
                   if r.mods_row and r.small_grid_rate]


@pytest.mark.parametrize("D", SMALL_GRID_DIMS or [64])
@pytest.mark.parametrize("case", ["plain", "causal", "gqa_window", "softcap", "fp16_lse", "long_keys", "long_window",
                                  "long_causal"])
def test_small_grids_run_the_short_rows_small_grid_row(D, case, launched):
    """A plain call whose query tiles would leave the GPU's SMs a short last round runs the short
    row's one-warpgroup mods_row (spec q_tiles 2: 64-row tiles, two blocks an SM; short_small_grid):
    one prompt of 32 heads at 1000 queries (the (B, S, H) that measured 17-21% faster), odd sizes,
    causal bottom-right over more keys, GQA with a window, a soft-cap, fp16 with the LSE; and past the
    short row's keys (the dense row's domain), non-causal GQA calls of 8 heads, one with a window,
    and a causal call of 2 heads over 8300 keys (bottom-right; the simulated pick)."""
    if D not in SMALL_GRID_DIMS:
        pytest.skip(f"attn_fwd_tma's short row has no small-grid row for d={D}")
    rng = np.random.default_rng(D + len(case))
    B, Sq, Sk, Hq, Hkv, dtype = 1, 1000, 1000, 32, 32, "bfloat16"
    opts = {"causal": {"causal": True}, "gqa_window": {"window": (200, 17)}, "softcap": {"softcap": 20.0}}.get(case, {})
    if case == "causal":
        Sq, Sk = 777, 1500
    if case == "gqa_window":
        Hkv = 4
    if case == "fp16_lse":
        dtype, B, Hq, Hkv, Sq = "float16", 2, 6, 2, 1234
    if case.startswith("long"):
        Sq, Sk, Hq, Hkv = 2000, 4099, 8, 2
        opts = {"window": (1000, 300)} if case == "long_window" else {}
    if case == "long_causal":
        Sq, Sk, Hq, Hkv, opts = 8000, 8300, 2, 1, {"causal": True}
    sm = pyattn.get_device().sm_count
    spec = select_attention_spec(dtype, D, "sm_90a", keys=Sk, causal=bool(opts.get("causal")),
                                 softcap=opts.get("softcap", 0.0), queries=Sq, batch_heads=B * Hq, sm_count=sm)
    row = _tma_row(D, table="short")
    assert (spec.family, spec.q_tiles, spec.tiles) == ("attn_fwd_tma", 2, row.mods_row.config())
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **opts)
    assert spec.entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window", [None, (64, 0)])
@pytest.mark.usefixtures("short_row_on_any_grid")  # the three-warpgroup row, few tiles
def test_persistent_blocks_skip_empty_tiles(window, D):
    """Causal bottom-right with 700 queries over 90 keys: the first row blocks see no key (no key
    tiles: stored as 0 / LSE -inf without a query tile loaded), between tiles that do; 40 heads
    so that blocks meet both kinds (d = 64: the short row's)."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 700, 90, 40, 8, D, "bfloat16")
    opts = dict(causal=True, window=window)
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True, **opts)
    _check(out.numpy(), lse.numpy(), q, k, v, **opts)
    assert np.isneginf(lse.numpy()[:, :, :610]).all()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_varlen_many_sequences(causal, D):
    """40 sequences of 1..700 queries in one launch of max-length row blocks: most tiles lie past
    their sequence's end and every role skips them (d = 64: the short row's)."""
    rng = np.random.default_rng(17 + causal)
    check_varlen(rng, [(int(a), int(b)) for a, b in zip(rng.integers(1, 701, 40), rng.integers(1, 701, 40))], D,
                 causal)


def check_varlen(rng, lens: list, D: int, causal: bool) -> None:
    """``attention_varlen`` of sequences of (queries, keys) ``lens`` (8 query heads, 2 KV heads,
    bf16, device arrays) against the fp64 reference, sequence by sequence (the 2x rule), with -inf
    LSE exactly where a row sees no key."""
    from pyattn.reference import attention_varlen_ref

    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    dt = DTYPES["bfloat16"]
    q = rng.standard_normal((cu_q[-1], 8, D)).astype(dt)
    k, v = (rng.standard_normal((cu_k[-1], 2, D)).astype(dt) for _ in range(2))
    out, lse = pyattn.attention_varlen(*(pyattn.asarray(x) for x in (q, k, v, cu_q, cu_k)), causal=causal,
                                       return_lse=True)
    out, lse = out.numpy().astype(np.float64), lse.numpy()
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    assert not np.isnan(out).any()
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    for n in range(len(lens)):
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        bound = error_bound(q[None, rows], k[None, keys], v[None, keys], causal=causal)
        assert np.abs(out[rows] - ref[rows]).max() <= bound, f"sequence {n} {lens[n]}"

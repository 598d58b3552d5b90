"""GPU tests of mask tensors through the TMA-fed sm_90a kernel (attn_fwd_tma) against the fp64
reference: float masks' swizzled tiles, bool masks packed to bits, key-padding masks (one row for
all), tiles the mask leaves untouched (skipped work) next to mixed and fully masked ones, and mask
views TMA cannot read (which run attn_fwd_wgmma); marked ``gpu``, skipped without an sm_90a GPU.

The kernel's views, layouts and modifiers: test_gpu_tma_views.py; its persistent blocks:
test_gpu_tma_persistent.py; shared helpers: _tma_helpers.py. (Masks on every kernel:
test_gpu_masks.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.kernels.specs import select_attention_spec

ml_dtypes = pytest.importorskip("ml_dtypes")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from _tma_helpers import LENGTHS, SETTINGS, TMA_DIMS, _tma_row, _view  # noqa: E402
from test_gpu_attention import _check, _inputs  # noqa: E402
from test_gpu_wgmma_ws import _is_sm90a  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]


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


@pytest.mark.parametrize("kind", ["bf16", "f32"])
@pytest.mark.parametrize("tma", [True, False])
def test_lowest_float_mask_values_hide_keys(kind, tma):
    """The masks HF transformers builds: finfo(dtype).min where a key is hidden. Such a term hides
    its key as -inf does, and a row hidden so at every key is an empty row (0, LSE -inf), not NaN.
    (The wgmma kernels add m / scale to raw scores, which overflows to -inf for such terms; another
    form of the sum, e.g. a score in natural-log units, must not turn them into NaN rows.)
    ``tma=False``: a view off 16 bytes, attn_fwd_wgmma."""
    rng = np.random.default_rng(8)
    B, Sq, Sk, H, D = 1, 130, 512, 2, 128
    q, k, v = _inputs(rng, B, Sq, Sk, H, H, D, "bfloat16")
    low = np.finfo(np.float32).min if kind == "f32" else float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)
    hide = rng.random((B, H, Sq, Sk)) < 0.5
    hide[:, :, 5] = True  # every key of row 5
    hide[:, :, 64:] &= np.arange(Sk) >= 256  # rows 64..: the first two key tiles all visible
    buf = np.zeros((B, H, Sq, Sk + 16), MASK_DTYPES[kind])
    off = 0 if tma else 1
    buf[..., off:off + Sk] = np.where(hide, low, 0.0)
    mask = _view(pyattn.asarray(buf), off, (B, H, Sq, Sk), (H * Sq * (Sk + 16), Sq * (Sk + 16), Sk + 16, 1))
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), mask=mask, return_lse=True)
    out, lse = out.numpy(), lse.numpy()
    _check(out, lse, q, k, v, mask=np.where(hide, -np.inf, 0.0))
    assert (out[:, 5] == 0).all() and np.isneginf(lse[..., 5]).all()


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
       causal=st.sampled_from([False, True, "top_left"]), window=st.sampled_from([None, (150, 0), (40, 300)]),
       visible=st.sampled_from([0.0, 0.5, 0.97, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_bool_masks_packed_to_bits(Sq, Sk, D, view, causal, window, visible, seed):
    """Bool masks reach attn_fwd_tma packed to bits by the mask_bits kernel, whatever their layout:
    any key count (words zero past the keys), a view one byte into its buffer, strided keys, a mask
    broadcast over keys or over query rows; all True (the skipped per-score work), all False (rows
    of 0 / LSE -inf) and mixed. Causal and windowed calls: the pack writes the groups outside a
    row's band as zeros unread (a group straddling the band's edge must be packed)."""
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
    out, lse = pyattn.attention(dq, dk, dv, mask=m, causal=causal, window=window, return_lse=True)
    _check(out.numpy(), lse.numpy(), q, k, v, mask=np.ascontiguousarray(mask), causal=causal, window=window)
    assert spec.mask == ("bits" if spec.family == "attn_fwd_tma" else "bool")


# The d = 64 rows' calls (B, Sq, Sk, H, D): Sq not a multiple of 192, Sk not of 128, Sq != Sk;
# below 4096 keys masks take the short row.
_D64 = (2, 400, 4096 + 200, 2, 64)
_D64_MODS = {"": {}, "softcap": {"softcap": 15.0}, "alibi": {"alibi_slopes": np.array([0.3, 0.05], np.float32)}}


def _d64_spec(kind: str, causal: bool, opts: dict):
    """The spec a _D64 call with a ``kind`` mask and ``opts`` selects."""
    return select_attention_spec("bfloat16", _D64[4], "sm_90a", mask=kind, keys=_D64[2], causal=causal,
                                 softcap=opts.get("softcap"), alibi="alibi_slopes" in opts)


def _d64_check(seed: int, make_mask, causal: bool, opts: dict) -> None:
    """A _D64 call on device arrays (inputs drawn first, then ``make_mask(rng)``) against the fp64
    reference, with its LSE."""
    B, Sq, Sk, H, D = _D64
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, Sq, Sk, H, H, D, "bfloat16")
    mask = make_mask(rng)
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), mask=pyattn.asarray(mask), causal=causal,
                                return_lse=True, **opts)
    _check(out.numpy(), lse.numpy(), q, k, v, mask=mask, causal=causal, **opts)


@pytest.mark.parametrize("view", ["per_head", "heads_broadcast", "key_padding", "batch_broadcast"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mods", ["", "softcap", "alibi"])
def test_bits_in_the_ring(view, causal, mods):
    """The d = 64 dense row stages the packed words in its ring (TileConfig.mask_bits): rows past
    the end and, causal, the rows before 0 of its bottom-aligned first block arrive as zeros; a
    mask broadcast over heads or batch is a map axis of size 1, one broadcast over the query rows
    (key padding) 192 copies of its row. With a soft-cap or ALiBi the row runs two warpgroups
    (warpgroups_mods): 128-row boxes."""
    opts = _D64_MODS[mods]
    spec = _d64_spec("bool", causal, opts)
    assert (spec.family, spec.mask, spec.tiles.mask_bits, spec.tiles.block_m) == \
        ("attn_fwd_tma", "bits", True, 128 if mods else 192)
    B, Sq, Sk, H, _ = _D64
    shape = {"per_head": (B, H, Sq, Sk), "heads_broadcast": (B, 1, Sq, Sk), "key_padding": (B, 1, 1, Sk),
             "batch_broadcast": (1, H, Sq, Sk)}[view]

    def make_mask(rng):
        mask = rng.random(shape) < 0.6
        if view == "key_padding":  # batch entry 1 sees its first 900 keys only
            mask[:] = True
            mask[1, ..., 900:] = False
        else:
            mask[..., :64, :] |= True  # some tiles all visible (the skipped per-score work)
            mask[..., 130:140, :] = False  # rows seeing no key: 0 / LSE -inf
        return mask

    _d64_check(17, make_mask, causal, opts)


@pytest.mark.parametrize("kind", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mods", ["", "softcap", "alibi"])
def test_d64_float_masks_on_three_warpgroups(kind, causal, mods):
    """The d = 64 float mask rows (16-bit and f32): three warpgroups of 64-key tiles (192 rows,
    bottom-aligned when causal: the first block's rows before 0 get zero mask terms), with soft-cap
    or ALiBi too."""
    opts = _D64_MODS[mods]
    spec = _d64_spec(kind, causal, opts)
    assert (spec.family, spec.tiles.block_m, spec.tiles.block_n) == ("attn_fwd_tma", 192, 64)
    B, Sq, Sk, H, _ = _D64
    _d64_check(23, lambda rng: _block_mask(rng, (B, H, Sq, Sk), kind, 64), causal, opts)

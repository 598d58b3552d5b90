"""GPU tests of the persistent attn_fwd_tma's tail split (kernels_src/fwd_tail_split.cuh, its
row's variant with spec q_tiles 3): calls whose last round of work units the plan splits by keys
over every block (non-causal, and causal pairs of row blocks), against the fp64 reference
(outputs and LSEs), repeated on one stream (the counters left zero), and calls the rule leaves
whole on the row's own variant. Marked ``gpu``, skipped without an sm_90a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.kernels.specs import select_attention_spec
from pyattn.ops._fwd_tail import tail_split
from pyattn.validate.attention import AttentionProblem

from test_gpu_attention import _check, _inputs
from test_gpu_wgmma_ws import _is_sm90a

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90a(), reason="needs an sm_90a GPU"),
              pytest.mark.usefixtures("poison_allocations")]

SQ, SK, D = 256, 4096, 128  # two 128-row query tiles a head, 32 key tiles each


def _heads(fill: float, group: int = 1) -> int:
    """Query heads (batch 1, a multiple of ``group``) whose 2 tiles a head leave the last round
    about ``fill`` of the GPU's SMs (one block an SM)."""
    sms = pyattn.get_device().sm_count
    return -(-(sms + max(1, round(fill * sms))) // (2 * group)) * group


def _problem(H: int, Hkv: int, Sq: int, Sk: int, Dh: int, dtype: str, causal: bool = False,
             softcap: float = 0.0) -> AttentionProblem:
    """The validated problem of (1, Sq, H, Dh) queries over Sk keys of Hkv heads, bshd, on the device
    (what tail_split reads of it: the shape, causality and soft-cap)."""
    return AttentionProblem(1, H, Hkv, Sq, Sk, Dh, dtype, "bshd", int(causal), Dh ** -0.5, True,
                            (Sq * H * Dh, H * Dh, Dh), (Sk * Hkv * Dh, Hkv * Dh, Dh), (Sk * Hkv * Dh, Hkv * Dh, Dh),
                            softcap=softcap)


def _tail(H: int, Hkv: int, causal: bool = False, dtype: str = "bfloat16", softcap: float = 0.0):
    """The plan's tail split (None: none) and spec for (1, SQ, H, D) queries over SK keys."""
    spec = select_attention_spec(dtype, D, "sm_90a", keys=SK, causal=causal, softcap=softcap)
    P = _problem(H, Hkv, SQ, SK, D, dtype, causal, softcap)
    return tail_split(P, spec, spec.tiles, pyattn.get_device().sm_count), spec


@pytest.mark.parametrize("fill, group", [(0.5, 1), (0.3, 3), (0.7, 1), (0.5, 4)])
def test_tail_split_matches_reference(fill, group, launched):
    """The last round's tiles split by keys: outputs and LSEs against the fp64 reference, for a
    last round of half the SMs, of a third, of most, and with GQA."""
    H = _heads(fill, group)
    tail, spec = _tail(H, H // group)
    assert tail is not None and tail.slots >= 2, (H, tail)  # pieces of units, merged by the kernel
    rng = np.random.default_rng(H + group)
    q, k, v = _inputs(rng, 1, SQ, SK, H, H // group, D, "bfloat16")
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True)
    assert spec.replace(q_tiles=3).entry_name in launched, launched  # the row's variant with the split
    _check(out.numpy(), lse.numpy(), q, k, v)


@pytest.mark.parametrize("Dh, Sq, Sk, group, dtype", [(96, 200, 3000, 1, "float16"), (72, 256, 4097, 2, "bfloat16"),
                                                      (128, 131, 2500, 3, "bfloat16")])
def test_tail_split_odd_shapes(Dh, Sq, Sk, group, dtype, launched):
    """Head dims below the bucket (the slots' columns past head_dim), a last row block partly past
    the sequence (rows merged, never stored) and a last key tile partly past the keys."""
    sms = pyattn.get_device().sm_count
    H = -(-(sms + sms // 2) // (2 * group)) * group  # two row blocks a head: a half-full last round
    spec = select_attention_spec(dtype, Dh, "sm_90a", keys=Sk)
    assert tail_split(_problem(H, H // group, Sq, Sk, Dh, dtype), spec, spec.tiles, sms) is not None
    rng = np.random.default_rng(Dh + Sk)
    q, k, v = _inputs(rng, 1, Sq, Sk, H, H // group, Dh, dtype)
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True)
    assert spec.replace(q_tiles=3).entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v)


@pytest.mark.parametrize("fill, group, dtype", [(0.5, 1, "bfloat16"), (0.3, 2, "float16"), (0.2, 1, "bfloat16")])
def test_tail_split_causal_pairs(fill, group, dtype, launched):
    """Causal: units pair row blocks 15 - i and i of 2048 queries over 2048 keys (17 key tiles), so
    a piece may hold key tiles of both of its unit's query tiles, each merged on its own."""
    sms = pyattn.get_device().sm_count
    S, H = 2048, -(-(sms + max(1, round(fill * sms))) // (8 * group)) * group  # 8 units a head
    spec = select_attention_spec(dtype, D, "sm_90a", keys=S, causal=True, queries=S, batch_heads=H,
                                 sm_count=sms)
    tail = tail_split(_problem(H, H // group, S, S, D, dtype, causal=True), spec, spec.tiles, sms)
    assert tail is not None and tail.tiles_split == 2 * tail.units, (H, tail)
    rng = np.random.default_rng(H + group)
    q, k, v = _inputs(rng, 1, S, S, H, H // group, D, dtype)
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
    assert spec.replace(q_tiles=3).entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, causal=True)


def test_tail_split_soft_cap_with_a_row_max(launched):
    """fp16 with a cap over 51 (a soft-cap with a row max, KernelSpec.softcap 1) splits too."""
    H = _heads(0.5)
    tail, fp16 = _tail(H, H, dtype="float16", softcap=60.0)
    assert tail is not None and fp16.softcap == 1
    rng = np.random.default_rng(11)
    q, k, v = (x * 4 for x in _inputs(rng, 1, SQ, SK, H, H, D, "float16"))  # scores that reach the cap
    out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), softcap=60.0, return_lse=True)
    assert fp16.replace(q_tiles=3).entry_name in launched, launched
    _check(out.numpy(), lse.numpy(), q, k, v, softcap=60.0)


def test_nan_key_reaches_a_split_tiles_rows():
    """A NaN key makes every row that sees it NaN, in split tiles as in whole ones: key 0 is in
    each tail tile's first piece, whose NaN LSE the merge must not drop (fmaxf does); the heads
    without one stay finite."""
    H = _heads(0.5)
    tail, _ = _tail(H, H)
    assert tail is not None
    nan_head = H - 1  # its two query tiles are tail units (the last ones)
    assert (tail.first // 2) <= nan_head, (tail, nan_head)
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 1, SQ, SK, H, H, D, "bfloat16")
    k[0, 0, nan_head, 3] = np.nan
    out, lse = (x.numpy() for x in pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), return_lse=True))
    others = [h for h in range(H) if h != nan_head]
    assert np.isnan(out[0, :, nan_head].astype(np.float32)).all() and np.isnan(lse[0, nan_head]).all()
    assert np.isfinite(out[0][:, others].astype(np.float32)).all() and np.isfinite(lse[0, others]).all()


def test_tail_split_repeats_on_one_stream():
    """Three calls on one stream give the same bits: each leaves its counters zero for the next
    (a counter left over would merge a unit early, from slots not yet written)."""
    H = _heads(0.5)
    assert _tail(H, H)[0] is not None
    rng = np.random.default_rng(7)
    xs = [pyattn.asarray(x) for x in _inputs(rng, 1, SQ, SK, H, H, D, "bfloat16")]
    s = pyattn.Stream(pyattn.get_device())
    outs = [pyattn.attention(*xs, stream=s).numpy() for _ in range(3)]
    assert all(np.array_equal(outs[0].view(np.uint16), o.view(np.uint16)) for o in outs[1:])


def test_no_tail_split_where_rounds_are_whole_or_causal(launched):
    """A last round that is whole, and causal calls, take no split: the row's own variant runs."""
    sms = pyattn.get_device().sm_count
    for H, causal in ((sms, False), (_heads(0.5), True)):  # 2 x sms tiles: two whole rounds
        tail, spec = _tail(H, H, causal=causal)
        assert tail is None
        rng = np.random.default_rng(H)
        q, k, v = _inputs(rng, 1, SQ, SK, H, H, D, "bfloat16")
        out, lse = pyattn.attention(*(pyattn.asarray(x) for x in (q, k, v)), causal=causal, return_lse=True)
        assert spec.entry_name in launched and spec.replace(q_tiles=3).entry_name not in launched, launched
        _check(out.numpy(), lse.numpy(), q, k, v, causal=causal)


@pytest.mark.parametrize("dtype, softcap", [("bfloat16", 0.0), ("float16", 0.0), ("float16", 60.0)])
def test_split_rows_hold_their_designed_blocks(dtype, softcap):
    """The plan decides the split on the row's designed blocks an SM (``min_blocks``: the setmaxnreg
    split fills the register file at exactly that many) and loads only the launched variant
    (ops/_fwd_tail.persistent_launch): the driver's occupancy of the row's variant and of its split
    variant is that number here, so on this GPU the decision is never taken twice."""
    from pyattn.kernels.registry import get_kernel

    dev = pyattn.get_device()
    spec = select_attention_spec(dtype, D, dev.arch, keys=SK, softcap=softcap)
    for s in (spec, spec.replace(q_tiles=3)):
        assert get_kernel(s, dev).max_active_blocks(s.threads, s.shared_bytes) == spec.tiles.min_blocks, s

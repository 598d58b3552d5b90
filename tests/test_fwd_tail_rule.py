"""The tail split's rule and bookkeeping on the host (no GPU): which calls split their last round
of work units by keys (pyattn/ops/_fwd_tail.py), that the slots a query tile needs cover every
block whose key-tile range reaches into it (kernels_src/fwd_tail_split.cuh walks the same ranges),
and, on the fake driver, the launch a split call makes (its variant, grid and parameter fields)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pyattn.kernels.specs import select_attention_spec
from pyattn.ops._fwd_tail import NO_TAIL, tail_split
from pyattn.validate.attention import AttentionProblem


def _problem(B, H, S, Sk=None, D=128, causal=0, window=(-1, -1)):
    Sk = Sk or S
    return AttentionProblem(B, H, H, S, Sk, D, "bfloat16", "bshd", causal, D ** -0.5, True,
                            (S * H * D, H * D, D), (Sk * H * D, H * D, D), (Sk * H * D, H * D, D), window)


def _rule(P, G=132, **kw):
    spec = select_attention_spec("bfloat16", P.head_dim, "sm_90a", keys=P.seqlen_k, causal=bool(P.causal), **kw)
    return tail_split(P, spec, spec.tiles, G)


def test_benchmark_shapes_split_their_last_round():
    """(4, 4k, 16, 128): 2048 tiles on 132 blocks, 15 whole rounds and 68 tiles of 32 key tiles."""
    t = _rule(_problem(4, 16, 4096))
    assert t is not None and (t.first, t.iters, t.tiles, t.units) == (15 * 132, 68 * 32, 32, 68)
    assert t.slots == 3 and t.pieces == 2 and t.warps == 8 and t.slot_floats == 128 * 128


def test_no_split_where_it_cannot_pay_or_apply():
    assert _rule(_problem(2, 33, 4096)) is None  # 2112 tiles: 16 whole rounds
    assert _rule(_problem(4, 16, 1024)) is None  # 8 key tiles a unit: the pieces cost more than they save
    # 16 and 24 key tiles a unit (15.5 / 14.5 rounds): measured level with the whole call
    # (BENCHMARKS.md, fifty-eighth session), so the split's cost (five key steps) outweighs its gain
    assert _rule(_problem(8, 16, 2048)) is None and _rule(_problem(5, 16, 3072)) is None
    assert _rule(_problem(4, 16, 4096 - 128, causal=1)) is None  # 31 row blocks: units of unequal cost
    assert _rule(_problem(4, 16, 4096, Sk=4096 + 128, causal=1)) is None  # more keys than queries
    assert _rule(_problem(4, 16, 4096, window=(256, 0))) is None
    assert _rule(_problem(4, 16, 4096), softcap=30.0) is None  # bf16 cap <= 51: the fixed reference
    assert _rule(_problem(4, 16, 4096), alibi=True) is None
    assert _rule(_problem(4, 16, 4096, D=256)) is None
    assert len(NO_TAIL) == 64 and not any(NO_TAIL)


def test_causal_units_split_as_pairs_of_row_blocks():
    """(4, 4k, 17, 128) causal: 1088 units of 33 key tiles (row blocks 31 - i and i), 8 whole
    rounds and 32 units split; each unit's two query tiles have slots and counters of their own.
    (4, 4k, 16): 7.76 rounds, a predicted gain under the causal rule's 3% (measured slower)."""
    t = _rule(_problem(4, 17, 4096, causal=1))
    assert t is not None and (t.first, t.units, t.tiles, t.iters, t.tiles_split) == (8 * 132, 32, 33, 1056, 64)
    assert _rule(_problem(4, 16, 4096, causal=1)) is None


@settings(max_examples=200, deadline=None)
@given(units=st.integers(1, 5000), kt=st.integers(2, 600), G=st.integers(1, 264), causal=st.booleans())
def test_slots_cover_every_block_of_a_tile(units, kt, G, causal):
    """Each tail query tile's blocks (the ranges [b I / G, (b + 1) I / G) that meet its key tiles)
    are consecutive and no more than the plan's slots, and the kernel's block-of formula names
    them; causal units (two query tiles: row block n - 1 - i's n - i key tiles, then i's i + 1)
    cover their n + 1 key tiles exactly."""
    if causal:  # n = 2 * (kt // 2) row blocks (even), units * n / 2 units in all
        n = 2 * max(1, kt // 2)
        P = _problem(1, max(1, units // (n // 2)), 128 * n, causal=1)
    else:
        P = _problem(1, units, 128, Sk=128 * kt)
    t = _rule(P, G)
    if t is None:
        return
    ranges = [(b * t.iters // G, (b + 1) * t.iters // G) for b in range(G)]
    spans = []
    for u in range(t.units):
        c0 = t.tiles - 1 - (t.first + u) % ((t.tiles - 1) // 2) if causal else t.tiles
        spans += [(u * t.tiles, u * t.tiles + c0)] + ([(u * t.tiles + c0, (u + 1) * t.tiles)] if causal else [])
    assert len(spans) == t.tiles_split and spans[-1][1] == t.iters
    for lo, hi in spans:
        assert hi > lo
        blocks = [b for b, (s, e) in enumerate(ranges) if s < hi and e > lo]
        assert blocks == list(range(blocks[0], blocks[-1] + 1)) and len(blocks) <= t.slots
        assert blocks[0] == ((lo + 1) * G - 1) // t.iters and blocks[-1] == (hi * G - 1) // t.iters
        assert sum(min(e, hi) - max(s, lo) for b, (s, e) in enumerate(ranges) if b in blocks) == hi - lo
    # every block's pieces fit its sk_pieces walk, in the kernel's order (tail_piece_of)
    for b, (s, e) in enumerate(ranges):
        units_met = sorted({x // t.tiles for x in range(s, e)})
        assert len(units_met) <= t.pieces
        for i, unit in enumerate(units_met):
            a = s if i == 0 else unit * t.tiles
            assert s // t.tiles + i == unit and (a - unit * t.tiles, min(t.tiles, e - unit * t.tiles)) == (
                max(s, unit * t.tiles) - unit * t.tiles, min(e, (unit + 1) * t.tiles) - unit * t.tiles)


def test_a_split_call_launches_the_tail_variant_with_its_fields(gpu, monkeypatch):
    """On the fake driver (132 SMs, one attn_fwd_tma block an SM): a (1, 256, 99, 128) call over
    2048 keys (198 tiles, 66 in the last round) launches the q_tiles 3 variant on 132 blocks with
    its tail fields and their buffers; a call of whole rounds (66 heads) the row's own variant
    with the fields zero (AttnFwdTmaParams packed as the kernel reads it). Each call loads only the
    variant it launches (the split's decision is taken on the row's designed occupancy), so a first
    call compiles one variant."""
    import struct

    import fake_driver
    import ml_dtypes
    from _host_path_helpers import _da

    import pyattn
    from pyattn.kernels.params import ATTN_FWD_TMA_PARAMS
    from pyattn.ops import _fwd

    monkeypatch.setitem(fake_driver.OCCUPANCY, "attn_fwd_tma", 1)
    seen, real = [], _fwd.launch

    def spy(kernel, grid, block, smem, s, packed):
        seen.append((kernel, grid, packed))
        return real(kernel, grid, block, smem, s, packed)

    monkeypatch.setattr(_fwd, "launch", spy)
    names = [n for n, _ in ATTN_FWD_TMA_PARAMS.fields]
    bf16 = ml_dtypes.bfloat16
    for H, split in ((99, True), (66, False)):
        seen.clear()
        before = set(gpu.kernel_names.values())
        pyattn.attention(_da((1, 256, H, 128), bf16), _da((1, 2048, H, 128), bf16), _da((1, 2048, H, 128), bf16))
        (kernel, grid, packed), = seen
        assert len(packed) == ATTN_FWD_TMA_PARAMS.size and grid == (132, 1, 1)
        f = dict(zip(names, struct.unpack_from(ATTN_FWD_TMA_PARAMS.format, packed)))
        tail = (f["sk_first"], f["sk_iters"], f["sk_tiles"], f["sk_slots"], f["sk_pieces"])
        assert tail == ((132, 66 * 16, 16, 2, 1) if split else (0,) * 5), tail
        assert all(f[n] for n in ("sk_part", "sk_lse", "sk_ctr")) == split
        assert gpu.kernel_names[int(kernel.handle)].endswith("pt") == split  # (entry suffix t: the split)
        assert set(gpu.kernel_names.values()) - before == {gpu.kernel_names[int(kernel.handle)]}


def test_a_driver_occupancy_off_the_design_retakes_the_split_decision(gpu, monkeypatch):
    """Where the driver holds two blocks an SM of a row designed for one, the split is decided again
    on the driver's 264 blocks: (1, 256, 99, 128) over 2048 keys, 198 tiles, is then one round and
    launches the row's own variant, a block a tile (on the design's 132 it splits, test above)."""
    import fake_driver
    import ml_dtypes
    from _host_path_helpers import _da

    import pyattn

    monkeypatch.setitem(fake_driver.OCCUPANCY, "attn_fwd_tma", 2)
    gpu.record_launches = True
    fake_driver.LAUNCHES.clear()
    x = _da((1, 256, 99, 128), ml_dtypes.bfloat16)
    k = _da((1, 2048, 99, 128), ml_dtypes.bfloat16)
    pyattn.attention(x, k, k)
    (name, grid, *_), = fake_driver.LAUNCHES
    assert grid == (198, 1, 1) and "attn_fwd_tma" in name and not name.endswith("pt")

"""The soft-capped softmax's exp2 on the FMA pipe (CPU only): ``poly_exp2`` in kernels_src/mma.cuh,
emulated step for step in float32 from the constants the kernel source holds, and the tile rows
that select it (``poly_exp``). tests/test_gpu_softcap_poly.py runs the kernels on a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from pyattn.jit.source import kernel_source_dir, render
from pyattn.kernels.families import tile_table
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, select_attention_spec

F32 = np.float32


def _poly_exp2_source() -> str:
    text = (kernel_source_dir() / "mma.cuh").read_text()
    start = text.index("float poly_exp2(")
    return text[start:text.index("\n}\n", start)]


def _emulate(x: np.ndarray) -> np.ndarray:
    """poly_exp2 in float32, operation by operation (an fmaf as an exact float64 product and sum,
    rounded once to float32: exact for these magnitudes but for rare double roundings)."""
    src = _poly_exp2_source()
    c3, c2, c1, c0 = (F32(float.fromhex(h[:-1])) for h in re.findall(r"0x[0-9a-f.]+p[-+]?\d+f", src))
    assert "fmaxf(x, -127.f)" in src and src.count("0f4B400000") == 2 and "(127 << 23)" in src
    fma = lambda a, b, c: (a.astype(np.float64) * b + c).astype(F32)  # noqa: E731
    with np.errstate(invalid="ignore"):
        x = np.maximum(x.astype(F32), F32(-127))
        t = (x + F32(12582912.0)).astype(F32)  # add.rn 1.5 * 2^23
        n = (t - F32(12582912.0)).astype(F32)
        f = (x - n).astype(F32)
        p = fma(fma(fma(np.full_like(f, c3), f, c2), f, c1), f, c0)
        bits = (t.view(np.int32).astype(np.int64) << 23) + (127 << 23)
        scale = (bits & 0xFFFFFFFF).astype(np.uint32).view(F32)
        return (p * scale).astype(F32)


def test_poly_exp2_is_within_its_stated_error_over_the_softmax_range():
    """Relative error <= 7.5e-5 (the comment's figure, far below bf16 P's rounding of 2^-9) from 2^-126
    to 2^30 (the lazy reference lets P reach 2^8, the bounded soft-cap 2^24)."""
    x = np.concatenate([np.linspace(-126.0, 30.0, 400_001), np.arange(-126, 31) + 0.5,
                        np.arange(-126, 31, dtype=np.float64)]).astype(F32)
    rel = np.abs(_emulate(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= 7.6e-5, f"worst relative error {rel.max():.3e} at x = {x[rel.argmax()]}"


def test_poly_exp2_gives_zero_for_masked_scores():
    """-inf (a masked score) and everything at or below -127 give +0 exactly, as ex2.approx.ftz does:
    a row that sees no key must sum to 0, never to a tiny positive (its output would be V's mean)."""
    x = np.array([-np.inf, -1e30, -300.0, -127.0, -126.6], F32)
    assert (_emulate(x) == 0).all() and not np.signbit(_emulate(x)).any()


def test_poly_exp_rows_are_within_the_kernels_range():
    for table in ("dense", "short", "mask2", "mask4"):
        for r in tile_table("attn_fwd_tma", "sm_90a", table=table):
            assert 0 <= r.poly_exp <= 8 and 0 <= r.poly_exp_max <= 8, r  # AttnFwdWgmmaTraits' static_assert


def _tile_token(entry_name: str) -> str:
    """The entry name's tile part (``m128n128w12pe2``)."""
    return next(t for t in entry_name.split("_") if re.fullmatch(r"m\d+n\d+w\d+\w*", t))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [d for d in HEAD_DIM_BUCKETS if d % 64 == 0])
def test_only_soft_capped_specs_take_the_polynomial(dtype, head_dim):
    """A row's poly_exp reaches the specs with the bounded soft-cap it serves (name and traits), its
    poly_exp_max those with a row max (fp16, caps over 51), and no other spec: the same row without a
    soft-cap renders as before the fields existed."""
    rows = {r.max_head_dim: r for r in tile_table("attn_fwd_tma", "sm_90a")}
    for keys, cap in ((1, 30.0), (1 << 20, 30.0), (1 << 20, 60.0)):
        plain = select_attention_spec(dtype, head_dim, "sm_90a", keys=keys)
        capped = select_attention_spec(dtype, head_dim, "sm_90a", keys=keys, softcap=cap)
        assert plain.tiles.poly_exp == 0 and not re.search(r"e\d$", _tile_token(plain.entry_name))
        if capped.family != "attn_fwd_tma" or capped.q_tiles:
            assert capped.tiles.poly_exp == 0, capped
            continue
        row = rows[capped.head_dim]
        assert capped.softcap == (2 if dtype == "bfloat16" and cap <= 51 else 1)
        want = row.poly_exp if capped.softcap == 2 else row.poly_exp_max
        assert capped.tiles.poly_exp == want
        traits = re.search(r"AttnFwdWgmmaTraits<([^>]*)>", render(capped)).group(1).split(", ")
        if want:  # POLY_EXP, the traits' 14th argument (O_STAGE may follow)
            assert traits[13] == str(want) and re.search(f"e{want}o?$", _tile_token(capped.entry_name)), traits
        else:
            assert len(traits) <= 13 or (traits[13] == "0" and traits[14:] == ["true"]), traits


def test_some_row_takes_the_polynomial():
    """The measured rows (tma.py: d = 64's dense row 1 of 8 with either soft-cap, d = 128's 2 of 8
    with the bounded one only) keep it; the short row (S < 2k, causal < 8k) measured slower with it
    and takes none."""
    rows = {r.max_head_dim: (r.poly_exp, r.poly_exp_max) for r in tile_table("attn_fwd_tma", "sm_90a")}
    assert rows[64] == (1, 1) and rows[128] == (2, 0)
    assert all(r.poly_exp == r.poly_exp_max == 0 for r in tile_table("attn_fwd_tma", "sm_90a", table="short"))

"""fp8 e4m3 attention without a GPU: validation (refused before any device work, the argument named),
spec selection, the family's shared memory, the reference, and the layout contract between the
fp8_vt pass (V^T's key order) and the main loop's packing of P (``Mainloop::pack_p``).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import pyattn
import pyattn.runtime.device as device_mod
from pyattn.kernels.families import tile_table
from pyattn.kernels.specs import KernelSpec, fp8_specs, select_attention_spec, warmup_specs
from pyattn.reference import (attention_fp8_lowp, attention_fp8_ref, attention_ref, dequantize_fp8, fp8_error_bound,
                              quantize_fp8)

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCKED = "driver blocked by test_fp8_host"
NAMED = r"^[A-Za-z_][\w\[\], /]*: "


class Dev8:
    """A CUDA array of fp8 codes as torch or JAX expose one: an array interface whose typestr is
    opaque (``<V1``) plus a ``dtype`` saying what it is. The address is fake (16-byte aligned)."""

    def __init__(self, shape, dtype=FP8, strides=None):
        dt = np.dtype(dtype)
        self.dtype = dt
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "data": (0x100000, False),
                                         "strides": strides, "version": 3}


@pytest.fixture
def blocked(monkeypatch):
    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


def _qkv(D=64, S=8, dtype=FP8):
    return Dev8((1, S, 4, D), dtype), Dev8((1, S, 2, D), dtype), Dev8((1, S, 2, D), dtype)


def test_a_valid_fp8_call_reaches_the_driver(blocked):
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.attention(*_qkv(), causal=True, descale_q=0.5, descale_k=2.0, descale_v=0.01,
                         mask=Dev8((1, 1, 8, 8), np.bool_))


BAD = {
    "mixed dtypes": (lambda: (Dev8((1, 8, 4, 64)), Dev8((1, 8, 2, 64), BF16), Dev8((1, 8, 2, 64))), {}, TypeError,
                     "q, k, v"),
    "descale for bf16": (lambda: _qkv(dtype=BF16), {"descale_v": 2.0}, ValueError, "descale_v"),
    "descale 0": (_qkv, {"descale_k": 0.0}, ValueError, "descale_k"),
    "descale inf": (_qkv, {"descale_q": float("inf")}, ValueError, "descale_q"),
    "descale str": (_qkv, {"descale_v": "1"}, TypeError, "descale_v"),
    "descale bool": (_qkv, {"descale_q": True}, TypeError, "descale_q"),
    "score scale past fp32": (_qkv, {"descale_q": 1e30, "descale_k": 1e30}, ValueError, "descale_q"),
    "float mask": (_qkv, {"mask": Dev8((1, 1, 8, 8), BF16)}, ValueError, "mask"),
    "head_dim 40": (lambda: _qkv(D=40), {}, ValueError, "q"),
    "NumPy codes": (lambda: tuple(np.zeros(s, FP8) for s in ((1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64))), {},
                    TypeError, "q"),
    "fp8 out": (_qkv, {"out": Dev8((1, 8, 4, 64))}, TypeError, "out"),
    "rows of 8 codes": (lambda: (Dev8((1, 8, 4, 64), strides=(8 * 4 * 72, 4 * 72, 72, 1)), *_qkv()[1:]), {},
                        ValueError, "q"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fp8_calls_are_refused_before_device_work(blocked, case):
    make, kwargs, exc, name = BAD[case]
    with pytest.raises(exc) as info:
        pyattn.attention(*make(), **kwargs)
    assert re.match(NAMED, str(info.value)) and str(info.value).startswith(name), str(info.value)


def test_varlen_refuses_fp8(blocked):
    q, k = Dev8((8, 4, 64)), Dev8((8, 2, 64))
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="^q: expected dtype"):
        pyattn.attention_varlen(q, k, k, cu, cu)


def test_fp8_spec_selection():
    spec = select_attention_spec("float8_e4m3fn", 64, "sm_90a")
    assert (spec.family, spec.dtype, spec.head_dim, spec.mask) == ("attn_fwd_fp8", "e4m3", 128, "none")
    assert select_attention_spec("float8_e4m3fn", 192, "sm_90a").head_dim == 256
    assert select_attention_spec("float8_e4m3fn", 128, "sm_90a", mask="bool").mask == "bits"
    assert select_attention_spec("float8_e4m3fn", 128, "sm_90a", softcap=True, alibi=True).entry_name.endswith(
        "_softcap_alibi")
    for kwargs, field in (({"arch": "sm_80"}, "dtype"), ({"arch": "sm_100a"}, "dtype"), ({"mask": "f16"}, "mask"),
                          ({"sparse": 1}, "dtype"), ({"tma": False}, "q/k/v")):
        args = {"arch": "sm_90a", **kwargs}
        arch = args.pop("arch")
        with pytest.raises(ValueError, match=f"^{field}: "):
            select_attention_spec("float8_e4m3fn", 128, arch, **args)
    with pytest.raises(ValueError, match="^family: attn_fwd_fp8 takes"):
        KernelSpec("attn_fwd_fp8", "e4m3", 64, "sm_90a")
    with pytest.raises(ValueError, match="^family: attn_fwd_fp8 takes"):
        KernelSpec("attn_fwd_fp8", "bf16", 128, "sm_90a")
    # warm-up compiles the fp8 variants and their V^T pass on sm_90a only
    assert set(fp8_specs("sm_90a")) <= set(warmup_specs("sm_90a")) and fp8_specs("sm_80") == []


def test_fp8_rows_fit_and_their_shared_memory_is_counted_in_bytes():
    for r in tile_table("attn_fwd_fp8", "sm_90a"):
        spec = KernelSpec("attn_fwd_fp8", "e4m3", r.max_head_dim, "sm_90a")
        t = spec.tiles
        assert t.block_n % 128 == 0, "V^T tiles are whole 128-key rows"
        barriers = 16 * t.stages + (16 if t.persistent else 0)
        assert spec.shared_bytes == (t.block_m + 2 * t.stages * t.block_n) * r.max_head_dim + barriers + 1024
        assert spec.shared_bytes <= 227 * 1024
        # the same tile in 16 bits takes twice the tile bytes
        assert f"pyattn::fp8e4m3, {r.max_head_dim}, {t.block_m}, {t.block_n}" in spec.template_id


def test_fp8_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 33, 3, 32)) * 5
    codes, d = quantize_fp8(x)
    assert codes.dtype == FP8 and np.abs(codes.astype(np.float64)).max() == 448.0
    assert np.abs(dequantize_fp8(codes, d) - x).max() <= 2 ** -4 * np.abs(x).max() + 2 ** -9 * d
    q, k, v = (quantize_fp8(rng.standard_normal((1, 40, 2, 32)) * m) for m in (2.0, 1.0, 3.0))
    codes, scales = (q[0], k[0], v[0]), (q[1], k[1], v[1])
    ref = attention_fp8_ref(*codes, descale=scales, causal=True)
    values = [dequantize_fp8(c, s) for c, s in zip(codes, scales)]
    assert np.array_equal(ref, attention_ref(*values, causal=True))
    low = attention_fp8_lowp(*codes, descale=scales, causal=True)
    err = np.abs(low - ref).max()
    assert 0 < err < 0.2 and fp8_error_bound(*codes, descale=scales, causal=True) == pytest.approx(2 * err + 8e-3)
    with pytest.raises(TypeError, match="^codes: "):
        dequantize_fp8(np.zeros(3, np.float16), 1.0)


def _vt_order(keys: int) -> np.ndarray:
    """fp8_vt.cuh's key order: position l of a V^T row holds physical key order[l]."""
    order = np.empty(keys, int)
    for l0 in range(0, keys, 4):  # one 4-byte word, as the kernel writes it
        base = (l0 & ~15) + 2 * ((l0 & 15) // 4)
        order[l0:l0 + 4] = (base, base + 1, base + 8, base + 9)
    return order


def _pack_p_order(block_n: int) -> np.ndarray:
    """The physical key of each k position of P's A fragments as pack_p builds them: for lane t, register
    r of k32 step kk holds 4 bytes; the wgmma A layout gives byte j of registers 0/2 the k positions
    4t + j and 16 + 4t + j, and pack_p puts there the accumulator values s[16 kk + i] whose key is
    8 (i // 4) + 2t + (i % 2) (the m16n8 C layout: n8 block i // 4, columns 2t, 2t + 1)."""
    key_of = np.full(block_n, -1)
    picks = ((0, 1, 4, 5), (8, 9, 12, 13))  # registers 0 and 2 (row g; 1 and 3 are row g + 8's, the same keys)
    for kk in range(block_n // 32):
        for t in range(4):
            for half, idx in enumerate(picks):
                for j, i in enumerate(idx):
                    key_of[32 * kk + 16 * half + 4 * t + j] = 32 * kk + 8 * (i // 4) + 2 * t + (i % 2)
    return key_of


def test_p_and_vt_use_one_key_order():
    """P's k position l is key pack_p[l], and V^T's row position l holds key vt[l]: the product P V
    pairs each probability with its own key's values only if the two orders are the same."""
    for block_n in (128, 256):
        pack = _pack_p_order(block_n)
        assert sorted(pack) == list(range(block_n))  # a permutation
        assert np.array_equal(pack, _vt_order(block_n))

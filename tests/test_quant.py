"""CPU tests of 8-bit KV-cache quantization: the NumPy reference (``pyattn.quant``), the NVRTC
compile of every ``kv_append`` variant, and the quantized ``PagedKVCache`` constructor.

The error bounds asserted here are the ones ``pyattn/quant.py`` documents. The fp8 encode of the
reference (``ml_dtypes`` cast after clipping to +-448) is checked bit for bit against a NumPy port
of the CUDA header's software conversion (``__nv_cvt_double_to_fp8``, what sm_80 / sm_86 run; sm_89+
run ``cvt.rn.satfinite.e4m3x2.f32``, the same rounding in hardware). The kernel against the reference
is ``tests/test_gpu_quant_cache.py``.
"""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ml_dtypes = pytest.importorskip("ml_dtypes")

from pyattn.quant import CODE_MAX, code_dtype, dequantize, kind_of, quantize_rows  # noqa: E402

KINDS = ("int8", "fp8e4m3")
SRC = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
F32_MAX = float(np.finfo(np.float32).max)


# -- the CUDA software fp8 conversion, ported -------------------------------------------------
def cuda_e4m3_satfinite(y) -> np.ndarray:
    """``__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3)`` of finite float32 ``y`` as uint8,
    following cuda_fp8.hpp's ``__nv_cvt_double_to_fp8`` step by step (float32 -> float64 is exact)."""
    xb = np.asarray(y, np.float32).astype(np.float64).view(np.uint64).astype(np.uint64)
    sign = ((xb >> np.uint64(63)) << np.uint64(7)).astype(np.int64)
    absx = xb & np.uint64(0x7FFFFFFFFFFFFFFF)
    exp = ((xb >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64) - 1023 + 7
    mant = ((xb >> np.uint64(49)) & np.uint64(0x7)).astype(np.int64)
    half = 1 << 48  # half an e4m3 ulp, in float64 mantissa bits
    xi = xb.astype(object)  # Python ints: exact shifts by a per-element amount
    res = np.zeros(xb.shape, np.int64)
    for i in np.ndindex(xb.shape):
        a = int(absx[i])
        if a <= 0x3F50000000000000:  # |y| <= 2^-10: zero
            r = 0
        elif a > 0x407D000000000000:  # beyond 448 + half an ulp: saturate
            r = 0x7E
        elif a >= 0x3F90000000000000:  # normal: >= 2^-6
            r = (int(exp[i]) << 3) | int(mant[i])
            rnd = int(xi[i]) & ((half << 1) - 1)
            if rnd > half or (rnd == half and mant[i] & 1):
                r += 1
        else:  # subnormal
            shift = 1 - int(exp[i])
            m = int(mant[i]) | 8
            r = m >> shift
            rnd = (int(xi[i]) | (1 << 52)) & ((half << (shift + 1)) - 1)
            if rnd > (half << shift) or (rnd == (half << shift) and r & 1):
                r += 1
        res[i] = r | int(sign[i])
    return res.astype(np.uint8)


def _e4m3_probe_values(rng) -> np.ndarray:
    """Every finite e4m3 value, every midpoint between neighbours (the ties), each one float32 ulp
    either side, values past 448, and random float32 values across the subnormal and normal range."""
    grid = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # 0 .. 448
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)  # exact in float32
    probes = [grid, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf)),
              np.float32([448, 448.0001, 463.99997, 464, 464.00003, 480, 500, 1e4, 3e38, F32_MAX]),
              np.float32([2.0**-10, np.nextafter(np.float32(2.0**-10), np.float32(1)), 2.0**-11, 1e-30, 1e-45]),
              np.exp2(rng.uniform(-14, 9.5, 20000)).astype(np.float32)]
    v = np.concatenate(probes)
    return np.concatenate([v, -v])


def test_reference_fp8_encode_matches_the_cuda_conversion():
    """clip(+-448) then the ml_dtypes cast == the CUDA satfinite conversion, bit for bit (ties included)."""
    y = _e4m3_probe_values(np.random.default_rng(0))
    want = cuda_e4m3_satfinite(y)
    got = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    bad = np.flatnonzero(got != want)
    assert not len(bad), f"{len(bad)} differ, e.g. y={y[bad[:5]]}: ml_dtypes {got[bad[:5]]}, cuda {want[bad[:5]]}"


def test_int8_encode_rounds_half_to_even():
    x = np.float32([[127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]])  # amax 127: inv = 1 exactly
    codes, scales = quantize_rows(x, "int8")
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]] and scales[0] == np.float32(1)


# -- error bounds and code ranges -------------------------------------------------------------
def _bound(x64, amax, scale, kind):
    """The documented per-element bound on |x - dequantized| (pyattn/quant.py), float64."""
    extra = 2.0**-21 * amax[..., None] + 2.0**-140
    if kind == "int8":
        return scale[..., None] / 2 + extra
    return np.maximum(2.0**-4 * np.abs(x64), 2.0**-10 * scale[..., None]) + extra


def _check_rows(x, kind):
    codes, scales = quantize_rows(x, kind)
    assert codes.dtype == code_dtype(kind) and codes.shape == x.shape
    assert scales.dtype == np.float32 and scales.shape == x.shape[:-1]
    x64 = x.astype(np.float64)
    amax = np.max(np.abs(x64), axis=-1)
    c = codes.astype(np.float64)
    if kind == "int8":
        assert c.min(initial=0) >= -127 and c.max(initial=0) <= 127
    else:
        assert np.isfinite(c).all() and np.abs(c).max(initial=0) <= 448
    err = np.abs(x64 - dequantize(codes, scales).astype(np.float64))
    normal = amax >= CODE_MAX[kind] / F32_MAX  # the reciprocal did not overflow
    assert np.all(err[normal] <= _bound(x64, amax, scales.astype(np.float64), kind)[normal])
    assert np.all(err[~normal] <= 2 * amax[~normal, None])
    big = normal & (amax > 0)
    assert np.all(np.abs(c[big]).max(axis=-1) == CODE_MAX[kind]), "the largest element must get the largest code"
    assert np.all(scales[amax == 0] == 0) and np.all(c[amax == 0] == 0)
    return codes, scales


ROW_SCALES = st.sampled_from([1.0, 1e-3, 30.0, 1e4, 1e-30, 1e-37, 1e-38, 1e-40, 3e38])


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(KINDS), src=st.sampled_from(list(SRC)), rows=st.integers(1, 40),
       D=st.sampled_from([8, 16, 40, 64, 128, 256]), mag=ROW_SCALES, outliers=st.integers(0, 5),
       zeros=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_round_trip_within_documented_bounds(kind, src, rows, D, mag, outliers, zeros, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, D)) * mag
    for _ in range(outliers):  # a spike in one element, or a whole loud token
        r = rng.integers(rows)
        if rng.random() < 0.5:
            x[r, rng.integers(D)] *= 1e3
        else:
            x[r] *= 100
    x[rng.integers(rows, size=zeros)] = 0.0
    top = float(ml_dtypes.finfo(SRC[src]).max)
    if src == "float32":
        top = float(np.nextafter(np.float32(top), np.float32(0)))  # FLT_MAX itself: see test_flt_max_row
    x = np.clip(x, -top, top).astype(SRC[src])  # finite after the cast
    _check_rows(x, kind)


def test_flt_max_row():
    """The documented overflow: only a float32 amax of FLT_MAX itself, only int8, dequantizes to inf."""
    x = np.float32([[F32_MAX, -F32_MAX / 3, 1, 0]])
    for kind in KINDS:
        with np.errstate(over="ignore"):
            deq = dequantize(*quantize_rows(x, kind))
        assert np.isinf(deq[0, 0]) == (kind == "int8") and np.isfinite(deq[0, 1:]).all()
    bf16_max = np.array([[ml_dtypes.finfo(ml_dtypes.bfloat16).max, 1]], ml_dtypes.bfloat16)
    for kind in KINDS:
        _check_rows(bf16_max, kind)


def test_every_float16_value_round_trips_within_bounds():
    """All finite float16 values in rows of 8, twice: once in order, once shuffled."""
    v = np.arange(0, 0x10000, dtype=np.uint32).astype(np.uint16).view(np.float16)
    v = v[np.isfinite(v)]
    v = v[: len(v) // 8 * 8]
    for kind in KINDS:
        _check_rows(v.reshape(-1, 8), kind)
        _check_rows(np.random.default_rng(1).permutation(v).reshape(-1, 8), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_outlier_only_costs_its_own_row(kind):
    """Rows are independent: a loud token next to a quiet one leaves the quiet one's codes alone."""
    rng = np.random.default_rng(2)
    quiet = rng.standard_normal((1, 64)).astype(np.float32)
    loud = quiet * 1e4
    loud[0, 5] = 3e5
    both_c, both_s = quantize_rows(np.concatenate([quiet, loud]), kind)
    alone_c, alone_s = quantize_rows(quiet, kind)
    assert np.array_equal(both_c[:1].view(np.uint8), alone_c.view(np.uint8)) and both_s[0] == alone_s[0]
    assert quantize_rows(np.stack([quiet, loud]), kind)[0].shape == (2, 1, 64)  # any leading shape


@pytest.mark.parametrize("kind", KINDS)
def test_zero_rows_get_zero_codes_and_scale(kind):
    x = np.zeros((3, 16), np.float16)
    x[1] = -0.0
    codes, scales = quantize_rows(x, kind)
    assert not codes.view(np.uint8).any() and not scales.view(np.uint32).any()  # +0 codes, +0 scales
    assert not dequantize(codes, scales).any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_dequantize_to_nan(kind, bad):
    x = np.ones((2, 16), np.float32)
    x[1, 3] = bad
    codes, scales = quantize_rows(x, kind)
    assert not codes[1].view(np.uint8).any() and scales[1:].view(np.uint32).tolist() == [0x7FFFFFFF]
    deq = dequantize(codes, scales)
    assert np.isnan(deq[1]).all() and np.isfinite(deq[0]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_rows_do_not_overflow_the_reciprocal(kind):
    """bfloat16 / float32 rows with amax < M / FLT_MAX: inv is clamped to FLT_MAX, never inf (no NaN)."""
    x = np.float32([[1e-38, -1e-38, 0, 3e-39], [2.0**-149, 0, -0.0, 0], [1e-37, 0, 0, -5e-38]])
    codes, scales = _check_rows(x, kind)
    assert np.isfinite(codes.astype(np.float32)).all() and np.isfinite(scales).all()
    _check_rows(x.astype(ml_dtypes.bfloat16), kind)


def test_validation():
    x = np.ones((2, 8), np.float16)
    with pytest.raises(ValueError, match=r"^kind: expected one of \('int8', 'fp8e4m3'\), got 'fp8'"):
        quantize_rows(x, "fp8")
    with pytest.raises(TypeError, match=r"^x: expected dtype float16, bfloat16 or float32, got float64"):
        quantize_rows(x.astype(np.float64), "int8")
    with pytest.raises(TypeError, match=r"^x: expected dtype .* got int8"):
        quantize_rows(x.astype(np.int8), "int8")
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., head_dim\) with head_dim >= 1, got \(2, 0\)"):
        quantize_rows(np.ones((2, 0), np.float16), "int8")
    with pytest.raises(ValueError, match=r"^x: expected shape .* got \(\)"):
        quantize_rows(np.float16(1), "int8")
    codes, scales = quantize_rows(x, "int8")
    with pytest.raises(TypeError, match=r"^codes: expected dtype int8 or float8_e4m3fn, got int16"):
        dequantize(codes.astype(np.int16), scales)
    with pytest.raises(TypeError, match=r"^scales: expected dtype float32, got float16"):
        dequantize(codes, scales.astype(np.float16))
    with pytest.raises(ValueError, match=r"^scales: expected shape \(2,\) \(codes.shape\[:-1\]\), got \(1,\)"):
        dequantize(codes, scales[:1])
    with pytest.raises(ValueError, match=r"^kind: expected one of"):
        code_dtype("uint8")


def test_kind_of():
    for d in ("int8", np.int8, np.dtype(np.int8)):
        assert kind_of(d) == "int8"
    for d in ("fp8_e4m3", "fp8e4m3", "float8_e4m3fn", ml_dtypes.float8_e4m3fn, np.dtype(ml_dtypes.float8_e4m3fn)):
        assert kind_of(d) == "fp8e4m3"
    for d in ("float16", np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3, ml_dtypes.float8_e5m2, "uint8",
              np.uint8, "e4m3", None):
        assert kind_of(d) == "", d


# -- the kv_append kernels compile everywhere ---------------------------------------------------
def _spec(arch, tag, kv, ptx=False):
    from pyattn.kernels.specs import KernelSpec

    return KernelSpec("kv_append", tag, 32, arch, ptx, kv=kv)


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_append_compiles_for_every_source_type_and_kind(arch):
    """NVRTC to cubin (no GPU needed): T in {f16, bf16} x KV in {16-bit, int8, fp8 e4m3}."""
    import pyattn.jit as jit

    for tag, kv in itertools.product(("f16", "bf16"), ("", "int8", "fp8e4m3")):
        spec = _spec(arch, tag, kv)
        image, meta = jit.compile_spec(spec)
        assert image[:4] == b"\x7fELF" and meta["format"] == "cubin", spec.describe()
        assert spec.entry_name.encode() in image, spec.describe()


@pytest.mark.parametrize("arch, hw_cvt", [("sm_80", False), ("sm_89", True), ("sm_90a", True)])
def test_quantizing_kernels_use_exact_fp32_arithmetic(arch, hw_cvt):
    """The bit-exact contract needs IEEE division (no fast-math reciprocal) and, for fp8, the
    satfinite conversion: in hardware from sm_89 on, the header's software path before."""
    import pyattn.jit as jit

    for kv in ("int8", "fp8e4m3"):
        ptx = jit.compile_spec(_spec(arch, "bf16", kv, ptx=True))[0].decode(errors="replace")
        assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx, (arch, kv)
        if kv == "int8":
            assert "cvt.rni.s32.f32" in ptx
        else:
            assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == hw_cvt, (arch, kv)


# -- the quantized cache's constructor, without a GPU -------------------------------------------
class _FakeArray:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.elem_strides = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.stream = self

    def synchronize(self):
        pass


@pytest.fixture
def fake_device(monkeypatch):
    """PagedKVCache with its device and allocations stubbed: the constructor's host logic only."""
    import pyattn.paged.cache as cache_mod

    monkeypatch.setattr(cache_mod, "get_device", lambda ordinal=None: types.SimpleNamespace(ordinal=0))
    monkeypatch.setattr(cache_mod, "empty", lambda shape, dtype, device=None: _FakeArray(shape, dtype))


@pytest.mark.parametrize("dtype, kv, name", [
    ("int8", "int8", "int8"), (np.int8, "int8", "int8"), ("fp8_e4m3", "fp8e4m3", "float8_e4m3fn"),
    (ml_dtypes.float8_e4m3fn, "fp8e4m3", "float8_e4m3fn"), ("float8_e4m3fn", "fp8e4m3", "float8_e4m3fn"),
    ("float16", "", "float16"), (ml_dtypes.bfloat16, "", "bfloat16")])
def test_cache_constructor_pools_and_pool_info(fake_device, dtype, kv, name):
    import pyattn

    c = pyattn.PagedKVCache(6, 16, 3, 128, dtype)
    assert c.kv == kv and c.dtype.name == name
    assert c.k.shape == c.v.shape == (6, 16, 3, 128) and c.k.dtype == c.dtype
    p = c.pool_info
    assert (p.num_pages, p.page_size, p.heads_kv, p.head_dim, p.dtype, p.kv) == (6, 16, 3, 128, c.dtype, kv)
    assert p.k_strides == p.v_strides == (16 * 3 * 128, 3 * 128, 128)
    if kv:
        assert c.k_scale.shape == c.v_scale.shape == (6, 3, 16) and c.k_scale.dtype == np.float32
        assert p.ks_strides == p.vs_strides == (3 * 16, 1, 16)  # (page, slot, head) of (page, head, slot)
        assert f"{name} codes + float32 scales per token and kv head" in repr(c)
    else:
        assert c.k_scale is None and c.v_scale is None and p.ks_strides == p.vs_strides == (0, 0, 0)
        assert f"head_dim 128, {name}, 6 pages free" in repr(c)


@pytest.mark.parametrize("dtype", ["float32", np.uint8, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3, "fp8"])
def test_cache_constructor_rejects_other_dtypes(fake_device, dtype):
    import pyattn

    with pytest.raises(TypeError, match=r"^dtype: (expected float16, bfloat16, int8 or fp8_e4m3 "
                                        r"\(ml_dtypes.float8_e4m3fn\), got|unsupported dtype)"):
        pyattn.PagedKVCache(4, 16, 2, 64, dtype)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_cache_needs_head_dim_multiple_of_16(fake_device, kv):
    import pyattn

    with pytest.raises(ValueError, match=r"^head_dim: an 8-bit cache needs a multiple of 16"):
        pyattn.PagedKVCache(4, 16, 2, 72, kv)
    assert pyattn.PagedKVCache(4, 16, 2, 80, kv).head_dim == 80
    assert pyattn.PagedKVCache(4, 16, 2, 72, "float16").head_dim == 72  # 16-bit caches keep multiples of 8


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_append_validates_token_dtypes_before_any_gpu_work(fake_device, kv):
    import pyattn

    c = pyattn.PagedKVCache(4, 16, 2, 64, kv)
    s = c.add_sequence()
    k16 = np.ones((1, 2, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"^k: expected dtype float16 or bfloat16 \(quantized into the "
                                        r"(int8|fp8e4m3) cache\), got float32"):
        c.append([s], k16.astype(np.float32), k16)
    with pytest.raises(TypeError, match=r"^k: expected dtype float16 or bfloat16 .* got int8"):
        c.append([s], k16.astype(np.int8), k16.astype(np.int8))
    with pytest.raises(TypeError, match=r"^v: expected dtype float16 \(k's\), got bfloat16"):
        c.append([s], k16, k16.astype(ml_dtypes.bfloat16))
    assert c.length(s) == 0 and c.num_free_pages == 4


def test_16bit_append_still_requires_the_cache_dtype(fake_device):
    import pyattn

    c = pyattn.PagedKVCache(4, 16, 2, 64, "bfloat16")
    s = c.add_sequence()
    k = np.ones((1, 2, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"^k: expected dtype bfloat16 \(the cache's\), got float16"):
        c.append([s], k, k)

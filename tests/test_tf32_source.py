"""kernels_src/attention_fwd_tf32.cuh without a GPU: fragment index mapping and NVRTC compiles.

The emulation reads the shared-memory address expressions and shuffle sources straight out of the
header (they are valid Python as written) and replays them for all 32 lanes of a warp, with
ldmatrix and mma.m16n8k8.tf32 modelled from the PTX ISA fragment layouts. It proves that Q/K
fragments give S = Q K^T, that the shuffle-built P fragment and the scalar-loaded V fragment give
O = P V, and that the shared-memory accesses are free of bank conflicts. CPU only, a few seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec

SRC = (Path(__file__).resolve().parents[1] / "kernels_src" / "attention_fwd_tf32.cuh").read_text()
LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


def _expr(pattern: str) -> str:
    m = re.search(pattern, SRC)
    assert m, f"pattern not found in attention_fwd_tf32.cuh: {pattern}"
    return m.group(1)


Q_ADDR = _expr(r"ldmatrix_x4\(a\[mi\], sQ \+ (.+?)\);")
K_ADDR = _expr(r"ldmatrix_x4\(b, tK \+ (.+?)\);")
V_ADDR = _expr(r"const float\* vp = tV \+ (.+?);")
V_B1 = _expr(r"b1 = tf32_round\(vp\[(.+?)\]\)")
SRC1 = _expr(r"const int src1 = (.+?), src2")
SRC2 = _expr(r"src2 = (src1 \^ 2);")


def _ev(expr: str, **env) -> np.ndarray:
    return np.asarray(eval(expr, {}, {"lane": LANES, "g": G, "t": T, **env}))  # noqa: S307 (our own header)


def _strides(d):
    return d + 4, d + 8  # kStrideQK, kStrideV (checked against the header below)


# -- models of the hardware (PTX ISA layouts, g = lane / 4, t = lane % 4) --------------------------
def ldmatrix_x4(smem: np.ndarray, addr: np.ndarray) -> np.ndarray:
    """Lane 8m + r gives the address of row r of matrix m (4 words); lane l receives, for every
    matrix m, the 32-bit word l % 4 of row l // 4. Returns regs[lane, m]."""
    assert addr.shape == (32,) and np.all(addr % 4 == 0), "ldmatrix rows must be 16-byte aligned"
    return np.stack([smem[addr[8 * m + LANES // 4] + LANES % 4] for m in range(4)], axis=1)


def mma_1688(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """c[lane, 4] += A(16x8) @ B(8x8), operands given as per-lane fragments a[lane, 4], b[lane, 2]."""
    A, B = np.full((16, 8), np.nan), np.full((8, 8), np.nan)
    A[G, T], A[G + 8, T], A[G, T + 4], A[G + 8, T + 4] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    B[T, G], B[T + 4, G] = b[:, 0], b[:, 1]
    assert not np.isnan(A).any() and not np.isnan(B).any()
    C = A @ B
    return c + np.stack([C[G, 2 * T], C[G, 2 * T + 1], C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], axis=1)


def c_fragment(M: np.ndarray) -> np.ndarray:
    """The C fragment (per lane, 4 values) of a 16x8 matrix."""
    return np.stack([M[G, 2 * T], M[G, 2 * T + 1], M[G + 8, 2 * T], M[G + 8, 2 * T + 1]], axis=1)


def shfl(vals: np.ndarray, src: np.ndarray) -> np.ndarray:
    return vals[src]


def build_p_fragment(c: np.ndarray) -> np.ndarray:
    """The kernel's A build from one n8 C tile: c[lane, 4] -> a[lane, 4] (see the header)."""
    hi, odd = (T & 2) != 0, (T & 1) != 0
    src1 = _ev(SRC1)
    src2 = _ev(SRC2, src1=src1)
    a = np.empty((32, 4))
    for h in range(2):
        c0, c1 = c[:, 2 * h], c[:, 2 * h + 1]
        x1 = shfl(np.where(hi, c1, c0), src1)
        x2 = shfl(np.where(hi, c0, c1), src2)
        a[:, h] = np.where(odd, x2, x1)
        a[:, h + 2] = np.where(odd, x1, x2)
    return a


def test_header_matches_the_emulated_code():
    for line in ("const float x1 = __shfl_sync(kFullMask, hi ? c1 : c0, src1);",
                 "const float x2 = __shfl_sync(kFullMask, hi ? c0 : c1, src2);",
                 "a[mi][h] = tf32_round(odd ? x2 : x1);",
                 "a[mi][h + 2] = tf32_round(odd ? x1 : x2);",
                 "const bool odd = t & 1, hi = t & 2;",
                 "const float c0 = s[mi][kk][2 * h], c1 = s[mi][kk][2 * h + 1];",
                 "static constexpr int kStrideQK = HEAD_DIM_ + 4;",
                 "static constexpr int kStrideV = HEAD_DIM_ + 8;",
                 "mma_1688_tf32(s[mi][nt], a[mi], b[0], b[1]);",
                 "mma_1688_tf32(s[mi][nt + 1], a[mi], b[2], b[3]);",
                 "for (int mi = 0; mi < MT; ++mi) mma_1688_tf32(acc[mi][dt], a[mi], b0, b1);",
                 "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
                 "cvt.rna.tf32.f32"):
        assert line in SRC, line


def test_p_fragment_from_shuffles_times_scalar_v_is_p_at_v():
    """One k8 step: random 16x8 P in S's C layout, random 8x8 V in padded shared memory."""
    rng = np.random.default_rng(0)
    for d in (32, 256):
        _, LV = _strides(d)
        P, V = rng.standard_normal((16, 8)), rng.standard_normal((8, d))
        sV = np.full(8 * LV, np.nan)
        for r in range(8):
            sV[r * LV:r * LV + d] = V[r]
        a = build_p_fragment(c_fragment(P))
        for dt in range(d // 8):
            addr = _ev(V_ADDR, kk=0, dt=dt, LV=LV)
            b = np.stack([sV[addr], sV[addr + _ev(V_B1, LV=LV)]], axis=1)
            out = mma_1688(np.zeros((32, 4)), a, b)
            np.testing.assert_allclose(out, c_fragment(P @ V[:, dt * 8:dt * 8 + 8]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d,bn,mt,warp", [(32, 16, 1, 0), (64, 32, 1, 3), (128, 32, 2, 1), (256, 16, 1, 2)])
def test_warp_tile_s_and_o_match_numpy(d, bn, mt, warp):
    """A whole warp's tile, as the kernel's loops walk it: S = Q K^T, then O = P V with P = S."""
    rng = np.random.default_rng(d + bn)
    LD, LV = _strides(d)
    warps = warp + 1
    bm = 16 * mt * warps
    Q, K, V = (rng.standard_normal(s) for s in ((bm, d), (bn, d), (bn, d)))
    sQ, sK, sV = np.full(bm * LD, np.nan), np.full(bn * LD, np.nan), np.full(bn * LV, np.nan)
    for X, buf, ld in ((Q, sQ, LD), (K, sK, LD), (V, sV, LV)):
        for r in range(X.shape[0]):
            buf[r * ld:r * ld + d] = X[r]
    warp_row, nt_count = warp * 16 * mt, bn // 8
    s = np.zeros((mt, nt_count, 32, 4))
    for kk in range(d // 8):
        a = [ldmatrix_x4(sQ, _ev(Q_ADDR, warp_row=warp_row, mi=mi, LD=LD, kk=kk)) for mi in range(mt)]
        for nt in range(0, nt_count, 2):
            b = ldmatrix_x4(sK, _ev(K_ADDR, nt=nt, LD=LD, kk=kk))
            for mi in range(mt):
                s[mi, nt] = mma_1688(s[mi, nt], a[mi], b[:, 0:2])
                s[mi, nt + 1] = mma_1688(s[mi, nt + 1], a[mi], b[:, 2:4])
    S = Q @ K.T
    for mi in range(mt):
        rows = slice(warp_row + 16 * mi, warp_row + 16 * mi + 16)
        for nt in range(nt_count):
            np.testing.assert_allclose(s[mi, nt], c_fragment(S[rows, nt * 8:nt * 8 + 8]), rtol=1e-10, atol=1e-10)
    acc = np.zeros((mt, d // 8, 32, 4))
    for kk in range(nt_count):
        a = [build_p_fragment(s[mi, kk]) for mi in range(mt)]
        for dt in range(d // 8):
            addr = _ev(V_ADDR, kk=kk, dt=dt, LV=LV)
            b = np.stack([sV[addr], sV[addr + _ev(V_B1, LV=LV)]], axis=1)
            for mi in range(mt):
                acc[mi, dt] = mma_1688(acc[mi, dt], a[mi], b)
    O = S @ V
    for mi in range(mt):
        rows = slice(warp_row + 16 * mi, warp_row + 16 * mi + 16)
        for dt in range(d // 8):
            np.testing.assert_allclose(acc[mi, dt], c_fragment(O[rows, dt * 8:dt * 8 + 8]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("d", HEAD_DIM_BUCKETS)
def test_shared_memory_accesses_are_conflict_free(d):
    LD, LV = _strides(d)
    assert (LD * 4) % 16 == 0 and (LV * 4) % 16 == 0  # cp.async 16-byte chunks stay aligned
    for kk in range(d // 8):
        phases = [_ev(Q_ADDR, warp_row=16, mi=1, LD=LD, kk=kk)] + [_ev(K_ADDR, nt=nt, LD=LD, kk=kk) for nt in (0, 2)]
        for addr in phases:  # one ldmatrix phase = one matrix = 8 rows of 16 bytes
            for m in range(4):
                groups = (addr[8 * m:8 * m + 8] * 4 // 16) % 8
                assert len(set(groups)) == 8, (d, kk, m, addr)
    for kk in range(2):
        for dt in range(d // 8):
            addr = _ev(V_ADDR, kk=kk, dt=dt, LV=LV)
            for off in (0, _ev(V_B1, LV=LV)):
                assert len(set((addr + off) % 32)) == 32, (d, kk, dt)


# -- NVRTC: the library's own units (their static_assert checks the shared-memory formula) -------
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90a": 227 * 1024,
              "sm_100a": 227 * 1024}


@pytest.mark.parametrize("arch", tuple(SMEM_LIMIT))
def test_tile_choices_fit_shared_memory(arch):
    for d in HEAD_DIM_BUCKETS:
        assert KernelSpec("attn_fwd_tf32", "f32", d, arch).shared_bytes <= SMEM_LIMIT[arch], (arch, d)


@pytest.mark.parametrize("arch", tuple(SMEM_LIMIT))
def test_compiles_for_every_arch(arch):
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("cuda.bindings")
    from pyattn.jit.headers import cuda_include_dir
    from pyattn.jit.nvrtc import compile_source
    from pyattn.jit.source import kernel_headers, render

    inc = cuda_include_dir()[0]
    specs = [KernelSpec("attn_fwd_tf32", "f32", d, arch) for d in (32, 64, 128, 256)]
    specs += [KernelSpec("attn_fwd_tf32", "f32", d, arch, mask="bool", softcap=True, alibi=True) for d in (32, 256)]

    def build(spec):
        opts = spec.compile_options((str(inc),)) + ("-Xptxas=-v",)  # -v: the spill counts below
        return compile_source(render(spec), kernel_headers(), opts, name=spec.describe())

    with ThreadPoolExecutor(max_workers=4) as pool:
        for spec, (image, log) in zip(specs, pool.map(build, specs)):
            assert image[:4] == b"\x7fELF", spec.describe()
            assert spec.entry_name.encode() + b"\0" in image
            spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
            assert spills and max(spills) == 0, (spec.describe(), log)

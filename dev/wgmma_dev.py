"""Develop the Hopper wgmma forward kernel (kernels_src/attention_fwd_wgmma.cuh) outside the library.

Usage (repository root):
  PYTHONPATH=. python3 dev/wgmma_dev.py                 # compile every variant for sm_90a, report
  PYTHONPATH=. python3 dev/wgmma_dev.py --emit-header   # regenerate kernels_src/wgmma.cuh
                                                            # (= python -m pyattn.jit.wgmma_gen)
  PYTHONPATH=. python3 dev/wgmma_dev.py --run [--quick] # on an sm_90 GPU: probe, check, time

Without a GPU it renders each variant with pyattn.jit.source.render (its tiles put in the wgmma
family's table through pyattn.kernels.families.override_tiles), compiles it with NVRTC for sm_90a
against a wgmma.cuh generated for the variants' shapes too, and prints the NVRTC log and (when
cuobjdump is found) registers / spills.
With --run it also runs a one-warpgroup probe (one S = A B^T and one O = P V, against NumPy:
pins down the descriptor and fragment layouts), checks each variant against the float64
reference (pyattn.reference) on many shapes, and times it against torch SDPA's FlashAttention-2
and cuDNN backends (CUDA events, median).
"""

from __future__ import annotations

import sys

# torch (for the SDPA comparison only) is imported before anything loads NVRTC / cuda.bindings:
# imported after them, `import torch` failed on the device machine (run 1: a schema parse error
# inside torch's own import). Checks and the probe do not need torch.
torch = None
TORCH_ERROR = ""
if "--run" in sys.argv:
    try:
        import torch
    except Exception as _exc:  # noqa: BLE001 - report and go on without torch
        torch, TORCH_ERROR = None, repr(_exc)

import argparse
import concurrent.futures as cf
import functools
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ----------------------------------------------------------------------------- variants

@dataclass(frozen=True)
class Variant:
    """One wgmma tile to try: the library's own spec, compiled with this tile in the family's table."""

    dtype: str
    head_dim: int
    block_n: int
    warpgroups: int
    stages: int
    overlap: bool
    min_blocks: int = 1

    @functools.cached_property
    def unit(self) -> tuple:
        """(rendered source, entry, shared bytes, threads, block_m) of the library's spec at this tile.

        Not thread-safe (override_tiles): compile_all computes every unit before its thread pool.
        """
        from pyattn.jit.source import render
        from pyattn.kernels.families import WgmmaTile, override_tiles
        from pyattn.kernels.specs import KernelSpec

        row = WgmmaTile(self.head_dim, self.block_n, self.warpgroups, self.stages, self.overlap, self.min_blocks,
                        f"wgmma_dev {self.tag}")
        with override_tiles("attn_fwd_wgmma", "sm_90a", (row,)):
            spec = KernelSpec("attn_fwd_wgmma", self.dtype, self.head_dim, "sm_90a")
            return render(spec), spec.entry_name, spec.shared_bytes, spec.threads, spec.tiles.block_m

    @property
    def entry(self) -> str:
        return self.unit[1]

    @property
    def smem(self) -> int:  # AttnFwdWgmmaTraits::kSmemBytes (the rendered unit asserts it)
        return self.unit[2]

    @property
    def threads(self) -> int:
        return self.unit[3]

    @property
    def block_m(self) -> int:
        return self.unit[4]

    @property
    def tag(self) -> str:
        return (f"d{self.head_dim}_m{64 * self.warpgroups}n{self.block_n}w{self.warpgroups}s{self.stages}"
                f"{'o' if self.overlap else 'p'}")


def _variants_for(dtype: str) -> list:
    # Measured on an H200 (device run 2, 2026-11-22; fp16 / bf16 alike within 2%), TFLOP/s at
    # d=128 B4 S2048 H16, d=64 B4 S4096 H16, d=256 B2 S4096 H16, non-causal / causal; torch SDPA
    # FA2 in the same run: d128 337 / 245, d64 294 / 257, d256 318 / 276; cuDNN 616 / 450,
    # 469 / 405, 696 / 576. All 18 variants pass every CASES entry.
    V = Variant
    return [
        V(dtype, 128, 128, 2, 3, True),    # 348 / 268: best at d=128 (1.03x / 1.09x FA2); 252 regs, 225 KiB
        V(dtype, 128, 128, 2, 2, False),   # 335 / 263: the overlap buys ~4% only (lockstep warpgroups)
        V(dtype, 128, 64, 3, 4, True),     # 318 / 251
        V(dtype, 128, 64, 2, 4, True),     # 338 / 261
        V(dtype, 128, 64, 1, 3, True, 2),  # 317 / 259: two 1-warpgroup blocks per SM, not in lockstep
        V(dtype, 64, 128, 2, 4, True),     # 291 / 259
        V(dtype, 64, 64, 2, 4, True, 2),   # 356 / 304: best at d=64 (1.21x / 1.19x FA2), 2 blocks/SM, 128 regs
        V(dtype, 256, 64, 2, 2, False),    # 392 / 309 (bf16 398 / 351): best at d=256 (1.23x / 1.12x FA2)
        V(dtype, 256, 32, 2, 3, True),     # 351 / 296
    ]


VARIANTS = _variants_for("f16") + _variants_for("bf16")


# The probe: one warpgroup, one tile. S = A B^T (64 x 128 x 128) through the kernel's descriptors,
# written out as f32 from the accumulator layout; then O = f16(S) V (64 x 128, k = 128 keys) with P
# from registers and V read MN-major.
def probe_source() -> str:
    from pyattn.kernels.params import ATTN_FWD_PARAMS

    return (
        '#include "common.cuh"\n#include "mma.cuh"\n'
        f"namespace pyattn {{\n{ATTN_FWD_PARAMS.c_declaration()}}}  // namespace pyattn\n"
        '#include "attention_fwd_wgmma.cuh"\n'
        r'''
using Tr = pyattn::AttnFwdWgmmaTraits<__half, 128, 64, 128, 1, 2, false>;
extern "C" __global__ void __launch_bounds__(128, 1)
wgmma_probe(const __half* a, const __half* b, const __half* v, float* s_out, float* o_out) {
  using namespace pyattn;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (wg::smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned sA = base, sB = base + Tr::kQBytes, sV = sB + Tr::kKVBytes;
  wgmma_load_tile<Tr, 64>(sA, a, 128, 0, 64, 128);
  wgmma_load_tile<Tr, 128>(sB, b, 128, 0, 128, 128);
  wgmma_load_tile<Tr, 128>(sV, v, 128, 0, 128, 128);
  wg::cp_async_commit();
  wg::cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  __syncthreads();
  const unsigned long long da = wg::make_desc_sw128(sA, 16, 1024), db = wg::make_desc_sw128(sB, 16, 1024);
  const unsigned long long dv = wg::make_desc_sw128(sV, 128 * 128, 1024);
  float s[64], o[64];
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wg::Mma<__half, 128, 0>::ss(s, wg::desc_add(da, (kk / 4) * 64 * 128 + (kk % 4) * 32),
                                wg::desc_add(db, (kk / 4) * 128 * 128 + (kk % 4) * 32), kk > 0);
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(s);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = threadIdx.x / 32 * 16 + g;
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) s_out[(r0 + 8 * (e >> 1)) * 128 + 8 * i + 2 * t + (e & 1)] = s[4 * i + e];
  unsigned pf[8][4];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    pf[kk][0] = pack2<__half>(s[8 * kk + 0], s[8 * kk + 1]);
    pf[kk][1] = pack2<__half>(s[8 * kk + 2], s[8 * kk + 3]);
    pf[kk][2] = pack2<__half>(s[8 * kk + 4], s[8 * kk + 5]);
    pf[kk][3] = pack2<__half>(s[8 * kk + 6], s[8 * kk + 7]);
  }
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) wg::Mma<__half, 128, 1>::rs(o, pf[kk], wg::desc_add(dv, kk * 2048), kk > 0);
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(o);
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o_out[(r0 + 8 * (e >> 1)) * 128 + 8 * i + 2 * t + (e & 1)] = o[4 * i + e];
}
''')


# ----------------------------------------------------------------------------- compile

def _include_dir() -> str:
    from pyattn.jit.headers import check_headers_match_nvrtc

    return str(check_headers_match_nvrtc())


def _dev_shapes() -> set:
    """wgmma N used by the library's tables and by every variant here (Q K^T: block_n, P V: head_dim)."""
    from pyattn.kernels.families import wgmma_shapes

    return set(wgmma_shapes()) | {v.block_n for v in VARIANTS} | {v.head_dim for v in VARIANTS}


def compile_unit(source: str, name: str, arch: str = "sm_90a") -> tuple:
    from pyattn.jit.nvrtc import compile_source
    from pyattn.jit.source import kernel_headers
    from pyattn.jit.wgmma_gen import wgmma_header

    # The library's wgmma.cuh has the shapes of its tile tables only; variants may use others.
    headers = [(n, wgmma_header(_dev_shapes()) if n == "wgmma.cuh" else t) for n, t in kernel_headers()]
    names = {n for n, _ in headers}
    for extra in ("wgmma.cuh", "attention_fwd_wgmma.cuh", "attention_mask.cuh"):
        if extra not in names:
            headers.append((extra, (ROOT / "kernels_src" / extra).read_text()))
    opts = [f"-arch={arch}", "-std=c++17", "-lineinfo", "-DNDEBUG", f"-I{_include_dir()}"]
    t0 = time.perf_counter()
    image, log = compile_source(source, headers, opts, name=name)
    return image, log, time.perf_counter() - t0


def _cuobjdump() -> str | None:
    for c in (shutil.which("cuobjdump"), "/tmp/cudatools/nvidia/cu13/bin/cuobjdump",
              "/usr/local/cuda/bin/cuobjdump"):
        if c and os.path.exists(c):
            return c
    return None


def _cuobjdump_output(image: bytes, flag: str) -> str | None:
    """``cuobjdump <flag>`` of a cubin image (None without cuobjdump)."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(image)
        path = f.name
    try:
        return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)


def resource_usage(image: bytes) -> str:
    out = _cuobjdump_output(image, "-res-usage")
    if out is None:
        return "(no cuobjdump)"
    lines = [ln.strip() for ln in out.splitlines() if "REG" in ln]
    return " | ".join(lines) if lines else out.strip()[-300:]


def sass_counts(image: bytes) -> str:
    out = _cuobjdump_output(image, "-sass")
    if out is None:
        return ""
    keys = ("HGMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "LDL", "STL", "MUFU.EX2", "BAR.SYNC", "LDGSTS")
    return " ".join(f"{k}={out.count(k)}" for k in keys)


def compile_all(variants, *, show=True) -> dict:
    images = {}

    sources = {var: var.unit[0] for var in variants}  # sequentially: override_tiles is not thread-safe

    def one(var):
        return var, compile_unit(sources[var], var.entry)

    with cf.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2)) as ex:
        futs = [ex.submit(one, v) for v in variants]
        for fut in futs:
            try:
                var, (image, log, secs) = fut.result()
            except Exception as exc:  # CompileError: print the log and go on with the others
                print(f"COMPILE FAILED: {exc}"[:6000])
                continue
            images[var] = image
            if show:
                print(f"{var.dtype} {var.tag}: {secs:.2f}s smem={var.smem} {resource_usage(image)} "
                      f"{sass_counts(image)}")
                if log.strip():
                    print("  log:", log.strip()[:3000])
    return images


# ----------------------------------------------------------------------------- GPU checks

def _np_dtype(dtype: str):
    import ml_dtypes

    return {"f16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]


def _drv():
    from cuda.bindings import driver

    return driver


def _ck(res, what):
    err = res[0]
    if int(err) != 0:
        raise RuntimeError(f"{what}: {err}")
    return res[1] if len(res) == 2 else res[1:]


class DArr:
    """A device copy of a NumPy array (C order), with the torch-like accessors params() uses."""

    def __init__(self, host: np.ndarray):
        host = np.ascontiguousarray(host)
        self.shape, self.dtype, self.nbytes = host.shape, host.dtype, host.nbytes
        self._strides = tuple(st // host.itemsize for st in host.strides)
        self.ptr = int(_ck(_drv().cuMemAlloc(max(1, host.nbytes)), "cuMemAlloc"))
        self.upload(host)

    def upload(self, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        _ck(_drv().cuMemcpyHtoD(self.ptr, host.ctypes.data, host.nbytes), "cuMemcpyHtoD")

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        _ck(_drv().cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self, i: int) -> int:
        return self._strides[i]

    def free(self) -> None:
        if self.ptr:
            _drv().cuMemFree(_drv().CUdeviceptr(self.ptr))
            self.ptr = 0


def _sync():
    _ck(_drv().cuCtxSynchronize(), "cuCtxSynchronize")


class Runner:
    def __init__(self, images: dict):
        from pyattn.runtime.device import get_device
        from pyattn.runtime.module import Module
        from pyattn.runtime.stream import Stream

        if torch is not None:
            torch.zeros(1, device="cuda")  # torch's context is the primary one pyattn uses too
        self.device = get_device(0)
        self.device.activate()
        self.stream = Stream(handle=0)  # the legacy default stream (torch's current one)
        self.kernels = {}
        self.modules = []
        for var, image in images.items():
            mod = Module(self.device, image)
            self.modules.append(mod)
            kern = mod.kernel(var.entry)
            kern.set_max_dynamic_shared(var.smem)
            self.kernels[var] = kern

    def params(self, var, q, k, v, o, lse, *, layout, causal, window, cu_q=None, cu_k=None, max_sq=None,
               max_sk=None, head_dim=None):
        from pyattn.kernels.params import ATTN_FWD_PARAMS

        vals = {name: 0 for name, _ in ATTN_FWD_PARAMS.fields}
        d = q.shape[-1] if head_dim is None else head_dim
        if cu_q is not None:  # packed (total, H, D)
            hq, hkv = q.shape[1], k.shape[1]
            b = cu_q.shape[0] - 1
            for n, t in (("q", q), ("k", k), ("v", v), ("o", o)):
                vals[f"{n}_stride_b"] = 0
                vals[f"{n}_stride_s"] = t.stride(0)
                vals[f"{n}_stride_h"] = t.stride(1)
            sq, sk = max_sq, max_sk
            vals.update(cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr(),
                        lse_stride_b=0, lse_stride_h=q.shape[0])
        else:
            if layout == "bshd":
                b, sq, hq, _ = q.shape
                sk, hkv = k.shape[1], k.shape[2]
                ax = {"b": 0, "s": 1, "h": 2}
            else:
                b, hq, sq, _ = q.shape
                hkv, sk = k.shape[1], k.shape[2]
                ax = {"b": 0, "s": 2, "h": 1}
            for n, t in (("q", q), ("k", k), ("v", v), ("o", o)):
                for a, i in ax.items():
                    vals[f"{n}_stride_{a}"] = t.stride(i)
            vals.update(lse_stride_b=hq * sq, lse_stride_h=sq)
        scale = 1.0 / np.sqrt(d)
        vals.update(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=o.data_ptr(),
                    lse=lse.data_ptr() if lse is not None else 0,
                    batch=b, heads_q=hq, heads_kv=hkv, group=hq // hkv, seqlen_q=sq, seqlen_k=sk, head_dim=d,
                    causal={False: 0, True: 1, "bottom_right": 1, "top_left": 2}[causal],
                    window_left=window[0] if window else -1, window_right=window[1] if window else -1,
                    scale=float(scale), scale_log2=float(scale * 1.4426950408889634), softcap=0.0)
        grid = ((sq + var.block_m - 1) // var.block_m, hq, b)
        return ATTN_FWD_PARAMS.pack(vals), grid

    def launch(self, var, packed, grid):
        from pyattn.runtime.launch import launch

        launch(self.kernels[var], grid, (var.threads, 1, 1), var.smem, self.stream, packed)


def run_probe(images_probe) -> bool:
    import ctypes

    from pyattn.runtime.device import get_device
    from pyattn.runtime.module import Module

    dev = get_device(0)
    dev.activate()
    mod = Module(dev, images_probe)
    kern = mod.kernel("wgmma_probe")
    smem = 64 * 128 * 2 + 2 * 128 * 128 * 2 + 1024
    kern.set_max_dynamic_shared(smem)
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((64, 128)) * 0.3).astype(np.float16)
    b = (rng.standard_normal((128, 128)) * 0.3).astype(np.float16)
    v = rng.standard_normal((128, 128)).astype(np.float16)
    bufs = [DArr(x) for x in (a, b, v, np.full((64, 128), np.nan, np.float32), np.full((64, 128), np.nan, np.float32))]
    args = [ctypes.c_void_p(x.ptr) for x in bufs]
    argv = (ctypes.c_void_p * 5)(*[ctypes.addressof(x) for x in args])
    _ck(_drv().cuLaunchKernel(kern.handle, 1, 1, 1, 128, 1, 1, smem, 0, ctypes.addressof(argv), 0), "launch probe")
    _sync()
    s_got, o_got = bufs[3].numpy().astype(np.float64), bufs[4].numpy().astype(np.float64)
    s_ref = a.astype(np.float64) @ b.astype(np.float64).T
    o_ref = s_got.astype(np.float16).astype(np.float64) @ v.astype(np.float64)
    es = float(np.max(np.abs(s_got - s_ref)))
    eo = float(np.max(np.abs(o_got - o_ref))) / max(1.0, float(np.max(np.abs(o_ref))))
    ok = es < 1e-2 and eo < 1e-2
    print(f"PROBE S=AB^T max|err|={es:.3g}  O=PV rel err={eo:.3g}  nan={int(np.isnan(s_got).sum())}/"
          f"{int(np.isnan(o_got).sum())} -> {'OK' if ok else 'FAIL'}")
    if not ok:  # which reference column each output column matches, to read off a permutation
        for name, got, ref in (("S", s_got, s_ref), ("O", o_got, o_ref)):
            cols = [int(np.argmin(np.max(np.abs(got[:, c:c + 1] - ref), axis=0))) for c in range(16)]
            rows = [int(np.argmin(np.max(np.abs(got[r:r + 1, :] - ref), axis=1))) for r in range(16)]
            print(f"  {name}: got cols 0..15 ~ ref cols {cols}; got rows 0..15 ~ ref rows {rows}")
    for x in bufs:
        x.free()
    return ok


CASES = [
    # (name, B, Sq, Sk, Hq, Hkv, D_actual, layout, causal, window, varlen)
    ("dense", 2, 256, 256, 4, 4, None, "bshd", False, None, None),
    ("causal_tail", 2, 1000, 1000, 2, 2, None, "bshd", True, None, None),
    ("tiny", 1, 1, 5, 2, 1, None, "bshd", False, None, None),
    ("sq<sk causal", 1, 300, 1000, 4, 2, None, "bshd", True, None, None),
    ("sq>sk causal (empty rows)", 1, 1000, 300, 4, 4, None, "bshd", True, None, None),
    ("gqa bhsd", 2, 333, 517, 8, 2, None, "bhsd", False, None, None),
    ("window(128,0)", 1, 777, 777, 4, 4, None, "bshd", False, (128, 0), None),
    ("window(64,64)+causal", 1, 640, 700, 2, 2, None, "bshd", True, (64, 64), None),
    ("top_left", 1, 300, 700, 2, 2, None, "bhsd", "top_left", None, None),
    ("pad head_dim", 2, 200, 333, 2, 1, "pad", "bshd", True, None, None),
    ("varlen causal", 0, 0, 0, 4, 2, None, "bshd", True, None, ([0, 100, 357, 1000, 1000, 1017], [0, 300, 357, 900, 1000, 1200])),
    ("varlen", 0, 0, 0, 4, 4, None, "bshd", False, None, ([0, 129, 250], [0, 64, 700])),
]


_REF_CACHE: dict = {}


def _make_case(case, dtype, D, rng):
    """Inputs, fp64 reference output / LSE and tolerance of one case (cached per dtype and bucket)."""
    from pyattn.reference import attention_ref, attention_varlen_ref, error_bound

    key = (case[0], dtype, D)
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    name, B, Sq, Sk, Hq, Hkv, dact, layout, causal, window, varlen = case
    n_dt = _np_dtype(dtype)
    d = D - 24 if dact == "pad" else D  # 104 in the 128 bucket, 40 in 64, 232 in 256
    opts = dict(causal=causal, window=window)
    if varlen is not None:
        cu_q, cu_k = (np.array(c, dtype=np.int32) for c in varlen)
        tq, tk = int(cu_q[-1]), int(cu_k[-1])
        qn = rng.standard_normal((tq, Hq, d)).astype(n_dt)
        kn = rng.standard_normal((tk, Hkv, d)).astype(n_dt)
        vn = rng.standard_normal((tk, Hkv, d)).astype(n_dt)
        ref, ref_lse = attention_varlen_ref(qn, kn, vn, cu_q, cu_k, return_lse=True, **opts)
        tol = 0.0  # the largest per-sequence bound
        for i in range(len(cu_q) - 1):
            a, b_, c, e = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            if b_ > a and e > c:
                tol = max(tol, error_bound(qn[None, a:b_], kn[None, c:e], vn[None, c:e], **opts))
        tol = tol or 1e-2
        extra = (cu_q, cu_k)
    else:
        shp = lambda s_, h: (B, s_, h, d) if layout == "bshd" else (B, h, s_, d)
        qn = rng.standard_normal(shp(Sq, Hq)).astype(n_dt)
        kn = rng.standard_normal(shp(Sk, Hkv)).astype(n_dt)
        vn = rng.standard_normal(shp(Sk, Hkv)).astype(n_dt)
        ref, ref_lse = attention_ref(qn, kn, vn, layout=layout, return_lse=True, **opts)
        tol = error_bound(qn, kn, vn, layout=layout, **opts)
        extra = None
    _REF_CACHE[key] = (d, qn, kn, vn, ref, ref_lse, tol, extra)
    return _REF_CACHE[key]


def check_variant(runner, var, cases, rng) -> bool:
    all_ok = True
    for case in cases:
        name, B, Sq, Sk, Hq, Hkv, dact, layout, causal, window, varlen = case
        d, qn, kn, vn, ref, ref_lse, tol, extra = _make_case(case, var.dtype, var.head_dim, rng)
        n_dt = _np_dtype(var.dtype)
        q, k, v = DArr(qn), DArr(kn), DArr(vn)
        o = DArr(np.full(qn.shape, np.nan, dtype=n_dt))
        bufs = [q, k, v, o]
        if varlen is not None:
            cu_q, cu_k = extra
            lse = DArr(np.full((Hq, qn.shape[0]), np.nan, np.float32))
            cq, ck = DArr(cu_q), DArr(cu_k)
            bufs += [lse, cq, ck]
            mq, mk = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())
            packed, grid = runner.params(var, q, k, v, o, lse, layout=layout, causal=causal, window=window,
                                         cu_q=cq, cu_k=ck, max_sq=mq, max_sk=mk)
        else:
            lse = DArr(np.full((B, Hq, Sq), np.nan, np.float32))
            bufs.append(lse)
            packed, grid = runner.params(var, q, k, v, o, lse, layout=layout, causal=causal, window=window)
        runner.launch(var, packed, grid)
        _sync()
        got = o.numpy().astype(np.float64)
        again = ""
        if name == "causal_tail":  # a race shows as a difference between two identical launches
            o.upload(np.full(qn.shape, np.nan, dtype=n_dt))
            runner.launch(var, packed, grid)
            _sync()
            again = " repeat_identical=" + str(bool(np.array_equal(got, o.numpy().astype(np.float64))))
        got_lse = lse.numpy().astype(np.float64)
        for x in bufs:
            x.free()
        nan = int(np.isnan(got).sum())
        err = float(np.nanmax(np.abs(got - ref))) if nan < got.size else float("inf")
        fin = np.isfinite(ref_lse)
        lse_err = float(np.max(np.abs(got_lse[fin] - ref_lse[fin]), initial=0.0))
        lse_inf_ok = bool(np.all(np.isneginf(got_lse[~fin])))
        ok = nan == 0 and err <= tol and lse_err < 4e-3 and lse_inf_ok
        all_ok &= ok
        print(f"  {'ok  ' if ok else 'FAIL'} {var.dtype} {var.tag} {name:28s} d={d} err={err:.3g} tol={tol:.3g} "
              f"lse_err={lse_err:.2g} empty_rows_lse_ok={lse_inf_ok} nan={nan}{again}")
        if not ok and nan < got.size:  # where: index of the worst element, share of bad ones
            diff = np.nan_to_num(np.abs(got - ref), nan=np.inf)
            worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
            print(f"       worst at {tuple(int(i) for i in worst)} (shape {got.shape}): got {got[worst]:.4f} "
                  f"ref {ref[worst]:.4f}; {float(np.mean(diff > tol)):.3%} of elements over tol")
    return all_ok


def time_ms(fn, stream, reps=15, inner=5):
    """Median over `reps` of the mean time of `inner` back-to-back calls (hides host launch cost)."""
    for _ in range(3):
        fn()
    stream.synchronize()
    ts = []
    for _ in range(reps):
        a = stream.record(timing=True)
        for _ in range(inner):
            fn()
        b = stream.record(timing=True)
        b.synchronize()
        ts.append(a.elapsed_ms(b) / inner)
    return sorted(ts)[len(ts) // 2]


def bench(runner, variants, shapes) -> list:
    rows = []
    st = runner.stream
    rng = np.random.default_rng(2)
    for (B, S, H, D) in shapes:
        for dtype in ("f16", "bf16"):
            if not any(v.dtype == dtype and v.head_dim == D for v in variants) and torch is None:
                continue
            n_dt = _np_dtype(dtype)
            # two input sets, alternated, so that repeated runs do not just hit L2
            hosts = [[rng.standard_normal((B, S, H, D), dtype=np.float32).astype(n_dt) for _ in range(3)]
                     for _ in range(2)]
            sets = [[DArr(h) for h in hs] for hs in hosts]
            o = DArr(np.zeros((B, S, H, D), dtype=n_dt))
            lse = DArr(np.zeros((B, H, S), np.float32))
            tsets = None
            if torch is not None:
                t_dt = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
                tsets = [[torch.from_numpy(h.view(np.int16)).view(t_dt).cuda().transpose(1, 2) for h in hs]
                         for hs in hosts]  # (B, H, S, D) views of bshd data, as torch SDPA takes them
            for causal in (False, True):
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                res = {"flash": float("nan"), "cudnn": float("nan")}
                if tsets is not None:
                    import torch.nn.functional as F
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                        try:
                            with sdpa_kernel([be]):
                                it = iter(range(10 ** 9))
                                res[name] = time_ms(lambda: F.scaled_dot_product_attention(
                                    *tsets[next(it) % 2], is_causal=causal), st)
                        except Exception as exc:  # backend missing for this shape
                            print(f"  torch {name} failed: {exc!s:.200}")
                    print(f"  torch {dtype} B{B} S{S} H{H} D{D} causal={causal}: flash {res['flash']:.3f} ms "
                          f"({flops / res['flash'] / 1e9:.0f} TFLOP/s), cudnn {res['cudnn']:.3f} ms "
                          f"({flops / res['cudnn'] / 1e9:.0f} TFLOP/s)")
                for var in variants:
                    if var.dtype != dtype or var.head_dim != D or var not in runner.kernels:
                        continue
                    packs = [runner.params(var, *s_, o, lse, layout="bshd", causal=causal, window=None)
                             for s_ in sets]
                    it = iter(range(10 ** 9))
                    ms = time_ms(lambda: runner.launch(var, *packs[next(it) % 2]), st)
                    tf = flops / ms / 1e9
                    rows.append((dtype, f"B{B} S{S} H{H} D{D}", causal, var.tag, ms, tf,
                                 res["flash"], res["flash"] / ms, res["cudnn"], res["cudnn"] / ms))
                    print(f"  {dtype} B{B} S{S} H{H} D{D} causal={causal!s:5} {var.tag:18s} {ms:.3f} ms "
                          f"{tf:6.1f} TFLOP/s | x flash {res['flash'] / ms:.2f} | x cudnn {res['cudnn'] / ms:.2f}")
            for x in [o, lse] + [b for s_ in sets for b in s_]:
                x.free()
            del tsets
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emit-header", action="store_true", help="regenerate kernels_src/wgmma.cuh")
    ap.add_argument("--run", action="store_true", help="probe, check and time on the GPU")
    ap.add_argument("--quick", action="store_true", help="fewer variants and cases")
    ap.add_argument("--only", default="", help="substring filter on variant tags")
    ap.add_argument("--probe-only", action="store_true", help="compile and run the layout probe only")
    args = ap.parse_args()

    from pyattn.jit import wgmma_gen

    if args.emit_header:
        return wgmma_gen.main([])
    if wgmma_gen.main(["--check"]):
        print("WARNING: kernels_src/wgmma.cuh differs from the generator (run --emit-header)")

    variants = [v for v in VARIANTS if args.only in v.tag]
    t0 = time.perf_counter()
    probe_img = None
    try:
        probe_img, plog, _ = compile_unit(probe_source(), "wgmma_probe")
        print(f"probe: {resource_usage(probe_img)} {plog.strip()[:500]}")
    except Exception as exc:
        print(f"PROBE COMPILE FAILED: {exc}"[:4000])
    if args.probe_only:
        if probe_img is None:
            return 1
        if args.run:
            return 0 if run_probe(probe_img) else 1
        return 0
    images = compile_all(variants)
    print(f"compiled {len(images)}/{len(variants)} variants in {time.perf_counter() - t0:.1f}s")
    if not args.run:
        return 0 if len(images) == len(variants) else 1

    print(f"torch: {torch.__version__ if torch is not None else 'unavailable ' + TORCH_ERROR}")
    runner = Runner(images)
    print(f"GPU: {runner.device.name}")
    for var, kern in runner.kernels.items():
        print(f"  loaded {var.dtype} {var.tag}: {kern.num_regs} regs, {kern.local_bytes} B local, smem {var.smem}")
    rng = np.random.default_rng(0)
    summary = {}
    for var in variants:
        if var not in images:
            continue
        cases = CASES if not args.quick else CASES[:4]
        try:
            summary[var] = check_variant(runner, var, cases, rng)
        except Exception as exc:
            print(f"  CHECK CRASHED {var.tag}: {exc!r}")
            summary[var] = False
            break  # a fault poisons the context
    print("correct:", {f"{v.dtype}:{v.tag}": ok for v, ok in summary.items()})
    good = [v for v, ok in summary.items() if ok]
    rows = bench(runner, good, [(4, 2048, 16, 128), (4, 4096, 16, 64), (2, 4096, 16, 256)][: 1 if args.quick else 3])
    print("\n| dtype | shape | causal | variant | ms | TFLOP/s | flash ms | x flash | cudnn ms | x cudnn |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3f} | {r[5]:.0f} | {r[6]:.3f} | {r[7]:.2f} | "
              f"{r[8]:.3f} | {r[9]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

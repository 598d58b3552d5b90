"""``sparse_attention`` beyond validation (CPU only): the launch a valid call makes, with the device
layer faked (grid, block and every parameter-struct field), and the NVRTC compile of its kernel for
every dtype and head-dim bucket without spills. Input validation is in test_sparse_validation.py.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from _problems import problem
from _sparse_helpers import B, D, HKV, HQ, INDICES, OFFSETS, SK, SQ, qkv
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec
from pyattn.validate.csr import check_csr


# --------------------------------------------------------------------------------------------
# The launch a valid call makes, with the device layer faked
# --------------------------------------------------------------------------------------------
class _Fake:
    """A device array stand-in: the attributes the launch reads."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The device layer of ``ops.sparse._run`` faked: plans, outputs, uploads and launches."""
    import pyattn.ops.sparse as mod

    device, launches, ptrs = _Fake(arch="sm_90a", ordinal=0), [], iter(range(0x10000, 2**40, 0x10000))

    def array(shape, dtype):
        return _Fake(ptr=next(ptrs), shape=tuple(shape), dtype=np.dtype(dtype), device=device)

    monkeypatch.setattr(mod, "get_plan", lambda build, P, dev: mod._Plan(_spec_of(P, dev), None))
    monkeypatch.setattr(mod, "output", lambda dev, s, shape, dtype: array(shape, dtype))
    monkeypatch.setattr(mod, "upload", lambda arrays, dev, s: [array(a.shape, a.dtype) for a in arrays])
    monkeypatch.setattr(mod, "launch", lambda *args: launches.append(args))

    def run(q, k, v, indices, offsets, *, layout="bshd", scale=None, return_lse=False):
        P = problem(q, k, v, layout=layout, scale=scale)
        csr = check_csr(indices, offsets, P.batch, P.heads_q, P.seqlen_q, P.seqlen_k)
        dq, dk, dv = (array(x.shape, x.dtype) for x in (q, k, v))
        return mod._run(P, csr, device, "stream", dq, dk, dv, None, return_lse)

    return run, launches


def _spec_of(P, device):
    bucket = next(b for b in HEAD_DIM_BUCKETS if b >= P.head_dim)
    return KernelSpec("attn_sparse", {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[P.dtype], bucket,
                      device.arch)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("shape", [(SQ + 1,), (HQ, SQ + 1), (B, HQ, SQ + 1)])
def test_launch_parameters(layout, shape, fake_gpu):
    import struct

    run, launches = fake_gpu
    q, k, v = qkv(np.float16, layout=layout)
    out, lse = run(q, k, v, INDICES, np.broadcast_to(OFFSETS, shape).copy(), layout=layout, scale=0.5,
                   return_lse=True)
    assert out.shape == q.shape and out.dtype == np.float16 and lse.shape == (B, HQ, SQ) and lse.dtype == np.float32
    (kernel, grid, block, smem, stream, raw), = launches
    spec = _spec_of(problem(q, k, v, layout=layout), _Fake(arch="sm_90a"))
    assert (spec.family, spec.dtype, spec.head_dim, spec.arch) == ("attn_sparse", "f16", 64, "sm_90a")
    assert grid == (-(-SQ // 4), HQ, B) and block == (128, 1, 1) and smem == 0 and stream == "stream"
    p = dict(zip([n for n, _ in spec.params.fields], struct.unpack_from(spec.params.format, raw)))
    seq, head = (HQ * D, D) if layout == "bshd" else (D, SQ * D)
    assert (p["q_stride_b"], p["q_stride_s"], p["q_stride_h"]) == (SQ * HQ * D, seq, head)
    assert (p["o_stride_b"], p["o_stride_s"], p["o_stride_h"]) == (SQ * HQ * D, seq, head)
    seq, head = (HKV * D, D) if layout == "bshd" else (D, SK * D)
    for name in ("k", "v"):
        assert (p[f"{name}_stride_b"], p[f"{name}_stride_s"], p[f"{name}_stride_h"]) == (SK * HKV * D, seq, head)
    assert (p["off_stride_b"], p["off_stride_h"]) == {1: (0, 0), 2: (0, SQ + 1), 3: (HQ * (SQ + 1), SQ + 1)}[len(shape)]
    assert (p["lse_stride_b"], p["lse_stride_h"]) == (HQ * SQ, SQ)
    assert (p["batch"], p["heads_q"], p["group"], p["seqlen_q"], p["seqlen_k"], p["head_dim"]) == (B, HQ, 2, SQ, SK, D)
    assert p["scale_log2"] == pytest.approx(0.5 * math.log2(math.e))
    assert all(p[n] for n in ("q", "k", "v", "o", "lse", "indices", "offsets"))


def test_empty_problem_launches_nothing(fake_gpu):
    run, launches = fake_gpu
    q, k, v = qkv()
    out, _ = run(q[:, :0], k, v, np.zeros(0, np.int32), np.zeros(1, np.int32))
    assert out.shape == (B, 0, HQ, D) and launches == []


# --------------------------------------------------------------------------------------------
# NVRTC: the kernel compiles for every dtype and bucket (one arch) and on every other arch
# --------------------------------------------------------------------------------------------
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")


def _compile_specs():
    specs = [KernelSpec("attn_sparse", dt, d, "sm_90a") for dt in ("f32", "f16", "bf16") for d in HEAD_DIM_BUCKETS]
    others = [a for a in ARCHS if a != "sm_90a"]
    picks = [("bf16", 96), ("f16", 160), ("f32", 224), ("bf16", 256)]
    return specs + [KernelSpec("attn_sparse", dt, d, a) for a, (dt, d) in zip(others, picks)]


def test_sparse_kernel_compiles_without_spills():
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("cuda.bindings")
    from pyattn.jit.headers import cuda_include_dir
    from pyattn.jit.nvrtc import compile_source
    from pyattn.jit.source import kernel_headers, render

    inc = str(cuda_include_dir()[0])
    specs = _compile_specs()
    assert {s.arch for s in specs} == set(ARCHS) and len(specs) == 28

    def build(spec):
        opts = spec.compile_options((inc,)) + ("-Xptxas=-v",)
        return compile_source(render(spec), kernel_headers(), opts, name=spec.describe())

    with ThreadPoolExecutor(max_workers=4) as pool:
        for spec, (image, log) in zip(specs, pool.map(build, specs)):
            what = spec.describe()
            assert image[:4] == b"\x7fELF", what
            assert f"-arch {spec.arch} ".encode() in image, what
            assert spec.entry_name.encode() + b"\0" in image, what
            # register arrays (q, the accumulator, 8 K/V rows) must stay in registers
            assert re.findall(r"(\d+) bytes stack frame", log) == ["0"], (what, log)
            assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], (what, log)

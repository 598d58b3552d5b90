"""The ``pyattn.merge_states`` kernel on a CPU: its NVRTC compilation for every arch, dtype and
head-dim bucket, and the host launch plan, checked by running it against a NumPy mirror of the
kernel (``FakeMemory.emulate``, reading the packed params) over a fake device memory: every call
form (host stacks and lists, device stacks, views, separate allocations folded), out= pairs and
empty rows. GPU tests of the kernel are in test_gpu_merge_states.py.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.jit as jit
import pyattn.ops.merge as merge_mod
from _merge_states_helpers import BF16, DTYPES, SLOW, random_states
from pyattn.array import DeviceArray
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec
from pyattn.reference import merge_states_ref

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
NEG_INF = np.float32(-np.inf)


# --------------------------------------------------------------------------- NVRTC
def test_merge_kernel_compiles_for_every_arch_dtype_and_bucket(cache_dir):
    specs = [KernelSpec("merge_states", dt, hd, arch) for arch in ARCHS for dt in ("f32", "f16", "bf16")
             for hd in HEAD_DIM_BUCKETS]
    results = jit.build_many(specs, workers=4)
    assert [s for s, *_ in results] == specs
    cache, fp = jit.get_cache(), jit.toolchain_fingerprint()
    for spec, meta, _ in results:
        image = cache.get(spec.cache_key(fp))[0]
        assert meta["format"] == "cubin" and image[:4] == b"\x7fELF", spec.describe()
        assert f"-arch {spec.arch} ".encode() in image and spec.entry_name.encode() + b"\0" in image, spec.describe()
        assert spec.shared_bytes == 0 and spec.threads == 128


# --------------------------------------------------------------------------- the launch plan, on a fake device
_BASE = 1 << 40  # fake device addresses are _BASE + an offset into FakeMemory.buf


class FakeDevice:
    ordinal, arch = 0, "sm_90a"

    def activate(self):
        pass


class FakeMemory:
    def __init__(self):
        self.buf, self.top, self.launches = np.zeros(1 << 22, np.uint8), 0, 0

    def alloc(self, nbytes, align=256):
        self.top = -(-self.top // align) * align + nbytes
        return _BASE + self.top - nbytes

    def put(self, a) -> DeviceArray:
        a = np.ascontiguousarray(a)
        ptr = self.alloc(a.nbytes)
        self.buf[ptr - _BASE: ptr - _BASE + a.nbytes] = a.reshape(-1).view(np.uint8)
        return DeviceArray(ptr, a.shape, a.dtype, FakeDevice())

    def get(self, x: DeviceArray) -> np.ndarray:
        return np.ndarray(x.shape, x.dtype, self.buf, x.ptr - _BASE, x.strides).copy()

    def read(self, ptr, dtype, n):
        return self.buf[ptr - _BASE: ptr - _BASE + n * dtype.itemsize].view(dtype)

    def emulate(self, spec, grid, block, smem, stream, params):
        """The kernel's arithmetic in NumPy float32, reading and writing through the packed params."""
        self.launches += 1
        names = [n for n, _ in spec.params.fields]
        p = dict(zip(names, struct.unpack(spec.params.format, params[:struct.calcsize(spec.params.format)])))
        T = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}[spec.dtype]
        dims, D, f32 = (p["dim0"], p["dim1"], p["dim2"]), p["head_dim"], np.dtype(np.float32)
        assert grid == (-(-int(np.prod(dims)) // 4), 1, 1) and block == (128, 1, 1) and smem == 0
        for row in range(int(np.prod(dims))):
            idx = np.unravel_index(row, dims)

            def at(name, size, step=0):
                return p[name] + size * (sum(i * p[f"{name}_stride_{k}"] for k, i in enumerate(idx)) + step)

            ls = np.array([self.read(at("lse_a", 4), f32, 1)[0]]
                          + [self.read(at("lse_b", 4, s * p["lse_b_stride_n"]), f32, 1)[0] for s in range(p["n_b"])])
            m = ls.max()
            acc = np.zeros(D, np.float32)
            if m > NEG_INF:
                total = np.exp(ls - m).sum(dtype=np.float32)
                for s, lse in enumerate(ls):
                    if lse > NEG_INF:  # dead states are never read
                        o = self.read(at("o_a", T.itemsize) if s == 0 else
                                      at("o_b", T.itemsize, (s - 1) * p["o_b_stride_n"]), T, D)
                        acc += np.exp(lse - m) / total * o.astype(np.float32)
            self.read(at("out", T.itemsize), T, D)[:] = acc.astype(T)
            self.read(at("out_lse", 4), f32, 1)[0] = m + np.log(total) if m > NEG_INF else NEG_INF


class FakeHost:
    """``pipeline.host`` on the fake memory: NumPy inputs up, results back, ``outs`` filled."""

    def __init__(self, mem):
        self.mem = mem

    def call(self, fn, inputs, outs, stream):
        results = fn([self.mem.put(x) if x is not None else None for x in inputs], "stream")
        hosts = [self.mem.get(r) for r in results]
        outs = list(outs) + [None] * (len(hosts) - len(outs))
        for o, h in zip(outs, hosts):
            if o is not None:
                o[...] = h
        return [o if o is not None else h for o, h in zip(outs, hosts)]


@pytest.fixture
def fake_gpu(monkeypatch):
    mem = FakeMemory()

    def output(device, stream, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        ptr = mem.alloc(nbytes)
        mem.read(ptr, np.dtype(np.uint8), nbytes)[:] = 0xFF  # poisoned, as PYATTN_POISON_ALLOC=1
        return DeviceArray(ptr, shape, dtype, device)

    def plan(build, key, device):
        tag = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[key[0]]
        spec = KernelSpec("merge_states", tag, next(b for b in HEAD_DIM_BUCKETS if b >= key[1]), "sm_90a")
        return merge_mod._Plan(spec, spec)  # the "kernel" is the spec: the emulator reads its params

    monkeypatch.setattr(merge_mod, "start", lambda stream, args: (FakeDevice(), "stream", list(args)))
    monkeypatch.setattr(merge_mod, "finish", lambda s, args: None)
    monkeypatch.setattr(merge_mod, "get_plan", plan)
    monkeypatch.setattr(merge_mod, "output", output)
    monkeypatch.setattr(merge_mod, "launch", mem.emulate)
    monkeypatch.setattr(merge_mod, "host", FakeHost(mem))
    return mem


SHAPES = {"bshd": st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3)),
          "bhsd": st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4)),
          "thd": st.tuples(st.integers(1, 6), st.integers(1, 3))}


@settings(max_examples=80, deadline=None, suppress_health_check=SLOW)
@given(layout=st.sampled_from(sorted(SHAPES)), data=st.data(), D=st.sampled_from([8, 16, 40, 64, 136, 256]),
       n=st.integers(1, 5), dtype=st.sampled_from(sorted(DTYPES)),
       form=st.sampled_from(["host stack", "host list", "stack", "views", "separate", "other memory order"]),
       seed=st.integers(0, 2**31 - 1))
def test_launch_plan_matches_reference_on_a_fake_device(fake_gpu, layout, data, D, n, dtype, form, seed):
    rng = np.random.default_rng(seed)
    fake_gpu.top = fake_gpu.launches = 0  # the fixture is shared by hypothesis's examples
    shape = (*data.draw(SHAPES[layout]), D)
    os_, ls = random_states(rng, n, shape, DTYPES[dtype], layout)
    lshape = ls.shape[1:]
    if form == "host stack":
        args, launches = (os_, ls), 1
    elif form == "host list":
        args, launches = (list(os_), list(ls)), 1
    elif form == "stack":
        args, launches = (fake_gpu.put(os_), fake_gpu.put(ls)), 1
    elif form == "views":  # list(stack) of a device stack: equally spaced, one launch
        do, dl = fake_gpu.put(os_), fake_gpu.put(ls)
        sub = [DeviceArray(do.ptr + i * do.strides[0], shape, do.dtype, do.device) for i in range(n)]
        lsub = [DeviceArray(dl.ptr + i * dl.strides[0], lshape, np.float32, dl.device) for i in range(n)]
        args, launches = (sub, lsub), 1
    else:  # separate allocations at uneven gaps: a fold; the other order stores each LSE reversed in memory
        sub, lsub = [], []
        for i in range(n):
            sub.append(fake_gpu.put(os_[i]))
            lsub.append(fake_gpu.put(ls[i].T.copy()).transpose() if form == "other memory order"
                        else fake_gpu.put(ls[i]))
            fake_gpu.alloc(256 * (i + 1))
        args, launches = (sub, lsub), 1 if n <= 3 else n - 1  # any two arrays are "equally spaced"
    o, lse = pyattn.merge_states(*args, layout=layout)
    assert fake_gpu.launches == launches
    if isinstance(o, DeviceArray):
        assert o.is_c_contiguous and lse.is_c_contiguous and lse.dtype == np.float32
        o, lse = fake_gpu.get(o), fake_gpu.get(lse)
    assert o.shape == shape and o.dtype == DTYPES[dtype] and lse.shape == lshape
    ref_o, ref_lse = merge_states_ref(list(os_), list(ls), layout)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)) and not np.isnan(o.astype(np.float64)).any()
    rounding = np.finfo(np.float32).eps if dtype == "float32" else float(ml_dtypes.finfo(DTYPES[dtype]).eps)
    steps = fake_gpu.launches  # a fold rounds the running output once per launch
    tol = steps * rounding * max(1.0, float(np.abs(ref_o).max(initial=0))) + 1e-6
    assert np.abs(o.astype(np.float64) - ref_o).max(initial=0) <= tol
    live = np.isfinite(ref_lse)
    assert np.abs(lse[live] - ref_lse[live]).max(initial=0) <= 1e-5 * max(1.0, np.abs(ref_lse[live]).max(initial=0))


def test_out_pair_and_empty_rows_on_a_fake_device(fake_gpu):
    rng = np.random.default_rng(0)
    os_, ls = random_states(rng, 3, (4, 2, 32), np.float16, "thd")
    out_o, out_l = np.full((4, 2, 32), np.nan, np.float16), np.full((2, 4), np.nan, np.float32)
    o, lse = pyattn.merge_states(list(os_), list(ls), out=(out_o, out_l), layout="thd")
    assert o is out_o and lse is out_l
    ref_o, ref_lse = merge_states_ref(list(os_), list(ls), "thd")
    assert np.abs(out_o - ref_o).max() < 2e-3 and np.array_equal(np.isneginf(out_l), np.isneginf(ref_lse))
    dev_out = fake_gpu.put(np.full((4, 2, 32), np.nan, np.float16))
    o, lse = pyattn.merge_states(fake_gpu.put(os_), fake_gpu.put(ls), out=dev_out, layout="thd")
    assert o is dev_out and np.array_equal(fake_gpu.get(dev_out), out_o)
    launches = fake_gpu.launches
    o, lse = pyattn.merge_states(np.ones((2, 1, 0, 3, 64), np.float32), np.ones((2, 1, 3, 0), np.float32))
    assert o.shape == (1, 0, 3, 64) and lse.shape == (1, 3, 0) and fake_gpu.launches == launches

"""``pyattn.merge_states``: validation, NVRTC compilation, the host launch plan (CPU) and the kernel (GPU).

LSEs come in the one convention every op returns: (B, H, S) for "bshd" and "bhsd" outputs, (H, T)
for "thd". CPU tests need no driver: bad calls must raise before any GPU work (the driver is
blocked, so a call that slips through raises NoDeviceError instead); the launch plan is checked by
running it against a NumPy mirror of the kernel over a fake device memory. GPU tests are marked
``gpu``.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.jit as jit
import pyattn.ops.merge as merge_mod
import pyattn.runtime.device as device_mod
from pyattn.array import DeviceArray
from pyattn.kernels.specs import HEAD_DIM_BUCKETS, KernelSpec
from pyattn.interop.inputs import read
from pyattn.reference import attention_ref, error_bound, merge_states_ref
from pyattn.runtime import memory

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
FLOOR = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}  # pyattn.reference's error_bound floors
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
BLOCKED = "driver blocked by test_merge_states"
NEG_INF = np.float32(-np.inf)
SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


class FakeCudaArray:
    """A CUDA array as CAI describes it (byte strides, None = C order); data pointer 0, never read."""

    def __init__(self, shape, dtype=np.float32, strides=None):
        dt = np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "descr": dt.descr,
                                         "data": (0, False), "strides": strides, "version": 3}


@pytest.fixture
def blocked_driver(monkeypatch):
    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


def h(shape, dtype=np.float16):
    return np.ones(shape, dtype)


def d(shape, dtype=np.float16, strides=None):
    return FakeCudaArray(shape, dtype, strides)


O = h((2, 5, 3, 64))  # bshd: B=2, S=5, H=3, D=64
L = np.zeros((2, 3, 5), np.float32)  # its LSE: (B, H, S)
F32 = np.float32
VE, TE = ValueError, TypeError
BAD = {  # name: (positional args, keyword args, exception, regex of the message)
    "3 positional": ((O, L, O), {}, TE, r"^merge_states: expected \(o_a, lse_a, o_b, lse_b\) or \(os, lses\)"),
    "not an array": ((O, L, "x", L), {}, TE, r"^o_b: expected a NumPy array or a CUDA array"),
    "layout": ((O, L, O, L), {"layout": "bsh"}, VE, r"^layout: expected one of \('bshd', 'bhsd', 'thd'\)"),
    "o 3-D for bshd": ((h((2, 3, 64)), np.zeros((2, 3), F32)) * 2, {}, VE,
                       r"^o_a: expected \(batch, seq, heads, head_dim\) for layout='bshd', got \(2, 3, 64\)"),
    "o 4-D for thd": ((O, L) * 2, {"layout": "thd"}, VE, r"^o_a: expected \(total, heads, head_dim\)"),
    "o_b shape": ((O, L, h((2, 4, 3, 64)), L), {}, VE,
                  r"^o_b: expected shape \(2, 5, 3, 64\) \(from o_a\), got \(2, 4, 3, 64\)"),
    "lse as o.shape[:-1]": ((O, np.zeros((2, 5, 3), F32), O, L), {}, VE,
                            r"^lse_a: expected shape \(2, 3, 5\) \(the LSE of a bshd output of shape "
                            r"\(2, 5, 3, 64\)\), got \(2, 5, 3\)"),
    "bhsd lse": ((h((2, 3, 5, 64)), np.zeros((2, 5, 3), F32)) * 2, {"layout": "bhsd"}, VE,
                 r"^lse_a: expected shape \(2, 3, 5\)"),
    "thd lse (T, H)": ((h((7, 3, 64)), np.zeros((7, 3), F32)) * 2, {"layout": "thd"}, VE,
                       r"^lse_a: expected shape \(3, 7\)"),
    "lse dtype": ((O, L, O, L.astype(np.float64)), {}, TE, r"^lse_b: expected dtype float32 .*got float64"),
    "o dtype": ((O.astype(np.float64), L) * 2, {}, TE,
                r"^o_a: expected dtype float32, float16 or bfloat16, got float64"),
    "mixed o dtypes": ((O, L, O.astype(F32), L), {}, TE, r"^o_b: expected dtype float16 \(from o_a\), got float32"),
    "head_dim 12": ((h((2, 5, 3, 12)), L) * 2, {}, VE, r"^o_a: head_dim must be a multiple of 8 in \[8, 256\], got 12"),
    "head_dim 264": ((h((2, 5, 3, 264)), L) * 2, {}, VE, r"^o_a: head_dim must be .*got 264"),
    "host o, device lse": ((O, d((2, 3, 5), F32), O, L), {}, TE,
                           r"^merge_states: expected all host \(NumPy\) or all device arrays, got o_a on host, "
                           r"o_b on host, lse_a on device, lse_b on host"),
    "device in, host out": ((d((2, 5, 3, 64)), d((2, 3, 5), F32)) * 2, {"out": O}, TE, r"out on host"),
    "host NaN lse": ((O, L, O, np.full((2, 3, 5), np.nan, F32)), {}, VE, r"^lse_b: LSE values must be finite or -inf"),
    "host +inf lse": ((O, np.full((2, 3, 5), np.inf, F32), O, L), {}, VE, r"^lse_a: LSE values"),
    "D not contiguous": ((d((2, 5, 3, 64)), d((2, 3, 5), F32), d((2, 5, 3, 64), strides=(3840, 768, 256, 4)),
                          d((2, 3, 5), F32)), {}, VE,
                         r"^o_b: the head_dim axis must be contiguous \(stride 1 element\), "
                         r"got strides \(1920, 384, 128, 2\)"),
    "too many rows": ((d((2**16, 2**15 + 1, 8)), d((2**15 + 1, 2**16), F32)) * 2, {"layout": "thd"}, VE,
                      r"^o_a: dims, rows .* must each be < 2\*\*31"),
    # stacked and list forms
    "stack 4-D": ((h((2, 5, 3, 64)), np.zeros((2, 3, 5), F32)), {}, VE,
                  r"^os: expected \(n_states,\) \+ \(batch, seq, heads, head_dim\) for layout='bshd'"),
    "stack lses shape": ((h((4, 2, 5, 3, 64)), np.zeros((4, 2, 5, 3), F32)), {}, VE,
                         r"^lses: expected shape \(4, 2, 3, 5\) \(n_states \+ the LSE of a bshd output\), "
                         r"got \(4, 2, 5, 3\)"),
    "stack of none": ((h((0, 2, 5, 3, 64)), np.zeros((0, 2, 3, 5), F32)), {}, VE, r"^os: expected at least one state"),
    "list and array": (([O, O], np.zeros((2, 2, 3, 5), F32)), {}, TE,
                       r"^os, lses: expected two lists \(or tuples\) of arrays or two stacked arrays, "
                       r"got list and ndarray"),
    "empty lists": (([], []), {}, VE, r"^os, lses: expected equally long non-empty lists, got lengths 0 and 0"),
    "lists 3 and 2": (([O] * 3, [L] * 2), {}, VE, r"^os, lses: .*got lengths 3 and 2"),
    "list item shape": (([O, O, h((2, 5, 3, 72))], [L] * 3), {}, VE,
                        r"^os\[2\]: expected shape \(2, 5, 3, 64\) \(from os\[0\]\)"),
    "list lse shape": (([O, O], [L, L[:1]]), {}, VE, r"^lses\[1\]: expected shape \(2, 3, 5\)"),
    "list item type": (([O, None], [L, L]), {}, TE, r"^os\[1\]: expected a NumPy array"),
    "list mixed places": (([O, d((2, 5, 3, 64))], [L, L]), {}, TE, r"os\[1\] on device"),
    # out
    "out shape": ((O, L, O, L), {"out": h((2, 5, 3, 72))}, VE,
                  r"^out: expected shape \(2, 5, 3, 64\) and dtype float16, got shape \(2, 5, 3, 72\)"),
    "out dtype": ((O, L, O, L), {"out": h((2, 5, 3, 64), F32)}, VE, r"^out: expected .*dtype float32"),
    "out lse": ((O, L, O, L), {"out": (None, np.zeros((2, 5, 3), F32))}, VE,
                r"^out\[1\]: expected shape \(2, 3, 5\) and dtype float32, got shape \(2, 5, 3\)"),
    "out triple": ((O, L, O, L), {"out": (O, L, L)}, VE, r"^out: expected an array or an \(o, lse\) pair"),
    "out read-only": ((O, L, O, L), {"out": np.broadcast_to(O, O.shape)}, VE, r"^out: expected a writeable NumPy"),
    "out D strided": ((d((2, 5, 3, 64)), d((2, 3, 5), F32)) * 2, {"out": d((2, 5, 3, 64), strides=(3840, 768, 256, 4))},
                      VE, r"^out: the head_dim axis must be contiguous"),
    "stream": ((O, L, O, L), {"stream": "s"}, TE, r"^stream: expected None, a pyattn.Stream"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_calls_raise_before_gpu_work(case, blocked_driver):
    args, kwargs, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        pyattn.merge_states(*args, **kwargs)


GOOD = {  # name: (positional args, keyword args)
    "host pair": ((O, L, O, L), {}),
    "host stack bf16 5 states": ((h((5, 7, 2, 4, 256), BF16), np.zeros((5, 7, 4, 2), np.float32)), {}),
    "host lists thd": (([h((9, 2, 8), np.float32)] * 3, [np.zeros((2, 9), np.float32)] * 3), {"layout": "thd"}),
    "device pair, strided lse": ((d((2, 5, 3, 64)), d((2, 3, 5), np.float32, strides=(60, 4, 12)),
                                  d((2, 5, 3, 64)), d((2, 3, 5), np.float32)), {}),
    "device stack bhsd": ((d((3, 2, 4, 5, 64)), d((3, 2, 4, 5), np.float32)), {"layout": "bhsd"}),
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_good_calls_pass_validation_and_reach_the_driver(case, blocked_driver):
    args, kwargs = GOOD[case]
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.merge_states(*args, **kwargs)


# --------------------------------------------------------------------------- DeviceArray.transpose
@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=5), data=st.data())
def test_transpose_permutes_shape_and_strides_like_numpy(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    ref = np.empty(shape, np.float32)
    a = DeviceArray(4096, shape, np.float32, None, owner="alloc", stream="s")
    for t, r in ((a.transpose(*perm), ref.transpose(perm)), (a.transpose(perm), ref.transpose(perm)),
                 (a.transpose(), ref.transpose()), (a.transpose(*[p - len(shape) for p in perm]), ref.transpose(perm))):
        assert (t.shape, t.strides, t.ptr, t.owner, t.stream) == (r.shape, r.strides, 4096, "alloc", "s")
        assert t.elem_strides == tuple(s // 4 for s in r.strides)
        assert read("x", t).strides == t.elem_strides


def test_transpose_rejects_bad_axes():
    a = DeviceArray(0, (2, 3, 4), np.float32, None)
    for axes, exc in (((0, 1), ValueError), ((0, 0, 1), ValueError), ((0, 1, 3), ValueError), ((0, 1.0, 2), TypeError)):
        with pytest.raises(exc, match=r"^axes: "):
            a.transpose(*axes)


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


def random_states(rng, n, shape, dtype, layout="bshd", dead=0.3):
    """n states of o shape ``shape`` with LSEs in ``layout``'s convention; about ``dead`` of the
    (state, row) pairs have LSE -inf and NaN in o."""
    os_ = rng.standard_normal((n, *shape)).astype(dtype)
    rows = (rng.standard_normal((n, *shape[:-1])) * 3).astype(np.float32)  # indexed like o's rows
    kill = rng.random(rows.shape) < dead
    rows[kill] = -np.inf
    os_[kill] = np.nan
    to_lse = {"bshd": lambda x: x.transpose(0, 1, 3, 2), "bhsd": lambda x: x, "thd": lambda x: x.transpose(0, 2, 1)}
    return os_, np.ascontiguousarray(to_lse[layout](rows))


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


# --------------------------------------------------------------------------- GPU
from test_gpu_attention import _has_gpu  # noqa: E402


def gpu_test(f):
    return pytest.mark.gpu(pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")(f))


try:
    import torch
except ImportError:
    torch = None


def _lowp_merge(os_, ls, dtype):
    """The naive same-precision merge (float32 math, one rounding): the tolerance rule's yardstick.
    ``os_`` (n, B, S, H, D), ``ls`` (n, B, H, S): bshd states."""
    os32, ls = np.asarray(os_, np.float32), np.swapaxes(np.asarray(ls, np.float32), -1, -2)
    m = ls.max(axis=0)
    ref = np.where(np.isneginf(m), 0, m)
    w = np.exp(ls - ref)
    w = w / np.where(np.isneginf(m), 1, w.sum(axis=0))
    return np.where(w[..., None] > 0, w[..., None] * os32, 0).sum(axis=0).astype(dtype).astype(np.float64)


def _check(o, lse, full_o, full_lse, os_, ls, dtype, extra=0.0):
    """The 2x rule against the naive merge; ``extra`` adds a fold's additional roundings."""
    o = np.asarray(o).astype(np.float64)
    assert not np.isnan(o).any(), "unwritten (poisoned) or NaN output elements"
    bound = 2 * np.abs(_lowp_merge(os_, ls, dtype) - full_o).max(initial=0) + FLOOR[np.dtype(dtype).name] + extra
    assert np.abs(o - full_o).max(initial=0) <= bound
    assert np.array_equal(np.isneginf(lse), np.isneginf(full_lse))
    live = np.isfinite(full_lse)
    assert np.abs(lse[live] - full_lse[live]).max(initial=0) <= 1e-5 * max(1.0, np.abs(full_lse[live]).max(initial=0))


def _parts(rng, B, Sq, H, D, cuts, dtype):
    """States of attention over the key parts ``cuts`` (empty parts allowed: LSE -inf, o set to NaN)
    and the reference over all keys; o (B, Sq, H, D) in ``dtype``, LSE (B, H, Sq) float32: as
    ``attention`` returns them."""
    q, k, v = (rng.standard_normal((B, S, H, D)).astype(dtype) for S in (Sq, cuts[-1], cuts[-1]))
    os_, ls = [], []
    for a, b in zip(cuts, cuts[1:]):
        o, lse = attention_ref(q, k[:, a:b], v[:, a:b], return_lse=True)
        o = o.astype(dtype)
        o[b == a] = np.nan  # a dead state's o is garbage and must never be read
        os_.append(o)
        ls.append(lse.astype(np.float32))
    full_o, full_lse = attention_ref(q, k, v, return_lse=True)
    return np.stack(os_), np.stack(ls), full_o, full_lse


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(memory, "POISON_ALLOC", True)  # unwritten outputs read as NaN


@gpu_test
@pytest.mark.usefixtures("poison")
@settings(max_examples=60, deadline=None, suppress_health_check=SLOW)
@given(B=st.integers(1, 2), Sq=st.integers(1, 40), H=st.integers(1, 3),
       D=st.sampled_from([8, 32, 40, 64, 128, 136, 256]),
       cuts=st.lists(st.integers(0, 120), min_size=1, max_size=4), dtype=st.sampled_from(sorted(DTYPES)),
       form=st.sampled_from(["pair", "stack", "list"]), on_device=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_merging_split_attention_equals_attention_over_all_keys(B, Sq, H, D, cuts, dtype, form, on_device, seed):
    rng = np.random.default_rng(seed)
    cuts = [0] + sorted(cuts) if form != "pair" else [0, cuts[0], cuts[0] + 17]
    os_, ls, full_o, full_lse = _parts(rng, B, Sq, H, D, cuts, DTYPES[dtype])
    up = pyattn.asarray if on_device else (lambda x: x)
    if form == "pair":
        args = (up(os_[0]), up(ls[0]), up(os_[1]), up(ls[1]))
    elif form == "stack":
        args = (up(os_), up(ls))
    else:
        args = ([up(o) for o in os_], [up(x) for x in ls])
    o, lse = pyattn.merge_states(*args)
    assert isinstance(o, DeviceArray) == on_device and o.shape == os_.shape[1:] and o.dtype == DTYPES[dtype]
    if on_device:
        o, lse = o.numpy(), lse.numpy()
    assert lse.dtype == np.float32 and lse.shape == ls.shape[1:]
    _check(o, lse, full_o, full_lse, os_, ls, DTYPES[dtype])


@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@gpu_test
def test_dead_states_and_all_dead_rows(dtype):
    rng = np.random.default_rng(1)
    os_, ls = random_states(rng, 6, (3, 50, 4, 96), DTYPES[dtype], dead=0.5)  # bshd: ls (6, 3, 4, 50)
    ls[:, 0, :, :7] = -np.inf  # rows where every state is dead
    os_[:, 0, :7] = np.nan
    for args in ((os_, ls), (pyattn.asarray(os_), pyattn.asarray(ls)), (list(os_), list(ls))):
        o, lse = pyattn.merge_states(*args)
        o, lse = (o.numpy(), lse.numpy()) if isinstance(o, DeviceArray) else (o, lse)
        assert np.all(o[0, :7] == 0) and np.all(np.isneginf(lse[0, :, :7]))
        ref_o, ref_lse = merge_states_ref(list(os_), list(ls))
        _check(o, lse, ref_o, ref_lse, os_, ls, DTYPES[dtype])


@pytest.mark.usefixtures("poison")
@gpu_test
def test_device_attention_parts_merge_as_returned():
    """The split-KV pipeline: pyattn.attention on key parts, its (out, lse) pairs merged as they are
    (bshd output, LSE (B, H, S): one convention), on a user stream, against attention over all keys."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, S, 4, 128)).astype(np.float16) for S in (77, 600, 600))
    cuts = (0, 150, 151, 600)
    with pyattn.Stream() as s:
        parts = [pyattn.attention(*(pyattn.asarray(x, stream=s) for x in (q, k[:, a:b], v[:, a:b])),
                                  return_lse=True, stream=s) for a, b in zip(cuts, cuts[1:])]
        o, lse = pyattn.merge_states([o for o, _ in parts], [lse for _, lse in parts], stream=s)
        assert lse.stream is s and o.shape == q.shape
        o, lse = o.numpy(stream=s), lse.numpy(stream=s)
    full_o, full_lse = attention_ref(q, k, v, return_lse=True)
    bound = max(error_bound(q, k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])) + FLOOR["float16"]
    assert np.abs(o.astype(np.float64) - full_o).max() <= bound
    assert np.abs(lse - full_lse).max() <= 1e-4 * np.abs(full_lse).max()


@pytest.mark.usefixtures("poison")
@gpu_test
def test_unaligned_rows_fold_and_out(monkeypatch):
    """Rows at 2-byte offsets (the scalar load/store path), a list that must be folded (one state
    laid out differently), and out= written in place without touching its neighbours ("thd", H=1)."""
    launches = []
    real_launch = merge_mod.launch
    monkeypatch.setattr(merge_mod, "launch", lambda *a: (launches.append(a), real_launch(*a)))
    rng = np.random.default_rng(3)
    n, rows, D = 4, 37, 72
    os_, ls = random_states(rng, n, (rows, 1, D), np.float16, "thd")  # o (n, 37, 1, 72), lse (n, 1, 37)
    padded = np.full((n, rows, D + 1), 7, np.float16)
    padded[..., 1:] = os_[:, :, 0]
    big = pyattn.asarray(padded)
    views = [DeviceArray(big.ptr + 2 + i * big.strides[0], (rows, 1, D), np.float16, big.device,
                         strides=(big.strides[1], big.strides[1], 2), owner=big) for i in range(n)]
    views[2] = pyattn.asarray(os_[2])  # a different layout: os[1:] are no single stack, so a fold
    out_big = pyattn.asarray(np.full((rows, D + 1), 7, np.float16))
    out = DeviceArray(out_big.ptr + 2, (rows, 1, D), np.float16, out_big.device,
                      strides=(out_big.strides[0], out_big.strides[0], 2))
    out_lse = pyattn.asarray(np.full((2 * rows,), 7, np.float32))
    lse_view = DeviceArray(out_lse.ptr, (1, rows), np.float32, out_lse.device, strides=(8 * rows, 8))
    o, lse = pyattn.merge_states(views, [pyattn.asarray(x) for x in ls], out=(out, lse_view), layout="thd")
    assert len(launches) == n - 1 and o.ptr == out.ptr and lse.ptr == out_lse.ptr
    res, res_lse = out_big.numpy(), out_lse.numpy()
    assert np.all(res[:, 0] == 7) and np.all(res_lse[1::2] == 7)  # neighbours untouched
    ref_o, ref_lse = merge_states_ref(list(os_), list(ls), "thd")
    fold = (n - 2) * np.finfo(np.float16).eps * np.abs(ref_o).max()  # the extra roundings of a fold
    got_o, got_lse = res[:, None, 1:], res_lse[::2][None]
    assert not np.isnan(got_o.astype(np.float64)).any()
    lowp = np.abs(_lowp_merge(os_[:, None], ls[:, None], np.float16)[0] - ref_o).max(initial=0)  # B = 1
    assert np.abs(got_o.astype(np.float64) - ref_o).max() <= 2 * lowp + FLOOR["float16"] + fold
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    live = np.isfinite(ref_lse)
    assert np.abs(got_lse[live] - ref_lse[live]).max(initial=0) <= 1e-5 * max(1.0, np.abs(ref_lse[live]).max())


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@gpu_test
def test_torch_stack_with_strided_lse(dtype):
    rng = np.random.default_rng(4)
    os_, ls, full_o, full_lse = _parts(rng, 2, 33, 3, 64, [0, 40, 41, 100, 260, 261], DTYPES[dtype])
    t_o = torch.from_numpy(os_).cuda()
    t_l = torch.from_numpy(np.ascontiguousarray(ls.transpose(0, 1, 3, 2))).cuda().transpose(2, 3)  # (n, B, H, S) view
    assert not t_l.is_contiguous()
    o, lse = pyattn.merge_states(t_o, t_l)
    _check(o.numpy(), lse.numpy(), full_o, full_lse, os_, ls, DTYPES[dtype])
    o, lse = pyattn.merge_states(t_o[0], t_l[0], t_o[3], t_l[3])  # the pair form, strided LSE views
    ref_o, ref_lse = merge_states_ref([os_[0], os_[3]], [ls[0], ls[3]])
    _check(o.numpy(), lse.numpy(), ref_o, ref_lse, os_[[0, 3]], ls[[0, 3]], DTYPES[dtype])

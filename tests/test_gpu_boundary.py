"""The array boundary on a GPU, called the way users call (marked ``gpu``; skipped without a driver).

- The late-write race: a producer writes ``q`` on its stream right after a long device wait, then
  pyattn reads it at once. For every producer kind (torch tensors as they are, with and without an
  explicit pyattn stream; torch seen only through its CUDA array interface, only through DLPack; CuPy
  on a stream of its own and on its null stream) and dtype, 0 stale reads in 100 trials. A control that hides the producer
  (a bare pointer, pyattn's own stream) must read stale data, or the test proves nothing.
- Export: results and 8-bit cache pools go to torch and CuPy zero-copy in every dtype.
- A fresh process compiles kernels first and imports torch afterwards; one that only compiled leaves
  the driver alone, so the workers it forks can use the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import pyattn
from pyattn.reference import attention_ref
from test_gpu_attention import _has_gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from harness import DlpackOnly  # noqa: E402  (a torch tensor seen through DLPack only: JAX's stand-in)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")]
torch = pytest.importorskip("torch") if _has_gpu() else None

TRIALS = 100
SHAPE_Q, SHAPE_KV = (1, 64, 4, 64), (1, 96, 2, 64)
TORCH_DT = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
NP_DT = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


class CaiOnly:
    """A torch tensor seen through its CUDA array interface only (no stream in it: the legacy rule)."""

    def __init__(self, t):
        self.t, self.__cuda_array_interface__ = t, t.__cuda_array_interface__


class CaiWithDevice(CaiOnly):
    """:class:`CaiOnly` that tells its device (``__dlpack_device__``), so that its repeat calls take
    the fast path (``interop.quick.quick_key``): the legacy rule must hold there too."""

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def _fixtures(dtype):
    rng = np.random.default_rng(0)
    q_old, q_new = (rng.standard_normal(SHAPE_Q).astype(NP_DT[dtype]) for _ in range(2))
    k, v = (rng.standard_normal(SHAPE_KV).astype(NP_DT[dtype]) for _ in range(2))
    ref_old, ref_new = attention_ref(q_old, k, v), attention_ref(q_new, k, v)
    return q_old, q_new, k, v, ref_old, ref_new


def _stale_reads(dtype, make_input, stream=None, trials=TRIALS):
    """Trials in which pyattn read ``q`` before the producer's late write landed."""
    q_old, q_new, k, v, ref_old, ref_new = _fixtures(dtype)
    dt = getattr(torch, TORCH_DT[dtype])
    t_old, t_new = (torch.from_numpy(x.astype(np.float32)).to("cuda", dt) for x in (q_old, q_new))
    tk, tv = (torch.from_numpy(x.astype(np.float32)).to("cuda", dt) for x in (k, v))
    q = torch.empty_like(t_old)
    stale = 0
    for _ in range(trials):
        q.copy_(t_old)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # ~1 ms of device time on torch's current stream
        q.copy_(t_new)  # the late write
        out = pyattn.attention(make_input(q), make_input(tk), make_input(tv), stream=stream)
        torch.cuda.synchronize()
        if stream is not None:
            stream.synchronize()
        got = np.asarray(out.numpy(), np.float64)
        stale += np.abs(got - ref_old).max() < np.abs(got - ref_new).max()
    return stale


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_no_stale_reads_of_torch_tensors(dtype):
    assert _stale_reads(dtype, lambda q: q) == 0  # torch's current stream (the rule)
    with pyattn.Stream() as s:  # an explicit other stream waits for torch's current stream
        assert _stale_reads(dtype, lambda q: q, stream=s) == 0
    assert _stale_reads(dtype, DlpackOnly) == 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # torch's interface has no typestr for bfloat16
def test_no_stale_reads_through_the_cuda_array_interface(dtype):
    assert _stale_reads(dtype, CaiOnly) == 0
    assert _stale_reads(dtype, CaiWithDevice) == 0


def test_the_race_is_real_without_ordering():
    """Control: a bare pointer (no producer known) on pyattn's idle stream reads stale data."""
    def bare(q):
        return pyattn.DeviceArray(q.data_ptr(), tuple(q.shape), np.float16, pyattn.get_device())

    assert _stale_reads("float16", bare, trials=20) >= 18


@pytest.mark.parametrize("where", ["own stream", "null stream", "explicit pyattn stream"])
def test_no_stale_reads_of_cupy_arrays_on_their_stream(where):
    """CuPy writes ``q`` on its current stream (a stream of its own, or the null stream, CuPy's
    default) after a long device wait; pyattn runs on that stream (rule 2), or with an explicit
    pyattn stream waits for the stream CuPy's interface names."""
    cupy = pytest.importorskip("cupy")
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {}
    }''', "spin")
    q_old, q_new, k, v, ref_old, ref_new = _fixtures("float16")
    ck, cv = cupy.asarray(k), cupy.asarray(v)
    explicit = pyattn.Stream() if where == "explicit pyattn stream" else None
    with (cupy.cuda.Stream(non_blocking=True) if where == "own stream" else cupy.cuda.Stream.null) as producer:
        q = cupy.empty(SHAPE_Q, np.float16)
        stale = 0
        for _ in range(TRIALS):
            q.set(q_old, stream=producer)
            producer.synchronize()
            spin((1,), (1,), (np.int64(2_000_000),))  # on the producer stream
            q.set(q_new, stream=producer)  # the late write
            out = pyattn.attention(q, ck, cv, stream=explicit)
            assert out.__cuda_array_interface__["stream"] == (explicit.ptr if explicit else producer.ptr or 1)
            got = np.asarray(out.numpy(), np.float64)
            stale += np.abs(got - ref_old).max() < np.abs(got - ref_new).max()
        producer.synchronize()
    assert stale == 0


def test_cupy_takes_results_through_dlpack_without_waiting_for_them():
    """``cupy.from_dlpack(out)`` returns while the call's kernels still run (its stream waits on the
    device), and reads the values those kernels wrote; the README recommends it over
    ``cupy.asarray``, which synchronizes the host with the interface's stream."""
    cupy = pytest.importorskip("cupy")
    x = cupy.asarray(np.random.default_rng(0).standard_normal((1, 8192, 16, 128)).astype(np.float16))
    outs = [pyattn.attention(x, x, x) for _ in range(5)]  # ~5 ms of queued work on an H200
    o = cupy.from_dlpack(outs[-1])
    # CuPy 14 takes pyattn's stream through its __cuda_stream__ protocol (ExternalStream of a raw
    # handle is deprecated there); older CuPy only by handle.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    stream = outs[-1].stream
    pending = not (from_external(stream) if from_external else cupy.cuda.ExternalStream(stream.ptr)).done
    first = cupy.from_dlpack(outs[0])
    same = bool(cupy.array_equal(o, first))  # queued on CuPy's stream: after pyattn's work
    assert pending, "cupy.from_dlpack waited for the call's kernels"
    assert o.data.ptr == outs[-1].ptr and same


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_results_export_zero_copy_to_torch_and_cupy(dtype):
    rng = np.random.default_rng(1)
    q = pyattn.asarray(rng.standard_normal((2, 33, 4, 64)).astype(NP_DT[dtype]))
    out = pyattn.attention(q, q, q, causal=True)
    host = out.numpy()
    t = torch.from_dlpack(out)
    assert t.dtype == getattr(torch, dtype) and t.data_ptr() == out.ptr and tuple(t.shape) == out.shape
    assert np.array_equal(t.float().cpu().numpy(), host.astype(np.float32))
    t2 = torch.from_dlpack(out.transpose(0, 2, 1, 3))  # a strided view keeps its strides
    assert t2.stride() == tuple(out.transpose(0, 2, 1, 3).elem_strides) and t2.data_ptr() == out.ptr
    cupy = pytest.importorskip("cupy")
    if dtype == "bfloat16" and not hasattr(cupy, "from_dlpack"):
        pytest.skip("this CuPy has no from_dlpack")
    c = cupy.asarray(out)
    assert c.data.ptr == out.ptr and c.dtype.name == np.dtype(NP_DT[dtype]).name
    assert np.array_equal(cupy.asnumpy(c).astype(np.float32), host.astype(np.float32))


def test_fp8_cache_pools_export_to_torch():
    cache = pyattn.PagedKVCache(4, 16, 2, 64, "fp8_e4m3")
    sid = cache.add_sequence()
    kv = np.random.default_rng(2).standard_normal((1, 20, 2, 64)).astype(np.float16)
    cache.append([sid], kv, kv)
    t = torch.from_dlpack(cache.k)
    assert t.dtype == torch.float8_e4m3fn and t.data_ptr() == cache.k.ptr
    assert np.array_equal(t.view(torch.uint8).cpu().numpy(), cache.k.view(np.uint8).numpy())


def test_torch_out_and_torch_stream():
    """A torch tensor given as ``out`` is written in place, on torch's current stream."""
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.standard_normal((1, 40, 4, 64)).astype(np.float32)).to("cuda", torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        res = pyattn.attention(q, q, q, out=out)
        assert res is out
    s.synchronize()
    ref = attention_ref(*(q.float().cpu().numpy().astype(ml_dtypes.bfloat16),) * 3)
    assert np.abs(out.float().cpu().numpy() - ref).max() < 2e-2


def test_compiling_first_then_importing_torch_works(tmp_path):
    """The reported defect: after pyattn compiled a kernel, ``import torch`` failed in torch's schema
    parser. The cause: NVRTC wrote an empty log's NUL into ``b" " * 1``, which is CPython's one
    shared ``b" "``, so every space the process encoded afterwards was a NUL (torch's schema strings
    included). A fresh process compiles, then imports torch and uses it."""
    code = textwrap.dedent("""
        import sys, numpy as np
        assert "torch" not in sys.modules
        import pyattn
        q = np.random.default_rng(0).standard_normal((1, 16, 2, 64)).astype(np.float16)
        out = pyattn.attention(q, q, q, causal=True)   # compiles (a fresh cache)
        import torch
        x = torch.ones(3, device="cuda")
        t = torch.from_dlpack(pyattn.attention(pyattn.asarray(q), pyattn.asarray(q), pyattn.asarray(q)))
        print("OK", float(x.sum()), t.dtype)
    """)
    env = dict(os.environ, PYATTN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK 3.0 torch.float16" in r.stdout, r.stdout + r.stderr[-2000:]


def test_a_process_that_only_compiled_forks_workers_that_use_the_gpu(tmp_path):
    """A server pre-warms pyattn's kernels (no device use), then forks its GPU workers. NVRTC's own
    compute cache, unless ``--no-cache`` is passed, initialised the driver in the compiling parent,
    and every forked child's ``cuInit`` then failed with CUDA_ERROR_NOT_INITIALIZED."""
    code = textwrap.dedent("""
        import multiprocessing as mp, numpy as np
        from cuda.bindings import driver
        from pyattn import jit
        from pyattn.kernels.specs import KernelSpec
        image, meta, compiled = jit.build(KernelSpec("attn_fwd_simt", "f32", 64, "sm_80"))
        err, _ = driver.cuDeviceGetCount()
        print("compiled", compiled, "parent driver", err.name)

        def work(_):
            import pyattn
            q = np.random.default_rng(0).standard_normal((1, 16, 2, 64)).astype(np.float16)
            out = pyattn.attention(q, q, q)
            return bool(np.isfinite(out).all())

        with mp.get_context("fork").Pool(2) as pool:
            print("children", pool.map(work, range(2)))
    """)
    env = dict(os.environ, PYATTN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "compiled True parent driver CUDA_ERROR_NOT_INITIALIZED" in r.stdout, r.stdout
    assert "children [True, True]" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_script_that_keeps_results_exits_cleanly(tmp_path):
    """Results left in globals are torn down at exit after their streams: their frees must not reach
    the driver then (it segfaulted in about half of such runs)."""
    code = textwrap.dedent("""
        import numpy as np, pyattn
        q = pyattn.asarray(np.ones((1, 128, 4, 64), np.float16))
        out = pyattn.attention(q, q, q)
        s = pyattn.Stream()
        out2 = pyattn.attention(q, q, q, stream=s)
        host = pyattn.attention(np.ones((1, 64, 2, 64), np.float16), np.ones((1, 64, 2, 64), np.float16),
                                np.ones((1, 64, 2, 64), np.float16))
        print("done")
    """)
    env = dict(os.environ, PYATTN_CACHE_DIR=str(tmp_path / "cache"))
    for _ in range(6):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_pinned_inputs_first_in_a_fresh_process(tmp_path):
    """``pinned_empty`` as a process's first CUDA call (it needs a current context), and NumPy
    inputs in pinned memory, sent in place, give the result of pageable ones."""
    code = textwrap.dedent("""
        import numpy as np, pyattn
        x = np.random.default_rng(0).standard_normal((1, 2048, 4, 64)).astype(np.float16)
        p = pyattn.pinned_empty(x.shape, x.dtype)
        p[...] = x
        a, b = pyattn.attention(p, p, p), pyattn.attention(x, x, x)
        print("equal", bool(np.array_equal(a, b)))
    """)
    env = dict(os.environ, PYATTN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "equal True" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])

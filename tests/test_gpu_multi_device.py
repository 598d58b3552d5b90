"""Two GPUs in one process, called the way users call (marked ``gpu``; skipped below two devices).

A torch or CuPy program often holds tensors on ``cuda:1`` while the current device is 0, or runs one
thread per GPU. Every per-device fact must then follow the arrays: the kernel's module (a module
is loaded into one context), the plan, pyattn's own stream and memory pool, torch's current stream
*of the arrays' device*, the decode's TMA descriptors, the paged cache's pools. Each test below
computes on device 1 (and on 0 beside it) and compares with the fp64 reference, so a kernel
launched in the wrong context, a result allocated on the wrong device or a stream of the other
device shows up as an error or a wrong value, not as a skip.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pyattn
from test_gpu_attention import DTYPES, _check, _has_gpu
from test_gpu_backward import _check as _check_grads
from test_gpu_decode import _check_decode, _rand
from test_gpu_quant_decode import _check_dequant, _dequant


def _two_gpus() -> bool:
    return _has_gpu() and pyattn.device_count() >= 2


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="fewer than two CUDA devices")]
SHAPE_Q, SHAPE_KV = (2, 200, 8, 128), (2, 333, 2, 128)


def _qkv(seed, dtype="bfloat16"):
    rng = np.random.default_rng(seed)
    return _rand(rng, SHAPE_Q, dtype), _rand(rng, SHAPE_KV, dtype), _rand(rng, SHAPE_KV, dtype)


def _on(x, ordinal):
    return pyattn.asarray(x, device=pyattn.get_device(ordinal))


def _current_context() -> int:
    from cuda.bindings import driver

    err, ctx = driver.cuCtxGetCurrent()
    assert err == driver.CUresult.CUDA_SUCCESS
    return int(ctx)


def test_device_arrays_on_each_device_interleaved():
    """Calls alternate between the devices (first and repeat calls of one signature): each runs
    where its arrays are, its result lives there, and the thread's current context (the device a
    framework's runtime calls go to) is the one it had before the call."""
    q, k, v = _qkv(0)
    arrays = {o: [_on(x, o) for x in (q, k, v)] for o in (0, 1)}
    pyattn.get_device(0).activate()  # as a framework holding device 0 would have it
    before = _current_context()
    for ordinal in (1, 0, 1, 1, 0, 1):
        out = pyattn.attention(*arrays[ordinal], causal=True)
        assert out.device.ordinal == ordinal
        assert _current_context() == before, f"a call on device {ordinal} left another context current"
        _check(out.numpy(), None, q, k, v, causal=True)


def test_arrays_of_two_devices_refused_before_device_work():
    q, k, v = _qkv(1)
    with pytest.raises(ValueError, match="k: expected an array on device 0"):
        pyattn.attention(_on(q, 0), _on(k, 1), _on(v, 0))


def test_varlen_backward_and_merge_on_the_second_device():
    """The ops that allocate scratch (the backward's dq accumulator, varlen's offsets) or take two
    results (merge_states) on device 1."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(2, "float16")
    dout = _rand(rng, SHAPE_Q, "float16")
    d = [_on(x, 1) for x in (dout, q, k, v)]
    out, lse = pyattn.attention(d[1], d[2], d[3], causal=True, return_lse=True)
    grads = pyattn.attention_backward(d[0], d[1], d[2], d[3], out, lse, causal=True)
    assert all(g.device.ordinal == 1 for g in grads)
    _check_grads([g.numpy() for g in grads], dout, q, k, v, causal=True)

    cu_q = np.array([0, 120, 200], np.int32)
    cu_k = np.array([0, 150, 333], np.int32)
    qv, kv_, vv = q[0], k[0], v[0]  # (S, H, D): two sequences packed
    got = pyattn.attention_varlen(_on(qv, 1), _on(kv_, 1), _on(vv, 1), _on(cu_q, 1), _on(cu_k, 1),
                                  max_seqlen_q=120, max_seqlen_k=183)
    assert got.device.ordinal == 1
    for i in range(2):
        _check(got.numpy()[None, cu_q[i]:cu_q[i + 1]], None, qv[None, cu_q[i]:cu_q[i + 1]],
               kv_[None, cu_k[i]:cu_k[i + 1]], vv[None, cu_k[i]:cu_k[i + 1]])

    halves = [pyattn.attention(d[1], _on(x[:, s], 1), _on(y[:, s], 1), return_lse=True)
              for x, y, s in ((k, v, slice(0, 150)), (k, v, slice(150, 333)))]
    merged = pyattn.merge_states(*halves[0], *halves[1])
    assert merged[0].device.ordinal == 1
    _check(merged[0].numpy(), None, q, k, v)


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_paged_caches_on_both_devices(kv):
    """A cache on each device, appended to and decoded from in turn: pools, page tables, the
    16-bit decode's tensor maps and the 8-bit scales all belong to their cache's device."""
    rng = np.random.default_rng(3)
    Hkv, D, group = 2, 128, 4
    caches = {o: pyattn.PagedKVCache(64, 16, Hkv, D, kv, device=o) for o in (1, 0)}
    seqs, ks, vs = {}, {}, {}
    for o, cache in caches.items():
        seqs[o] = [cache.add_sequence() for _ in range(2)]
        k0, v0 = _rand(rng, (2, 300, Hkv, D), "bfloat16"), _rand(rng, (2, 300, Hkv, D), "bfloat16")
        cache.append(seqs[o], _on(k0, o), _on(v0, o))
        ks[o], vs[o] = [k0[0], k0[1]], [v0[0], v0[1]]
    for _ in range(3):
        for o, cache in caches.items():
            k1, v1 = _rand(rng, (2, 1, Hkv, D), "bfloat16"), _rand(rng, (2, 1, Hkv, D), "bfloat16")
            cache.append(seqs[o], _on(k1, o), _on(v1, o))
            for i in range(2):
                ks[o][i] = np.concatenate([ks[o][i], k1[i]])
                vs[o][i] = np.concatenate([vs[o][i], v1[i]])
            q = _rand(rng, (2, 1, Hkv * group, D), "bfloat16")
            out, lse = pyattn.decode(_on(q, o), cache, seqs[o], return_lse=True)
            assert out.device.ordinal == o and lse.device.ordinal == o
            if kv == "int8":  # against per-token codes x scales of the same rows (as test_gpu_quant_decode)
                for i in range(2):
                    kd, vd = (_dequant(x[i].astype(np.float32), "int8") for x in (ks[o], vs[o]))
                    _check_dequant(out.numpy()[i:i + 1], lse.numpy()[i:i + 1], q[i:i + 1], kd[None], vd[None],
                                   "bfloat16", causal=True)
            else:
                _check_decode(out.numpy(), lse.numpy(), q, ks[o], vs[o], causal=True)


def test_one_thread_per_device():
    """Two threads, one a device, each a loop of calls at once: every result right."""
    q, k, v = _qkv(4)
    errors = []

    def loop(ordinal):
        try:
            dq, dk, dv = _on(q, ordinal), _on(k, ordinal), _on(v, ordinal)
            outs = [pyattn.attention(dq, dk, dv, causal=True) for _ in range(20)]
            for out in outs:
                assert out.device.ordinal == ordinal
                _check(out.numpy(), None, q, k, v, causal=True)
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            errors.append((ordinal, exc))

    threads = [threading.Thread(target=loop, args=(o,)) for o in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_torch_tensors_on_cuda1_while_device_0_is_current():
    """torch's current device 0, tensors on cuda:1 written by torch just before the call (behind a
    long wait on cuda:1's current stream): pyattn must run on device 1, ordered after that stream
    (0 stale reads), and hand a bf16 result back to torch on cuda:1."""
    torch = pytest.importorskip("torch")
    torch.cuda.set_device(0)
    q, k, v = _qkv(5)
    q_new = _rand(np.random.default_rng(6), SHAPE_Q, "bfloat16")
    dev = torch.device("cuda", 1)
    to_t = lambda x: torch.from_numpy(x.astype(np.float32)).to(dev, torch.bfloat16)  # noqa: E731
    tq_old, tq_new, tk, tv = to_t(q), to_t(q_new), to_t(k), to_t(v)
    tq = torch.empty_like(tq_old)
    stale = 0
    for _ in range(20):
        tq.copy_(tq_old)
        torch.cuda.synchronize(dev)
        with torch.cuda.device(dev):
            torch.cuda._sleep(2_000_000)  # ~1 ms on cuda:1's current stream
        tq.copy_(tq_new)  # the late write
        out = pyattn.attention(tq, tk, tv, causal=True)
        assert out.device.ordinal == 1
        assert torch.cuda.current_device() == 0, "the call changed torch's current device"
        back = torch.from_dlpack(out)
        assert back.device == dev and back.dtype == torch.bfloat16
        got = back.float().cpu().numpy()
        ref_new = pyattn.reference.attention_ref(q_new, k, v, causal=True)
        stale += not np.allclose(got, ref_new, atol=3e-2)
    assert stale == 0, f"{stale} of 20 calls read q before torch's write on cuda:1"
    _check(got.astype(DTYPES["bfloat16"]), None, q_new, k, v, causal=True)


def test_results_of_device_1_freed_under_device_0():
    """Results of device 1 dropped while device 0's context is current (the thread's own, put back
    by every call) go back to device 1's pool: 40 results of 64 MiB, each freed before the next
    call, leave device 1's free memory where one result left it."""
    import gc

    from cuda.bindings import driver

    q = _on(np.zeros((1, 8192, 32, 128), np.float16), 1)  # 64 MiB a result
    pyattn.get_device(0).activate()
    out = pyattn.attention(q, q, q)
    del out
    gc.collect()

    def free_on_1() -> int:
        pyattn.get_device(1).synchronize()  # (puts device 0's context back)
        dev1 = pyattn.get_device(1)
        assert int(driver.cuCtxPushCurrent(dev1.context)[0]) == 0
        free = int(driver.cuMemGetInfo()[1])
        driver.cuCtxPopCurrent()
        return free

    before = free_on_1()
    for _ in range(40):
        out = pyattn.attention(q, q, q)
        assert _current_context() == int(pyattn.get_device(0).context)
        del out
        gc.collect()
    assert before - free_on_1() < 256 << 20, "device 1's results were not freed"

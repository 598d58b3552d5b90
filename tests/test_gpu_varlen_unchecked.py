"""``attention_varlen`` and its backward over device offsets with both maxima given, on the GPU (marked
``gpu``; skipped without a driver or torch): the offsets are not read on the host, as FlashAttention's
varlen API takes them.

- Right offsets: the same results as the checked call (bitwise with the same maxima; an upper bound
  for the maxima is held to the fp64 reference, the 2x rule).
- Wrong offsets: the kernels clamp each sequence's rows into the packed arrays and its lengths to the
  maxima (kernels_src/common.cuh ``clamp_rows``), so nothing outside q, k, v, out (and dq, dk, dv) is
  touched: guard rows around every array stay as they were, rows no clamped sequence covers stay
  unwritten, and the rows that are covered equal the reference of the clamped sequences.
- No synchronisation: the call returns while torch's stream still sleeps ahead of it (the checked
  call waits for its copy-back); and a torch CUDA graph replays it on new offsets.
The CPU side (nothing fetched, the packed row counts passed, capture) is ``test_varlen_unchecked_host.py``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import pyattn
from pyattn.reference import attention_ref, attention_varlen_ref, error_bound
from test_gpu_attention import _has_gpu
from test_gpu_graph_capture import _capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")]
torch = pytest.importorskip("torch") if _has_gpu() else None

GUARD = 32  # rows of each buffer around the array a call sees
TORCH = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


def _guarded(total, heads, D, dtype, gen, fill=None):
    """(buffer, view): rows [GUARD, GUARD + total) of a buffer of random rows (or ``fill``)."""
    tdt = getattr(torch, TORCH[dtype])
    buf = torch.randn(total + 2 * GUARD, heads, D, device="cuda", generator=gen).to(tdt)
    if fill is not None:
        buf.fill_(fill)
    return buf, buf[GUARD:GUARD + total]


def _host(x):
    """A torch tensor as the NumPy array the references take (bf16 through ml_dtypes)."""
    import ml_dtypes

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return x.cpu().numpy()


def _t(x):
    """A result as a torch tensor (pyattn returns DeviceArrays, or the given ``out=`` tensors)."""
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def _clamped(cu, total, longest):
    """What the kernels make of offsets ``cu`` (clamp_rows): (first row, length) a sequence."""
    out = []
    for b in range(len(cu) - 1):
        lo = min(max(int(cu[b]), 0), total)
        out.append((lo, min(min(max(int(cu[b + 1]), lo), total) - lo, longest)))
    return out


def _cu(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window=(40, 3), softcap=12.0), dict()],
                         ids=["causal", "window-softcap", "plain"])
def test_right_offsets_give_the_checked_results(dtype, opts):
    gen = torch.Generator(device="cuda").manual_seed(1)
    lq, lk = [37, 0, 130, 1, 64], [50, 9, 130, 1, 200]
    cq, ck = _cu(lq), _cu(lk)
    D = 64 if dtype == "float32" else 128
    _, q = _guarded(sum(lq), 8, D, dtype, gen)
    _, k = _guarded(sum(lk), 2, D, dtype, gen)
    _, v = _guarded(sum(lk), 2, D, dtype, gen)
    want, want_lse = pyattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **opts)
    got, got_lse = pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                                           return_lse=True, **opts)
    assert torch.equal(_t(got), _t(want))
    assert torch.equal(_t(got_lse), _t(want_lse))
    # an upper bound for the maxima (another tile plan may follow): the fp64 reference's 2x rule
    wide = pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=max(lq) + 70, max_seqlen_k=max(lk) + 300, **opts)
    hq, hk, hv, cu_q, cu_k = (_host(x) for x in (q, k, v, cq, ck))
    ref = attention_varlen_ref(hq, hk, hv, cu_q, cu_k, **opts)
    out = _host(_t(wide)).astype(np.float64)
    for n in range(len(lq)):
        rows = slice(cu_q[n], cu_q[n + 1])
        if lq[n]:
            keys = slice(cu_k[n], cu_k[n + 1])
            bound = error_bound(hq[None, rows], hk[None, keys], hv[None, keys], **opts)
            assert np.abs(out[rows] - ref[rows]).max() <= bound


@pytest.mark.parametrize("seed", range(6))
def test_wrong_offsets_stay_inside_the_arrays(seed):
    """Offsets out of range, decreasing, past the packed rows and longer than the maxima (the first
    seed a hand-made case, the rest random): no access outside the arrays (the guard rows), rows
    no sequence covers unwritten, covered rows the reference of the clamped sequences."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    Tq, Tk, max_q, max_k, n = 10, 12, 4, 6, 3
    if seed == 0:
        cu_q, cu_k = [-5, 3, 3, 999], [-3, 20, 4, 9]
    else:
        pool = [-(2**31), -7, 2**31 - 1, 40]
        cu_q = [int(x) if rng.random() > 0.2 else pool[rng.integers(4)] for x in rng.integers(-3, Tq + 4, n + 1)]
        cu_k = [int(x) if rng.random() > 0.2 else pool[rng.integers(4)] for x in rng.integers(-3, Tk + 4, n + 1)]
    bq, q = _guarded(Tq, 4, 64, "bfloat16", gen)
    bk, k = _guarded(Tk, 2, 64, "bfloat16", gen)
    bv, v = _guarded(Tk, 2, 64, "bfloat16", gen)
    bo, o = _guarded(Tq, 4, 64, "bfloat16", gen, fill=7.0)
    before = [b.clone() for b in (bq, bk, bv, bo)]
    cq, ck = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    res = pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=True, out=o)
    assert res is o
    torch.cuda.synchronize()
    for b, b0 in zip((bq, bk, bv), before):
        assert torch.equal(b, b0)  # inputs only read
    g = slice(GUARD, GUARD + Tq)
    assert torch.equal(bo[:GUARD], before[3][:GUARD]) and torch.equal(bo[g.stop:], before[3][g.stop:])
    seqs_q, seqs_k = _clamped(cu_q, Tq, max_q), _clamped(cu_k, Tk, max_k)
    covered = np.zeros(Tq, int)
    for lo, ln in seqs_q:
        covered[lo:lo + ln] += 1
    out = _host(o).astype(np.float64)
    assert (out[covered == 0] == 7.0).all()  # unwritten
    hq, hk, hv = _host(q), _host(k), _host(v)
    for (q0, sq), (k0, sk) in zip(seqs_q, seqs_k):
        rows = slice(q0, q0 + sq)
        if sq == 0 or (covered[rows] > 1).any():  # rows two sequences write: either may win
            continue
        qs, ks, vs = hq[None, rows], hk[None, k0:k0 + sk], hv[None, k0:k0 + sk]
        if sk == 0:
            assert not out[rows].any()  # no keys: 0
            continue
        ref = attention_ref(qs, ks, vs, causal=True)[0]
        assert np.abs(out[rows] - ref).max() <= error_bound(qs, ks, vs, causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_backward_clamps_wrong_offsets_too(deterministic):
    """Right offsets: the checked call's gradients, bitwise. Wrong ones: the guard rows around the
    given dq, dk, dv stay as they were."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    lq, lk = [37, 0, 130, 1, 64], [50, 9, 130, 1, 200]
    cq, ck = _cu(lq), _cu(lk)
    Tq, Tk = sum(lq), sum(lk)
    _, q = _guarded(Tq, 4, 64, "float16", gen)
    _, k = _guarded(Tk, 2, 64, "float16", gen)
    _, v = _guarded(Tk, 2, 64, "float16", gen)
    _, dout = _guarded(Tq, 4, 64, "float16", gen)
    out, lse = pyattn.attention_varlen(q, k, v, cq, ck, return_lse=True, causal=True)
    want = pyattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=True, deterministic=True)
    got = pyattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, max_seqlen_q=130, max_seqlen_k=200,
                                           causal=True, deterministic=True)
    for a, b in zip(got, want):
        assert torch.equal(_t(a), _t(b))
    bad_q = torch.tensor([-9, 200, 40, 2**31 - 1, 5, Tq + 50], dtype=torch.int32, device="cuda")
    bad_k = torch.tensor([3, -1, 500, 80, 7, 2], dtype=torch.int32, device="cuda")
    grads = [_guarded(t, h, 64, "float16", gen, fill=5.0) for t, h in ((Tq, 4), (Tk, 2), (Tk, 2))]
    before = [b.clone() for b, _ in grads]
    res = pyattn.attention_varlen_backward(dout, q, k, v, out, lse, bad_q, bad_k, max_seqlen_q=100, max_seqlen_k=90,
                                           causal=True, deterministic=deterministic, dq=grads[0][1], dk=grads[1][1],
                                           dv=grads[2][1])
    assert all(r is view for r, (_, view) in zip(res, grads))
    torch.cuda.synchronize()
    for (b, view), b0 in zip(grads, before):
        assert torch.equal(b[:GUARD], b0[:GUARD]) and torch.equal(b[GUARD + view.shape[0]:], b0[GUARD + view.shape[0]:])


def test_the_call_does_not_wait_for_the_stream():
    """torch writes the inputs behind a long kernel on its stream: the unchecked call returns while
    that kernel still runs (nothing synchronised); the checked one returns only after it (its
    offsets' copy-back waits for the writes); both read what torch wrote."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    lq, lk = [100, 28], [90, 300]
    cq, ck = _cu(lq), _cu(lk)
    _, q = _guarded(sum(lq), 4, 128, "bfloat16", gen)
    _, k = _guarded(sum(lk), 4, 128, "bfloat16", gen)
    _, v = _guarded(sum(lk), 4, 128, "bfloat16", gen)
    fresh = torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16)
    pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=100, max_seqlen_k=300, causal=True)  # compiled, planned
    torch.cuda.synchronize()
    results = {}
    for mode, maxima in (("unchecked", dict(max_seqlen_q=100, max_seqlen_k=300)), ("checked", {})):
        q.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the GPU ahead of the writes
        q.copy_(fresh)
        t = time.perf_counter()
        results[mode] = pyattn.attention_varlen(q, k, v, cq, ck, causal=True, **maxima)
        host = time.perf_counter() - t
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        if mode == "unchecked":
            assert busy and host < 0.03, (busy, host)
        else:
            assert host > 0.03, host
    assert torch.equal(_t(results["unchecked"]), _t(results["checked"]))
    q.copy_(fresh)
    assert torch.equal(_t(results["checked"]),
                       _t(pyattn.attention_varlen(q, k, v, cq, ck, causal=True)))


def test_a_graph_replays_on_new_offsets():
    """Captured once with torch's graph; each replay reads the offsets and queries as they are then
    (new splits of the same packed rows), bitwise equal to eager calls."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    Tq, Tk, n = 300, 500, 4
    _, q = _guarded(Tq, 8, 128, "bfloat16", gen)
    _, k = _guarded(Tk, 2, 128, "bfloat16", gen)
    _, v = _guarded(Tk, 2, 128, "bfloat16", gen)
    cq, ck = _cu([100, 50, 100, 50]), _cu([200, 100, 100, 100])
    call = lambda: pyattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=Tq, max_seqlen_k=Tk,  # noqa: E731
                                           causal=True)
    g, out = _capture(call, "fresh")
    out = _t(out)
    rng = np.random.default_rng(6)
    for _ in range(3):
        cuts_q = np.sort(rng.integers(0, Tq + 1, n - 1))
        cuts_k = np.sort(rng.integers(0, Tk + 1, n - 1))
        cq.copy_(torch.tensor(np.concatenate([[0], cuts_q, [Tq]]), dtype=torch.int32))
        ck.copy_(torch.tensor(np.concatenate([[0], cuts_k, [Tk]]), dtype=torch.int32))
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16))
        g.replay()
        got = out.clone()
        want = _t(call())
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_a_graph_replays_the_backward_on_new_offsets():
    gen = torch.Generator(device="cuda").manual_seed(7)
    Tq, Tk = 200, 260
    _, q = _guarded(Tq, 4, 64, "float16", gen)
    _, k = _guarded(Tk, 2, 64, "float16", gen)
    _, v = _guarded(Tk, 2, 64, "float16", gen)
    _, dout = _guarded(Tq, 4, 64, "float16", gen)
    cq, ck = _cu([120, 80]), _cu([100, 160])
    maxima = dict(max_seqlen_q=Tq, max_seqlen_k=Tk, causal=True)

    def call():
        out, lse = pyattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **maxima)
        return [_t(g) for g in pyattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, deterministic=True,
                                                                **maxima)]

    g, grads = _capture(call, "fresh")
    for split_q, split_k in ((30, 250), (200, 0), (7, 99)):
        cq.copy_(torch.tensor([0, split_q, Tq], dtype=torch.int32))
        ck.copy_(torch.tensor([0, split_k, Tk], dtype=torch.int32))
        dout.copy_(torch.randn(dout.shape, device="cuda", generator=gen).to(torch.float16))
        g.replay()
        got = [x.clone() for x in grads]
        want = call()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want))

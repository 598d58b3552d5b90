"""CUDA graphs captured by torch (``torch.cuda.graph``) around pyattn calls, replayed on new inputs
(marked ``gpu``; skipped without a driver or torch).

Each case warms up (compile, plans, kept tables), captures, changes what the graph reads in place
(queries, caches, device lengths and page tables, as a serving loop does), replays, and compares
with the same call run eagerly on the changed inputs: bitwise, since they are the same kernels on
the same values; the decode steps are also held to the fp64 reference (the 2x rule, through
``_check_decode``). The CPU side (what is queued in a capture, what is refused) is
``test_graph_capture_host.py``.
"""

from __future__ import annotations

import ml_dtypes
import pytest

import pyattn
from pyattn.kernels.specs import select_attention_spec
from test_gpu_attention import _has_gpu
from test_gpu_decode import _check_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")]
torch = pytest.importorskip("torch") if _has_gpu() else None
BF16 = ml_dtypes.bfloat16


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def _capture(call, where):
    """Warm ``call`` up on a side stream, then capture it on that stream ("warm-up") or on torch's
    own capture stream ("fresh"). Returns (graph, the captured call's output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s if where == "warm-up" else None):
        out = call()
    return g, out


def _replays_match_eager(g, out, call, refill, rounds=3):
    for _ in range(rounds):
        refill()
        g.replay()
        got = out.clone()
        want = call()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize("where", ["warm-up", "fresh"])
@pytest.mark.parametrize("case", ["new output", "out=", "bool mask", "backward", "tail split"])
def test_attention_calls_replay_as_eager_calls(case, where, launched):
    """Results allocated in the capture (the graph's own memory), ``out=``, a two-kernel masked
    call, the backward, and a call whose last round of query tiles is split by keys (its fp32
    partials and counters taken in the capture: on sm_90a; elsewhere the same call unsplit),
    captured on the stream the warm-up calls used (whose kept blocks and counters a capture must
    not take) and on a fresh one."""
    q, k, v, dout = (_rand(1, 512, 8, 128) for _ in range(4))
    if case == "tail split":  # 2 query tiles a head over 16 key tiles, the last round half full
        sms = pyattn.get_device().sm_count
        H = -(-(sms + sms // 2) // 2)
        q, k, v = _rand(1, 256, H, 128), _rand(1, 2048, H, 128), _rand(1, 2048, H, 128)
    mask = torch.rand(1, 1, 512, 512, device="cuda") < 0.8
    o = torch.empty_like(q)
    out_t, lse_t = (torch.from_dlpack(x) for x in pyattn.attention(q, k, v, causal=True, return_lse=True))
    calls = {
        "new output": lambda: torch.from_dlpack(pyattn.attention(q, k, v, causal=True)),
        "out=": lambda: (pyattn.attention(q, k, v, causal=True, out=o), o)[1],
        "bool mask": lambda: torch.from_dlpack(pyattn.attention(q, k, v, mask=mask)),
        # (deterministic: dq's order of sums fixed, so that replays and eager calls agree bitwise)
        "backward": lambda: torch.from_dlpack(pyattn.attention_backward(dout, q, k, v, out_t, lse_t, causal=True,
                                                                        deterministic=True)[0]),
        # (the merge adds a tile's slots in a fixed order, whichever warp completes it)
        "tail split": lambda: torch.from_dlpack(pyattn.attention(q, k, v)),
    }
    call = calls[case]
    g, out = _capture(call, where)
    if case == "tail split" and pyattn.get_device().arch == "sm_90a":  # the row's split variant ran
        split = select_attention_spec("bfloat16", 128, "sm_90a", keys=2048).replace(q_tiles=3)
        assert split.entry_name in launched, launched
    target = dout if case == "backward" else q
    _replays_match_eager(g, out, call, lambda: target.copy_(_rand(*target.shape)))


def test_blocks_dropped_while_another_stream_captures():
    """An earlier graph's result and an eager result dropped inside a capture on another stream
    (torch's global capture mode, where the driver refuses "unsafe" calls from any thread): their
    frees go through, and the capture still ends and replays. (Results of 512 KiB: freed through
    the driver, not kept.)"""
    q, k, v = (_rand(1, 1024, 4, 64) for _ in range(3))
    call = lambda: torch.from_dlpack(pyattn.attention(q, k, v, causal=True))  # noqa: E731
    g1, earlier = _capture(call, "fresh")
    eager = call()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=s):
        del earlier, eager
        out = call()
    _replays_match_eager(g2, out, call, lambda: q.copy_(_rand(*q.shape)), rounds=2)


def _host(t):
    return t.float().cpu().numpy().astype(BF16)


def test_a_contiguous_decode_step_replays_over_growing_device_lengths():
    """HF's static cache layout (batch, heads_kv, max_len, dim): each step torch writes the new
    token's K/V at the sequence's length and advances the device lengths (ragged), then replays one
    graph holding ``contiguous_decode(..., max_seqlen=max_len)``; the replay equals the same call
    made eagerly (bitwise: one plan) and the fp64 reference over what torch wrote."""
    B, Hkv, Hq, L, D = 3, 2, 8, 2048, 128
    kc, vc = _rand(B, Hkv, L, D), _rand(B, Hkv, L, D)
    q = _rand(B, 1, Hq, D)
    start = [700, 1500, 33]
    lens = torch.tensor(start, dtype=torch.int32, device="cuda")

    def step():
        return torch.from_dlpack(pyattn.contiguous_decode(q, kc, vc, lens, layout="hnd", max_seqlen=L))

    g, out = _capture(step, "fresh")
    host_lens = list(start)
    for _ in range(4):
        for b in range(B):  # the new token at position lens[b], written by torch
            kc[b, :, host_lens[b]] = _rand(Hkv, D)
            vc[b, :, host_lens[b]] = _rand(Hkv, D)
            host_lens[b] += 1
        lens += 1
        q.copy_(_rand(B, 1, Hq, D))
        g.replay()
        got = out.clone()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    ks = [_host(kc[b, :, :n].transpose(0, 1)) for b, n in enumerate(host_lens)]
    vs = [_host(vc[b, :, :n].transpose(0, 1)) for b, n in enumerate(host_lens)]
    _check_decode(_host(got), None, _host(q), ks, vs, causal=True)


def test_a_contiguous_decode_step_with_its_append_replays():
    """The whole step in the graph, as ``flash_attn_with_kvcache`` takes it: each step torch writes
    the new token's K/V and q into fixed buffers, the replay appends them at each sequence's device
    length and attends over the length plus one, then torch advances the lengths. The replay equals
    the same call made eagerly (which rewrites the same slots with the same values), and the last
    step the fp64 reference over the caches as the appends left them."""
    B, Hkv, Hq, L, D = 3, 2, 8, 1024, 64
    kc, vc = _rand(B, Hkv, L, D), _rand(B, Hkv, L, D)
    q, kn, vn = _rand(B, 1, Hq, D), _rand(B, 1, Hkv, D), _rand(B, 1, Hkv, D)
    start = [500, 17, 1000]
    lens = torch.tensor(start, dtype=torch.int32, device="cuda")

    def step():
        return torch.from_dlpack(pyattn.contiguous_decode(q, kc, vc, lens, k_new=kn, v_new=vn, layout="hnd",
                                                          max_seqlen=L))

    g, out = _capture(step, "fresh")
    host_lens = list(start)
    for _ in range(4):
        for x in (q, kn, vn):
            x.copy_(_rand(*x.shape))
        g.replay()
        got = out.clone()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert all(torch.equal(kc[b, :, n], kn[b, 0]) for b, n in enumerate(host_lens))
        host_lens = [n + 1 for n in host_lens]
        lens += 1
    ks = [_host(kc[b, :, :n].transpose(0, 1)) for b, n in enumerate(host_lens)]
    vs = [_host(vc[b, :, :n].transpose(0, 1)) for b, n in enumerate(host_lens)]
    _check_decode(_host(got), None, _host(q), ks, vs, causal=True)


def test_a_paged_decode_step_replays_over_changed_tables():
    """vLLM's form on the device under ``max_seqlen``: between replays the block table is rewritten
    (pages moved) and the lengths change; the replay equals the same call made eagerly (bitwise: one
    plan), an eager checked call on the same tables within its own rounding (its splits follow the
    lengths), and the fp64 reference over the pages the table names."""
    B, Hkv, Hq, P, D, pages, cols = 4, 2, 8, 16, 128, 256, 64
    kp, vp = _rand(pages, P, Hkv, D), _rand(pages, P, Hkv, D)
    q = _rand(B, 1, Hq, D)
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(pages, generator=gen)[: B * cols].reshape(B, cols).to(torch.int32).cuda()
    lens = torch.tensor([100, 1024, 7, 513], dtype=torch.int32, device="cuda")

    def step():
        return torch.from_dlpack(pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=lens,
                                                     max_seqlen=cols * P))

    g, out = _capture(step, "warm-up")
    for new_lens in ([101, 1000, 8, 514], [1024, 16, 999, 1], [0, 3, 4, 1024]):
        table.copy_(torch.randperm(pages, generator=gen)[: B * cols].reshape(B, cols).to(torch.int32))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(_rand(B, 1, Hq, D))
        g.replay()
        got = out.clone()
        want = step()
        checked = torch.from_dlpack(pyattn.paged_decode(q, kp, vp, block_table=table, seq_lens=lens))
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert torch.allclose(got.float(), checked.float(), atol=2e-2, rtol=2e-2)
    t, kh, vh = table.cpu().numpy(), _host(kp), _host(vp)
    ks = [kh[t[b, : -(-n // P)]].reshape(-1, Hkv, D)[:n] for b, n in enumerate(new_lens)]
    vs = [vh[t[b, : -(-n // P)]].reshape(-1, Hkv, D)[:n] for b, n in enumerate(new_lens)]
    _check_decode(_host(got), None, _host(q), ks, vs, causal=True)


def test_unchecked_lengths_and_pages_stay_inside_the_pools():
    """Under ``max_seqlen`` nothing is range-checked: a length over the bound is attended as the
    bound, a negative one as 0 keys, and page entries outside the pool (negative, huge) read its
    last page; never outside the pools (a read there would fault or differ run to run)."""
    B, Hkv, Hq, P, D, pages, cols = 3, 2, 8, 16, 64, 32, 8
    kp, vp = _rand(pages, P, Hkv, D), _rand(pages, P, Hkv, D)
    q = _rand(B, 1, Hq, D)
    table = torch.arange(B * cols, dtype=torch.int32, device="cuda").reshape(B, cols) % pages
    bad = table.clone()
    bad[0, 1], bad[1, 0] = -5, 10**9
    lens = torch.tensor([100, 64, -3], dtype=torch.int32, device="cuda")
    got = torch.from_dlpack(pyattn.paged_decode(q, kp, vp, block_table=bad, seq_lens=lens, max_seqlen=90,
                                                num_splits=1))
    fixed = table.clone()
    fixed[0, 1], fixed[1, 0] = pages - 1, pages - 1
    want = torch.from_dlpack(pyattn.paged_decode(q, kp, vp, block_table=fixed,
                                                 seq_lens=torch.tensor([90, 64, 0], dtype=torch.int32,
                                                                       device="cuda"), num_splits=1))
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.all(got[2] == 0)  # no key: zeros


def test_calls_a_graph_cannot_replay_are_refused_and_the_capture_survives():
    """A decode over a PagedKVCache (host bookkeeping) and device lengths without ``max_seqlen``
    (a copy-back) raise CaptureError inside the capture before reaching the stream, so the rest of
    the capture is intact: the graph then replays the call captured after them."""
    cache = pyattn.PagedKVCache(64, 16, 2, 64, "bfloat16")
    ids = [cache.add_sequence() for _ in range(2)]
    kv = _rand(2, 100, 2, 64)
    cache.append(ids, kv, kv)
    qd = _rand(2, 1, 8, 64)
    kc, vc = _rand(2, 256, 2, 64), _rand(2, 256, 2, 64)
    lens = torch.tensor([50, 60], dtype=torch.int32, device="cuda")
    q, k, v = (_rand(1, 256, 4, 64) for _ in range(3))
    pyattn.decode(qd, cache, ids)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call = lambda: torch.from_dlpack(pyattn.attention(q, k, v, causal=True))  # noqa: E731
        call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        with pytest.raises(pyattn.CaptureError, match="PagedKVCache"):
            pyattn.decode(qd, cache, ids)
        with pytest.raises(pyattn.CaptureError, match="max_seqlen"):
            pyattn.contiguous_decode(qd, kc, vc, lens)
        out = call()
    _replays_match_eager(g, out, call, lambda: q.copy_(_rand(*q.shape)), rounds=2)

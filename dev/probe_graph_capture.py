"""Dev probe (GPU): pyattn calls captured into a CUDA graph by torch (``torch.cuda.graph``), replayed
after the inputs change, against the same call run eagerly.

    PYTHONPATH=. python dev/probe_graph_capture.py

Serving stacks capture their decode steps (and models their layers) into CUDA graphs; pyattn's
launches go to torch's current stream when ``stream=None``, which during a capture is the capturing
stream. Per case, captured on torch's own capture stream and again on the stream the warm-up calls
used: whether the capture succeeds, and two replays' max difference from eager calls on new inputs
(0 expected: the same kernels). Cases: attention with a new output and with
``out=`` (bf16, causal), a bool-masked call (two kernels), the backward, a decode over a paged cache
(the cache filled before the capture; refused with CaptureError since the fifty-third session), and
contiguous_decode over device lengths with max_seqlen. A case that raises prints the exception's type
and message.
``--trace``: every ``cuda.bindings.driver`` call pyattn makes while a capture is open is recorded, and
a failing case prints the calls that returned an error (the first is what broke the capture).
``--time``: wall time per decode step, a loop of eager ``contiguous_decode(..., max_seqlen=)`` calls
(on torch's default stream, and on a side stream) against a loop of replays of one captured call
(bf16, GQA 32 / 8, d 128, HF layout, 1000 steps, one synchronisation at the end; median of 5 loops).
"""

from __future__ import annotations

import sys

import torch
from cuda.bindings import driver

import pyattn

_TRACE: list = []  # (driver function, CUresult) of the calls made while a capture is open


def _trace_driver() -> None:
    """Wrap every ``cu*`` function of ``cuda.bindings.driver`` (pyattn looks them up at call time)."""
    ok = driver.CUresult.CUDA_SUCCESS

    def wrap(name, fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            err = out[0] if isinstance(out, tuple) and out else out
            if isinstance(err, driver.CUresult) and err != ok:
                _TRACE.append((name, err.name))
            return out
        return call

    for name in dir(driver):
        fn = getattr(driver, name)
        if name.startswith("cu") and callable(fn) and not isinstance(fn, type):  # (cuuint32_t & co. are types)
            setattr(driver, name, wrap(name, fn))


def _case(name, make_call):
    """Capture ``call()`` (returning a torch tensor) once warmed up, then twice: change the inputs,
    replay, and compare with an eager call on the changed inputs. Captured on torch's own capture
    stream, and on the stream the warm-up calls used (``torch.cuda.graph(g, stream=s)``)."""
    for where in ("capture stream", "warm-up stream"):
        try:
            call, refill = make_call()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    call()  # warm: compile, load, plan, pools
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            _TRACE.clear()
            with torch.cuda.graph(g, stream=s if where == "warm-up stream" else None):
                out = call()
            errs = []
            for _ in range(2):
                refill()
                g.replay()
                torch.cuda.synchronize()
                got = out.clone()
                want = call()
                torch.cuda.synchronize()
                errs.append((got.float() - want.float()).abs().max().item())
            print(f"{name:30s} {where:15s} captured; 2 replays vs eager max |diff| {errs}", flush=True)
        except Exception as exc:  # noqa: BLE001 - each case reports its own failure
            print(f"{name:30s} {where:15s} {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
            for fn, err in _TRACE[:4]:
                print(f"    driver call failed during the capture: {fn} -> {err}", flush=True)
            torch.cuda.synchronize()


def _time_steps() -> None:
    """``--time``: see the module's docstring."""
    import time

    for B, L in ((1, 4096), (8, 4096), (8, 32768)):
        q = torch.randn(B, 1, 32, 128, device="cuda").to(torch.bfloat16)
        kc, vc = (torch.randn(B, 8, L, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
        lens = torch.full((B,), L - 1, dtype=torch.int32, device="cuda")

        def step():
            return pyattn.contiguous_decode(q, kc, vc, lens, layout="hnd", max_seqlen=L)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
            step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        rows = {}
        for name, fn, where in (("eager", step, None), ("eager, side stream", step, s), ("replay", g.replay, None)):
            runs = []
            for _ in range(5):
                torch.cuda.synchronize()
                with torch.cuda.stream(where or torch.cuda.current_stream()):
                    t0 = time.perf_counter()
                    for _ in range(1000):
                        fn()
                    torch.cuda.synchronize()
                runs.append((time.perf_counter() - t0) / 1000 * 1e6)
            rows[name] = sorted(runs)[2]
        print(f"contiguous_decode B{B} x {L}, us a step: " + ", ".join(f"{k} {v:.1f}" for k, v in rows.items()),
              flush=True)


def main() -> int:
    if "--time" in sys.argv[1:]:
        _time_steps()
        return 0
    if "--trace" in sys.argv[1:]:
        _trace_driver()
    bf = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=bf)

    # Every input made before the first capture: torch's generator refuses to advance after a
    # capture that failed.
    q, k, v, dout = (rand(1, 1024, 32, 128) for _ in range(4))
    qd = rand(8, 1, 32, 128)
    fresh = {name: [rand(*t.shape) for _ in range(4)] for name, t in (("q", q), ("dout", dout), ("qd", qd))}
    mask = torch.rand(1, 1, 1024, 1024, device="cuda") < 0.9
    kv = rand(8, 4096, 8, 128)
    kc, vc = rand(8, 8, 4096, 128), rand(8, 8, 4096, 128)
    lens = torch.full((8,), 3000, dtype=torch.int32, device="cuda")
    o = torch.empty_like(q)

    def refiller(name, t):
        def refill():
            t.copy_(fresh[name][0])
            fresh[name].append(fresh[name].pop(0))
        return refill

    refill = refiller("q", q)
    _case("attention -> new output", lambda: (lambda: torch.from_dlpack(pyattn.attention(q, k, v, causal=True)),
                                               refill))

    def with_out():
        pyattn.attention(q, k, v, causal=True, out=o)
        return o

    _case("attention, out=", lambda: (with_out, refill))
    _case("attention, bool mask", lambda: (lambda: torch.from_dlpack(pyattn.attention(q, k, v, mask=mask)), refill))
    out, lse = pyattn.attention(q, k, v, causal=True, return_lse=True)
    out_t, lse_t = torch.from_dlpack(out), torch.from_dlpack(lse)

    def backward():
        dq, _, _ = pyattn.attention_backward(dout, q, k, v, out_t, lse_t, causal=True, deterministic=True)
        return torch.from_dlpack(dq)

    _case("attention_backward", lambda: (backward, refiller("dout", dout)))
    cache = pyattn.PagedKVCache(8 * 260, 16, 8, 128, "bfloat16")
    ids = [cache.add_sequence() for _ in range(8)]
    cache.append(ids, kv, kv)
    _case("decode over a paged cache", lambda: (lambda: torch.from_dlpack(pyattn.decode(qd, cache, ids)),
                                                 refiller("qd", qd)))  # (refused since the 53rd session)
    _case("contiguous_decode, max_seqlen", lambda: (
        lambda: torch.from_dlpack(pyattn.contiguous_decode(qd, kc, vc, lens, layout="hnd", max_seqlen=4096)),
        refiller("qd", qd)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

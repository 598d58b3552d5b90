"""Dev probe (GPU): GPU time per call of small calls, where the gap between back-to-back kernels
counts (what programmatic dependent launch takes off: kernels_src/pdl.cuh).

    PYTHONPATH=. python dev/probe_small_calls.py

Each case is called back to back on the harness's stream with torch-made bf16 tensors (as a
model's layers call pyattn), GPU us per call behind the harness's pre-roll (``Bench.gpu_ms``), and
again behind a small torch op (a model's kernel before the call; the op's own time taken off):
prefill of one short prompt (causal), a bool-masked call (two kernels: the mask's packing, then
attention), the backward (three kernels), a chunked prefill of 64 tokens over a 4k paged prefix
and ``merge_states``. One line a case.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "scripts")
import harness  # noqa: E402

import pyattn  # noqa: E402


def main() -> int:
    bench = harness.Bench(torch)
    s = bench.stream
    bf = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=bf)

    cases = []
    for B, S, H, D in ((1, 128, 32, 128), (1, 1024, 32, 128), (4, 512, 32, 128), (1, 1024, 32, 64)):
        q, k, v = rand(B, S, H, D), rand(B, S, H, D), rand(B, S, H, D)
        cases.append((f"attention ({B}, {S}, {H}, {D}) causal",
                      lambda q=q, k=k, v=v: pyattn.attention(q, k, v, causal=True, stream=s)))
    q, k, v = rand(1, 1024, 32, 64), rand(1, 1024, 32, 64), rand(1, 1024, 32, 64)
    mask = torch.rand(1, 1, 1024, 1024, device="cuda") < 0.9
    cases.append(("attention (1, 1024, 32, 64) bool mask", lambda: pyattn.attention(q, k, v, mask=mask, stream=s)))
    q, k, v = rand(1, 1024, 16, 128), rand(1, 1024, 16, 128), rand(1, 1024, 16, 128)
    out, lse = pyattn.attention(q, k, v, causal=True, return_lse=True, stream=s)
    dout = rand(1, 1024, 16, 128)
    cases.append(("backward (1, 1024, 16, 128) causal",
                  lambda: pyattn.attention_backward(dout, q, k, v, out, lse, causal=True, stream=s)))
    cache = pyattn.PagedKVCache(4 * 300, 16, 8, 128, "bfloat16")
    ids = [cache.add_sequence() for _ in range(4)]
    kv = rand(4, 4096, 8, 128)
    cache.append(ids, kv, kv, stream=s)
    qc = rand(4, 64, 32, 128)
    cases.append(("prefill 4 x 64 tokens over 4k pages", lambda: pyattn.prefill(qc, cache, ids, stream=s)))
    oa, ob = rand(4, 64, 32, 128), rand(4, 64, 32, 128)
    la, lb = (torch.randn(4, 32, 64, device="cuda") for _ in range(2))
    cases.append(("merge_states (4, 64, 32, 128)", lambda: pyattn.merge_states(oa, la, ob, lb, stream=s)))
    x = torch.randn(4096, device="cuda")
    op = bench.gpu_ms(lambda: x.mul_(1.0), loop=10, reps=25).ms * 1e3
    for name, fn in cases:
        alone = bench.gpu_ms(fn, loop=10, reps=15).ms * 1e3

        def behind(fn=fn):
            x.mul_(1.0)
            return fn()

        after = bench.gpu_ms(behind, loop=10, reps=15).ms * 1e3 - op
        print(f"{name:42s} {alone:8.1f} us back to back | {after:8.1f} us behind a torch op", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

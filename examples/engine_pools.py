"""An engine's own paged KV cache in torch tensors (vLLM's layout), attended with pyattn.paged_prefill.

The engine owns everything here: one ``(2, num_blocks, page, kv_heads, dim)`` bfloat16 tensor whose
halves are the K and V pools, a free list of blocks, a block table and the sequence lengths as
torch tensors. Each step is one attention layer of a mixed batch, as a chunked-prefill scheduler
builds it: requests still in their prompt contribute a chunk of up to ``CHUNK`` tokens, the others
one decode token. torch projects the tokens, writes their K / V into the pools at each token's
slot (what vLLM's ``reshape_and_cache`` does), and ``pyattn.paged_prefill`` attends every new token
over its sequence's pages in one launch. With ``max_seqlen_q`` / ``max_seqlen_k`` the call reads the
tables on the device only: no synchronisation, so the loop never waits for the GPU (and a CUDA
graph could capture it). Outputs are checked against the float64 reference over the tokens each
sequence holds (``pyattn.reference.attention_ref``, with its error bound).

Run (pyattn and torch with CUDA installed): ``python examples/engine_pools.py``.
Exit status 0 on success (or ``skipped: ...`` without torch or a GPU), 1 with ``FAILED: ...``.
"""

import importlib.util
import sys
import time

import numpy as np

try:
    import pyattn
except ImportError as exc:
    sys.exit(f"error: cannot import pyattn ({exc}); run `pip install -e .` in the repository first")

HQ, HKV, D, PAGE, BLOCKS, CHUNK, MAX_PAGES = 16, 4, 128, 16, 1024, 256, 128


def check(ok, what):
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok    {what}")


def main():
    if importlib.util.find_spec("torch") is None:
        print("skipped: torch is not installed")
        return
    if pyattn.device_count() == 0:
        print("skipped: no CUDA GPU (pyattn.device_count() == 0)")
        return
    import ml_dtypes
    import torch

    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    kv_cache = torch.zeros(2, BLOCKS, PAGE, HKV, D, **bf16)  # the engine's pools: K = kv_cache[0], V = [1]
    free = list(range(BLOCKS))[::-1]
    prompts = [1000, 77, 300, 513]  # prompt lengths; each request then decodes 24 tokens
    n_seq = len(prompts)
    table = np.zeros((n_seq, MAX_PAGES), np.int32)
    lens = np.zeros(n_seq, np.int64)  # tokens each sequence holds
    d_table = torch.zeros(n_seq, MAX_PAGES, dtype=torch.int32, device="cuda")
    d_lens = torch.zeros(n_seq, dtype=torch.int32, device="cuda")
    keys = [torch.empty(0, HKV, D, **bf16) for _ in prompts]  # what each sequence holds, for the checks
    values = [torch.empty(0, HKV, D, **bf16) for _ in prompts]
    step_times, step = [], 0
    while any(lens[b] < prompts[b] + 24 for b in range(n_seq)):
        # The scheduler: a prompt chunk for requests still prefilling, one token for the others.
        counts = [min(CHUNK, prompts[b] - int(lens[b])) if lens[b] < prompts[b] else int(lens[b] < prompts[b] + 24)
                  for b in range(n_seq)]
        t0 = time.perf_counter()
        total = sum(counts)
        q = torch.randn(total, HQ, D, **bf16)
        k, v = torch.randn(total, HKV, D, **bf16), torch.randn(total, HKV, D, **bf16)
        pos = np.concatenate([np.arange(lens[b], lens[b] + c) for b, c in enumerate(counts)]).astype(np.int64)
        seq = np.repeat(np.arange(n_seq), counts)
        for b, c in enumerate(counts):  # blocks for the new tokens, from the free list
            for p in range(-(-int(lens[b]) // PAGE), -(-int(lens[b] + c) // PAGE)):
                table[b, p] = free.pop()
        lens += counts
        pages = torch.from_numpy(table[seq, pos // PAGE].astype(np.int64)).cuda()
        slots = torch.from_numpy(pos % PAGE).cuda()
        kv_cache[0][pages, slots] = k  # the engine writes the new K / V at their slots
        kv_cache[1][pages, slots] = v
        d_table.copy_(torch.from_numpy(table), non_blocking=True)
        d_lens.copy_(torch.from_numpy(lens.astype(np.int32)), non_blocking=True)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device="cuda")
        out = pyattn.paged_prefill(q, kv_cache[0], kv_cache[1], cu, block_table=d_table, seq_lens=d_lens,
                                   max_seqlen_q=CHUNK, max_seqlen_k=MAX_PAGES * PAGE)
        o = torch.from_dlpack(out)  # (total, HQ, D) bfloat16, zero-copy, ordered on torch's stream
        step_times.append(time.perf_counter() - t0)
        at = 0
        for b, c in enumerate(counts):
            keys[b], values[b] = torch.cat([keys[b], k[at:at + c]]), torch.cat([values[b], v[at:at + c]])
            at += c
        if step % 4 == 0 or not any(lens[b] < prompts[b] + 24 for b in range(n_seq)):
            torch.cuda.synchronize()
            at = 0
            for b, c in enumerate(counts):
                if c:
                    host = [t.float().cpu().numpy().astype(ml_dtypes.bfloat16)[None]  # (exact: bf16 -> f32 -> bf16)
                            for t in (q[at:at + c], keys[b], values[b])]
                    ref = pyattn.reference.attention_ref(*host, causal=True)  # bottom-right: the chunk is last
                    err = np.abs(o[at:at + c].float().cpu().numpy()[None].astype(np.float64) - ref).max()
                    bound = pyattn.reference.error_bound(*host, causal=True)
                    check(err <= bound, f"step {step}, sequence {b}: {c} new token(s) over {int(lens[b])}: "
                                        f"max err {err:.2e} <= bound {bound:.2e}")
                at += c
        step += 1
    torch.cuda.synchronize()
    print(f"note  {step} steps; host time of a step (projections, K/V writes, table copies, paged_prefill, "
          f"from_dlpack): median {1e6 * float(np.median(step_times)):.0f} us")


if __name__ == "__main__":
    main()

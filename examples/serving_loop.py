"""A serving loop on pyattn's paged KV cache, with torch as the model: requests join, decode one
token a step, fork a shared prefix, and leave.

Each step is what an engine's decode loop does for one attention layer: torch computes the new
tokens' q, k, v; ``cache.append(ids, k, v)`` stores k and v (one token a sequence); then
``pyattn.decode(q, cache, ids)`` attends over each sequence's whole cache, and the result goes
back to torch with ``torch.from_dlpack`` (bfloat16, zero-copy). The decode's page table follows the
appends on the device (no table upload per step); a request joining or leaving makes the next
decode build a new one. Every few steps the outputs are checked against the float64 reference
over the tokens the loop appended (``pyattn.reference.attention_ref``, with its error bound).

Run (pyattn and torch with CUDA installed): ``python examples/serving_loop.py``.
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

HIDDEN, HQ, HKV, D, PAGE = 512, 8, 2, 64, 16  # GQA: 8 query heads share 2 KV heads


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
    import torch

    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    import ml_dtypes

    wq, wk, wv = (torch.randn(HIDDEN, n * D, **bf16) / HIDDEN ** 0.5 for n in (HQ, HKV, HKV))
    wo = torch.randn(HQ * D, HIDDEN, **bf16) / (HQ * D) ** 0.5
    cache = pyattn.PagedKVCache(4096, PAGE, HKV, D, "bfloat16")
    keys, values = {}, {}  # what the loop appended to each sequence (torch), for the checks

    def project(x):
        n = x.shape[0]
        return ((x @ wq).view(n, 1, HQ, D), (x @ wk).view(n, 1, HKV, D), (x @ wv).view(n, 1, HKV, D))

    def admit(prompt_len):
        """A new request: its prompt's K / V appended in one call (a prefill would also attend)."""
        sid = cache.add_sequence()
        x = torch.randn(prompt_len, HIDDEN, **bf16)
        _, k, v = project(x)
        cache.append([sid], k.view(1, prompt_len, HKV, D), v.view(1, prompt_len, HKV, D))
        keys[sid], values[sid] = k.view(prompt_len, HKV, D), v.view(prompt_len, HKV, D)
        return sid

    ids = [admit(n) for n in (37, 200, 5, 120)]
    x = torch.randn(len(ids), HIDDEN, **bf16)
    step_times = []
    for step in range(48):
        if step == 16:  # a request joins
            ids.append(admit(64))
            x = torch.cat([x, torch.randn(1, HIDDEN, **bf16)])
        if step == 24:  # parallel sampling: a fork shares sequence 0's pages (copied when written)
            child = cache.fork(ids[0])
            keys[child], values[child] = keys[ids[0]], values[ids[0]]
            ids.append(child)
            x = torch.cat([x, x[:1]])
        if step == 32:  # a request finishes
            cache.free(ids.pop(1))
            x = torch.cat([x[:1], x[2:]])
        t0 = time.perf_counter()
        q, k, v = project(x)
        cache.append(ids, k, v)
        o = torch.from_dlpack(pyattn.decode(q, cache, ids))  # (batch, 1, HQ, D) bfloat16, zero-copy
        x = x + o.reshape(len(ids), HQ * D) @ wo  # the residual stream: the next step reads this one's output
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)  # RMS norm
        step_times.append(time.perf_counter() - t0)
        for i, sid in enumerate(ids):
            keys[sid] = torch.cat([keys[sid], k[i]])
            values[sid] = torch.cat([values[sid], v[i]])
        if step % 8 == 7:
            torch.cuda.synchronize()
            for i, sid in enumerate(ids):
                host = [t.float().cpu().numpy().astype(ml_dtypes.bfloat16)  # (exact: bf16 -> f32 -> bf16)
                        for t in (q[i:i + 1], keys[sid][None], values[sid][None])]
                got = o[i:i + 1].float().cpu().numpy()
                ref = pyattn.reference.attention_ref(*host, causal=True)
                err = np.abs(got.astype(np.float64) - ref).max()
                bound = pyattn.reference.error_bound(*host, causal=True)
                if err > bound:
                    check(False, f"step {step}, sequence {sid} ({cache.length(sid)} tokens): max err {err:.2e} > "
                                 f"bound {bound:.2e} (max |q| {np.abs(host[0].astype(np.float32)).max():.1f}, |v| "
                                 f"{np.abs(host[2].astype(np.float32)).max():.1f}, |out| {np.abs(ref).max():.2f})")
            check(True, f"step {step}: {len(ids)} sequences of {min(cache.length(s) for s in ids)}-"
                        f"{max(cache.length(s) for s in ids)} tokens match the float64 reference")
    torch.cuda.synchronize()
    print(f"note  host time of a step (project, append, decode, from_dlpack): median "
          f"{1e6 * float(np.median(step_times)):.0f} us")


if __name__ == "__main__":
    main()

"""pyattn with plain NumPy arrays: no torch, no CuPy.

Shows, each checked against the float64 reference ``pyattn.reference.attention_ref`` with the
tolerance rule ``pyattn.reference.error_bound`` (2x a naive same-precision attention, plus a floor):

1. causal GQA prefill in float16 and bfloat16 (``ml_dtypes.bfloat16``): NumPy in, NumPy out;
2. one decode step over a paged KV cache filled from NumPy K/V;
3. split-KV: ``merge_states`` of two ``attention(..., return_lse=True)`` calls over the two
   halves of the keys, passed as they are (the LSE is (batch, heads, seq) in every op);
4. a decode loop over a contiguous KV cache (``contiguous_decode``: the new tokens' K/V written
   into device buffers by the same call);
5. timings of a (1, 4096, 16, 128) float16 causal call: NumPy in/out (wall, copies included),
   the same with the inputs in pinned ``pyattn.pinned_empty`` arrays (sent without a staging copy),
   and device-resident (CUDA events).

Run (pyattn installed, e.g. ``pip install -e .``): ``python examples/numpy_attention.py``.
Exit status 0 on success (or ``skipped: ...`` without a GPU), 1 with ``FAILED: ...``.
"""

import sys
import time

import numpy as np

try:
    import pyattn
except ImportError as exc:
    sys.exit(f"error: cannot import pyattn ({exc}); run `pip install -e .` in the repository first")


def check(ok, what):
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok    {what}")


def main():
    if pyattn.device_count() == 0:  # before anything that compiles or touches the GPU
        print("skipped: no CUDA GPU (pyattn.device_count() == 0)")
        return
    import ml_dtypes
    from pyattn.reference import attention_ref, error_bound

    rng = np.random.default_rng(0)
    randn = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731

    # 1. Prefill: 8 query heads share 2 KV heads; an odd length exercises the tile edges.
    for dt in (np.float16, ml_dtypes.bfloat16):
        q, k, v = randn(2, 300, 8, 64).astype(dt), randn(2, 300, 2, 64).astype(dt), randn(2, 300, 2, 64).astype(dt)
        out = pyattn.attention(q, k, v, causal=True)
        err = np.abs(out.astype(np.float64) - attention_ref(q, k, v, causal=True)).max()
        bound = error_bound(q, k, v, causal=True)
        check(out.dtype == dt and err <= bound, f"prefill {np.dtype(dt).name:8s} {out.shape}: max err {err:.2e} "
              f"<= bound {bound:.2e}")

    # 2. Decode: two sequences of 100 and 37 cached tokens, then one new token each.
    cache = pyattn.PagedKVCache(num_pages=32, page_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    seqs = {cache.add_sequence(): n for n in (100, 37)}
    kv = {}
    for sid, n in seqs.items():
        kv[sid] = randn(1, n + 1, 2, 64).astype(np.float16), randn(1, n + 1, 2, 64).astype(np.float16)
        cache.append([sid], kv[sid][0][:, :n], kv[sid][1][:, :n])  # the prompt
    ids = list(seqs)
    cache.append(ids, np.concatenate([kv[s][0][:, -1:] for s in ids]), np.concatenate([kv[s][1][:, -1:] for s in ids]))
    q = randn(2, 1, 8, 64).astype(np.float16)
    out = pyattn.decode(q, cache, ids)  # NumPy q -> NumPy out (2, 1, 8, 64)
    for b, sid in enumerate(ids):
        k, v = kv[sid]
        err = np.abs(out[b:b + 1].astype(np.float64) - attention_ref(q[b:b + 1], k, v, causal=True)).max()
        bound = error_bound(q[b:b + 1], k, v, causal=True)
        check(err <= bound, f"decode seq {sid} ({cache.length(sid)} tokens): max err {err:.2e} <= bound {bound:.2e}")

    # 3. Split-KV: attention over each half of the keys, merged by LSE, equals attention over all.
    q, k, v = randn(1, 128, 8, 64).astype(np.float16), randn(1, 1024, 2, 64).astype(np.float16), \
        randn(1, 1024, 2, 64).astype(np.float16)
    o1, l1 = pyattn.attention(q, k[:, :512], v[:, :512], return_lse=True)
    o2, l2 = pyattn.attention(q, k[:, 512:], v[:, 512:], return_lse=True)
    o, lse = pyattn.merge_states(o1, l1, o2, l2)  # (out, lse) pairs as the ops return them
    ref, ref_lse = attention_ref(q, k, v, return_lse=True)
    # Each half meets its own bound, and a convex combination of the halves is no further from the
    # reference's than the worse half; plus one more rounding of the merged output to float16
    # (one ulp at the largest output allowed). The LSE is float32 math on exact float16 products.
    bound = max(error_bound(q, k[:, :512], v[:, :512]), error_bound(q, k[:, 512:], v[:, 512:]))
    bound += 2.0 ** -10 * max(1.0, np.abs(ref).max())
    err, lse_err = np.abs(o.astype(np.float64) - ref).max(), np.abs(lse - ref_lse).max()
    check(err <= bound and lse_err <= 1e-3, f"merge_states of 2 x 512 keys: max err {err:.2e} <= {bound:.2e}, "
          f"LSE err {lse_err:.1e} <= 1e-3")

    # 4. A contiguous KV cache (flash_attn_with_kvcache's form): one (batch, max_len, heads, dim)
    # device buffer per K and V. The first call writes a 100-token prompt's K/V (k_new / v_new) and
    # attends its last query; each later step writes one new token and decodes over all of them.
    kc, vc = (pyattn.empty((2, 512, 2, 64), ml_dtypes.bfloat16) for _ in range(2))
    ks, vs, n = np.zeros((2, 0, 2, 64), ml_dtypes.bfloat16), np.zeros((2, 0, 2, 64), ml_dtypes.bfloat16), 0
    for n_new in [100] + [1] * 5:
        k, v = randn(2, n_new, 2, 64).astype(ml_dtypes.bfloat16), randn(2, n_new, 2, 64).astype(ml_dtypes.bfloat16)
        q = randn(2, 1, 8, 64).astype(ml_dtypes.bfloat16)
        out = pyattn.contiguous_decode(q, kc, vc, n, k_new=k, v_new=v)  # n tokens cached before k / v
        ks, vs, n = np.concatenate([ks, k], 1), np.concatenate([vs, v], 1), n + n_new
        err = np.abs(out.astype(np.float64) - attention_ref(q, ks, vs, causal=True)).max()
        bound = error_bound(q, ks, vs, causal=True)
        check(err <= bound, f"contiguous cache, {n} tokens: max err {err:.2e} <= bound {bound:.2e}")

    # 5. Timings (informative): the first call also compiles (or loads) the kernel.
    q, k, v = (randn(1, 4096, 16, 128).astype(np.float16) for _ in range(3))
    walls = []
    for _ in range(6):
        t = time.perf_counter()
        pyattn.attention(q, k, v, causal=True)
        walls.append(time.perf_counter() - t)
    flops = 4 * 4096 * 4096 * 16 * 128 / 2  # QK^T and PV, half of the square under the causal mask
    print(f"time  (1, 4096, 16, 128) fp16 causal, NumPy in/out: first call {walls[0] * 1e3:.0f} ms, "
          f"best of 5 {min(walls[1:]) * 1e3:.2f} ms wall (copies included)")
    # Inputs in pinned (page-locked) NumPy arrays are sent by the DMA in place: no staging copy.
    pq, pk, pv = (pyattn.pinned_empty(x.shape, x.dtype) for x in (q, k, v))
    for dst, src in ((pq, q), (pk, k), (pv, v)):
        dst[...] = src
    pinned = []
    for _ in range(6):
        t = time.perf_counter()
        pout = pyattn.attention(pq, pk, pv, causal=True)
        pinned.append(time.perf_counter() - t)
    check(np.array_equal(pout, pyattn.attention(q, k, v, causal=True)), "pinned inputs give the same result")
    print(f"time  same call, q/k/v in pyattn.pinned_empty arrays: best of 5 {min(pinned[1:]) * 1e3:.2f} ms wall")
    dq, dk, dv = (pyattn.asarray(x) for x in (q, k, v))
    s = pyattn.Stream()
    pyattn.attention(dq, dk, dv, causal=True, stream=s)  # warm-up (and wait for the uploads)
    start = s.record(timing=True)
    for _ in range(10):
        pyattn.attention(dq, dk, dv, causal=True, stream=s)
    ms = start.elapsed_ms(s.record(timing=True)) / 10
    print(f"time  same call on device arrays: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
    s.close()


if __name__ == "__main__":
    main()

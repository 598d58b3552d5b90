"""One 8-bit-cache decode call for Nsight Compute (development tool).

    ncu --clock-control none -k regex:attn_decode --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        python3 dev/profile_quant_decode.py [int8|fp8e4m3] [B] [ctx]

Fills the pools with random codes and positive scales (through the tuning helper), then decodes
bf16 queries, Hq 32, Hkv 8, D 128, page 16, a few times.
"""

from __future__ import annotations

import sys

import torch  # noqa: F401 - first, as in the other scripts

import numpy as np

import pyattn
from pyattn.ops import decode as dec
from pyattn.interop.inputs import read
from pyattn.validate.paged import check_pools, check_query
from pyattn.runtime.stream import default_stream

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tune_decode import _quantized_pool  # noqa: E402


def main():
    kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
    B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    L = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
    Hq, Hkv, D, PS = 32, 8, 128, 16
    dev = pyattn.get_device()
    s = default_stream(dev)
    npages = B * L // PS
    k = torch.randn(npages, PS, Hkv, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(npages, device="cuda").int().reshape(B, L // PS)
    dq, dk, dt = pyattn.asarray(q), pyattn.asarray(k), pyattn.asarray(table)
    pool, (ck, cv), scale_pools = _quantized_pool(check_pools(read("k_pool", dk), read("v_pool", dk)), k, kv)
    scales = tuple(x.ptr for x in scale_pools)  # (the pools stay alive in scale_pools)
    dl = pyattn.asarray(np.full(B, L, np.int32))
    P = check_query(read("q", dq), pool, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None, num_splits=None)
    for _ in range(6):
        dec.run_decode(P, dev, dq.ptr, ck.ptr, cv.ptr, (dt, None, L // PS, dl), L, 0, s, False, scales)
    s.synchronize()


if __name__ == "__main__":
    main()

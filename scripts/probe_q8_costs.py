"""Where does the 8-bit decode kernel's time go? (development probe)

Times run_decode over a random int8 cache (B8 L32k and B64 L4k, bf16 q, Hq 32, Hkv 8, D 128, page 16)
with kernel-source variants that drop one piece of work each (results are garbage; timing only):
  base     the shipped kernel
  noVconv  V codes reinterpreted as T pairs (no dequantisation math)
  noKconv  K codes reinterpreted as T pairs
  noconv   both
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch  # noqa: F401

import numpy as np

import pyattn
import pyattn.jit as jit
from pyattn.jit import source
from pyattn.kernels import registry
from pyattn.ops import decode as dec
from pyattn.ops._paged import check_pools, check_query
from pyattn.runtime.stream import default_stream

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tune_decode import _quantized_pool, time_us  # noqa: E402

ORIG = dict(source.kernel_headers())
V_OLD = '''          for (int i = 0; i < 4; ++i) {
            codes_to_float4<KV>(vw[i][w4], f[i]);
            if constexpr (!kFoldV) {
#pragma unroll
              for (int e = 0; e < 4; ++e) f[i][e] *= vsc[i];
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const unsigned b0 = pack2<T>(f[0][e], f[1][e]), b1 = pack2<T>(f[2][e], f[3][e]);'''
V_NEW = '''          for (int i = 0; i < 4; ++i) f[i][0] = vsc[i];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const unsigned b0 = vw[0][w4] ^ vw[1][w4] ^ e, b1 = vw[2][w4] ^ vw[3][w4] ^ e;'''
K_OLD = '''          codes_to_pairs<KV, __half>(words[kk], b0, b1);'''
K_NEW = '''          b0 = words[kk]; b1 = words[kk] >> 8;'''


def variant(name):
    text = ORIG["attention_decode_q8.cuh"]
    if name in ("noVconv", "noconv"):
        assert V_OLD in text, "the kernel's V conversion changed: update V_OLD"
        text = text.replace(V_OLD, V_NEW)
    if name in ("noKconv", "noconv"):
        assert K_OLD in text, "the kernel's K conversion changed: update K_OLD"
        text = text.replace(K_OLD, K_NEW)
    hdrs = dict(ORIG)
    hdrs["attention_decode_q8.cuh"] = text + f"\n// variant {name}\n"
    return tuple(sorted(hdrs.items()))


def main():
    dev = pyattn.get_device()
    s = default_stream(dev)
    Hq, Hkv, D, PS = 32, 8, 128, 16
    cases = []
    for B, L in ((8, 32768), (64, 4096), (1, 32768)):
        npages = B * L // PS
        k = torch.randn(npages, PS, Hkv, D, device="cuda", dtype=torch.bfloat16)
        q = pyattn.asarray(torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16))
        table = pyattn.asarray(torch.randperm(npages, device="cuda").int().reshape(B, L // PS))
        pool, (ck, cv), scales = _quantized_pool(check_pools(pyattn.asarray(k), pyattn.asarray(k)), k, "int8")
        dl = pyattn.asarray(np.full(B, L, np.int32))
        P = check_query(q, pool, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None,
                        num_splits=None)
        cases.append((B, L, P, pool, q, ck, cv, table, dl, scales))
        del k
    for name in ("base", "noVconv", "noKconv", "noconv"):
        hdrs = variant(name)
        jit.kernel_headers = lambda h=hdrs: h  # what build() hands NVRTC
        os.environ["PYATTN_CACHE_DIR"] = tempfile.mkdtemp()  # the disk key does not see the variant
        registry._kernels.clear()
        dec._plans.clear()
        cells = []
        for B, L, P, pool, q, ck, cv, table, dl, scales in cases:
            us = time_us(lambda: dec.run_decode(P, pool, q, ck, cv, (table, None, L // PS, dl), L, None, s, False,
                                                scales), s, dev)
            cells.append(f"B{B} L{L}: {us:7.1f} us ({B * L * Hkv * (2 * D + 8) / us / 1e6:.2f} TB/s)")
        print(f"{name:8s} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

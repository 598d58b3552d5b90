"""What the tile-row probes share (probe_d64_rows, probe_short_rows, probe_short_d128,
probe_split_kv, probe_d128_wide): each variant's outputs against the fp64 reference, and its
time on a prefill shape beside SDPA cuDNN; (probe_small_pages, profile_sparq) attn_decode rows
named on the command line; and (probe_serving, probe_mask_cost) a table with one bucket's row
swapped. A variant is a name; ``run(name, fn)`` calls ``fn`` with that variant's tile tables in
force (``override_tiles``) and returns what it returns; the variant named "table" is the library
as it is.

Imported by those scripts from their own directory (``python dev/<probe>.py`` puts dev/ on the path).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import harness  # noqa: E402

import pyattn  # noqa: E402
from pyattn.reference import attention_ref  # noqa: E402


def check(bench, names, run, shape: tuple, *, mask: bool = False, **opts) -> int:
    """Each variant's max error against the fp64 reference on bf16 inputs of ``shape`` (B, Sq, Sk,
    Hq, Hk, D) drawn from seed 1, with ``opts`` (causal, softcap) and, with ``mask``, a random float
    mask (1, Hq, Sq, Sk) in bf16; printed on one line. Returns 1 when a variant errs by more than
    twice the table's (+ 1e-3), else 0."""
    torch = bench.torch
    B, Sq, Sk, Hq, Hk, D = shape
    rng = np.random.default_rng(1)
    hs = [rng.standard_normal((B, s, h, D)).astype(np.float32) for s, h in ((Sq, Hq), (Sk, Hk), (Sk, Hk))]
    ts = [torch.from_numpy(h).to("cuda", torch.bfloat16) for h in hs]
    tm = torch.from_numpy((rng.standard_normal((1, Hq, Sq, Sk)) * 2).astype(np.float32)).to(
        "cuda", torch.bfloat16) if mask else None
    f64 = [t.float().cpu().numpy().astype(np.float64) for t in ts]
    ref = attention_ref(*f64, mask=None if tm is None else tm.float().cpu().numpy().astype(np.float64), **opts)
    ref = np.asarray(ref[0] if isinstance(ref, tuple) else ref)
    xs = [harness.to_pyattn(t, bench.stream) for t in ts]
    dm = None if tm is None else harness.to_pyattn(tm, bench.stream)
    errs = {}
    for n in names:
        o = run(n, lambda: pyattn.attention(*xs, mask=dm, stream=bench.stream, **opts))
        errs[n] = float(np.abs(harness.to_torch(o).float().cpu().numpy() - ref).max())
    print(f"check B{B} Sq{Sq} Sk{Sk} H{Hq}/{Hk} d{D} {opts} mask={mask}: max err vs fp64 "
          + " ".join(f"{n} {e:.2e}" for n, e in errs.items()), flush=True)
    return int(max(errs.values()) > 2 * errs["table"] + 1e-3)


def time_shape(bench, names, run, head: str, B: int, S: int, H: int, D: int, *, cudnn: bool = True,
               dtype: str = "bfloat16", **opts) -> None:
    """``pyattn.attention`` on (B, S, H, D) inputs of ``dtype`` (seed 0) with ``opts`` under each
    variant, two rounds (the second in reverse order), the best of each; SDPA cuDNN on the same
    inputs when ``cudnn`` (plain or causal calls only). Prints ``head``, cuDNN's ms and each variant's ms (x cuDNN)."""
    torch = bench.torch
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(B, S, H, D, device="cuda", dtype=getattr(torch, dtype), generator=g) for _ in range(3)]
    xs = [harness.to_pyattn(t, bench.stream) for t in ts]
    fn = lambda: pyattn.attention(*xs, stream=bench.stream, **opts)  # noqa: E731
    ms = {n: [] for n in names}
    for _, n in harness.alternating(names, 2):  # (the second round in reverse: harness.alternating says why)
        ms[n].append(run(n, lambda: bench.gpu_ms(fn, loop=10, reps=5).ms))
    cu = None
    if cudnn:
        f = harness.sdpa(torch, "cudnn", *(t.transpose(1, 2) for t in ts), is_causal=bool(opts.get("causal")))
        cu = bench.gpu_ms(f, loop=10, reps=5).ms
    print(f"{head} cuDNN {cu or 0:.3f} | " + " | ".join(
        f"{n} {min(t):.3f}" + (f" ({cu / min(t):.2f})" if cu else "") for n, t in ms.items()), flush=True)


def decode_rows(names: str) -> dict:
    """attn_decode's sm_90a table with its d <= 128 row replaced by each of ``names``
    (``KEYSxWARPSxSTAGESxBLOCKS``, comma-separated: keys a warp, warps, stages, launch-bound blocks),
    by name, for ``override_tiles("attn_decode", "sm_90a", rows)``."""
    from pyattn.kernels.families import tile_table

    base, out = tile_table("attn_decode", "sm_90a"), {}
    for name in filter(None, names.split(",")):
        keys, warps, stages, blocks = (int(x) for x in name.split("x"))
        out[name] = tuple(r._replace(keys_per_warp=keys, warps=warps, stages=stages, min_blocks=blocks)
                          if r.max_head_dim == 128 else r for r in base)
    return out


def rows_with(table, d, row) -> tuple:
    """``table`` (a tile table's rows) with the row of head-dim bucket ``d`` replaced by ``row``."""
    return tuple(row if r.max_head_dim == d else r for r in table)

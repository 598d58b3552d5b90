"""Kernel families of the paged cache's optional state: per-channel key scales and SparQ.

kv_key_pages (re)quantizes the keys of the pages an append wrote with per-(page, channel) scales;
kv_sparq keeps SparQ's transposed key copy and running V sums; sparq_score and sparq_select are
SparQ's first stages, a kernel each, before the paged decode kernel that ends it (its finish folded
in). All take the head dim as a launch parameter (one variant, bucket 32, serves every head dim)
and have no dynamic shared memory.
"""

from __future__ import annotations

from ..params import KV_PAGES_PARAMS, KV_SPARQ_PARAMS, SPARQ_PARAMS
from .base import CTYPES, KV_KINDS, MAX_HEAD_DIM, Family, FixedTile, every_arch
from .decode import PAGED_ALIGNMENT

__all__ = ["KV_KEY_PAGES", "KV_SPARQ", "SPARQ_SCORE", "SPARQ_SELECT"]

_PAGES = every_arch((FixedTile(MAX_HEAD_DIM, block_m=0, block_n=0, warps=8,
                               reason="memory-bound, one warp per (page, kv head) or (slot, kv head): 256 threads, "
                                      "grid-stride; unmeasured"),))
_SPARQ_SCORE = every_arch((FixedTile(MAX_HEAD_DIM, block_m=0, block_n=2048, warps=8, min_blocks=2,
                                     reason="2048 keys a block step (8 a quad of lanes: 16-byte reads of the chosen "
                                            "kt rows), 35 KiB of static shared memory; 2 blocks an SM (109 registers "
                                            "then, 127 since the fiftieth session; 8 reads in flight a thread): H200 "
                                            "B8 x 32k score stage 63.5 us against 71.8 at 3 blocks (80 registers); "
                                            "the tensor-core sums (127 registers) 50.1 us against 58.3 at 3 blocks "
                                            "with no reads ahead; BENCHMARKS.md 'SparQ selection', sixty-seventh "
                                            "session"),))
_SPARQ_SELECT = every_arch((FixedTile(MAX_HEAD_DIM, block_m=0, block_n=2048, warps=8, min_blocks=4,
                                      reason="2048 keys a block step, like the score stage's; 4 blocks an SM (60 "
                                             "registers, 36 KiB of static shared memory), its grid sized to them: "
                                             "H200 B8 x 32k select stage 23.2 -> 21.2 us against 2 blocks in a "
                                             "kernel shared with the score stage; BENCHMARKS.md, fiftieth session"),))


def _needs_kv(spec) -> None:
    if not spec.kv:
        raise ValueError(f"kv: kv_key_pages quantizes 8-bit caches (int8 / fp8e4m3), got {spec.kv!r}")


KV_KEY_PAGES = Family(
    name="kv_key_pages", label="kv_key_pages", header="kv_pages.cuh", params=KV_PAGES_PARAMS,
    tables={"dense": _PAGES},
    template_id=lambda spec, t: f"pyattn::kv_key_pages<{CTYPES[spec.dtype]}, {KV_KINDS[spec.kv]}>",
    dtypes=("f16", "bf16"), alignment=PAGED_ALIGNMENT, check=_needs_kv, kv=True,
)

KV_SPARQ = Family(
    name="kv_sparq", label="kv_sparq", header="kv_pages.cuh", params=KV_SPARQ_PARAMS,
    tables={"dense": _PAGES},
    template_id=lambda spec, t: f"pyattn::kv_sparq<{CTYPES[spec.dtype]}>",
    dtypes=("f16", "bf16"), alignment=PAGED_ALIGNMENT,
)


def _sparq(stage: str, table) -> Family:
    return Family(
        name=f"sparq_{stage}", label=f"sparq_{stage}", header="sparq.cuh", params=SPARQ_PARAMS,
        tables={"dense": table},
        template_id=lambda spec, t: f"pyattn::sparq_{stage}_stage<{CTYPES[spec.dtype]}>",
        dtypes=("f16", "bf16"),
    )


SPARQ_SCORE = _sparq("score", _SPARQ_SCORE)
SPARQ_SELECT = _sparq("select", _SPARQ_SELECT)

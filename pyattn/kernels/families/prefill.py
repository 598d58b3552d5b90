"""Prefill over a paged KV cache: the tensor-core forward kernels with paged K/V loads.

``attn_prefill_wgmma`` (sm_90a) and ``attn_prefill_mma`` (mma.sync, every arch) run the dense
kernels' main loops (their traits, shared memory and tile tables) with K/V rows gathered through
a sequence's page list, ragged new tokens against each sequence's cached keys, GQA row groups and
key splits (``kernels_src/attention_prefill_*.cuh``). ``attn_prefill_tma`` is attn_prefill_wgmma on
TMA traits: K/V come as page boxes through tensor maps over the pools (pages of a power of two
from 16 slots) instead of the producer warpgroup's cp.async gather. ``attn_tree_wgmma`` /
``attn_tree_mma`` are the same kernels with a draft tree's ancestor masks over the last keys (speculative decoding's
verification), on tiles of 64 rows: a tree is at most 64 tokens, so the dense tables' 128-row
tiles would leave half of a block idle.
"""

from __future__ import annotations

from ..params import PAGED_FWD_PARAMS
from .base import Alignment, Family, every_arch, score_mods, tma_page_boxes
from .mma import ATTN_FWD_MMA, MmaTile
from .tables import rows as table_rows
from .wgmma import ATTN_FWD_WGMMA, WGMMA_ARCHS, WgmmaTile

__all__ = ["ATTN_PREFILL_WGMMA", "ATTN_PREFILL_TMA", "ATTN_PREFILL_MMA", "ATTN_TREE_WGMMA", "ATTN_TREE_MMA",
           "PREFILL_ALIGNMENT", "prefill_tma_serves"]

# q / out as the tensor-core kernels (16-byte chunks, element-pair stores); pools as decode's.
PREFILL_ALIGNMENT = Alignment(qkv=16, out_elems=2, pool=16)
_TAKES = f"f16/bf16, soft-cap/ALiBi only, a head-dim bucket that is a multiple of 64 and arch in {WGMMA_ARCHS}"

# One warpgroup of 64 rows: a tree of n tokens x a GQA group of G heads is n * G rows (16 x 4 = 64
# fills one), and two such blocks share an SM. The rows of the block-sparse 64 x 64 table.
_TREE_SM90 = (
    WgmmaTile(64, 64, 1, 4, True, 2, "64 tree rows per block; 74 KiB, 3 blocks/SM fit; unmeasured"),
    WgmmaTile(128, 64, 1, 2, False, 2, "64 tree rows per block; 82 KiB, 2 blocks/SM (3 stages with overlap "
                                       "would need 113 KiB each, exactly the SM's 228 KiB for two)"),
    WgmmaTile(192, 64, 1, 2, False, 1, "64 tree rows per block; 123 KiB; unmeasured"),
    WgmmaTile(256, 64, 1, 2, False, 1, "64 tree rows per block; 164 KiB; unmeasured"),
)
_TREE_MMA = (  # 4 warps x 1 row tile = 64 rows; fits sm_86/89's 99 KiB too
    MmaTile(64, 64, 4, 1, 1, "64 tree rows per block; 46 KiB; unmeasured"),
    MmaTile(128, 64, 4, 1, 1, "64 tree rows per block; 87 KiB; unmeasured"),
    MmaTile(256, 16, 4, 1, 1, "64 tree rows per block; 68 KiB (32-key stages: 101 KiB, over sm_86's 99); "
                              "unmeasured"),
)


def _wgmma_check(spec) -> None:
    if spec.head_dim % 64 or spec.arch not in WGMMA_ARCHS:
        raise ValueError(f"family: {spec.family} takes {_TAKES}; got {spec}")


def _family(name: str, base: Family, tables: dict, tree: bool, wgmma: bool, check=_wgmma_check) -> Family:
    fn = "attn_prefill_wgmma" if wgmma else "attn_prefill_mma"  # attn_prefill_tma: the wgmma kernel, TMA traits
    return Family(
        name=name, label=f"the paged {'tree ' if tree else ''}prefill family ({'wgmma' if wgmma else 'mma.sync'})",
        header=f"attention_prefill_{'wgmma' if wgmma else 'mma'}.cuh", params=PAGED_FWD_PARAMS,
        tables={"dense": tables},
        template_id=lambda spec, t: (f"pyattn::{fn}<{base.traits(spec, t)}, {score_mods(spec)}, "
                                     f"{str(tree).lower()}>"),
        dtypes=("f16", "bf16"), mods=("softcap", "alibi"), alignment=PREFILL_ALIGNMENT, traits=base.traits,
        smem_bytes=base.smem_bytes, takes=_TAKES if wgmma else "", check=check if wgmma else None,
    )


# The dense kernel's rows. At d = 128 the dense row itself, measured on the paged kernel: with
# 32-bit slot-row loads and page lookups a tile ahead (wgmma_paged_load.cuh) the producer keeps
# up with 128-key tiles. dev/probe_serving.py (H200, 4096-token chunk over 16384 cached, pages of
# 16, bf16 Hq32 Hkv8; dense 2.195 ms): 128 x 128 x 3 stages 2.152 ms, 128 x 64 x 4 2.199, x 6
# 2.225, 128 x 128 x 2 2.678. (The old loader needed 128 x 64 x 4: 2.643 against 3.258.)
_PREFILL_SM90 = tuple(
    r._replace(reason="paged, the dense row: the 4k chunk over 16k 2.152 ms against dense 2.195 and 2.199 with "
                      "64-key tiles x 4 stages (dev/probe_serving.py, H200)")
    if r.max_head_dim == 128 else r for r in ATTN_FWD_WGMMA.tables["dense"]["sm_90a"])
ATTN_PREFILL_WGMMA = _family("attn_prefill_wgmma", ATTN_FWD_WGMMA, {a: _PREFILL_SM90 for a in WGMMA_ARCHS}, False,
                             True)
ATTN_PREFILL_MMA = _family("attn_prefill_mma", ATTN_FWD_MMA, ATTN_FWD_MMA.tables["dense"], False, False)
ATTN_TREE_WGMMA = _family("attn_tree_wgmma", ATTN_FWD_WGMMA, {a: _TREE_SM90 for a in WGMMA_ARCHS}, True, True)
ATTN_TREE_MMA = _family("attn_tree_mma", ATTN_FWD_MMA, every_arch(_TREE_MMA), True, False)

# attn_prefill_tma: the wgmma kernel on TMA traits (the producer warpgroup issues page boxes), only
# where a row names the bucket exactly. Measured on the 4k chunk over 16k (pages of 16, bf16, Hq 32,
# Hkv 8; dev/probe_serving.py --dims, H200) against attn_prefill_wgmma's cp.async row in one run.
_PREFILL_TMA_SM90 = (
    WgmmaTile(64, 128, 2, 3, True, 1, "1.384 ms against the cp.async row's 1.597 (dense 1.225); 4 stages 1.389, "
                                      "64-key tiles x 4 1.645", ws=True),
    WgmmaTile(128, 128, 2, 3, True, 1, "the cp.async row's tile: 1.784-1.801 ms against 2.212-2.233 (dense "
                                       "1.899-1.944; by ncu both 1.77); 64-key tiles x 4 / 6 2.159-2.196 / "
                                       "2.132-2.151", ws=True),
    WgmmaTile(256, 64, 2, 2, False, 1, "3.902 ms against the cp.async row's 4.804 (dense 3.662); no overlap: a "
                                       "third stage does not fit", ws=True),
)


def _tma_check(spec) -> None:
    _wgmma_check(spec)
    buckets = tuple(r.max_head_dim for r in table_rows(ATTN_PREFILL_TMA, "dense", spec.arch))
    if spec.head_dim not in buckets:
        raise ValueError(f"head_dim: attn_prefill_tma has rows for buckets {buckets} on {spec.arch}, got {spec}")


ATTN_PREFILL_TMA = _family("attn_prefill_tma", ATTN_FWD_WGMMA, {a: _PREFILL_TMA_SM90 for a in WGMMA_ARCHS}, False,
                           True, check=_tma_check)


def prefill_tma_serves(arch: str, head_dim: int, page_size: int, tree: bool) -> bool:
    """Whether attn_prefill_tma runs a paged prefill at head-dim bucket ``head_dim`` (a multiple of
    64) on ``arch`` over pages of ``page_size`` slots: not a tree, pages that
    :func:`~.base.tma_page_boxes` takes, and a row of its table names exactly that bucket."""
    return (not tree and tma_page_boxes(page_size) and arch in WGMMA_ARCHS
            and any(r.max_head_dim == head_dim for r in table_rows(ATTN_PREFILL_TMA, "dense", arch)))

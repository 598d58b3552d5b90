"""attn_decode: attention of a few query rows over a paged KV cache (16-bit or 8-bit pools).

16 * q_tiles query rows per block (a GQA group x q_len); the warps split each stage's keys and
merge their partial outputs through shared memory at the end.
"""

from __future__ import annotations

from typing import NamedTuple

from ..params import DECODE_PARAMS
from . import tables
from .base import (CTYPES, KV_HEAD_DIM_BUCKETS, KV_KINDS, PAGED_ALIGNMENT, WGMMA_ARCHS, Family, TileConfig, entry_name,
                   tma_page_boxes)

__all__ = ["DecodeTile", "KV_HEAD_DIM_BUCKETS", "ATTN_DECODE", "ATTN_DECODE_TMA", "ATTN_DECODE_SWAP", "decode_row",
           "tma_decode_serves", "tma_gathers", "PAGED_ALIGNMENT"]


class DecodeTile(NamedTuple):
    """A tile-table row of the decode kernel (see ``FixedTile`` for the common fields)."""

    max_head_dim: int
    keys_per_warp: int
    warps: int
    stages: int  # K/V ring depth
    max_q_tiles: int  # the most m16 row tiles one block takes
    min_blocks: int
    reason: str
    # sm_90a: this many more warps, producers filling the ring by TMA (attention_decode_tma.cuh),
    # tiles dealt round-robin; ``warps`` counts the consumers, the config's warps both.
    producer: int = 0
    # attn_decode_tma over 8-bit caches with per-channel key scales: (keys per warp, stages) of
    # that variant, whose segment records add to the ring and whose scoring holds more
    # registers; () takes the row's keys at no more than 2 stages (3, fitted to 2 blocks an SM by
    # dropping the unused K-scale ring, ran 9-13% slower: BENCHMARKS.md, thirty-second session).
    channel: tuple = ()
    # attn_decode_tma / attn_decode_swap on pages TMA boxes do not take (KernelSpec.gather; 8-bit
    # caches with per-token scales, and 16-bit ones on attn_decode_swap): (keys per warp, stages,
    # producer warps) of that variant, whose producers gather every row by cp.async and so want more
    # warps than the page boxes' one.
    gather: tuple = ()

    def config(self) -> TileConfig:
        """The tile at one row tile (``KernelSpec.tiles`` sets the spec's ``q_tiles``)."""
        return TileConfig(16, self.keys_per_warp * self.warps, self.warps + self.producer, self.reason,
                          self.min_blocks, 1, self.stages, ws=self.producer)


# 16-bit caches: smem = max(ring, warp merge) with ring = (16 q_tiles + 2 stages block_n) (d + 8) * 2
# and merge = warps * 16 q_tiles * (d + 10) * 4.
_227K = (  # sm_90a / sm_100a
    DecodeTile(128, 16, 4, 2, 2, 3, "pages below 16 slots (the TMA kernel takes the rest) and SparQ's one-slot "
                                    "gathers, H200, bf16 Hq32 Hkv8 (dev/probe_small_pages.py --rows): page 1 B8 x "
                                    "32k / B1 x 32k / B64 x 4k 266 / 48.3 / 281 us against 325 / 55.8 / 324 for "
                                    "2 warps x 32 keys x 3 stages at 2 blocks/SM (the row from when this kernel "
                                    "also took page 16: 3.50-3.60 TB/s there); page 8 272 / 47.8 / 278 against "
                                    "313 / 54.4 / 312; q_len 4 alike; 3 stages at 2 blocks/SM 309 / 50.3 / 302 at "
                                    "page 1; SparQ's decode stage 52 us against 59 (dev/profile_sparq.py)"),
    DecodeTile(256, 16, 4, 2, 1, 1, "143 KiB at d=256; one row tile (the accumulator is 128 registers); "
                                    "unmeasured"),
)
_163K = (  # sm_80
    DecodeTile(128, 16, 4, 2, 2, 2, "74 KiB at d=128: 2 blocks in sm_80's 164 KiB; unmeasured (no sm_80 machine "
                                    "here)"),
    DecodeTile(256, 16, 4, 2, 1, 1, "143 KiB at d=256; unmeasured"),
)
_99K = (  # sm_86 / sm_89
    DecodeTile(128, 16, 4, 2, 2, 1, "74 KiB at d=128, under 99 KiB; unmeasured"),
    DecodeTile(256, 16, 2, 2, 1, 1, "71 KiB at d=256 with 2 warps; unmeasured"),
)
# 8-bit caches (kv = "int8" / "fp8e4m3"): ring = (16 q_tiles (d + 8) * 2) + stages * block_n * 2 (d + 4)
# (codes and scales); head-dim buckets 64 / 128 / 256. More warps than the 16-bit kernel: the
# code -> fp16/bf16 conversion adds ~3 instructions per element, so more warps hide latency.
_Q8_227K = (  # sm_90a / sm_100a
    DecodeTile(128, 32, 4, 2, 1, 2, "H200, bf16 q, Hq32 Hkv8, B8 L32k (scripts/tune_decode.py --kv): fp8 190 us "
                                    "(2.91 TB/s of codes + scales), int8 198; 3 stages 199 / 205; 3 blocks/SM "
                                    "(170 regs) 185 at B8 L32k but 197 at B64 L4k; 16 keys x 4 warps 201-214; 2 or "
                                    "8 warps 231-249 (70 KiB)"),
    DecodeTile(256, 16, 4, 3, 1, 1, "108 KiB at d=256; unmeasured"),
)
_Q8_163K = (  # sm_80
    DecodeTile(128, 16, 4, 4, 2, 2, "72 KiB at d=128: 2 blocks in 164 KiB; unmeasured"),
    DecodeTile(256, 16, 4, 3, 1, 1, "108 KiB at d=256; unmeasured"),
)
_Q8_99K = (  # sm_86 / sm_89
    DecodeTile(128, 16, 4, 4, 2, 1, "72 KiB at d=128, under 99 KiB; unmeasured"),
    DecodeTile(256, 16, 4, 2, 1, 1, "75 KiB at d=256 with 2 stages; unmeasured"),
)


# attn_decode_tma (sm_90a, 16-bit caches): the same blocks plus producer warps filling the ring by
# TMA, page boxes of min(page size, block_n) slots; ring = 16 q_tiles (d + 8) * 2 + 1024 + 2 stages
# block_n d * 2 (unpadded, swizzled).
_TMA_227K = (
    DecodeTile(128, 16, 4, 3, 2, 2, "H200, bf16 Hq32 Hkv8 page 16 (dev/probe_decode_bw.py): B64 x 32k 1974 us (4.35 "
                                    "TB/s, 0.94x cuDNN), B8 x 32k 263, B8 x 4k 43.5, B1 x 32k 46.2, B1 x 4k 16.0; "
                                    "32 keys x 2 warps 1978 / 266 / 46.6 / 51.1 / 19.3; 4 stages (1 block/SM) "
                                    "1992 / 275 / 43.9 / 44.7 / 14.0; 8 warps x 16 keys, 2 stages 1971 / 273 / 46.0 "
                                    "/ 44.8 / 17.3; the cp.async kernel 2213 / 277 / 48.4 / 54.0 (another machine). "
                                    "Two producer warps (dev/probe_q8_rows.py --kind bf16, swapped roles): B8 x 32k "
                                    "255.6 -> 252.2 us, B64 x 32k 1928 -> 1919, B1 x 32k level; with a page chunk in "
                                    "one box (dev/probe_decode_qtiles.py --producers 1,2): B8 x 32k 250.9 -> 249.5, "
                                    "B64 x 4k 244.2 -> 243.0, q_len 4 1-2% faster, q_len 8 B64 x 4k 258.1 -> 259.1",
               producer=2),
    DecodeTile(256, 16, 4, 2, 1, 1, "141 KiB at d=256; unmeasured", producer=1),
)
# attn_decode_swap on 16-bit caches: the rows above, and their gathered rows for pages TMA boxes do
# not take (KernelSpec.gather; attn_decode_tma's m16 rows keep the cp.async kernel there: level with
# it, bf16 B8 x 32k q_len 4 page 1 269 / 267 us).
_SWAP16_227K = (
    _TMA_227K[0]._replace(gather=(16, 6, 6), reason=(
        "attn_decode_tma's row. Gathered rows (bf16, q_len 1 at GQA 4, page 1, B8 x 32k / B1 x 32k / B64 x 4k, "
        "dev/probe_small_pages.py's shapes): d 128 6 producers x 16 keys x 6 stages (1 block/SM) 241.2 / 40.4 / "
        "254.6 us (page 8 241.2 at B8) against attn_decode's cp.async rows 260.7 / 44.4 / 281.2; 3 x 16 x 3 (2 "
        "blocks/SM) 262.6 / 51.8 / 257.1, 4 x 16 x 4 306 / 45.6 / 307, 3 x 32 x 3 314 / 48 / 326; d 64 (16, 6, 6) "
        "131.8 / 25.9 / 131.8 against 143.1 / 28.5 / 141.2, (16, 4, 4) 127.7 / 28.3 / 127.6; SparQ's chosen-key "
        "decode (dev/profile_sparq.py) B8 x 32k 49.2 -> 48.1, B4 x 128k 83.1 -> 78.3")),
    _TMA_227K[1]._replace(gather=(16, 3, 3), reason=(
        "141 KiB at d=256. Gathered rows (bf16, q_len 1, page 1, B8 x 32k / B1 x 32k / B64 x 4k): 3 producers x 16 "
        "keys x 3 stages 628.6 / 87.8 / 648.2 us against the cp.async rows 662.7 / 90.7 / 650.1; (16, 2, 2) 829 / "
        "111 / 835")),
)
# attn_decode_tma on 8-bit caches: boxes of 128 columns (d = 128 / 256); ring = 16 q_tiles (d + 8) * 2
# + 1024 + stages block_n 2 (d + 4) (codes, then the fp32 scales; per-channel keys add the records).
_Q8_TMA_227K = (
    DecodeTile(128, 32, 4, 3, 1, 2, "H200, bf16 q, Hq32 Hkv8 page 16 (dev/tune_decode.py --kv): int8 B8 x 32k 154 us, "
                                    "B64 x 32k 1084 (4.09 TB/s of codes + scales), B1 x 32k 35.7; 2 stages 157 / "
                                    "1132 / 37.0; 16 keys x 4 warps x 4 stages 170 / 1248; 32 x 2 x 4: 212 / 1567; "
                                    "16 x 8 x 2: 253 / 1860; 3 blocks/SM (spills) 204 / 1601; the cp.async kernel "
                                    "237 / 1737 / 47.0 (fp8 alike, 2-6% faster); two producer warps: int8 B64 x 32k "
                                    "1002 -> 1033 us, B8 137 -> 141 (dev/probe_q8_rows.py). Gathered rows (page 1, "
                                    "int8, q_len 4 = m16 rows, B8 x 32k / B1 x 32k, dev/probe_small_pages.py): 2 "
                                    "producers x 32 keys x 3 stages 185 / 44 us; 1 producer 284 / 55, 3 (156 bytes of "
                                    "spill) 223 / 50, 4 x 16 x 4 211 / 47, 4 x 32 x 4 (1 block/SM) 204 / 40.5",
               producer=1, gather=(32, 3, 2)),
    DecodeTile(256, 16, 4, 2, 1, 1, "76 KiB at d=256; unmeasured", producer=1, gather=(16, 2, 2)),
)
# attn_decode_swap on 8-bit caches: the rows above but for their gathered rows (up to 8 query rows).
_Q8_SWAP_227K = (
    _Q8_TMA_227K[0]._replace(gather=(16, 4, 4), reason=(
        "attn_decode_tma's row. Gathered rows (int8, q_len 1 at GQA 4, dev/probe_small_pages.py, page 1: B8 x 32k / "
        "B1 x 32k / B64 x 4k): 4 producers x 16 keys x 4 stages 153.9 / 29.8 / 157.8 us (page 8 alike); 1 producer "
        "x 32 x 3 264.8 / 41.5 / 267.8, 2: 175.8 / 31.7 / 178.8, 3: 162.1 / 31.3 / 164.1, 4 x 32 x 4 (1 block/SM) "
        "185.0 / 32.7 / 198.2; attn_decode's cp.async rows 228 / 41.6 / 232")),
    _Q8_TMA_227K[1]._replace(gather=(16, 4, 4), reason="76 KiB at d=256 (gathered: 138 KiB); unmeasured"),
)


def _by_smem(k227: tuple, k163: tuple, k99: tuple) -> dict:
    """Per-arch table by shared memory per block: 227 KiB (sm_90a / sm_100a), 163 (sm_80), 99 (sm_86 / sm_89)."""
    return {"sm_80": k163, "sm_86": k99, "sm_89": k99, "sm_90a": k227, "sm_100a": k227}


def _kv_table(kv: str, sparse: int, mask: str = "none") -> str:
    return "kv8" if kv else "dense"


def _row(record, arch: str, head_dim: int, kv: str) -> DecodeTile:
    """``record``'s table row serving ``head_dim`` (a bucket) on ``arch`` for a ``kv`` cache."""
    return tables.row(record, _kv_table(kv, 0), arch, head_dim)


def decode_row(arch: str, head_dim: int, kv: str = "", tma: bool = False) -> DecodeTile:
    """The decode table row serving ``head_dim`` (a bucket) on ``arch``; ``kv``: the cache's kind;
    ``tma``: attn_decode_tma's."""
    return _row(ATTN_DECODE_TMA if tma else ATTN_DECODE, arch, head_dim, kv)


def tma_decode_serves(arch: str, head_dim: int, page_size: int, kv: str = "", key_channel: bool = False,
                      rows: int = 1) -> bool:
    """Whether attn_decode_tma (or, up to 8 query ``rows`` a kv head, attn_decode_swap) takes a
    decode: sm_90a; a 16-bit cache at a head-dim bucket of whole 64-column boxes (128 bytes), or an
    8-bit one at a bucket of whole 128-column boxes (the 64 bucket keeps the cp.async kernel),
    per-token or per-channel key scales alike, on pages that :func:`~.base.tma_page_boxes` takes.
    On other pages, per-token scales, where that family's row has a gathered variant
    (``DecodeTile.gather``: its producer warps gather the rows by cp.async, :func:`tma_gathers`)."""
    if arch not in WGMMA_ARCHS or head_dim % (128 if kv else 64):
        return False
    if tma_page_boxes(page_size):
        return True
    family = ATTN_DECODE_SWAP if rows <= 8 else ATTN_DECODE_TMA
    return not key_channel and bool(_row(family, arch, head_dim, kv).gather)


def tma_gathers(page_size: int) -> bool:
    """Whether the TMA decodes' producers, where they take a decode (:func:`tma_decode_serves`),
    gather its rows by cp.async instead of loading page boxes by TMA (no tensor maps;
    ``KernelSpec.gather``): pages :func:`~.base.tma_page_boxes` refuses (``decode_gather16`` in
    kernels_src/attention_decode_tma.cuh, ``decode_gather_q8`` in attention_decode_q8_tma.cuh). On an
    H200 at pages of 1 and 8 slots the 8-bit cp.async kernel, whose warps copy their own rows, read
    2.4 TB/s, the gathered rows 3.6; 16-bit, with swapped roles, 4.1 and 4.5 (sixty-second session)."""
    return not tma_page_boxes(page_size)


# Shared memory an SM has for blocks (each block also reserves 1 KiB), per arch.
_SM_SHARED = {"sm_80": 164 << 10, "sm_86": 100 << 10, "sm_89": 100 << 10, "sm_90a": 228 << 10, "sm_100a": 228 << 10}


def _spec_tiles(spec, t: TileConfig) -> TileConfig:
    """The row at the spec's row tiles (attn_decode_swap: one block of 8 rows), its launch bounds
    asking for no more blocks an SM than shared memory lets in: more would only cap registers
    (sm_90a, two row tiles: 3 blocks asked, 2 fit, 92 bytes of spill at 168 registers)."""
    t = t._replace(block_m=8 if spec.family == "attn_decode_swap" else 16 * spec.q_tiles, m_tiles=spec.q_tiles)
    fit = _SM_SHARED.get(spec.arch, 0) // (_smem_bytes(spec, t) + 1024)
    return t._replace(min_blocks=max(1, min(t.min_blocks, fit))) if fit else t


def _tma_spec_tiles(spec, t: TileConfig) -> TileConfig:
    """attn_decode_tma's row. Two row tiles (17-32 query rows a KV head: speculative q_len, GQA
    groups above 16) launch for one block an SM: 2 blocks of 5 warps cap registers at 168, where
    their accumulators spilled 212 bytes (H200, bf16 B8 x 32k with 32 rows: 378 us at 2 blocks, 279
    at 1; one row tile a block, reading K/V twice: 278; `dev/probe_decode_qtiles.py`). Per-channel
    key scales take the row's ``channel`` (keys per warp, stages), by default its keys at no more
    than 2 stages (their page records add (d * 2 + 144) * block_n / 16 bytes a stage: 3 stages at
    d = 128, 116 KiB, would leave one block an SM). That ring is set before ``_spec_tiles`` asks
    how many blocks fit: asked of the per-token row's 3 stages plus the records, it launched the
    per-channel kernel bounded for one block (no register cap), which then ran one block an SM
    with half the splits, 1.46x slower at B8 x 32k (BENCHMARKS.md, thirty-first session)."""
    row = _row(spec.record, spec.arch, spec.head_dim, spec.kv) if spec.key_channel or spec.gather else None
    if spec.key_channel:  # (the family's own row)
        kpw, stages = row.channel or (row.keys_per_warp, min(row.stages, 2))
        t = t._replace(block_n=kpw * row.warps, stages=stages)
    if spec.gather:  # the row's gathered variant (its own keys, stages and producer warps)
        kpw, stages, producers = row.gather
        t = t._replace(block_n=kpw * row.warps, stages=stages, warps=row.warps + producers, ws=producers)
    t = _spec_tiles(spec, t)
    return t._replace(min_blocks=1) if spec.q_tiles > 1 else t


def _traits(spec, t) -> str:
    kv = KV_KINDS[spec.kv] + (2 if spec.key_channel else 0)  # AttnDecodeTraits: 3 / 4 = per-channel key scales
    consumers = t.warps - t.ws  # the producer warps (ws) compute nothing
    swap = int(spec.family == "attn_decode_swap")  # SWAP_: 8 rows on the MMAs' N side
    tail = f", {swap}, 1" if spec.gather else f", {swap}" if swap else ""  # GATHER_: rows by cp.async
    return (f"pyattn::AttnDecodeTraits<{CTYPES[spec.dtype]}, {spec.head_dim}, {t.block_n // consumers}, {consumers}, "
            f"{t.m_tiles}, {t.stages}, {kv}, {int(t.ws)}{tail}>")


def _smem_bytes(spec, t) -> int:
    """max(K/V ring, warp merge) as AttnDecodeTraits::kSmemBytes (the kernel also traps on a mismatch)."""
    d = spec.head_dim
    ring = (t.block_m + 2 * t.stages * t.block_n) * (d + 8) * 2
    if t.ws:  # TMA ring: padded Q, 1024 bytes of alignment slack, unpadded swizzled K and V boxes
        ring = t.block_m * (d + 8) * 2 + 1024 + 2 * t.stages * t.block_n * d * 2
    if spec.kv:  # Q, (with TMA the slack,) then 8-bit K and V codes and their fp32 scales per stage
        ring = t.block_m * (d + 8) * 2 + (1024 if t.ws else 0) + t.stages * t.block_n * 2 * (d + 4)
    if spec.key_channel:  # and each 16-key segment's page record: 16 bytes, fp16 r[d], 16 slots x 4 kept fp16
        ring += t.stages * (t.block_n // 16) * (d * 2 + 144)
    acc_stride = d + ((2 if spec.kv else 4) if spec.family == "attn_decode_swap" else 8)  # Traits' kAccStride
    return max(ring, (t.warps - t.ws) * t.block_m * (acc_stride + 2) * 4)


def _check(spec) -> None:
    if spec.family != "attn_decode" and spec.head_dim % (128 if spec.kv else 64):
        raise ValueError(f"{spec.family}: 16-bit caches at head-dim buckets of whole 64-column boxes, 8-bit ones "
                         f"at buckets of 128 columns, got kv={spec.kv!r}, head_dim {spec.head_dim}")
    if spec.kv and spec.head_dim not in KV_HEAD_DIM_BUCKETS:
        raise ValueError(f"head_dim: 8-bit caches decode at head-dim buckets {KV_HEAD_DIM_BUCKETS}, "
                         f"got {spec.head_dim}")
    if spec.gather and spec.family != "attn_decode" and not spec.key_channel:  # (else check_spec's message)
        if not _row(spec.record, spec.arch, spec.head_dim, spec.kv).gather:
            raise ValueError(f"gather: {spec.family}'s row at head_dim {spec.head_dim} on {spec.arch} has no gathered "
                             f"variant for a {'8' if spec.kv else '16'}-bit cache (DecodeTile.gather)")
    most = 1 if spec.family == "attn_decode_swap" else decode_row(spec.arch, spec.head_dim, spec.kv,
                                                                      spec.family == "attn_decode_tma").max_q_tiles
    if not 1 <= spec.q_tiles <= most:
        raise ValueError(f"q_tiles: attn_decode at head_dim {spec.head_dim} on {spec.arch} takes 1 to {most}, "
                         f"got {spec.q_tiles}")


ATTN_DECODE = Family(
    name="attn_decode", label="attn_decode", header="attention_decode.cuh", params=DECODE_PARAMS,
    tables={"dense": _by_smem(_227K, _163K, _99K), "kv8": _by_smem(_Q8_227K, _Q8_163K, _Q8_99K)},
    template_id=lambda spec, t: (f"pyattn::attn_decode<{_traits(spec, t)}, {str(bool(spec.softcap)).lower()}, "
                                 f"{str(spec.alibi).lower()}>"),
    dtypes=("f16", "bf16"), mods=("softcap", "alibi"), alignment=PAGED_ALIGNMENT, traits=_traits,
    smem_bytes=_smem_bytes, table_for=_kv_table, spec_tiles=_spec_tiles,
    entry_name=lambda spec, t: entry_name(spec, t, stages=True), check=_check, kv=True, q_tiles=True,
    key_channel=True,
)


ATTN_DECODE_TMA = Family(
    name="attn_decode_tma", label="the TMA-fed decode", header="attention_decode.cuh", params=DECODE_PARAMS,
    tables={"dense": {arch: _TMA_227K for arch in WGMMA_ARCHS}, "kv8": {arch: _Q8_TMA_227K for arch in WGMMA_ARCHS}},
    template_id=ATTN_DECODE.template_id, dtypes=("f16", "bf16"), mods=("softcap", "alibi"), alignment=PAGED_ALIGNMENT,
    traits=_traits, smem_bytes=_smem_bytes, table_for=_kv_table, spec_tiles=_tma_spec_tiles,
    entry_name=lambda spec, t: entry_name(spec, t, stages=True), check=_check, kv=True, q_tiles=True,
    key_channel=True, gather=True,
)


# The TMA-fed decode with the MMA roles swapped (kernels_src/decode_swap.cuh): blocks of at most 8
# query rows (a GQA group of 4 or 8 at q_len 1) take the keys on the MMAs' M side and the rows on
# N = 8, where attn_decode_tma's m16 row tile left half or more of its MMAs, accumulator and
# softmax as padding. Its producer warp, ring and rows are attn_decode_tma's, 16- and 8-bit, but for
# their gathered variants (_SWAP16_227K, _Q8_SWAP_227K).
ATTN_DECODE_SWAP = Family(
    name="attn_decode_swap", label="the TMA-fed decode on 8-row blocks", header="attention_decode.cuh",
    params=DECODE_PARAMS, tables={"dense": {arch: _SWAP16_227K for arch in WGMMA_ARCHS},
                                  "kv8": {arch: _Q8_SWAP_227K for arch in WGMMA_ARCHS}},
    template_id=ATTN_DECODE.template_id, dtypes=("f16", "bf16"), mods=("softcap", "alibi"), alignment=PAGED_ALIGNMENT,
    traits=_traits, smem_bytes=_smem_bytes, table_for=_kv_table, spec_tiles=_tma_spec_tiles,
    entry_name=lambda spec, t: entry_name(spec, t, stages=True), check=_check, kv=True, q_tiles=True,
    key_channel=True, gather=True,
)

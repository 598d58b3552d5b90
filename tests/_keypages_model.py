"""Models of per-channel key scales for the tests (``key_scales="channel"`` caches).

* :func:`run_jobs`: the ``kv_key_pages`` kernel in NumPy, executing a ``KeyStager`` plan on NumPy
  pools (for CPU tests of the planner, which has no GPU to run on).
* :class:`Pages`: what every page must hold, derived from the cache operations alone (not from the
  planner's jobs): the page's slot values as the rule in ``pyattn.paged.keypages`` defines them
  (exact keys; a reopened page's kept keys as dequantized from its codes and kept channels then)
  and how many slots its last write filled. ``check`` compares pools with ``quantize_page`` of those
  values, bit for bit.

Pools are laid out as ``PagedKVCache.read_key_scales`` returns them: codes (P, ps, H, D), scale
(P, H), chan (P, H, D), idx (P, H, K), kept (P, ps, H, K).
"""

from __future__ import annotations

import numpy as np

from pyattn.quant import KEPT_CHANNELS as K, quantize_page


def effective(page_scale, chan) -> np.ndarray:
    """The kernel's float32 ``S * r`` per channel: shape page_scale.shape + (D,)."""
    return (np.asarray(page_scale, np.float32)[..., None] * np.asarray(chan).astype(np.float32)).astype(np.float32)


def dequant_slots(codes, page_scale, chan, idx, kept) -> np.ndarray:
    """float32 values of one page's slots (n, H, D) as the kernel dequantizes a reopened page: codes
    times S * r, kept channels (idx (H, K), kept (n, H, K)) their value times S."""
    out = (codes.astype(np.float32) * effective(page_scale, chan)[None]).astype(np.float32)
    s = np.asarray(page_scale, np.float32)
    for h in range(out.shape[1]):
        out[:, h, idx[h].astype(np.int64)] = (kept[:, h].astype(np.float32) * s[h]).astype(np.float32)
    return out


class Pools:
    """NumPy stand-ins for a per-channel cache's key pools and staging copy."""

    def __init__(self, num_pages, ps, H, D, kind):
        from pyattn.quant import code_dtype

        self.codes = np.zeros((num_pages, ps, H, D), code_dtype(kind))
        self.scale = np.zeros((num_pages, H), np.float32)
        self.chan = np.zeros((num_pages, H, D), np.float16)
        self.idx = np.zeros((num_pages, H, K), np.uint8)
        self.kept = np.zeros((num_pages, ps, H, K), np.float16)
        self.stage = np.zeros((0, ps, H, D), np.float32)
        self.kind, self.ps = kind, ps


def run_jobs(work, new_k, pools: Pools) -> None:
    """Execute ``work`` (a ``KeyJobs``) on ``pools`` as ``kv_key_pages`` does; ``new_k`` (total, H, D)."""
    ps = pools.ps
    if work.capacity > len(pools.stage):
        grown = np.zeros((work.capacity,) + pools.stage.shape[1:], np.float32)
        grown[: len(pools.stage)] = pools.stage
        pools.stage = grown
    H, D = pools.codes.shape[2:]
    results = []
    for page, n, off, slot, src_page in work.jobs.tolist():
        vals = np.empty((n, H, D), np.float32)
        for s, code in enumerate(work.src[off: off + n].tolist()):
            if code >= 0:
                vals[s] = np.asarray(new_k[code]).astype(np.float32)
            elif -1 - code < work.stage_rows:
                row = -1 - code
                vals[s] = pools.stage[row // ps, row % ps]
            else:
                sl = -1 - code - work.stage_rows
                vals[s] = dequant_slots(pools.codes[src_page, sl][None], pools.scale[src_page], pools.chan[src_page],
                                        pools.idx[src_page], pools.kept[src_page, sl][None])[0]
        results.append((page, n, slot, vals))
    for page, n, slot, vals in results:  # jobs are independent: read everything, then write
        codes, scale, chan, idx, kept = quantize_page(vals.transpose(1, 0, 2), pools.kind)  # per kv head: (H, n, D)
        pools.codes[page, :n] = codes.transpose(1, 0, 2)
        pools.scale[page], pools.chan[page], pools.idx[page] = scale, chan, idx
        pools.kept[page, :n] = kept.transpose(1, 0, 2)
        if slot >= 0:
            pools.stage[slot, :n] = vals


class Pages:
    """The values each page must have been quantized from, following cache operations."""

    def __init__(self, ps, H, D, kind):
        self.ps, self.H, self.D, self.kind = ps, H, D, kind
        self.values: dict = {}  # page -> float32 (ps, H, D)
        self.fill: dict = {}  # page -> slots its last write filled

    def append(self, length: int, old_page: int, dst, new_k, read_page) -> list:
        """One sequence's append of ``new_k`` (c, H, D) at slots ``dst``; the sequence had ``length``
        tokens, its last page ``old_page``. ``read_page(p)`` -> (codes, scale, chan, idx, kept) of
        page p now (for a reopened page). Returns the pages written."""
        ps = self.ps
        pages = np.asarray(dst) // ps
        fill = length % ps
        written = []
        for k, p in enumerate(dict.fromkeys(pages.tolist())):
            idx = np.flatnonzero(pages == p)
            vals = np.zeros((ps, self.H, self.D), np.float32)
            nb = fill if k == 0 else 0
            if nb:
                src = self.values[old_page]
                if self.fill[old_page] < ps:  # still open when last written: kept exact
                    vals[:nb] = src[:nb]
                else:  # reopened: dequantized from its codes
                    codes, scale, chan, kidx, kept = read_page(old_page)
                    vals[:nb] = dequant_slots(codes[:nb], scale, chan, kidx, kept[:nb])
            vals[nb: nb + len(idx)] = np.asarray(new_k[idx]).astype(np.float32)
            self.values[p], self.fill[p] = vals, nb + len(idx)
            written.append(p)
        return written

    def check(self, pages, codes, scale, chan, idx, kept, stage=None, stage_of=None) -> None:
        """Pools (NumPy, laid out as the module docstring says) against the rule, bitwise."""
        for p in pages:
            n = self.fill[p]
            want = quantize_page(self.values[p][:n].transpose(1, 0, 2), self.kind)
            got = (codes[p, :n].transpose(1, 0, 2), scale[p], chan[p], idx[p], kept[p, :n].transpose(1, 0, 2))
            for name, g, w in zip(("codes", "page scale", "channel scales", "kept channels", "kept values"), got, want):
                gb, wb = np.ascontiguousarray(g).view(np.uint8), np.ascontiguousarray(w).view(np.uint8)
                assert np.array_equal(gb, wb), f"page {p} ({n} slots): {name} differ from quantize_page"
            if stage is not None and n < self.ps:
                row = stage[stage_of[p], :n]
                assert np.array_equal(row.view(np.uint32), self.values[p][:n].view(np.uint32)), \
                    f"page {p}: staging copy differs from the page's keys"

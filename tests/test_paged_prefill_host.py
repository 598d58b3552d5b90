"""``pyattn.paged_prefill`` on a CPU through the fake driver: the launch it makes over a caller's pools
and page tables is :func:`pyattn.prefill`'s launch over a cache holding the same pages, field for
field, except the table and output addresses; device tables are read in place (after their copy-back
for the range check, which comes after every argument's metadata check); the ``hnd`` layout reaches
the kernel as its strides. With ``max_seqlen_k`` (and ``max_seqlen_q``) nothing is read on the host,
so a CUDA graph captures the call, and the kernel gets the bounds it clamps to. What the kernel
computes is ``test_gpu_paged_prefill.py``.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

import pyattn
from _host_path_helpers import _da  # (fixtures gpu, cache: conftest.py)
from pyattn.kernels.params import PAGED_FWD_PARAMS
from pyattn.ops import _prefill, paged_prefill
from pyattn.runtime.stream import Stream

BF16 = np.dtype(ml_dtypes.bfloat16)
# Per-call addresses: the tables, the offsets, the outputs and the split partials.
_PER_CALL = {"q", "out", "lse", "cu_seqlens_q", "page_indices", "page_indptr", "kv_len", "o_part", "lse_part",
             "table_stride"}


@pytest.fixture
def launches(monkeypatch) -> list:
    """(kernel entry, grid, PagedFwdParams by field name) of each prefill launch."""
    seen, real, names = [], _prefill.launch, [name for name, _ in PAGED_FWD_PARAMS.fields]

    def spy(kernel, grid, block, smem, s, packed):
        if len(packed) == PAGED_FWD_PARAMS.size:
            seen.append((kernel, grid, dict(zip(names, struct.unpack_from(PAGED_FWD_PARAMS.format, packed)))))
        return real(kernel, grid, block, smem, s, packed)

    monkeypatch.setattr(_prefill, "launch", spy)
    return seen


@pytest.fixture
def fetched(monkeypatch) -> dict:
    """Device table values the op copies back, served from this dict by argument name (every name
    fetched is recorded under "names")."""
    values = {"names": []}

    def fetch(a):
        values["names"].append(a.name)
        return values[a.name]

    monkeypatch.setattr(paged_prefill, "fetch_values", fetch)
    return values


def _block_table(cache, ids, width=20):
    table = np.full((len(ids), width), -7, np.int32)  # padding past a sequence's pages: garbage
    for b, i in enumerate(ids):
        pages = cache.book.pages(i)
        table[b, :len(pages)] = pages
    return table


@pytest.mark.parametrize("packed", [False, True])
def test_the_launch_is_prefills_over_the_same_pages(gpu, cache, launches, packed):
    c, ids = cache
    q = _da((64, 4, 64) if packed else (2, 32, 4, 64), BF16)
    cu = np.array([0, 40, 64], np.int32) if packed else None
    lens = c.book.lengths(ids).astype(np.int32)
    pyattn.prefill(q, c, ids, cu, window=(100, 0), return_lse=True)
    pyattn.paged_prefill(q, c.k, c.v, cu, block_table=_block_table(c, ids), seq_lens=lens, window=(100, 0),
                         return_lse=True)
    (k0, g0, want), (k1, g1, got) = launches
    assert k1 is k0 and g1 == g0
    assert {n: v for n, v in got.items() if n not in _PER_CALL} == {n: v for n, v in want.items() if n not in _PER_CALL}
    assert got["q"] == want["q"] and got["k"] == c.k.ptr
    assert (got["page_indptr"], got["table_stride"]) == (0, 20) and want["page_indptr"] != 0
    assert (got["max_q"], got["max_k"], got["total_q"]) == (40 if packed else 32, 256, 64)


def test_device_tables_are_read_in_place(gpu, cache, launches, fetched):
    c, ids = cache
    q = _da((2, 8, 4, 64), BF16)
    lens = c.book.lengths(ids).astype(np.int32)
    table = _block_table(c, ids)
    fetched.update(block_table=table, seq_lens=lens)
    d_table, d_lens = _da((2, 20), np.int32), _da((2,), np.int32)
    pyattn.paged_prefill(q, c.k, c.v, block_table=d_table, seq_lens=d_lens)
    assert fetched["names"] == ["block_table", "seq_lens"]
    p = launches[-1][2]
    assert p["page_indices"] == d_table.ptr and p["kv_len"] == d_lens.ptr
    assert p["page_indptr"] == 0 and p["table_stride"] == 20  # (the device table's row stride)
    n_pages = [len(c.book.pages(i)) for i in ids]
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    fetched.update(indptr=indptr, indices=np.concatenate([c.book.pages(i) for i in ids]).astype(np.int32),
                   last_page_len=np.full(2, 16, np.int32))
    d_ip, d_ix, d_last = _da((3,), np.int32), _da((32,), np.int32), _da((2,), np.int32)
    pyattn.paged_prefill(q, c.k, c.v, indptr=d_ip, indices=d_ix, last_page_len=d_last)
    p = launches[-1][2]
    assert p["page_indices"] == d_ix.ptr and p["page_indptr"] == d_ip.ptr and p["kv_len"] not in (0, d_last.ptr)


@pytest.mark.parametrize("bad, match", [
    (dict(cu=np.zeros(3, np.int64)), "^cu_seqlens_q: expected dtype int32"),
    (dict(lens=(2, 1)), "^seq_lens: expected 1 dim"),
    (dict(table=np.int64), "^block_table: expected dtype int32"),
    (dict(q=np.float16), "^q: expected dtype bfloat16"),
])
def test_metadata_is_checked_before_any_table_is_copied_back(gpu, cache, fetched, bad, match):
    c, _ = cache
    q = _da((64, 4, 64), bad.get("q", BF16))
    cu = bad.get("cu", _da((3,), np.int32))
    with pytest.raises((ValueError, TypeError), match=match):
        pyattn.paged_prefill(q, c.k, c.v, cu, block_table=_da((2, 20), bad.get("table", np.int32)),
                             seq_lens=_da(bad.get("lens", (2,)), np.int32))
    assert fetched["names"] == []


def test_hnd_pools_reach_the_kernel_as_their_strides(gpu, launches):
    kp, vp = _da((8, 2, 16, 64), BF16), _da((8, 2, 16, 64), BF16)  # (pages, heads, slots, dim)
    pyattn.paged_prefill(_da((1, 5, 4, 64), BF16), kp, vp, block_table=np.array([[3, 1]], np.int32),
                         seq_lens=np.array([20], np.int32), layout="hnd")
    p = launches[-1][2]
    assert (p["k_stride_page"], p["k_stride_slot"], p["k_stride_h"]) == (2 * 16 * 64, 64, 16 * 64)
    assert (p["v_stride_page"], p["v_stride_slot"], p["v_stride_h"]) == (2 * 16 * 64, 64, 16 * 64)
    assert p["page_size"] == 16 and p["k"] == kp.ptr and p["v"] == vp.ptr


def test_new_tokens_must_be_counted_by_the_table(gpu):
    kp = _da((8, 16, 2, 64), BF16)
    with pytest.raises(ValueError, match="^cu_seqlens_q: sequence 1 has 9 new tokens but its cache holds 4"):
        pyattn.paged_prefill(_da((12, 4, 64), BF16), kp, kp, np.array([0, 3, 12], np.int32),
                             block_table=np.array([[0], [1]], np.int32), seq_lens=np.array([16, 4], np.int32))


def _unchecked(stream=None):
    """Pools of 8 pages of 16, two sequences' device block table (2, 4), lengths and offsets, and
    packed q of 12 tokens."""
    kp = _da((8, 16, 2, 64), BF16, stream=stream)
    return (_da((12, 4, 64), BF16, stream=stream), kp, kp, _da((3,), np.int32, stream=stream),
            _da((2, 4), np.int32, stream=stream), _da((2,), np.int32, stream=stream))


def test_bounded_device_tables_are_not_read_on_the_host(gpu, launches, fetched):
    q, kp, vp, cu, table, lens = _unchecked()
    pyattn.paged_prefill(q, kp, vp, cu, block_table=table, seq_lens=lens, max_seqlen_q=9, max_seqlen_k=50)
    assert fetched["names"] == []
    _, grid, p = launches[-1]
    assert (p["cu_seqlens_q"], p["page_indices"], p["kv_len"], p["page_indptr"]) == (cu.ptr, table.ptr, lens.ptr, 0)
    assert (p["max_q"], p["max_k"], p["total_q"], p["num_pages"], p["table_stride"]) == (9, 50, 12, 8, 4)
    # One query tile for each sequence (18 rows at most: 9 tokens x row group 2), for each of 2 kv heads.
    assert grid == (2 * 2, 1, 1)
    # A host cu_seqlens_q is read (no copy-back needed); the device tables still are not.
    pyattn.paged_prefill(q, kp, vp, np.array([0, 5, 12], np.int32), block_table=table, seq_lens=lens, max_seqlen_k=64)
    assert fetched["names"] == [] and launches[-1][2]["max_q"] == 7 and launches[-1][2]["max_k"] == 64
    # Bounds past q's rows or the table's pages act as those (an engine's token budget, say).
    pyattn.paged_prefill(q, kp, vp, cu, block_table=table, seq_lens=lens, max_seqlen_q=4096, max_seqlen_k=10**6)
    assert (launches[-1][2]["max_q"], launches[-1][2]["max_k"]) == (12, 64)


@pytest.mark.parametrize("change, match", [
    (dict(max_seqlen_k=None), "^max_seqlen_q: bounds a device cu_seqlens_q read unchecked, which takes max_seqlen_k"),
    (dict(max_seqlen_q=None), "^max_seqlen_q: required with max_seqlen_k and a device cu_seqlens_q"),
    (dict(max_seqlen_k=2**31), "^max_seqlen_k: expected"),
    (dict(max_seqlen_k=-1), "^max_seqlen_k: expected"),
    (dict(max_seqlen_q=-1), "^max_seqlen_q: expected"),
    (dict(host_table=True), "^max_seqlen_k: bounds device tables read unchecked, so block_table"),
    (dict(host_lens=True), "^max_seqlen_k: bounds device lengths read unchecked, so seq_lens"),
    (dict(host_cu=True), "^max_seqlen_q: bounds a device cu_seqlens_q read unchecked; a host one"),
    (dict(csr=True), "^max_seqlen_k: takes the block_table form"),
])
def test_bounds_are_refused_where_they_cannot_apply(gpu, fetched, change, match):
    q, kp, vp, cu, table, lens = _unchecked()
    kw = dict(block_table=table, seq_lens=lens, max_seqlen_q=9, max_seqlen_k=50)
    kw.update({k: v for k, v in change.items() if k.startswith("max_")})
    if change.get("host_table"):
        kw["block_table"] = np.zeros((2, 4), np.int32)
    if change.get("host_lens"):
        kw["seq_lens"] = np.zeros(2, np.int32)
    if change.get("host_cu"):
        cu = np.array([0, 5, 12], np.int32)
    if change.get("csr"):
        del kw["block_table"], kw["seq_lens"]
        kw.update(indptr=_da((3,), np.int32), indices=_da((8,), np.int32), last_page_len=_da((2,), np.int32))
    with pytest.raises(ValueError, match=match):
        pyattn.paged_prefill(q, kp, vp, cu, **kw)
    assert fetched["names"] == []


def test_a_bounded_call_captures_and_a_checked_one_is_refused(gpu, fetched):
    s = Stream(pyattn.get_device())
    q, kp, vp, cu, table, lens = _unchecked(stream=s)
    kw = dict(block_table=table, seq_lens=lens, max_seqlen_q=9, max_seqlen_k=50, stream=s)
    pyattn.paged_prefill(q, kp, vp, cu, **kw)  # loads the kernel and the pools' tensor maps
    cid = gpu.begin_capture(s)
    out = pyattn.paged_prefill(q, kp, vp, cu, **kw)
    assert out.owner.graph == cid
    names = [name for name, _ in gpu.captured]
    assert "cuMemcpyDtoHAsync" not in names and "cuStreamSynchronize" not in names and "cuLaunchKernel" in str(names)
    n = len(gpu.captured)
    fetched.update(block_table=np.zeros((2, 4), np.int32), seq_lens=np.full(2, 12, np.int32),
                   cu_seqlens_q=np.array([0, 5, 12], np.int32))
    with pytest.raises(pyattn.CaptureError):
        pyattn.paged_prefill(q, kp, vp, cu, block_table=table, seq_lens=lens, stream=s)
    assert len(gpu.captured) == n
    del out
    gpu.end_capture(s)
    assert gpu.refused == []


def test_a_repeat_bounded_call_reads_only_addresses(gpu, launches, monkeypatch):
    """An engine's per-layer call: after the first, the validation is reused; new tables, offsets and
    pools are read by address; another bound or layout is another key; addresses are still checked."""
    from _host_path_helpers import _repeat_calls

    validations = []
    real = paged_prefill.check_pools
    monkeypatch.setattr(paged_prefill, "check_pools", lambda *a, **k: validations.append(1) or real(*a, **k))
    q, kp, vp, cu, table, lens = _unchecked()
    call = lambda: pyattn.paged_prefill(q, kp, vp, cu, block_table=table, seq_lens=lens,  # noqa: E731
                                        max_seqlen_q=9, max_seqlen_k=50)
    calls = _repeat_calls(call)
    assert calls == {"cuCtxGetCurrent": 1, "cuStreamIsCapturing": 1, "cuLaunchKernelEx": 1}
    assert len(validations) == 1
    first = launches[-1][2]
    q2, kp2, vp2, cu2, table2, lens2 = _unchecked()
    pyattn.paged_prefill(q2, kp2, vp2, cu2, block_table=table2, seq_lens=lens2, max_seqlen_q=9, max_seqlen_k=50)
    p = launches[-1][2]
    assert len(validations) == 1
    assert (p["q"], p["k"], p["cu_seqlens_q"], p["page_indices"], p["kv_len"]) == (q2.ptr, kp2.ptr, cu2.ptr,
                                                                                    table2.ptr, lens2.ptr)
    assert {n: v for n, v in p.items() if n not in _PER_CALL | {"k", "v", "tmaps"}} == \
        {n: v for n, v in first.items() if n not in _PER_CALL | {"k", "v", "tmaps"}}
    pyattn.paged_prefill(q2, kp2, vp2, cu2, block_table=table2, seq_lens=lens2, max_seqlen_q=9, max_seqlen_k=40)
    assert len(validations) == 2 and launches[-1][2]["max_k"] == 40
    misaligned = _da((12, 4, 64), BF16, ptr=q.ptr + 8)
    with pytest.raises(ValueError, match="^q: the address must be 16-byte aligned"):
        pyattn.paged_prefill(misaligned, kp, vp, cu, block_table=table, seq_lens=lens, max_seqlen_q=9, max_seqlen_k=50)
    # 4-D q, no offsets: the host offsets are kept with the key.
    q4 = _da((2, 6, 4, 64), BF16)
    for _ in range(2):
        pyattn.paged_prefill(q4, kp, vp, block_table=table, seq_lens=lens, max_seqlen_k=50)
        assert launches[-1][2]["max_q"] == 6 and launches[-1][2]["cu_seqlens_q"] not in (0, cu.ptr)
    assert len(validations) == 3


def test_grid_holds_the_batch_tiles_not_the_longest_sequence_tiles_for_each(gpu, launches):
    """A mixed step (one-token rows beside a long chunk) gets a grid of the batch's query tiles for
    each kv head (the kernel finds its sequence from the offsets: attention_mask.cuh paged_tile),
    bounded without reading device offsets: the rows' tiles plus one part tile a sequence. The old
    grid gave every sequence the longest's tiles."""
    n_dec, chunk, hq, hk = 7, 300, 4, 2
    total = n_dec + chunk
    kp = _da((64, 16, hk, 64), BF16)
    cu = np.array(list(range(n_dec + 1)) + [total], np.int32)
    table = np.arange(8 * 24, dtype=np.int32).reshape(8, 24) % 64
    lens = np.array([16] * n_dec + [chunk + 16], np.int32)
    spec = _prefill.prefill_specs("bfloat16", 64, "sm_90a", False, False, False, False, 16)[0]
    bm, rg = spec.tiles.block_m, hq // hk
    longest = -(-chunk * rg // bm)
    for dev_cu in (False, True):
        # A device cu_seqlens_q is read unchecked: with device tables and the bounds.
        args = ((_da((n_dec + 2,), np.int32), _da(table.shape, np.int32), _da(lens.shape, np.int32)) if dev_cu
                else (cu, table, lens))
        bounds = {"max_seqlen_q": chunk, "max_seqlen_k": 384} if dev_cu else {}
        pyattn.paged_prefill(_da((total, hq, 64), BF16), kp, kp, args[0], block_table=args[1], seq_lens=args[2],
                             **bounds)
        grid, p = launches[-1][1], launches[-1][2]
        assert p["num_splits"] == 1 and p["batch"] == n_dec + 1
        assert grid == (min((n_dec + 1) * longest, -(-total * rg // bm) + n_dec) * hk, 1, 1)
        assert grid[0] < (n_dec + 1) * longest * hk  # the old grid's (8 x the chunk's tiles, a kv head)

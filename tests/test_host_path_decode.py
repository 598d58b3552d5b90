"""The device-resident decode call path on a CPU, through the fake driver of ``fake_driver.py``:
a steady decode loop's driver calls and launches (the split combine fused in, or a second launch
for a large combine share), the repeat-call fast path (what must miss it, what is checked every
call), memos that keep no cache alive, a ragged batch's longest-first order, and the tensor maps
of attn_decode_tma over 16- and 8-bit pools.
"""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
from cuda.bindings import driver

import fake_driver
import pyattn
from pyattn.jit.source import kernel_source_dir
from pyattn.kernels.specs import KernelSpec
from pyattn.runtime import launch
from _host_path_helpers import _da, _repeat_calls


def test_decode_repeat_calls(gpu, cache, full_decode):
    """A steady decode loop: one context check and one launch (two splits, their combine fused in),
    as a programmatic dependent of the stream's previous kernel (cuLaunchKernelEx with
    programmatic stream serialization: kernels_src/pdl.cuh); the partials share the output's
    block; q's new address is read."""
    c, ids = cache
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    fake_driver.PDL_LAUNCHES.clear()
    # (whether the stream captures a graph, asked once: the cache refuses a capture, and the
    # result's and the counters' blocks take its answer)
    assert _repeat_calls(lambda: pyattn.decode(q, c, ids)) == {"cuCtxGetCurrent": 1, "cuStreamIsCapturing": 1,
                                                               "cuLaunchKernelEx": 1}
    # a GQA group of 4 at q_len 1: the TMA decode's swapped-role blocks (attn_decode_swap)
    assert fake_driver.PDL_LAUNCHES and all(n.startswith("pyattn_attn_decode_swap") for n in fake_driver.PDL_LAUNCHES)
    (attr,) = list(launch._tls.buf.config.attrs)[: launch._tls.buf.config.numAttrs]  # this thread's launch config
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    assert len(full_decode) == 1
    q2 = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    fake_driver.LAUNCHES.clear()
    out = pyattn.decode(q2, c, ids)
    assert len(full_decode) == 1
    ((name, grid, _, p),) = fake_driver.LAUNCHES  # one launch: the split combine is fused in
    assert grid[0] == 2 and name.startswith("pyattn_attn_decode")  # two splits
    assert p[:4] == (q2.ptr, c.k.ptr, c.v.ptr, out.ptr)
    assert out.ptr < p[5] < p[6] < out.ptr + out.owner.nbytes  # the partials, behind out in its block
    assert p[7] != 0  # the stream's split counters


def test_equal_lengths_go_to_the_kernel_by_value(gpu, cache):
    """A batch whose sequences are equally long (a batch of one always) passes the length by value
    (a null kv_len pointer: no dependent read at each block's start); a ragged one reads the
    cache's device lengths; the longest-first order only when ragged."""
    c, ids = cache
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids)
    pyattn.decode(_da((1, 1, 8, 64), ml_dtypes.bfloat16), c, ids[:1])
    (_, _, _, p), (_, _, _, p1) = fake_driver.LAUNCHES
    assert p[10] == 0 and p1[10] == 0 and p[11] == 0
    one = np.zeros((1, 1, 2, 64), ml_dtypes.bfloat16)
    c.append(ids[:1], one, one)  # one sequence a token longer
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids)
    ((_, _, _, p),) = fake_driver.LAUNCHES
    assert p[10] != 0 and p[11] != 0


def test_decode_with_a_large_combine_share_merges_in_a_second_launch(gpu, cache):
    """16 query tokens x a GQA group of 4 at 33 splits: the fused combine's last block would read
    4 items (4 consumer warps of attn_decode_tma) x 3 batches of splits per thread (over its
    budget), so the decode leaves the merge (null counters) to split_combine, launched right after
    on the same stream."""
    c, ids = cache
    gpu.record_launches = True
    q = _da((2, 16, 8, 64), ml_dtypes.bfloat16)
    fake_driver.LAUNCHES.clear()
    out = pyattn.decode(q, c, ids, num_splits=33)
    (name, grid, _, p), (cname, _, cstream, cp) = fake_driver.LAUNCHES
    assert name.startswith("pyattn_attn_decode_tma") and grid[0] == 33 and p[7] == 0
    assert cname.startswith("pyattn_split_combine") and cp[:2] == (p[5], p[6]) and cp[4] == out.ptr
    assert cname in fake_driver.PDL_LAUNCHES  # its entry waits for the decode, whose partials it reads
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids, num_splits=2)  # 8 items x 1 batch: within the budget, fused
    ((name, grid, _, p),) = fake_driver.LAUNCHES
    assert grid[0] == 2 and p[7] != 0


def test_every_kernel_waits_for_its_predecessor_and_launches_as_its_dependent_on_sm_90(gpu):
    """Programmatic dependent launch: every kernel's rendered entry point waits for the stream's
    previous kernel (griddepcontrol.wait) before the kernel runs, and kernels_src holds no wait of
    its own (one place, so no kernel can touch global memory first); on sm_90+ every launch
    (decode, TMA-fed or cp.async, its separate split combine, the append, attention) is that
    kernel's programmatic dependent, on sm_80 / sm_86 / sm_89 none, where the wait compiles to
    nothing. A kernel launched so without the wait would read what its predecessor still writes."""
    gpu.record_launches = True
    for page in (16, 8):
        c = pyattn.PagedKVCache(64, page, 2, 64, "bfloat16")
        ids = [c.add_sequence() for _ in range(2)]
        fake_driver.LAUNCHES.clear()
        fake_driver.PDL_LAUNCHES.clear()
        # page 8: 16 query rows a KV head, which keep the cp.async kernel there (up to 8 would
        # take the TMA kernel's gathered rows)
        pyattn.decode(_da((2, 1 if page == 16 else 4, 8, 64), ml_dtypes.bfloat16), c, ids)
        kv = np.zeros((2, 3, 2, 64), ml_dtypes.bfloat16)
        c.append(ids, kv, kv)  # a serving step's append follows the model's kernels alike
        pyattn.attention(*(_da((1, 64, 2, 64), ml_dtypes.bfloat16) for _ in range(3)))
        if page == 16:  # a combine share over the fused budget: the separate split_combine too
            pyattn.decode(_da((2, 16, 8, 64), ml_dtypes.bfloat16), c, ids, num_splits=33)
        names = [n for n, *_ in fake_driver.LAUNCHES]
        assert (names[0].startswith("pyattn_attn_decode_swap"), len(names)) == (page == 16, 5 if page == 16 else 3)
        assert names[1].startswith("pyattn_kv_append") and names[-1].startswith("pyattn_split_combine") == (page == 16)
        assert fake_driver.PDL_LAUNCHES == names, page
    for arch, dependent in (("sm_90a", True), ("sm_100a", True), ("sm_89", False), ("sm_80", False)):
        assert KernelSpec("split_combine", "bf16", 128, arch).dependent_launch is dependent
        assert KernelSpec("attn_decode", "bf16", 128, arch, q_tiles=1).dependent_launch is dependent
    src = kernel_source_dir()
    waits = [f.name for f in src.glob("*.cuh") if "pdl::wait()" in f.read_text() and f.name != "pdl.cuh"]
    assert not waits  # the entry point's wait is the only one (pyattn.jit.source.render)
    assert "#if __CUDA_ARCH__ >= 900" in (src / "pdl.cuh").read_text()  # nothing to wait for below sm_90


def test_decode_changes_miss_the_fast_path(gpu, cache, full_decode):
    c, ids = cache
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    pyattn.decode(q, c, ids)
    other = pyattn.PagedKVCache(64, 32, 2, 64, "bfloat16")  # another page size
    other_ids = [other.add_sequence() for _ in range(2)]
    variants = [
        lambda: pyattn.decode(_da((2, 2, 8, 64), ml_dtypes.bfloat16), c, ids),  # q_len
        lambda: pyattn.decode(_da((1, 1, 8, 64), ml_dtypes.bfloat16), c, ids[:1]),  # batch, number of ids
        lambda: pyattn.decode(q, other, other_ids),
        lambda: pyattn.decode(q, c, ids, causal=False),
        lambda: pyattn.decode(q, c, ids, window=(8, 0)),
        lambda: pyattn.decode(q, c, ids, num_splits=1),
        lambda: pyattn.decode(q, c, ids, softcap=20.0),
        lambda: pyattn.decode(q, c, ids, return_lse=True),
        lambda: pyattn.decode(q, c, ids, alibi_slopes=_da((8,), np.float32)),
    ]
    for i, call in enumerate(variants):
        call()
        assert len(full_decode) == 2 + i, i
        call()  # its own entry now
        assert len(full_decode) == 2 + i, i
    with pytest.raises(TypeError, match="^q: expected dtype bfloat16"):
        pyattn.decode(_da((2, 1, 8, 64), np.float16), c, ids)


def test_decode_checks_ids_and_addresses_every_call(gpu, cache):
    c, ids = cache
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    pyattn.decode(q, c, ids)
    pyattn.decode(q, c, ids)
    with pytest.raises(ValueError, match=r"^q: the address must be 16-byte aligned"):
        pyattn.decode(_da((2, 1, 8, 64), ml_dtypes.bfloat16, ptr=q.ptr + 8), c, ids)
    c.free(ids[1])
    with pytest.raises(ValueError, match="no live sequence"):
        pyattn.decode(q, c, ids)
    with pytest.raises(ValueError, match="^q: expected an array on the cache's device"):
        pyattn.decode(_da((1, 1, 8, 64), ml_dtypes.bfloat16, device=pyattn.get_device(1)), c, ids[:1])


def test_memo_keys_do_not_keep_a_cache_alive(gpu):
    """The decode memos key on the cache's layout: a dropped cache frees its pools."""
    import weakref

    c = pyattn.PagedKVCache(16, 16, 2, 64, "float16")
    ids = [c.add_sequence()]
    c.append(ids, np.zeros((1, 4, 2, 64), np.float16), np.zeros((1, 4, 2, 64), np.float16))
    pyattn.decode(_da((1, 1, 4, 64)), c, ids)
    pyattn.decode(_da((1, 1, 4, 64)), c, ids)
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None


def test_a_ragged_decode_runs_its_longest_sequence_first(gpu, cache):
    """batch_order (DecodeParams field 11) is null for an even batch and, for a ragged one, the
    device copy of the entries longest first, uploaded with the cache's decode table."""
    from pyattn.paged.book import longest_first

    c, ids = cache
    gpu.record_launches = True
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids)
    assert fake_driver.LAUNCHES[-1][3][11] == 0
    kv = np.zeros((1, 40, 2, 64), ml_dtypes.bfloat16)
    c.append([ids[1]], kv, kv)
    fake_driver.LAUNCHES.clear()
    pyattn.decode(q, c, ids)
    tables = c.decode_tables(ids, c._stream)[0]
    assert tables[4] is not None and fake_driver.LAUNCHES[-1][3][11] == tables[4].ptr
    assert longest_first(c.book.lengths(ids)).tolist() == [1, 0]


def test_tma_decode_maps_describe_the_pools(gpu, cache):
    """attn_decode_tma (the fake GPU is sm_90a, the cache's pages 16 slots) at a head_dim of whole
    64-column blocks reads each kv head through a K and a V map, (64 columns, 16 slots, column
    block, slot / 16, page) from the head's first element with the pools' byte strides (axes of one
    index: 16 bytes), boxes bringing min(page, block_n) slots whole, 128-byte swizzle, an L2 fetch of
    each box row's own 128 bytes (not the default 256: the next kv head's row is another block's);
    encoded and uploaded once per pool pair."""
    from pyattn.runtime import tensormap

    c, ids = cache
    q = _da((2, 1, 8, 64), ml_dtypes.bfloat16)
    pyattn.decode(q, c, ids)
    heads = [base + h * 128 for base in (c.k.ptr, c.v.ptr) for h in range(2)]  # NHD: each head 128 bytes on
    keys = [k for k in tensormap._memo if k[1] in heads]
    assert sorted(k[1] for k in keys) == sorted(heads)
    for dtype, _, (dims, strides), box, swizzle, l2 in keys:  # NHD pools (64 pages, 16 slots, 2 heads, 64)
        assert (dtype, dims, strides, box, swizzle, l2) == ("bf16", (64, 16, 1, 1, 64), (256, 128, 16, 4096),
                                                            (64, 16, 1, 1), 128, 128)
    promotion = driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B
    assert fake_driver.TMAP_L2 == [promotion] * 4  # what the driver was asked for
    encodes = fake_driver.CALLS["cuTensorMapEncodeTiled"]
    pyattn.decode(q, c, ids)
    assert fake_driver.CALLS["cuTensorMapEncodeTiled"] == encodes == 4


def test_tma_decode_maps_of_every_layer_are_kept(gpu):
    """A model's layers each decode over their own cache, in turn: every layer's maps are encoded
    and uploaded (with a synchronisation) at its first call only, for 80 layers (the oldest-out
    bound once held 64 pool pairs, so 80 layers visited in turn missed on every call)."""
    layers = [pyattn.PagedKVCache(4, 16, 1, 64, "bfloat16") for _ in range(80)]
    ids = [c.add_sequence() for c in layers]
    kv = np.zeros((1, 20, 1, 64), ml_dtypes.bfloat16)
    for c, sid in zip(layers, ids):
        c.append([sid], kv, kv)
    q = _da((1, 1, 4, 64), ml_dtypes.bfloat16)
    for c, sid in zip(layers, ids):
        pyattn.decode(q, c, [sid])
    fake_driver.CALLS.clear()
    for c, sid in zip(layers, ids):
        pyattn.decode(q, c, [sid])
    assert fake_driver.CALLS["cuStreamSynchronize"] == 0 and fake_driver.CALLS["cuMemcpyHtoDAsync"] == 0


@pytest.mark.parametrize("D, page, per_head", [(128, 64, True), (112, 64, False), (40, 32, False)])
def test_tma_decode_maps_of_16_bit_head_dims(gpu, D, page, per_head):
    """A head_dim of whole 64-column blocks takes per-head rank-5 maps whose boxes bring a page chunk
    (min(page, block_n) slots) whole; a narrower one (112 in the 128 bucket, 40 in the 64) the pools'
    rank-4 maps with boxes of 64 columns x 16 slots, whose columns past head_dim arrive as zeros
    (a whole column block would read the next head's, or past the pool)."""
    from pyattn.runtime import tensormap

    c = pyattn.PagedKVCache(32, page, 2, D, "bfloat16")
    ids = [c.add_sequence() for _ in range(2)]
    kv = np.zeros((2, 100, 2, D), ml_dtypes.bfloat16)
    c.append(ids, kv, kv)
    fake_driver.CALLS.clear()
    pyattn.decode(_da((2, 1, 8, D), ml_dtypes.bfloat16), c, ids)
    row = D * 2  # bytes of a (slot, head) row in the NHD pools
    bases = [b + h * row for b in (c.k.ptr, c.v.ptr) for h in range(2)] if per_head else [c.k.ptr, c.v.ptr]
    keys = [k for k in tensormap._memo if k[1] in bases]
    assert sorted(k[1] for k in keys) == sorted(bases) and fake_driver.CALLS["cuTensorMapEncodeTiled"] == len(bases)
    for _, _, (dims, strides), box, _, _ in keys:
        if per_head:
            assert dims == (64, 16, D // 64, page // 16, 32) and box == (64, 16, D // 64, 64 // 16)
            assert strides == (2 * row, 128, 16 * 2 * row, page * 2 * row)
        else:
            assert dims == (D, page, 2, 32) and box == (64, 16) and strides == (2 * row, row, page * 2 * row)


def test_dense_prefill_maps_keep_the_default_promotion(gpu):
    """The dense sm_90a prefill's q / k / v maps keep the 256-byte L2 promotion (their rows are
    reused across query tiles; measured level with 128, BENCHMARKS.md, thirty-sixth session): only
    the decode pools' maps ask for their rows' own 128 bytes."""
    q, k, v = (_da((1, 256, 8, 64), ml_dtypes.bfloat16) for _ in range(3))
    fake_driver.TMAP_L2.clear()
    pyattn.attention(q, k, v)
    assert len(fake_driver.TMAP_L2) == 3  # q, k, v
    assert set(fake_driver.TMAP_L2) == {driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B}


@pytest.mark.parametrize("kind, key_scales, D", [("int8", "token", 128), ("fp8_e4m3", "token", 128),
                                                ("int8", "channel", 128), ("int8", "token", 64)])
def test_tma_decode_maps_of_8_bit_pools(gpu, kind, key_scales, D):
    """An 8-bit cache takes the TMA-fed decode too (per-token or per-channel key scales; a group of 4
    at q_len 1 the swapped-role blocks, attn_decode_swap): its code pools as uint8 maps, boxes of 128
    codes (one 128-byte swizzle row) x min(page, block_n) slots. The 64 head-dim bucket keeps the
    cp.async kernel, whose launch encodes no map."""
    from pyattn.runtime import tensormap

    c = pyattn.PagedKVCache(64, 16, 2, D, kind, key_scales=key_scales)
    ids = [c.add_sequence() for _ in range(2)]
    kv = np.zeros((2, 256, 2, D), ml_dtypes.bfloat16)
    c.append(ids, kv, kv)
    fake_driver.CALLS.clear()
    gpu.record_launches = True
    pyattn.decode(_da((2, 1, 8, D), ml_dtypes.bfloat16), c, ids)
    name = fake_driver.LAUNCHES[-1][0]
    keys = [k for k in tensormap._memo if k[1] in (c.k.ptr, c.v.ptr)]
    if D == 64:
        assert keys == [] and fake_driver.CALLS["cuTensorMapEncodeTiled"] == 0
        assert name.startswith("pyattn_attn_decode_") and "tma" not in name
        return
    assert sorted(k[1] for k in keys) == sorted((c.k.ptr, c.v.ptr)) and name.startswith("pyattn_attn_decode_swap")
    assert name in fake_driver.PDL_LAUNCHES  # its entry waits for its predecessor, as every kernel's does
    for dtype, _, (dims, strides), box, swizzle, l2 in keys:  # NHD pools (64 pages, 16 slots, 2 heads, 128 codes)
        assert (dtype, dims, strides, box, swizzle, l2) == ("u8", (128, 16, 2, 64), (256, 128, 4096), (128, 16), 128,
                                                            128)


def test_16bit_decodes_take_one_block_an_sm_below_a_wave(gpu):
    """A 16-bit decode's split count below one wave (8 KV heads, one 16k-token sequence): a group of
    4 at q_len 1 (4 rows: the swapped-role blocks) and the same cache at q_len 4 (16 rows:
    attn_decode_tma's m16 tiles) both take one block an SM, 132 / 8 (sm_slots; the fake GPU's 132
    SMs), not the wave's 264 / 8, as measured for each (BENCHMARKS.md, fifty-ninth session). An
    8-bit cache keeps the wave's count (test_decode_splits.py covers the rule itself)."""
    c = pyattn.PagedKVCache(1040, 16, 8, 64, "bfloat16")
    sid = c.add_sequence()
    kv = np.zeros((1, 16384, 8, 64), ml_dtypes.bfloat16)
    c.append([sid], kv, kv)
    gpu.record_launches = True
    got = {}
    for q_len in (1, 4):
        fake_driver.LAUNCHES.clear()
        pyattn.decode(_da((1, q_len, 32, 64), ml_dtypes.bfloat16), c, [sid])
        name, grid = fake_driver.LAUNCHES[0][:2]
        got[q_len] = (name.split("_bf16")[0], grid[0])
    assert got == {1: ("pyattn_attn_decode_swap", 132 // 8), 4: ("pyattn_attn_decode_tma", 132 // 8)}
    c8 = pyattn.PagedKVCache(1040, 16, 8, 128, "int8")
    sid = c8.add_sequence()
    kv = np.zeros((1, 16384, 8, 128), ml_dtypes.bfloat16)
    c8.append([sid], kv, kv)
    fake_driver.LAUNCHES.clear()
    pyattn.decode(_da((1, 1, 32, 128), ml_dtypes.bfloat16), c8, [sid])
    name, grid = fake_driver.LAUNCHES[0][:2]
    # 264 slots / 8 units = 33, less the split that 128 key tiles of 128 leave empty
    assert (name.split("_bf16")[0], grid[0]) == ("pyattn_attn_decode_swap", 32)

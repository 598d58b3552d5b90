"""CPU tests of chunked prefill and token-tree verification over the paged cache: the accept
bookkeeping (a state machine over the page book with forks, copy-on-write and appends), ancestor
masks, validation of the new arguments, spec selection and the NVRTC compile of every new kernel
variant for every arch. GPU behaviour is in test_gpu_serving.py.
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

import pyattn.jit as jit
from pyattn.kernels.params import ATTN_FWD_PARAMS, PAGED_FWD_EXTRA, PAGED_FWD_PARAMS
from pyattn.kernels.specs import KernelSpec
from pyattn.ops._prefill import prefill_specs
from pyattn.paged.book import OutOfPagesError, PageBook
from pyattn.reference import tree_ancestor_mask
from pyattn.validate.paged import PoolInfo
from pyattn.validate.serving import check_parents, check_new_tokens, check_cu_seqlens_q, check_pool_rows, tree_masks
from _book_helpers import snapshot
from test_paged_book import BookMachine

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")


# -- accept: the page book ---------------------------------------------------------------------
class AcceptMachine(BookMachine):
    """BookMachine's appends, forks, truncations and frees, plus accepting draft-tree branches."""

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def accept(self, data):
        book, ps = self.book, self.ps
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3, unique=True))
        if data.draw(st.integers(0, 3)):  # mostly: the drafts' trees are appended first, as in use
            self.do_append(ids, [data.draw(st.integers(1, 12)) for _ in ids])
        sizes, paths = [], []
        for s in ids:
            length = len(self.model[s])
            n = data.draw(st.integers(min(1, length), min(length, 12)))
            sizes.append(n)
            if data.draw(st.integers(0, 3)) == 0:  # a branch kept in place, or (mostly) any ascending subset
                paths.append(list(range(data.draw(st.integers(0, n)))))
            else:
                paths.append(sorted(data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n))) if n else [])
        before, free = snapshot(book), set(book._free)
        try:
            plan = book.plan_accept(ids, paths, sizes)
        except OutOfPagesError:
            assert snapshot(book) == before, "a failed accept changed the book"
            return
        assert plan.copy_src.dtype == plan.copy_dst.dtype == np.int32
        written = plan.copy_dst.tolist()
        assert len(set(written)) == len(written), "a slot is written twice in one call"
        assert not set(written) & set(plan.copy_src.tolist()), "a slot is both read and written"
        assert {w // ps for w in written} <= free, "accept wrote into a page it did not take fresh"
        old = [self.mem[x] for x in plan.copy_src.tolist()]  # the kernel: every copy reads, then writes
        self.mem.update(zip(written, old))
        for s, n, path in zip(ids, sizes, paths):
            base = len(self.model[s]) - n
            self.model[s] = self.model[s][:base] + [self.model[s][base + i] for i in path]


AcceptMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=25, deadline=None,
                                           report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])


def test_accept_state_machine():
    run_state_machine_as_test(AcceptMachine, settings=AcceptMachine.TestCase.settings)


def test_accept_in_place_copies_nothing_and_frees_the_rest():
    book = PageBook(16, 4)
    s = book.add_sequence()
    book.plan_append([s], [10])  # 6 tokens before a tree of 4... and 10 in all
    free = book.num_free
    plan = book.plan_accept([s], [[0, 1]], 4)
    assert len(plan.copy_src) == 0 and book.length(s) == 8 and book.num_free == free + 1
    book.check()


def test_accept_copy_on_write_leaves_a_fork_untouched():
    book = PageBook(16, 4)
    s = book.add_sequence()
    book.plan_append([s], [10])  # tree = tokens 6..9, pages [0, 1, 2]
    f = book.fork(s)  # shares all three pages
    shared = book.pages(s).tolist()
    plan = book.plan_accept([s], [[1, 3]], 4)
    assert book.pages(f).tolist() == shared and book.length(f) == 10
    assert set(book.pages(s).tolist()[:1]) == {shared[0]}, "pages before the first moved token are kept"
    new_pages = set(book.pages(s).tolist()[1:])
    assert not new_pages & set(shared) and {d // 4 for d in plan.copy_dst.tolist()} == new_pages
    # page 1 is rebuilt: slots 4, 5 (kept prefix) copied, then tree tokens 1 and 3 (positions 7, 9)
    src_pos = [shared.index(x // 4) * 4 + x % 4 for x in plan.copy_src.tolist()]
    assert src_pos == [4, 5, 7, 9] and book.length(s) == 8
    book.check()


def test_accept_out_of_pages_changes_nothing():
    book = PageBook(3, 4)
    s = book.add_sequence()
    book.plan_append([s], [12])  # all pages used
    before = snapshot(book)
    with pytest.raises(OutOfPagesError):
        book.plan_accept([s], [[2, 3]], 4)
    assert snapshot(book) == before


@pytest.mark.parametrize("paths, sizes, match", [
    ([[1, 0]], 4, "paths: expected ascending"), ([[4]], 4, "paths: expected ascending"),
    ([[-1]], 4, "paths: expected ascending"), ([[0.5]], 4, "paths: expected a 1-D"),
    ([[0]], 11, "tree_sizes: expected 0 <="), ([[0]], 1.0, "tree_sizes: expected an int"),
    ([[0]], [1.0], "tree_sizes: expected ints"), (3, 4, "paths: expected a sequence"),
    ([[0], [0]], 4, "paths, tree_sizes: expected one per sequence"), ([[[0]]], 4, "paths: expected a 1-D"),
])
def test_accept_refuses_bad_paths(paths, sizes, match):
    book = PageBook(8, 4)
    s = book.add_sequence()
    book.plan_append([s], [10])
    before = snapshot(book)
    with pytest.raises((ValueError, TypeError), match=match):
        book.plan_accept([s], paths, sizes)
    assert snapshot(book) == before


# -- ancestor masks and validation --------------------------------------------------------------
@st.composite
def trees(draw, max_n=64):
    n = draw(st.integers(1, max_n))
    return [draw(st.integers(-1, i - 1)) for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(forest=st.lists(trees(), min_size=1, max_size=4))
def test_tree_masks_are_the_ancestor_sets(forest):
    cu = np.concatenate([[0], np.cumsum([len(t) for t in forest])])
    masks = tree_masks(np.concatenate([np.array(t, np.int64) for t in forest]), cu)
    for b, t in enumerate(forest):
        ref = tree_ancestor_mask(t)
        for i in range(len(t)):
            bits = int(masks[cu[b] + i])
            assert [bool(bits >> j & 1) for j in range(len(t))] == ref[i].tolist()
            assert bits >> len(t) == 0


class _Arg:  # just enough of interop.inputs.Arg for the value checks
    def __init__(self, name, value):
        self.name, self.obj = name, np.asarray(value)
        self.dtype, self.shape, self.strides, self.on_device = self.obj.dtype, self.obj.shape, (1,), False


def _no_fetch(a):
    raise AssertionError("host arrays are not fetched")


@pytest.mark.parametrize("parents, match", [
    (np.array([-1, 1], np.int32), "parents: each must be -1 or an earlier token"),
    (np.array([-2, 0], np.int32), "parents: each must be"),
    (np.array([0, 0], np.int32), "parents: each must be"),
    (np.array([-1, 0], np.int64), "parents: expected dtype int32"),
    (np.array([-1, 0, 0], np.int32), r"parents: expected shape \(2,\)"),
])
def test_bad_parents_are_refused(parents, match):
    with pytest.raises((ValueError, TypeError), match=match):
        check_parents(_Arg("parents", parents), np.array([0, 2]), "thd", _no_fetch)


def test_parents_index_within_each_tree():
    cu = np.array([0, 2, 5])
    flat = check_parents(_Arg("parents", np.array([-1, 0, -1, 0, 1], np.int32)), cu, "thd", _no_fetch)
    assert flat.tolist() == [-1, 0, -1, 0, 1]
    with pytest.raises(ValueError, match=r"parents\[2\] = 0 for tree token 0"):
        check_parents(_Arg("parents", np.array([-1, 0, 0, 0, 1], np.int32)), cu, "thd", _no_fetch)


@pytest.mark.parametrize("cu, match", [
    (np.array([1, 3, 5], np.int32), "cu_seqlens_q: must start at 0"), (np.array([0, 3, 2], np.int32), "non-decreasing"),
    (np.array([0, 3, 4], np.int32), "end at q's 5 tokens"), (np.array([0, 5], np.int32), r"expected shape \(3,\)"),
    (np.array([0, 3, 5], np.int64), "expected dtype int32"),
])
def test_bad_cu_seqlens_q_is_refused(cu, match):
    with pytest.raises((ValueError, TypeError), match=match):
        check_cu_seqlens_q(_Arg("cu_seqlens_q", cu), 2, 5, _no_fetch)


def test_new_tokens_must_be_in_the_cache_and_trees_small():
    with pytest.raises(ValueError, match="cu_seqlens_q: sequence 1 has 9 new tokens but its cache holds 8"):
        check_new_tokens(np.array([1, 9]), np.array([5, 8]), False)
    with pytest.raises(ValueError, match="q: a tree of at most 64 tokens"):
        check_new_tokens(np.array([65]), np.array([100]), True)
    check_new_tokens(np.array([64, 0]), np.array([64, 0]), True)


@pytest.mark.parametrize("k_strides, v_strides, pages, ok", [
    ((16 * 1024, 1024, 128), (16 * 1024, 1024, 128), 10, True),     # a cache's own (pages, slot, head, dim)
    ((16 * 1024, 128, 16 * 128), (16 * 1024, 128, 16 * 128), 10, True),  # (pages, head, slot, dim)
    ((16 * 1024 + 8, 1024, 128), (16 * 1024 + 8, 1024, 128), 10, False),  # padded pages
    ((16 * 1024, 1024, 128), (32 * 1024, 2048, 128), 10, True),     # V rows twice as far apart, same count
    ((16 * 1024, 1024, 128), (16 * 2048, 1024, 128), 10, False),    # V pages of another slot count
    ((16 * 1024, 1024, 128), (16 * 1024, 1024, 128), 2**28, False),  # 2**32 slot rows
])
def test_prefill_pools_need_32_bit_slot_rows(k_strides, v_strides, pages, ok):
    pool = PoolInfo(pages, 16, 8, 128, np.dtype(np.float16), k_strides, v_strides)
    if ok:
        check_pool_rows(pool)
    else:
        with pytest.raises(ValueError, match="cache: prefill needs K/V pools whose page stride"):
            check_pool_rows(pool)


# -- specs, parameter struct, compilation --------------------------------------------------------
def test_nested_params_pack_like_the_two_halves():
    assert PAGED_FWD_PARAMS.size == ATTN_FWD_PARAMS.size + PAGED_FWD_EXTRA.size
    values = {name: i + 1 for i, (name, kind) in enumerate(PAGED_FWD_PARAMS.fields)}
    whole = PAGED_FWD_PARAMS.pack(values)
    assert whole == ATTN_FWD_PARAMS.pack(values) + PAGED_FWD_EXTRA.pack(values)
    decl = PAGED_FWD_PARAMS.c_declaration()
    assert "struct PagedFwdParams {\n  AttnFwdParams fwd;" in decl and "offsetof" not in decl  # NVRTC 13.0 lacks it


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_spec_selection(arch):
    for tree in (False, True):
        spec, cspec = prefill_specs("bfloat16", 40, arch, False, False, False, tree)
        kind = "tree" if tree else "prefill"
        if arch == "sm_90a":
            assert spec.family == f"attn_{kind}_wgmma" and spec.head_dim == 64
        else:
            assert spec.family == f"attn_{kind}_mma" and spec.head_dim == 64
        assert cspec.family == "split_combine" and cspec.head_dim == 64
        assert spec.tiles.block_m == 64 if tree else spec.tiles.block_m >= 64
    with pytest.raises(ValueError, match="family: attn_prefill_wgmma takes"):
        KernelSpec("attn_prefill_wgmma", "bf16", 128, "sm_80")
    with pytest.raises(ValueError, match="head_dim: attn_prefill_tma has rows for buckets"):
        KernelSpec("attn_prefill_tma", "bf16", 192, "sm_90a")
    with pytest.raises(ValueError, match="mask/softcap/alibi"):
        KernelSpec("attn_prefill_mma", "bf16", 128, "sm_80", mask="bool")


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_prefill_reads_page_boxes_where_pages_and_head_dim_allow(arch):
    """attn_prefill_tma (TMA page boxes) on sm_90a for pages of a power of two from 16 slots at the
    head-dim buckets its table names (64, 128, 256); the cp.async gather for other pages, other
    buckets and trees; and its traits at d = 128 the cp.async row's tile with TMA on."""
    for d, page, tree, tma in ((128, 16, False, True), (120, 256, False, True), (128, 8, False, False),
                               (128, 48, False, False), (128, 16, True, False), (64, 16, False, True),
                               (40, 32, False, True), (256, 16, False, True), (192, 16, False, False)):
        spec, _ = prefill_specs("bfloat16", d, arch, False, False, False, tree, page)
        want = ("attn_prefill_tma" if tma else f"attn_{'tree' if tree else 'prefill'}_wgmma") if arch == "sm_90a" \
            else f"attn_{'tree' if tree else 'prefill'}_mma"
        assert spec.family == want, (d, page, tree)
        if spec.family == "attn_prefill_tma" and spec.head_dim == 128:
            cp = KernelSpec("attn_prefill_wgmma", "bf16", spec.head_dim, arch)
            assert (spec.tiles._replace(reason=""), spec.shared_bytes, spec.threads) == \
                (cp.tiles._replace(reason=""), cp.shared_bytes, cp.threads)
            assert ", 0, true, true>" in spec.traits  # WS and TMA, nothing after
        if spec.family == "attn_prefill_tma":
            assert spec.tiles.ws and spec.tiles.warps == 12 and not spec.tiles.persistent


def _serving_specs(arch):
    """Per arch: chunked prefill with both modifiers, tree verification with the soft-cap (each family
    on each arch it runs on; the plain variants differ only by compiled-out branches)."""
    out = []
    for dtype, d, mods, tree in (("float16", 128, {"softcap": True, "alibi": True}, False),
                                 ("bfloat16", 256, {"softcap": True}, True)):
        spec, cspec = prefill_specs(dtype, d, arch, False, mods.get("softcap", False), mods.get("alibi", False), tree)
        out.append(spec)
    if arch == "sm_90a":  # the TMA page boxes (pages of 16), with and without overlap
        out += [prefill_specs("bfloat16", d, arch, False, True, d == 128, False, 16)[0] for d in (128, 256)]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_serving_variants_compile_for_every_arch(arch, session_cache_dir, monkeypatch):
    monkeypatch.setenv("PYATTN_CACHE_DIR", str(session_cache_dir))
    specs = _serving_specs(arch)
    assert {s.family.split("_")[1] for s in specs} == {"prefill", "tree"}
    assert ("attn_prefill_tma" in {s.family for s in specs}) == (arch == "sm_90a")
    for spec, meta, _ in jit.build_many(specs, workers=2):
        assert meta["format"] == "cubin" and meta["entry"] == spec.entry_name
        assert spec.entry_name.startswith(f"pyattn_{spec.family}_")


def test_families_reuse_the_dense_kernels_tiles():
    """The paged prefill runs the dense kernels' traits and tiles (on sm_90a at d = 128 the dense
    row, measured again on the paged kernel: only its reason differs); the shared-memory formula is
    the dense family's."""
    for arch, fam, dense in (("sm_90a", "attn_prefill_wgmma", "attn_fwd_wgmma"), ("sm_80", "attn_prefill_mma",
                                                                                    "attn_fwd_mma")):
        for d in (64, 128, 256):
            a = KernelSpec(dense, "bf16", d, arch).replace(family=fam)
            b = KernelSpec(dense, "bf16", d, arch)
            assert (a.tiles._replace(reason=""), a.shared_bytes, a.threads) == \
                (b.tiles._replace(reason=""), b.shared_bytes, b.threads)
            if fam == "attn_prefill_wgmma" and d == 128:
                assert (a.tiles.block_m, a.tiles.block_n, a.tiles.stages, a.tiles.ws) == (128, 128, 3, True)
                assert "paged" in a.tiles.reason


def test_accept_refuses_caches_whose_side_state_it_would_leave_stale(deviceless_cache):
    """Per-channel key scales and SparQ's transposed keys describe slots; accept moves slots, so it
    refuses those caches before any device work (no GPU: the device is faked)."""
    for dtype, opts in (("int8", dict(key_scales="channel")), ("float16", dict(sparq=True))):
        c = deviceless_cache(16, 16, 2, 64, dtype, **opts)
        sid = c.add_sequence()
        with pytest.raises(ValueError, match="^accept: not supported"):
            c.accept([sid], [[0]], 1)

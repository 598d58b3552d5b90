"""``pyattn.merge_states`` on a GPU (marked ``gpu``; skipped without a driver): split attention
merged back equals attention over all keys, dead states and all-dead rows, the split-KV pipeline on
a user stream, unaligned rows with a fold and out=, and torch stacks with strided LSE views. Outputs
are checked with the 2x rule against the naive same-precision merge; allocations are poisoned
(``poison``), so an element no kernel writes fails. CPU tests of the kernel's launch plan are in
test_merge_states_plan.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.ops.merge as merge_mod
from _merge_states_helpers import DTYPES, SLOW, random_states
from pyattn.array import DeviceArray
from pyattn.reference import attention_ref, error_bound, merge_states_ref
from pyattn.runtime import memory
from test_gpu_attention import _has_gpu

FLOOR = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}  # pyattn.reference's error_bound floors


def gpu_test(f):
    return pytest.mark.gpu(pytest.mark.skipif(not _has_gpu(), reason="no CUDA driver or GPU")(f))


try:
    import torch
except ImportError:
    torch = None


def _lowp_merge(os_, ls, dtype):
    """The naive same-precision merge (float32 math, one rounding): the tolerance rule's yardstick.
    ``os_`` (n, B, S, H, D), ``ls`` (n, B, H, S): bshd states."""
    os32, ls = np.asarray(os_, np.float32), np.swapaxes(np.asarray(ls, np.float32), -1, -2)
    m = ls.max(axis=0)
    ref = np.where(np.isneginf(m), 0, m)
    w = np.exp(ls - ref)
    w = w / np.where(np.isneginf(m), 1, w.sum(axis=0))
    return np.where(w[..., None] > 0, w[..., None] * os32, 0).sum(axis=0).astype(dtype).astype(np.float64)


def _check(o, lse, full_o, full_lse, os_, ls, dtype, extra=0.0):
    """The 2x rule against the naive merge; ``extra`` adds a fold's additional roundings."""
    o = np.asarray(o).astype(np.float64)
    assert not np.isnan(o).any(), "unwritten (poisoned) or NaN output elements"
    bound = 2 * np.abs(_lowp_merge(os_, ls, dtype) - full_o).max(initial=0) + FLOOR[np.dtype(dtype).name] + extra
    assert np.abs(o - full_o).max(initial=0) <= bound
    assert np.array_equal(np.isneginf(lse), np.isneginf(full_lse))
    live = np.isfinite(full_lse)
    assert np.abs(lse[live] - full_lse[live]).max(initial=0) <= 1e-5 * max(1.0, np.abs(full_lse[live]).max(initial=0))


def _parts(rng, B, Sq, H, D, cuts, dtype):
    """States of attention over the key parts ``cuts`` (empty parts allowed: LSE -inf, o set to NaN)
    and the reference over all keys; o (B, Sq, H, D) in ``dtype``, LSE (B, H, Sq) float32: as
    ``attention`` returns them."""
    q, k, v = (rng.standard_normal((B, S, H, D)).astype(dtype) for S in (Sq, cuts[-1], cuts[-1]))
    os_, ls = [], []
    for a, b in zip(cuts, cuts[1:]):
        o, lse = attention_ref(q, k[:, a:b], v[:, a:b], return_lse=True)
        o = o.astype(dtype)
        o[b == a] = np.nan  # a dead state's o is garbage and must never be read
        os_.append(o)
        ls.append(lse.astype(np.float32))
    full_o, full_lse = attention_ref(q, k, v, return_lse=True)
    return np.stack(os_), np.stack(ls), full_o, full_lse


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(memory, "POISON_ALLOC", True)  # unwritten outputs read as NaN


@gpu_test
@pytest.mark.usefixtures("poison")
@settings(max_examples=60, deadline=None, suppress_health_check=SLOW)
@given(B=st.integers(1, 2), Sq=st.integers(1, 40), H=st.integers(1, 3),
       D=st.sampled_from([8, 32, 40, 64, 128, 136, 256]),
       cuts=st.lists(st.integers(0, 120), min_size=1, max_size=4), dtype=st.sampled_from(sorted(DTYPES)),
       form=st.sampled_from(["pair", "stack", "list"]), on_device=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_merging_split_attention_equals_attention_over_all_keys(B, Sq, H, D, cuts, dtype, form, on_device, seed):
    rng = np.random.default_rng(seed)
    cuts = [0] + sorted(cuts) if form != "pair" else [0, cuts[0], cuts[0] + 17]
    os_, ls, full_o, full_lse = _parts(rng, B, Sq, H, D, cuts, DTYPES[dtype])
    up = pyattn.asarray if on_device else (lambda x: x)
    if form == "pair":
        args = (up(os_[0]), up(ls[0]), up(os_[1]), up(ls[1]))
    elif form == "stack":
        args = (up(os_), up(ls))
    else:
        args = ([up(o) for o in os_], [up(x) for x in ls])
    o, lse = pyattn.merge_states(*args)
    assert isinstance(o, DeviceArray) == on_device and o.shape == os_.shape[1:] and o.dtype == DTYPES[dtype]
    if on_device:
        o, lse = o.numpy(), lse.numpy()
    assert lse.dtype == np.float32 and lse.shape == ls.shape[1:]
    _check(o, lse, full_o, full_lse, os_, ls, DTYPES[dtype])


@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@gpu_test
def test_dead_states_and_all_dead_rows(dtype):
    rng = np.random.default_rng(1)
    os_, ls = random_states(rng, 6, (3, 50, 4, 96), DTYPES[dtype], dead=0.5)  # bshd: ls (6, 3, 4, 50)
    ls[:, 0, :, :7] = -np.inf  # rows where every state is dead
    os_[:, 0, :7] = np.nan
    for args in ((os_, ls), (pyattn.asarray(os_), pyattn.asarray(ls)), (list(os_), list(ls))):
        o, lse = pyattn.merge_states(*args)
        o, lse = (o.numpy(), lse.numpy()) if isinstance(o, DeviceArray) else (o, lse)
        assert np.all(o[0, :7] == 0) and np.all(np.isneginf(lse[0, :, :7]))
        ref_o, ref_lse = merge_states_ref(list(os_), list(ls))
        _check(o, lse, ref_o, ref_lse, os_, ls, DTYPES[dtype])


@pytest.mark.usefixtures("poison")
@gpu_test
def test_device_attention_parts_merge_as_returned():
    """The split-KV pipeline: pyattn.attention on key parts, its (out, lse) pairs merged as they are
    (bshd output, LSE (B, H, S): one convention), on a user stream, against attention over all keys."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, S, 4, 128)).astype(np.float16) for S in (77, 600, 600))
    cuts = (0, 150, 151, 600)
    with pyattn.Stream() as s:
        parts = [pyattn.attention(*(pyattn.asarray(x, stream=s) for x in (q, k[:, a:b], v[:, a:b])),
                                  return_lse=True, stream=s) for a, b in zip(cuts, cuts[1:])]
        o, lse = pyattn.merge_states([o for o, _ in parts], [lse for _, lse in parts], stream=s)
        assert lse.stream is s and o.shape == q.shape
        o, lse = o.numpy(stream=s), lse.numpy(stream=s)
    full_o, full_lse = attention_ref(q, k, v, return_lse=True)
    bound = max(error_bound(q, k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])) + FLOOR["float16"]
    assert np.abs(o.astype(np.float64) - full_o).max() <= bound
    assert np.abs(lse - full_lse).max() <= 1e-4 * np.abs(full_lse).max()


@pytest.mark.usefixtures("poison")
@gpu_test
def test_unaligned_rows_fold_and_out(monkeypatch):
    """Rows at 2-byte offsets (the scalar load/store path), a list that must be folded (one state
    laid out differently), and out= written in place without touching its neighbours ("thd", H=1)."""
    launches = []
    real_launch = merge_mod.launch
    monkeypatch.setattr(merge_mod, "launch", lambda *a: (launches.append(a), real_launch(*a)))
    rng = np.random.default_rng(3)
    n, rows, D = 4, 37, 72
    os_, ls = random_states(rng, n, (rows, 1, D), np.float16, "thd")  # o (n, 37, 1, 72), lse (n, 1, 37)
    padded = np.full((n, rows, D + 1), 7, np.float16)
    padded[..., 1:] = os_[:, :, 0]
    big = pyattn.asarray(padded)
    views = [DeviceArray(big.ptr + 2 + i * big.strides[0], (rows, 1, D), np.float16, big.device,
                         strides=(big.strides[1], big.strides[1], 2), owner=big) for i in range(n)]
    views[2] = pyattn.asarray(os_[2])  # a different layout: os[1:] are no single stack, so a fold
    out_big = pyattn.asarray(np.full((rows, D + 1), 7, np.float16))
    out = DeviceArray(out_big.ptr + 2, (rows, 1, D), np.float16, out_big.device,
                      strides=(out_big.strides[0], out_big.strides[0], 2))
    out_lse = pyattn.asarray(np.full((2 * rows,), 7, np.float32))
    lse_view = DeviceArray(out_lse.ptr, (1, rows), np.float32, out_lse.device, strides=(8 * rows, 8))
    o, lse = pyattn.merge_states(views, [pyattn.asarray(x) for x in ls], out=(out, lse_view), layout="thd")
    assert len(launches) == n - 1 and o.ptr == out.ptr and lse.ptr == out_lse.ptr
    res, res_lse = out_big.numpy(), out_lse.numpy()
    assert np.all(res[:, 0] == 7) and np.all(res_lse[1::2] == 7)  # neighbours untouched
    ref_o, ref_lse = merge_states_ref(list(os_), list(ls), "thd")
    fold = (n - 2) * np.finfo(np.float16).eps * np.abs(ref_o).max()  # the extra roundings of a fold
    got_o, got_lse = res[:, None, 1:], res_lse[::2][None]
    assert not np.isnan(got_o.astype(np.float64)).any()
    lowp = np.abs(_lowp_merge(os_[:, None], ls[:, None], np.float16)[0] - ref_o).max(initial=0)  # B = 1
    assert np.abs(got_o.astype(np.float64) - ref_o).max() <= 2 * lowp + FLOOR["float16"] + fold
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    live = np.isfinite(ref_lse)
    assert np.abs(got_lse[live] - ref_lse[live]).max(initial=0) <= 1e-5 * max(1.0, np.abs(ref_lse[live]).max())


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@gpu_test
def test_torch_stack_with_strided_lse(dtype):
    rng = np.random.default_rng(4)
    os_, ls, full_o, full_lse = _parts(rng, 2, 33, 3, 64, [0, 40, 41, 100, 260, 261], DTYPES[dtype])
    t_o = torch.from_numpy(os_).cuda()
    t_l = torch.from_numpy(np.ascontiguousarray(ls.transpose(0, 1, 3, 2))).cuda().transpose(2, 3)  # (n, B, H, S) view
    assert not t_l.is_contiguous()
    o, lse = pyattn.merge_states(t_o, t_l)
    _check(o.numpy(), lse.numpy(), full_o, full_lse, os_, ls, DTYPES[dtype])
    o, lse = pyattn.merge_states(t_o[0], t_l[0], t_o[3], t_l[3])  # the pair form, strided LSE views
    ref_o, ref_lse = merge_states_ref([os_[0], os_[3]], [ls[0], ls[3]])
    _check(o.numpy(), lse.numpy(), ref_o, ref_lse, os_[[0, 3]], ls[[0, 3]], DTYPES[dtype])

"""NumPy calls and pinned host memory on a CPU, through the fake driver of ``fake_driver.py``: the
fake leaves no per-device state behind, repeat NumPy calls validate once and stage without events,
``is_pinned`` and ``pinned_empty`` (which makes a context current when it is the first CUDA call),
and write-combined staging beside cached result memory.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fake_driver
import pyattn
from _host_path_helpers import SHAPE, _repeat_calls


def test_the_fake_leaves_no_device_state_behind():
    """What pyattn makes per device under the fake driver (the NumPy path's pipelines, device tile
    lists) is gone with it: a GPU test later in the same process once ran a NumPy call on a
    pipeline of fake streams and staging addresses, and crashed."""
    from pyattn.ops import block_sparse
    from pyattn.pipeline import chunks

    def state():
        return chunks._pipelines, dict(chunks._pipelines), block_sparse._lists, dict(block_sparse._lists)

    before = state()
    with pytest.MonkeyPatch.context() as mp, fake_driver.installed(mp):
        x = np.zeros((1, 2048, 16, 64), np.float16)  # 4 MiB each: the NumPy path pipelines it (chunks)
        pyattn.attention(x, x, x)
        made = dict(chunks._pipelines)
    assert made  # (the call made one under the fake)
    after = state()
    assert all(a is b for a, b in zip(after[::2], before[::2])) and after[1::2] == before[1::2]


def test_numpy_calls_validate_once_and_stage_without_events(gpu, cache, monkeypatch):
    """Repeat NumPy calls find their problem by signature (q, k, v are read for shape, dtype and
    strides only); a small call's staging buffer is released after its synchronisation, so it makes
    no event calls; an ``out=`` (read for its writeable flag) is validated every call."""
    from pyattn.ops import attention as att_op
    from pyattn.ops import decode as dec_op

    made = []
    for mod, name in ((att_op, "make_problem"), (dec_op, "check_query")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **k: made.append(1) or _real(*a, **k))
    q = np.ones(SHAPE, np.float16)
    calls = _repeat_calls(lambda: pyattn.attention(q, q, q))
    assert len(made) == 2  # the NumPy call's problem, and its one chunk's on the uploaded arrays
    assert not {n for n in calls if n.startswith("cuEvent")}, calls
    assert calls.get("cuMemcpyHtoDAsync") == 1 and calls.get("cuMemcpyDtoHAsync") == 1
    c, ids = cache
    qd = np.ones((2, 1, 8, 64), ml_dtypes.bfloat16)
    calls = _repeat_calls(lambda: pyattn.decode(qd, c, ids))
    assert len(made) == 3 and not {n for n in calls if n.startswith("cuEvent")}, calls
    out = np.empty(SHAPE, np.float16)
    pyattn.attention(q, q, q, out=out)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        pyattn.attention(q, q, q, out=out)


def test_is_pinned_follows_the_views_to_pyattn_pinned_memory(gpu):
    from pyattn.runtime.pinned import is_pinned

    a = pyattn.pinned_empty((4, 8), np.float16)
    assert is_pinned(a) and is_pinned(a[1:3]) and is_pinned(a.view(np.uint16).T)
    assert not is_pinned(np.zeros((4, 8), np.float16)) and not is_pinned(np.zeros(4)[1:])


def test_pinned_empty_as_a_first_cuda_call_makes_a_context_current(gpu):
    """cuMemHostAlloc needs a current context: pinned_empty before any other call must make one
    (an H200 run found CUDA_ERROR_NOT_INITIALIZED), and must leave a caller's own context alone."""
    from pyattn.runtime import pinned

    gpu.current = 0  # no context current on this thread
    fake_driver.CALLS.clear()
    a = pyattn.pinned_empty((1 << 20,), np.uint8)  # a size no pooled block has yet
    assert a.shape == (1 << 20,) and gpu.current != 0 and fake_driver.CALLS["cuCtxSetCurrent"] == 1
    fake_driver.CALLS.clear()
    pinned.PinnedBuffer(4096)  # a context is current now: no switch
    assert fake_driver.CALLS["cuCtxSetCurrent"] == 0


def test_staging_is_write_combined_and_results_are_not(gpu):
    """Uploads stage through write-combined pinned memory (the CPU only writes it, the DMA reads it
    without snooping); result arrays, which the caller reads, stay cached."""
    from cuda.bindings import driver

    wc = driver.CU_MEMHOSTALLOC_WRITECOMBINED
    before = set(gpu.host_flags)
    q = np.zeros((1, 64, 2, 64), np.float16)
    out = pyattn.attention(q, q, q)
    new = {p: f for p, f in gpu.host_flags.items() if p not in before}
    staged = [p for p, f in new.items() if f & wc]
    assert staged and all(f & driver.CU_MEMHOSTALLOC_PORTABLE for f in new.values())
    result = out.__array_interface__["data"][0]
    owner = max(p for p in new if p <= result)  # the pinned block the result views
    assert not new[owner] & wc

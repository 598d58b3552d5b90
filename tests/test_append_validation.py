"""``PagedKVCache.append`` refuses every invalid call before any device work, naming the argument
(CPU only: the cache's pools are descriptions, and the first step of device work -- the stream
rule's ``start`` for device tokens, the upload of host tokens, the append's plan and launches --
raises ``Reached`` instead). A fuzz breaks one argument of a valid append (ids, k, v, counts,
stream), host or device tokens, 4-D or packed; the valid bases themselves reach device work."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.paged.cache as cache_mod
from pyattn.paged.appender import Appender
from pyattn.runtime import device as device_mod
from test_validate_first import ARRAY_DEFECTS, BLOCKED, NAMED, Dev

H, D = 2, 32
# Defects that leave a token array valid to read (the append only reads k and v)
_READABLE = {"read-only interface"}
SEQ_ID_DEFECTS = {"unknown id": [0, 99], "repeated id": [1, 1], "bool id": [True, 0], "str id": ["0", 1],
                  "float id": [0.5, 1], "nested": [[0], 1]}
BAD_STREAMS = ["bogus", -1, 1.5, object(), 2**64]


class Reached(Exception):
    """The append got to device work."""


@pytest.fixture
def blocked(monkeypatch):
    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    def reached(*args, **kwargs):
        raise Reached()

    monkeypatch.setattr(device_mod, "_driver", _no_driver)
    for target, name in ((cache_mod, "start"), (cache_mod, "as_stream"), (cache_mod, "upload"), (Appender, "write")):
        monkeypatch.setattr(target, name, reached)


@pytest.fixture
def cache(deviceless_cache, blocked):
    c = deviceless_cache(64, 16, H, D, "float16")
    for _ in range(3):
        c.add_sequence()
    return c


def _base(draw):
    """A valid append: ([ids], k, v, kwargs) with t tokens a sequence, 4-D or packed, host or device."""
    ids = draw(st.sampled_from([[0], [0, 1], [2, 0, 1]]))
    t = draw(st.integers(1, 5))
    device, packed = draw(st.booleans()), draw(st.booleans())
    shape = (len(ids) * t, H, D) if packed else (len(ids), t, H, D)
    arr = (lambda: Dev(shape, np.float16)) if device else (lambda: np.zeros(shape, np.float16))
    kwargs = {"counts": [t] * len(ids)} if packed else {}
    return ids, arr(), arr(), kwargs


@st.composite
def broken_appends(draw):
    ids, k, v, kwargs = _base(draw)
    what = draw(st.sampled_from(["seq_ids", "k", "v", "counts", "stream", "shape"]))
    if what == "seq_ids":
        defect = draw(st.sampled_from(sorted(SEQ_ID_DEFECTS)))
        ids = SEQ_ID_DEFECTS[defect]
        if defect in ("unknown id", "repeated id"):  # (two ids: the tokens must say two sequences)
            n = 2
            k = v = np.zeros((n, 1, H, D), np.float16)
            kwargs = {}
        return ids, k, v, kwargs, f"seq_ids {defect}", "seq_ids"
    if what in ("k", "v"):
        defect = draw(st.sampled_from(sorted(set(ARRAY_DEFECTS) - _READABLE)))
        good = k if what == "k" else v
        shape = good.shape if hasattr(good, "shape") else good.__cuda_array_interface__["shape"]
        bad = ARRAY_DEFECTS[defect](tuple(shape), np.float16)
        k, v = (bad, v) if what == "k" else (k, bad)
        return ids, k, v, kwargs, f"{what} {defect}", r"k|v"
    if what == "shape":  # the cache's heads or head dim, or k and v disagreeing
        shape = (len(ids), 1, draw(st.sampled_from([H + 1, H])), draw(st.sampled_from([D, D + 8])))
        if shape[2:] == (H, D):
            shape = (len(ids) + 1, 1, H, D)  # one token row too many for the ids
        return ids, np.zeros(shape, np.float16), np.zeros(shape, np.float16), {}, f"shape {shape}", \
            r"k|v"
    if what == "counts":
        n = len(ids)
        if "counts" in kwargs:  # packed tokens: t a sequence
            t = kwargs["counts"][0]
            bad = draw(st.sampled_from([None, [t] * (n - 1) + [t + 1], [t] * n + [0], [-1] + [t] * (n - 1),
                                        [float(t)] * n, [True] * n if t != 1 else [2.5] * n, n * t, "1" * n]))
        else:  # 4-D tokens take no counts
            bad = draw(st.sampled_from([[1] * n, (1,) * n, np.ones(n, np.int32)]))
        kwargs = {} if bad is None else {"counts": bad}
        return ids, k, v, kwargs, f"counts={bad!r}", r"counts|k"
    bad = draw(st.sampled_from(BAD_STREAMS))
    return ids, k, v, dict(kwargs, stream=bad), f"stream={bad!r}", "stream"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=broken_appends())
def test_invalid_appends_are_refused_before_device_work(cache, call):
    ids, k, v, kwargs, what, names = call
    version = cache.book.version
    try:
        cache.append(ids, k, v, **kwargs)
    except (ValueError, TypeError) as exc:
        assert re.match(NAMED, str(exc)), f"append with {what}: message names no argument: {exc}"
        assert re.match(rf"^({names})\b", str(exc)), f"append with {what}: names another argument: {exc}"
        assert cache.book.version == version, f"append with {what} changed the book before refusing"
        return
    except (Reached, pyattn.NoDeviceError) as exc:
        pytest.fail(f"append with {what} reached device work: {exc!r}")
    pytest.fail(f"append with {what} was accepted")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_valid_bases_reach_the_driver(cache, data):
    ids, k, v, kwargs = _base(data.draw)
    with pytest.raises(Reached):
        cache.append(ids, k, v, **kwargs)


@pytest.mark.parametrize("paths, sizes, error", [
    ([[5, 2]], 4, "paths: expected ascending tree indices"),
    ("x", 4, "paths: expected a 1-D sequence of ints"),
    ([[0]], 99, "tree_sizes: expected 0 <= tree size"),
    ([[0], [1]], 4, "paths, tree_sizes: expected one per sequence"),
    ([[0.5]], 4, "paths: expected a 1-D sequence of ints"),
])
def test_accept_checks_everything_before_device_work(cache, paths, sizes, error):
    """accept used to activate the device and look its kernel up before its paths were checked."""
    cache.book.plan_append([0], [8])
    version = cache.book.version
    with pytest.raises((ValueError, TypeError), match=f"^{re.escape(error)}"):
        cache.accept([0], paths, sizes)
    assert cache.book.version == version


def test_block_table_pad_must_be_an_int32(cache):
    with pytest.raises(TypeError, match="^pad: expected an int, got str"):
        cache.block_table([0], pad="x")
    with pytest.raises(ValueError, match="^pad: expected an int32"):
        cache.block_table([0], pad=2**40)
    assert cache.block_table([0], pad=-7)[0].dtype == np.int32

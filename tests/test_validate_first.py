"""Every invalid call is refused before any device work, naming the argument (hypothesis fuzz).

A valid call of random shapes is built for each entry point, then exactly one defect is injected
(a wrong dtype, rank, shape, place, array interface, option value or type, a number outside
float32's range, a bad stream, ...). The driver is blocked: a call that got past validation would
raise the blocking NoDeviceError, which fails the test, and so does any exception other than a
``ValueError``/``TypeError`` whose message starts with an argument's name. Runs with or without a
GPU.
"""

from __future__ import annotations

import re
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
import pyattn.runtime.device as device_mod

BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCKED = "driver blocked by test_validate_first"
NAMED = r"^[A-Za-z_][\w\[\], /]*: "  # "q: ...", "os[1]: ...", "block_table, seq_lens: ...", "merge_states: ..."


class Dev:
    """A CUDA array seen through its array interface only (16-byte aligned fake address)."""

    def __init__(self, shape, dtype=np.float16, strides=None, **extra):
        dt = np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "data": (0x100000, False),
                                         "strides": strides, "version": 3, **extra}


def _malformed(shape, dtype):
    return types.SimpleNamespace(__cuda_array_interface__={"shape": shape, "data": (0x100000, False), "version": 3})


# Defects of an array argument (one per call): each a function of the valid (shape, dtype).
ARRAY_DEFECTS = {
    "float64": lambda shape, dt: np.zeros(shape, np.float64),
    "complex": lambda shape, dt: np.zeros(shape, np.complex64),
    "rank+1": lambda shape, dt: np.zeros((1, *shape), dt),
    "rank-1": lambda shape, dt: np.zeros(shape[1:], dt),
    "list": lambda shape, dt: [[1, 2], [3, 4]],
    "str": lambda shape, dt: "q",
    "object array": lambda shape, dt: np.empty(shape, object),
    "negative dim (device)": lambda shape, dt: Dev((*shape[:-1], -shape[-1]), dt),
    "malformed interface": _malformed,
    "read-only interface": lambda shape, dt: types.SimpleNamespace(__cuda_array_interface__={
        "shape": shape, "typestr": np.dtype(dt).str, "data": (0x100000, True), "version": 3}),
    "interface stream 0": lambda shape, dt: Dev(shape, dt, stream=0),
}


def _bad_value(draw, name):
    options = {
        "scale": [0, -1.0, float("nan"), float("inf"), 1e300, 1e-300, "0.1", True],
        "softcap": [0, -1.0, float("inf"), 1e39, "1"],
        "window": [(1,), (-2, 0), (2**31, 0), "x", (1.5, 0), (True, 0)],
        "causal": [1, "yes", None, 2.0],
        "layout": ["bhds", None, 3],
        "stream": ["bogus", -1, 1.5, object(), 2**64],
        "return_lse": ["yes", 1, None],
        "allow_tf32": ["yes", 1],
        "num_splits": [0, 257, 1.5, True],
        "max_seqlen_q": [2**31, -1, "x", 1.5],
        "alibi_slopes": [np.full(4, np.inf), np.full(4, 1e39), np.ones(3), np.ones(4, np.int32)],
        # (41, 41): broadcastable to no call drawn here (S <= 40); a (7, 7) mask was valid at S = 7
        "mask": [np.full((1, 1, 1, 1), np.nan), np.full((1, 1, 1, 1), 1e39), np.ones((41, 41), bool)],
        "tensor_layout": ["bsdh"],
        "block_size": [(15, 16), (16,), (0, 16), ("a", 16)],
        "deterministic": ["yes", 1, None],
        "r": [0, 1000, -1, 1.5, True, "4", None],
        "k": [0, -3, 2**31, 2.5, False, None, "8"],
        "return_indices": ["yes", 1, None],
        "select": ["heads", 1, None, "GROUP"],
    }[name]
    return draw(st.sampled_from(options))


@pytest.fixture
def blocked(monkeypatch):
    def _no_driver():
        raise pyattn.NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", BLOCKED, "cuInit")

    monkeypatch.setattr(device_mod, "_driver", _no_driver)


@st.composite
def calls(draw):
    """``(entry name, function, positional args, keyword args, what was broken)``."""
    entry = draw(st.sampled_from(["attention", "attention_varlen", "sparse_attention", "block_sparse_attention",
                                  "merge_states", "paged_decode", "contiguous_decode", "decode", "prefill",
                                  "verify_tree", "paged_prefill",
                                  "attention_backward", "attention_varlen_backward",
                                  "sparq_decode"]))
    B, S, H, D = draw(st.integers(1, 3)), draw(st.integers(1, 40)), 4, draw(st.sampled_from([32, 64]))
    dt = draw(st.sampled_from([np.float16, BF16]))
    device = draw(st.booleans())
    arr = (lambda shape: Dev(shape, dt)) if device else (lambda shape: np.zeros(shape, dt))
    if entry in ("attention", "sparse_attention", "block_sparse_attention"):
        shapes = {"q": (B, S, H, D), "k": (B, S, 2, D), "v": (B, S, 2, D)}
        args = [arr(shapes[n]) for n in ("q", "k", "v")]
        kwargs = {}
        if entry == "sparse_attention":
            args += [np.arange(S, dtype=np.int32), np.arange(S + 1, dtype=np.int32).clip(0, S)]
        if entry == "block_sparse_attention":
            nb = -(-S // 16)
            args += [np.ones((nb, nb), bool), (16, 16)]
        options = {"attention": ["scale", "softcap", "window", "causal", "layout", "stream", "return_lse", "allow_tf32",
                                 "alibi_slopes", "mask"],
                   "sparse_attention": ["scale", "layout", "stream", "return_lse"],
                   "block_sparse_attention": ["scale", "softcap", "window", "causal", "tensor_layout", "stream",
                                              "return_lse", "block_size"]}[entry]
        names = ["q", "k", "v"]
    elif entry == "attention_varlen":
        T = B * S
        args = [arr((T, H, D)), arr((T, 2, D)), arr((T, 2, D))]
        cu = np.arange(B + 1, dtype=np.int32) * S
        args += [cu if not device else Dev((B + 1,), np.int32), cu if not device else Dev((B + 1,), np.int32)]
        kwargs, names = {}, ["q", "k", "v"]
        options = ["scale", "softcap", "window", "causal", "stream", "return_lse", "max_seqlen_q"]
    elif entry == "attention_backward":  # (dout, q, k, v, out, lse): the forward's arrays and its LSE
        f32 = (lambda shape: Dev(shape, np.float32)) if device else (lambda shape: np.zeros(shape, np.float32))
        args = [arr((B, S, H, D)), arr((B, S, H, D)), arr((B, S, 2, D)), arr((B, S, 2, D)), arr((B, S, H, D)),
                f32((B, H, S))]
        kwargs, names = {}, ["dout", "q", "k", "v", "out", "lse"]
        options = ["scale", "softcap", "window", "causal", "layout", "stream", "alibi_slopes", "deterministic"]
    elif entry == "attention_varlen_backward":
        T = B * S
        f32 = (lambda shape: Dev(shape, np.float32)) if device else (lambda shape: np.zeros(shape, np.float32))
        cu = np.arange(B + 1, dtype=np.int32) * S
        args = [arr((T, H, D)), arr((T, H, D)), arr((T, 2, D)), arr((T, 2, D)), arr((T, H, D)), f32((H, T))]
        args += [cu if not device else Dev((B + 1,), np.int32), cu if not device else Dev((B + 1,), np.int32)]
        kwargs, names = {}, ["dout", "q", "k", "v", "out", "lse"]
        options = ["scale", "softcap", "window", "causal", "stream", "max_seqlen_q", "deterministic"]
    elif entry == "merge_states":
        o = arr((B, S, H, D))
        lse = np.zeros((B, H, S), np.float32) if not device else Dev((B, H, S), np.float32)
        args, kwargs, names, options = [o, lse, o, lse], {}, ["o_a", "lse_a", "o_b", "lse_b"], ["layout", "stream"]
    elif entry in ("prefill", "verify_tree"):  # new tokens over a cache whose sequences hold S tokens each
        packed = draw(st.booleans())
        args = [arr((B * S, H, D)) if packed else arr((B, S, H, D)), "SERVE_CACHE", list(range(B))]
        names = ["q"]
        if entry == "verify_tree":
            parents = np.arange(-1, S - 1, dtype=np.int32)
            args.append(np.tile(parents, B) if packed else np.tile(parents, (B, 1)))
            names.append("parents")
        kwargs = {"cu_seqlens_q": np.arange(B + 1, dtype=np.int32) * S} if packed else {}
        options = ["scale", "softcap", "stream", "num_splits", "return_lse"]
        if entry == "prefill":
            options += ["window", "causal", "alibi_slopes"]
    elif entry == "paged_prefill":  # new tokens over the caller's pools: each sequence S + 2 tokens in 3 pages of 16
        packed = draw(st.booleans())
        pool = Dev((8, 16, 2, D), dt)
        args, names = [arr((B * S, H, D)) if packed else arr((B, S, H, D)), pool, pool], ["q", "k_pool", "v_pool"]
        kwargs = {"block_table": np.zeros((B, 3), np.int32), "seq_lens": np.full(B, S + 2, np.int32)}
        if packed:
            kwargs["cu_seqlens_q"] = np.arange(B + 1, dtype=np.int32) * S
        options = ["scale", "softcap", "window", "causal", "layout", "stream", "num_splits", "return_lse",
                   "alibi_slopes", "max_seqlen_q"]
    else:  # decode over pools or a cache: q is (batch, q_len, Hq, D)
        args = [arr((B, 1, H, D))]
        names, options = ["q"], ["scale", "softcap", "window", "causal", "stream", "num_splits", "return_lse"]
        if entry == "sparq_decode":
            args += [draw(st.just("SPARQ")), list(range(B))]
            kwargs = {"r": draw(st.integers(1, D)), "k": draw(st.integers(1, 64))}
            options = ["scale", "stream", "return_indices", "r", "k", "select"]
        elif entry == "paged_decode":
            pool = Dev((8, 16, 2, D), dt)
            args += [pool, pool]
            kwargs = {"block_table": np.zeros((B, 2), np.int32), "seq_lens": np.full(B, 3, np.int32)}
        elif entry == "contiguous_decode":
            kc = Dev((B, 24, 2, D), dt)
            args += [kc, kc, np.full(B, 3, np.int32)]
            names, kwargs = ["q", "k_cache", "v_cache", "cache_seqlens"], {}
            if draw(st.booleans()):  # new tokens written by the call (keyword arrays)
                kwargs = {"k_new": arr((B, 2, 2, D)), "v_new": arr((B, 2, 2, D))}
                names += ["k_new", "v_new"]
            options.append("layout")
        else:
            args.append(draw(st.just("CACHE")))  # replaced by the test's cache
            args.append(list(range(B)))
            kwargs = {}
    defect = draw(st.sampled_from(["array", "option"]))
    if defect == "array":
        n = draw(st.integers(0, len(names) - 1))
        what = draw(st.sampled_from(sorted(ARRAY_DEFECTS)))
        where = kwargs if names[n] in kwargs else args  # (keyword arrays: contiguous_decode's k_new, v_new)
        i = names[n] if where is kwargs else {"parents": 3}.get(names[n], n)  # (verify_tree's parents follow the cache)
        good = where[i]
        shape = tuple(good.shape) if hasattr(good, "shape") else tuple(good.__cuda_array_interface__["shape"])
        where[i] = ARRAY_DEFECTS[what](shape, good.dtype if names[n] == "parents" else dt)
        return entry, args, kwargs, f"{names[n]} {what}"
    name = draw(st.sampled_from(options))
    value = _bad_value(draw, name)
    if name == "block_size":
        args[4] = value
    else:
        kwargs[name] = value
    return entry, args, kwargs, f"{name}={value!r}"


@pytest.fixture
def cache(deviceless_cache):
    """A PagedKVCache made without a GPU (its pools are descriptions, never touched)."""
    caches = {}

    def make(D, dt, lengths=None, sparq=False):
        if lengths is not None:  # a fresh cache whose sequences hold these many tokens (host bookkeeping only)
            c = pyattn.PagedKVCache(64, 16, 2, D, dt)
            ids = [c.add_sequence() for _ in lengths]
            c.book.plan_append(ids, lengths)
            return c
        if (D, dt, sparq) not in caches:
            c = caches[(D, dt, sparq)] = pyattn.PagedKVCache(32, 16, 2, D, dt, sparq=sparq)
            for _ in range(3):
                c.add_sequence()
            if sparq:  # SparQ refuses empty sequences: give them tokens (bookkeeping only, no launch)
                c.book.plan_append([0, 1, 2], [5, 17, 1])
        return caches[(D, dt, sparq)]
    return make


def _tokens(args) -> int:
    """Tokens per sequence of a prefill / verify_tree call's valid base (the tree size for a tree)."""
    q, ids = args[0], args[2]
    shape = q.shape if hasattr(q, "shape") else q.__cuda_array_interface__["shape"] if hasattr(
        q, "__cuda_array_interface__") else (len(ids), 1)
    return max(1, shape[1] if len(shape) == 4 else shape[0] // max(1, len(ids)))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(call=calls())
def test_invalid_calls_are_refused_before_device_work(blocked, cache, call):
    entry, args, kwargs, what = call
    if entry in ("decode", "sparq_decode"):
        q = args[0]
        D = q.shape[-1] if hasattr(q, "shape") and len(q.shape) == 4 else 32
        dt = q.dtype if isinstance(q, np.ndarray) and q.dtype in (np.float16, BF16) else np.float16
        args[1] = cache(D, dt, sparq=entry == "sparq_decode")
    if entry in ("prefill", "verify_tree"):
        q = args[0]
        D = q.shape[-1] if hasattr(q, "shape") and len(q.shape) in (3, 4) else 32
        dt = q.dtype if isinstance(q, np.ndarray) and q.dtype in (np.float16, BF16) else np.float16
        args[1] = cache(D, dt, lengths=[_tokens(args)] * len(args[2]))
    try:
        getattr(pyattn, entry)(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        assert re.match(NAMED, str(exc)), f"{entry} with {what}: message names no argument: {exc}"
        return
    except pyattn.NoDeviceError as exc:
        pytest.fail(f"{entry} with {what} reached the driver: {exc}")
    pytest.fail(f"{entry} with {what} was accepted")


def test_the_fuzz_reaches_the_driver_with_valid_calls(blocked, cache):
    """The generator's base calls are valid: without a defect, each entry point gets to the driver."""
    q, kv = np.zeros((1, 8, 4, 32), np.float16), np.zeros((1, 8, 2, 32), np.float16)
    valid = [
        lambda: pyattn.attention(q, kv, kv, causal=True),
        lambda: pyattn.sparse_attention(q, kv, kv, np.arange(8, dtype=np.int32), np.arange(9, dtype=np.int32).clip(0, 8)),
        lambda: pyattn.block_sparse_attention(q, kv, kv, np.ones((1, 1), bool), (16, 16)),
        lambda: pyattn.attention_varlen(q[0], kv[0], kv[0], np.array([0, 8], np.int32), np.array([0, 8], np.int32)),
        lambda: pyattn.merge_states(q, np.zeros((1, 4, 8), np.float32), q, np.zeros((1, 4, 8), np.float32)),
        lambda: pyattn.paged_decode(np.zeros((1, 1, 4, 32), np.float16), Dev((8, 16, 2, 32)), Dev((8, 16, 2, 32)),
                                    block_table=np.zeros((1, 2), np.int32), seq_lens=np.full(1, 3, np.int32)),
        lambda: pyattn.contiguous_decode(np.zeros((2, 1, 4, 32), np.float16), Dev((2, 24, 2, 32)), Dev((2, 24, 2, 32)),
                                         np.array([3, 24], np.int32)),
        lambda: pyattn.contiguous_decode(Dev((2, 3, 4, 32)), Dev((2, 2, 64, 32)), Dev((2, 2, 64, 32)), 5, layout="hnd"),
        lambda: pyattn.contiguous_decode(np.zeros((2, 1, 4, 32), np.float16), Dev((2, 24, 2, 32)), Dev((2, 24, 2, 32)),
                                         3, k_new=np.zeros((2, 2, 2, 32), np.float16),
                                         v_new=np.zeros((2, 2, 2, 32), np.float16)),
        lambda: pyattn.decode(np.zeros((1, 1, 4, 32), np.float16), cache(32, np.float16), [0]),
        lambda: pyattn.prefill(np.zeros((1, 8, 4, 32), np.float16), cache(32, np.float16, [20]), [0]),
        lambda: pyattn.prefill(Dev((8, 4, 32)), cache(32, np.float16, [20, 8]), [0, 1],
                               np.array([0, 3, 8], np.int32)),
        lambda: pyattn.paged_prefill(np.zeros((1, 8, 4, 32), np.float16), Dev((8, 16, 2, 32)), Dev((8, 16, 2, 32)),
                                     block_table=np.zeros((1, 2), np.int32), seq_lens=np.full(1, 20, np.int32)),
        lambda: pyattn.paged_prefill(Dev((8, 4, 32)), Dev((8, 2, 16, 32)), Dev((8, 2, 16, 32)), np.array([0, 3, 8], np.int32),
                                     indptr=np.array([0, 1, 3], np.int32), indices=np.array([4, 0, 7], np.int32),
                                     last_page_len=np.array([9, 1], np.int32), layout="hnd"),
        lambda: pyattn.verify_tree(np.zeros((1, 3, 4, 32), np.float16), cache(32, np.float16, [9]), [0],
                                   np.array([[-1, 0, 0]], np.int32)),
        lambda: pyattn.attention_backward(q, q, kv, kv, q, np.zeros((1, 4, 8), np.float32), causal=True),
        lambda: pyattn.attention_varlen_backward(q[0], q[0], kv[0], kv[0], q[0], np.zeros((4, 8), np.float32),
                                                 np.array([0, 8], np.int32), np.array([0, 8], np.int32)),
        lambda: pyattn.sparq_decode(np.zeros((1, 1, 4, 32), np.float16), cache(32, np.float16, sparq=True), [0], r=8, k=4),
        lambda: pyattn.sparq_decode(Dev((2, 1, 4, 32)), cache(32, np.float16, sparq=True), [1, 2], r=32, k=1),
    ]
    for call in valid:
        with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
            call()


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value", [2**31, -1])
def test_varlen_max_seqlen_out_of_range_is_refused_before_the_lengths_are_fetched(blocked, name, value):
    """Device cu_seqlens are copied back for their range check; a max_seqlen no int32 holds is known
    bad before that copy (the fuzz found it on a GPU machine, where the copy could run)."""
    a = [Dev((8, 4, 32)), Dev((8, 2, 32)), Dev((8, 2, 32)), Dev((3,), np.int32), Dev((3,), np.int32)]
    with pytest.raises(ValueError, match=f"^{name}: "):
        pyattn.attention_varlen(*a, **{name: value})

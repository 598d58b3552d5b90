"""Validation of the prefill options (mask, window, causal modes, soft-cap, ALiBi, out=) and of
``attention_varlen`` (CPU only: every bad call raises before any GPU work, naming the argument)."""

from __future__ import annotations

import numpy as np
import pytest

import pyattn
from _problems import problem, varlen_problem
from _validation_helpers import KV, Q, dev, host


def _bad(exc, match, **kw):
    return (exc, match, kw)


BAD_OPTIONS = {
    "causal int": _bad(TypeError, r"^causal: expected a bool", causal=1),
    "causal typo": _bad(ValueError, r"^causal: expected False, True, 'bottom_right' or 'top_left'", causal="top"),
    "window scalar": _bad(ValueError, r"^window: expected a \(left, right\) pair", window=4),
    "window triple": _bad(ValueError, r"^window: expected a \(left, right\) pair", window=(1, 2, 3)),
    "window float": _bad(TypeError, r"^window: left must be an int", window=(1.5, 0)),
    "window -2": _bad(ValueError, r"^window: right must be -1 \(unbounded\)", window=(0, -2)),
    "softcap 0": _bad(ValueError, r"^softcap: expected a finite positive number", softcap=0.0),
    "softcap inf": _bad(ValueError, r"^softcap: expected a finite positive number", softcap=float("inf")),
    "softcap str": _bad(TypeError, r"^softcap: expected a positive number", softcap="1"),
    "mask int": _bad(TypeError, r"^mask: expected dtype bool, float16, bfloat16 or float32, got int32",
                     mask=np.ones((5, 7), np.int32)),
    "mask wrong Sk": _bad(ValueError, r"^mask: expected a shape broadcastable to \(B, Hq, Sq, Sk\) = "
                                      r"\(2, 4, 5, 7\), got \(5, 6\)", mask=np.ones((5, 6), bool)),
    "mask 5-D": _bad(ValueError, r"^mask: expected a shape broadcastable", mask=np.ones((1, 2, 4, 5, 7), bool)),
    "mask heads=2": _bad(ValueError, r"^mask: expected a shape broadcastable", mask=np.ones((2, 2, 5, 7), bool)),
    "mask nan": _bad(ValueError, r"^mask: a float mask may hold finite float32 values or -inf",
                     mask=np.full((5, 7), np.nan, np.float32)),
    "mask +inf": _bad(ValueError, r"^mask: a float mask may hold", mask=np.full((5, 7), np.inf)),
    "mask list": _bad(TypeError, r"^mask: expected a NumPy array or a CUDA array", mask=[[True]]),
    "alibi shape": _bad(ValueError, r"^alibi_slopes: expected shape \(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\), "
                                    r"got \(2,\)", alibi_slopes=np.ones(2, np.float32)),
    "alibi int": _bad(TypeError, r"^alibi_slopes: expected a float dtype", alibi_slopes=np.ones(4, np.int64)),
    "alibi nan": _bad(ValueError, r"^alibi_slopes: must be finite", alibi_slopes=np.full(4, np.nan)),
    "alibi device f16": _bad(TypeError, r"^alibi_slopes: a device array must be float32",
                             alibi_slopes=dev((4,), np.float16)),
    "out shape": _bad(ValueError, r"^out: expected shape \(2, 5, 4, 64\), got \(2, 5, 4, 32\)",
                      out=np.empty((2, 5, 4, 32), np.float16)),
    "out dtype": _bad(TypeError, r"^out: expected dtype float16, got float32", out=np.empty(Q, np.float32)),
    "out device for host q": _bad(TypeError, r"^out: expected a NumPy array like q", out=dev(Q, np.float16)),
    "out read-only": _bad(ValueError, r"^out: the array is read-only",
                          out=np.lib.stride_tricks.as_strided(np.empty(Q, np.float16), writeable=False)),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_options_raise_naming_the_argument(case, blocked_driver):
    exc, match, kw = BAD_OPTIONS[case]
    q, kv = host(Q, np.float16), host(KV, np.float16)
    with pytest.raises(exc, match=match):
        pyattn.attention(q, kv, kv, **kw)
    with pytest.raises(exc, match=match):
        problem(q, kv, kv, **kw)


def test_device_out_must_have_contiguous_head_dim():
    q, kv = dev(Q, np.float16), dev(KV, np.float16)
    with pytest.raises(ValueError, match=r"^out: the head_dim axis must be contiguous"):
        problem(q, kv, kv, out=dev(Q, np.float16, strides=(5 * 4 * 128, 4 * 128, 128, 4)))
    with pytest.raises(TypeError, match=r"^out: expected a device array like q"):
        problem(q, kv, kv, out=np.empty(Q, np.float16))


@pytest.mark.parametrize("shape, strides", [
    ((5, 7), (0, 0, 7, 1)),              # (Sq, Sk): broadcast over batch and heads
    ((1, 4, 1, 7), (0, 7, 0, 1)),        # per head and key
    ((2, 1, 5, 7), (35, 0, 7, 1)),       # per batch entry
    ((7,), (0, 0, 0, 1)),
    ((2, 4, 5, 7), (140, 35, 7, 1)),
])
def test_host_mask_strides_are_zero_on_broadcast_axes(shape, strides):
    q, kv = host(Q, np.float16), host(KV, np.float16)
    p = problem(q, kv, kv, mask=np.ones(shape, bool))
    assert p.mask.kind == "bool" and p.mask.strides == strides and not p.mask.on_device


def test_device_mask_keeps_its_strides_and_kind():
    q, kv = dev(Q, np.float16), dev(KV, np.float16)
    m = dev((4, 5, 7), np.float16, strides=(2 * 80, 2 * 8, 2))  # a padded-row view
    p = problem(q, kv, kv, mask=m)
    assert p.mask.kind == "f16" and p.mask.strides == (0, 80, 8, 1) and p.mask.on_device
    p = problem(q, kv, kv, mask=dev((5, 7), np.float32))
    assert p.mask.kind == "f32"
    p = problem(host(Q), host(KV), host(KV), mask=np.zeros((5, 7)))  # host float64 -> f32
    assert p.mask.kind == "f32"


def test_options_reach_the_problem():
    q, kv = host(Q, np.float16), host(KV, np.float16)
    p = problem(q, kv, kv, causal="top_left", window=(3, -1), softcap=30,
                        alibi_slopes=np.ones((2, 4)))
    assert (p.causal, p.window, p.softcap, p.alibi.stride_b) == (2, (3, -1), 30.0, 4)
    p = problem(q, kv, kv, causal="bottom_right", alibi_slopes=np.ones(4, np.float32))
    assert (p.causal, p.window, p.softcap, p.alibi.stride_b, p.mask) == (1, (-1, -1), 0.0, 0, None)


# -- varlen ---------------------------------------------------------------------------------
def _varlen(**kw):
    args = dict(q=host((10, 4, 64), np.float16), k=host((12, 2, 64), np.float16), v=host((12, 2, 64), np.float16),
                cu_seqlens_q=np.array([0, 4, 10], np.int32), cu_seqlens_k=np.array([0, 5, 12], np.int32))
    args.update(kw)
    return args


BAD_VARLEN = {
    "q 4-D": _bad(ValueError, r"^q: expected a 3-D array \(total_tokens, heads, head_dim\)",
                  q=host((1, 10, 4, 64), np.float16)),
    "v shape": _bad(ValueError, r"^v: expected the same shape as k", v=host((12, 1, 64), np.float16)),
    "cu int64": _bad(TypeError, r"^cu_seqlens_q: expected dtype int32, got int64",
                     cu_seqlens_q=np.array([0, 4, 10])),
    "cu 2-D": _bad(ValueError, r"^cu_seqlens_k: expected shape \(num_seqs \+ 1,\)",
                   cu_seqlens_k=np.zeros((1, 3), np.int32)),
    "cu not from 0": _bad(ValueError, r"^cu_seqlens_q: must start at 0", cu_seqlens_q=np.array([1, 4, 10], np.int32)),
    "cu decreasing": _bad(ValueError, r"^cu_seqlens_k: must start at 0, be non-decreasing",
                          cu_seqlens_k=np.array([0, 7, 5, 12], np.int32), cu_seqlens_q=np.array([0, 4, 6, 10], np.int32)),
    "cu wrong end": _bad(ValueError, r"^cu_seqlens_q: .*end at the packed length 10",
                         cu_seqlens_q=np.array([0, 4, 9], np.int32)),
    "cu count": _bad(ValueError, r"^cu_seqlens_k: expected 3 entries", cu_seqlens_k=np.array([0, 12], np.int32)),
    "max too small": _bad(ValueError, r"^max_seqlen_q: expected an int in \[the longest sequence \(6\)",
                          max_seqlen_q=5),
    "cu device for host q": _bad(TypeError, r"^cu_seqlens_q: expected a NumPy array like q",
                                 cu_seqlens_q=dev((3,), np.int32)),
    "alibi per-seq shape": _bad(ValueError, r"^alibi_slopes: expected shape \(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\)",
                                alibi_slopes=np.ones((3, 4), np.float32)),
    "mask given": _bad(TypeError, r"mask", mask=np.ones((10, 12), bool)),
}


@pytest.mark.parametrize("case", sorted(BAD_VARLEN))
def test_bad_varlen_input_raises_naming_the_argument(case, blocked_driver):
    exc, match, kw = BAD_VARLEN[case]
    with pytest.raises(exc, match=match):
        pyattn.attention_varlen(**_varlen(**kw))


def test_varlen_problem_fields():
    p, (cu_q, cu_k) = varlen_problem(**_varlen(causal=True, window=(8, 0)))
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (2, 4, 2, 6, 7, 64)
    assert p.layout == "thd" and p.total_q == 10 and p.out_shape() == (10, 4, 64)
    assert p.q_strides == (0, 4 * 64, 64) and p.k_strides == (0, 2 * 64, 64)
    assert (p.causal, p.window) == (1, (8, 0)) and cu_q.tolist() == [0, 4, 10] and cu_k.tolist() == [0, 5, 12]
    p, _ = varlen_problem(**_varlen(max_seqlen_q=100))
    assert p.seqlen_q == 100


def test_allow_tf32_must_be_a_bool(blocked_driver):
    q, kv = host(Q), host(KV)
    with pytest.raises(TypeError, match=r"^allow_tf32: expected a bool, got int"):
        pyattn.attention(q, kv, kv, allow_tf32=1)
    with pytest.raises(TypeError, match=r"^allow_tf32: expected a bool"):
        pyattn.attention_varlen(**_varlen(allow_tf32="yes"))

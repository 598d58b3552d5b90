"""Input validation of ``pyattn.attention`` (CPU only): rejected calls and the problem
(``validate.attention.make_problem``) read from valid ones.

Every bad call must raise ``ValueError``/``TypeError`` naming the argument *before* any GPU
work. There is no GPU in CI, so a call that slips past validation reaches the driver and raises
``pyattn.NoDeviceError`` instead, which ``pytest.raises(ValueError/TypeError)`` does not accept.
The tests that need a call to reach the driver block it with the ``blocked_driver`` fixture
(conftest.py), so they behave the same on a machine that has a GPU. Accepted calls and the reading
of array inputs (CUDA array interface, DLPack, ``DeviceArray``) are in test_validation_inputs.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyattn
from _problems import problem
from _validation_helpers import BF16, BLOCKED, KV, Q, dev, host
from pyattn.validate.attention import AttentionProblem


# --------------------------------------------------------------------------------------------
# Rejected calls: (q, k, v, kwargs, exception, regex the message must match)
# --------------------------------------------------------------------------------------------
def _case(q, k, v, exc, match, **kwargs):
    return (q, k, v, kwargs, exc, match)


BAD = {
    # ranks
    "q 3-D": _case(host((5, 4, 64)), host(KV), host(KV), ValueError, r"^q: expected a 4-D array"),
    "k 5-D": _case(host(Q), host((1,) + KV), host(KV), ValueError, r"^k: expected a 4-D array"),
    "v 3-D": _case(host(Q), host(KV), host((7, 2, 64)), ValueError, r"^v: expected a 4-D array"),
    "q 2-D bhsd": _case(host((5, 64)), host(KV), host(KV), ValueError,
                        r"^q: expected a 4-D array \(batch, heads, seq, head_dim\)", layout="bhsd"),
    # shape agreement
    "batch mismatch": _case(host(Q), host((3, 7, 2, 64)), host((3, 7, 2, 64)), ValueError,
                            r"^k: expected batch 2 \(from q\), got 3"),
    "head_dim mismatch": _case(host(Q), host((2, 7, 2, 32)), host((2, 7, 2, 32)), ValueError,
                               r"^k: expected head_dim 64 \(from q\), got 32"),
    "v seq != k seq": _case(host(Q), host(KV), host((2, 8, 2, 64)), ValueError,
                            r"^v: expected the same shape as k"),
    "v heads != k heads": _case(host(Q), host(KV), host((2, 7, 1, 64)), ValueError,
                                r"^v: expected the same shape as k"),
    "v head_dim != k head_dim": _case(host(Q), host(KV), host((2, 7, 2, 128)), ValueError,
                                      r"^v: expected the same shape as k"),
    "Hq not multiple of Hkv": _case(host((2, 5, 3, 64)), host(KV), host(KV), ValueError,
                                    r"^k: query heads \(3\) must be a multiple of key/value heads \(2\)"),
    "Hkv = 0": _case(host(Q), host((2, 7, 0, 64)), host((2, 7, 0, 64)), ValueError, r"^k: query heads"),
    # head_dim range
    "head_dim 60": _case(host((2, 5, 4, 60)), host((2, 7, 2, 60)), host((2, 7, 2, 60)), ValueError,
                         r"head_dim must be a multiple of 8 in \[8, 256\], got 60"),
    "head_dim 4": _case(host((2, 5, 4, 4)), host((2, 7, 2, 4)), host((2, 7, 2, 4)), ValueError,
                        r"head_dim .* got 4"),
    "head_dim 0": _case(host((2, 5, 4, 0)), host((2, 7, 2, 0)), host((2, 7, 2, 0)), ValueError,
                        r"head_dim .* got 0"),
    "head_dim 264": _case(host((1, 5, 1, 264)), host((1, 7, 1, 264)), host((1, 7, 1, 264)), ValueError,
                          r"head_dim .* got 264"),
    # dtypes
    "float64": _case(host(Q, np.float64), host(KV, np.float64), host(KV, np.float64), TypeError,
                     r"^q: expected dtype float32, float16, bfloat16 or float8_e4m3fn, got float64"),
    "int32": _case(host(Q, np.int32), host(KV, np.int32), host(KV, np.int32), TypeError,
                   r"^q: expected dtype .* got int32"),
    "v alone float64": _case(host(Q), host(KV), host(KV, np.float64), TypeError,
                             r"^v: expected dtype .* got float64"),
    "mixed f16/f32": _case(host(Q, np.float16), host(KV, np.float32), host(KV, np.float16), TypeError,
                           r"^q, k, v: expected one dtype, got q float16, k float32, v float16"),
    "mixed bf16/f16": _case(host(Q, BF16), host(KV, BF16), host(KV, np.float16), TypeError,
                            r"^q, k, v: expected one dtype"),
    "device float64": _case(dev(Q, np.float64), dev(KV, np.float64), dev(KV, np.float64), TypeError,
                            r"^q: expected dtype .* got float64"),
    # not arrays / host mixed with device
    "q is a list": _case(host(Q).tolist(), host(KV), host(KV), TypeError,
                         r"^q: expected a NumPy array or a CUDA array"),
    "v is None": _case(host(Q), host(KV), None, TypeError, r"^v: expected a NumPy array"),
    "q host, k/v device": _case(host(Q), dev(KV), dev(KV), TypeError,
                                r"^q, k, v: expected all host \(NumPy\) or all device arrays, "
                                r"got q on host, k on device, v on device"),
    "v device only": _case(host(Q), host(KV), dev(KV), TypeError, r"v on device"),
    # layout / causal / scale
    "layout bsdh": _case(host(Q), host(KV), host(KV), ValueError, r"^layout: expected one of", layout="bsdh"),
    "layout upper case": _case(host(Q), host(KV), host(KV), ValueError, r"^layout:", layout="BSHD"),
    "layout None": _case(host(Q), host(KV), host(KV), ValueError, r"^layout:", layout=None),
    "causal int": _case(host(Q), host(KV), host(KV), TypeError, r"^causal: expected a bool", causal=1),
    "causal str": _case(host(Q), host(KV), host(KV), ValueError, r"^causal: expected False, True", causal="yes"),
    "causal None": _case(host(Q), host(KV), host(KV), TypeError, r"^causal: expected a bool", causal=None),
    "scale 0": _case(host(Q), host(KV), host(KV), ValueError, r"^scale: expected a finite positive", scale=0.0),
    "scale int 0": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=0),
    "scale negative": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=-0.125),
    "scale nan": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=math.nan),
    "scale inf": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=math.inf),
    "scale -inf": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=-math.inf),
    "scale np.float32 nan": _case(host(Q), host(KV), host(KV), ValueError, r"^scale:", scale=np.float32("nan")),
    "scale str": _case(host(Q), host(KV), host(KV), TypeError, r"^scale: expected a number", scale="0.125"),
    # device arrays whose head_dim axis is not contiguous (CAI strides are in bytes)
    "q head_dim stride 2": _case(dev(Q, strides=(2 * 5 * 4 * 128 * 4, 4 * 128 * 4, 128 * 4, 8)),
                                 dev(KV), dev(KV), ValueError,
                                 r"^q: the head_dim axis must be contiguous \(stride 1 element\)"),
    "k head_dim reversed": _case(dev(Q), dev(KV, strides=(7 * 2 * 64 * 4, 2 * 64 * 4, 64 * 4, -4)), dev(KV),
                                 ValueError, r"^k: the head_dim axis must be contiguous"),
    # v (2, 7, 2, 64) f16 as a view of a (2, 64, 7, 2) buffer: its head_dim stride is 14 elements
    "v transposed (head_dim <-> seq)": _case(dev(Q, np.float16), dev(KV, np.float16),
                                             dev(KV, np.float16, strides=(64 * 7 * 2 * 2, 2 * 2, 2, 7 * 2 * 2)),
                                             ValueError, r"^v: the head_dim axis must be contiguous"),
    "v head_dim stride 0 (f16)": _case(dev(Q, np.float16), dev(KV, np.float16),
                                       dev(KV, np.float16, strides=(7 * 2 * 64 * 2, 2 * 64 * 2, 64 * 2, 0)),
                                       ValueError, r"^v: the head_dim axis must be contiguous"),
    "bhsd q head_dim stride 2": _case(dev((2, 4, 5, 64), strides=(4 * 5 * 128 * 4, 5 * 128 * 4, 128 * 4, 8)),
                                      dev((2, 2, 7, 64)), dev((2, 2, 7, 64)), ValueError,
                                      r"^q: the head_dim axis must be contiguous", layout="bhsd"),
    # bhsd: the heads axis is axis 1 (read as bshd, these would report heads 4 and 8 instead)
    "bhsd Hq not multiple of Hkv": _case(host((2, 3, 4, 64)), host((2, 2, 8, 64)), host((2, 2, 8, 64)), ValueError,
                                         r"^k: query heads \(3\) must be a multiple of key/value heads \(2\)",
                                         layout="bhsd"),
    "bhsd batch mismatch": _case(host((2, 4, 5, 64)), host((1, 2, 7, 64)), host((1, 2, 7, 64)), ValueError,
                                 r"^k: expected batch 2", layout="bhsd"),
    "bhsd v seq mismatch": _case(host((2, 4, 5, 64)), host((2, 2, 7, 64)), host((2, 2, 6, 64)), ValueError,
                                 r"^v: expected the same shape as k", layout="bhsd"),
}

@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    q, k, v, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        pyattn.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_make_problem_rejects_the_same_inputs(case):
    """The op adds no checks of its own before the GPU: reading and validation alone reject every case."""
    q, k, v, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        problem(q, k, v, **kwargs)


def test_bhsd_shapes_are_read_with_heads_on_axis_1(blocked_driver):
    q, kv = host((2, 4, 6, 64)), host((2, 2, 3, 64))  # bhsd: Hq=4, Hkv=2; bshd: Hq=6, Hkv=3
    p = problem(q, kv, kv, layout="bhsd")
    assert (p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (4, 2, 6, 3)
    p = problem(q, kv, kv, layout="bshd")
    assert (p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (6, 3, 4, 2)
    q2, kv2 = host((2, 4, 6, 64)), host((2, 4, 3, 64))  # bhsd: Hq=4, Hkv=4
    bad_kv = host((2, 3, 4, 64))  # bhsd: Hkv=3 does not divide Hq=4; bshd: Hkv=4 does not divide Hq=6
    with pytest.raises(ValueError, match=r"^k: query heads \(4\) must be a multiple of key/value heads \(3\)"):
        problem(q2, bad_kv, bad_kv, layout="bhsd")
    with pytest.raises(ValueError, match=r"^k: query heads \(6\) must be a multiple of key/value heads \(4\)"):
        problem(q2, bad_kv, bad_kv, layout="bshd")
    with pytest.raises(pyattn.NoDeviceError, match=BLOCKED):
        pyattn.attention(q2, kv2, kv2, layout="bhsd")


# --------------------------------------------------------------------------------------------
# make_problem fields
# --------------------------------------------------------------------------------------------
def test_make_problem_fields_bshd():
    p = problem(host(Q, np.float16), host(KV, np.float16), host(KV, np.float16), causal=np.bool_(True))
    assert isinstance(p, AttentionProblem)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (2, 4, 2, 5, 7, 64)
    assert p.group == 2 and p.dtype == "float16" and p.layout == "bshd" and p.on_device is False
    assert p.causal == 1 and type(p.causal) is int  # the kernel's code: 1 = bottom-right
    assert p.scale == pytest.approx(1 / 8) and type(p.scale) is float
    assert p.out_shape() == Q
    assert p.q_strides == (5 * 4 * 64, 4 * 64, 64)  # (batch, seq, head), elements
    assert p.k_strides == p.v_strides == (7 * 2 * 64, 2 * 64, 64)


def test_make_problem_fields_bhsd():
    q, kv = host((3, 6, 5, 96), BF16), host((3, 2, 9, 96), BF16)
    p = problem(q, kv, kv, layout="bhsd", scale=2)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (3, 6, 2, 5, 9, 96)
    assert p.group == 3 and p.dtype == "bfloat16" and p.layout == "bhsd" and p.causal == 0
    assert p.scale == 2.0 and type(p.scale) is float
    assert p.out_shape() == (3, 6, 5, 96)
    assert p.q_strides == (6 * 5 * 96, 96, 5 * 96)  # (batch, seq, head) of a bhsd buffer


def test_make_problem_device_strides():
    q = dev(Q, strides=(5 * 4 * 64 * 8, 4 * 64 * 8, 64 * 4, 4))
    p = problem(q, dev(KV), dev(KV))
    assert p.on_device is True
    assert p.q_strides == (5 * 4 * 64 * 2, 4 * 64 * 2, 64)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), hkv=st.integers(1, 4), group=st.integers(1, 4), sq=st.integers(0, 40),
       sk=st.integers(0, 40), d=st.integers(1, 32).map(lambda n: 8 * n), layout=st.sampled_from(["bshd", "bhsd"]),
       dtype=st.sampled_from([np.float32, np.float16, BF16]))
def test_make_problem_property(b, hkv, group, sq, sk, d, layout, dtype):
    hq = hkv * group

    def shape(s, h):
        return (b, s, h, d) if layout == "bshd" else (b, h, s, d)

    q, kv = np.empty(shape(sq, hq), dtype), np.empty(shape(sk, hkv), dtype)
    p = problem(q, kv, kv, layout=layout)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (b, hq, hkv, sq, sk, d)
    assert p.group == group
    assert p.out_shape() == q.shape
    assert p.scale == pytest.approx(1 / math.sqrt(d), rel=1e-15)
    assert p.dtype == np.dtype(dtype).name

"""``pyattn.attention_backward`` and ``pyattn.attention_varlen_backward``: gradients of attention.

Thin functions over the op pipeline: read the arguments, validate them into a frozen
``BackwardProblem`` (the forward's validators for q, k, v and the options; a repeat signature
skips this), plan once per problem (``ops._bwd``), then run the three backward kernels on the
stream the stream-order rule picks, or take the NumPy path (upload, run, download).
"""

from __future__ import annotations

import numpy as np

from ..interop.inputs import read_args
from ..interop.streams import order_inputs
from ..pipeline import host
from ..pipeline.device import fetch_values, finish, start
from ..pipeline.plans import Memo, get_plan, signature
from ..runtime.device import keeps_context
from ..runtime.stream import check_stream_arg
from ..validate.attention import check_pointers
from ..validate.backward import check_backward_addresses, make_backward_problem, make_varlen_backward_problem
from ._bwd import build_bwd_plan, run_bwd
from ._fwd import device_extras

__all__ = ["attention_backward", "attention_varlen_backward"]

_ARRAYS = ("dout", "q", "k", "v", "out", "lse", "alibi_slopes", "dq", "dk", "dv")
_REQUIRED = ("dout", "q", "k", "v", "out", "lse")
_memo = Memo()  # signature -> problem


@keeps_context
def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, softcap=None, alibi_slopes=None,
                       scale=None, layout="bshd", dq=None, dk=None, dv=None, deterministic=False, stream=None):
    """Gradients of :func:`pyattn.attention` with respect to q, k and v (FlashAttention-2's backward).

    Given the upstream gradient ``dout`` of the forward's output, and the output ``out`` and
    log-sum-exp ``lse`` that ``pyattn.attention(q, k, v, return_lse=True, ...)`` returned, computes
    ``dq, dk, dv`` without materialising the (seq_q, seq_k) probabilities: they are recomputed
    tile by tile from q, k and the LSE.

    Parameters
    ----------
    dout : array, q's shape and dtype
        Gradient of the loss with respect to the forward's output.
    q, k, v : array
        The forward's inputs, as :func:`pyattn.attention` takes them (``layout``, GQA/MQA, strides).
    out : array, q's shape and dtype
        The forward's output.
    lse : array, float32, shape (batch, heads_q, seqlen_q)
        The forward's natural-log LSE, exactly as ``attention(..., return_lse=True)`` returns it
        (in both layouts); any strides on the device.
    causal, window, softcap, alibi_slopes, scale, layout
        The forward's options, with the same meaning and checks as in :func:`pyattn.attention`
        (there is no ``mask``: the backward of a mask tensor is not implemented).
    dq, dk, dv : array, optional
        Destinations of q's, k's and v's exact shapes and q's dtype (device arrays for device
        inputs, writable NumPy arrays for NumPy inputs); must not overlap the inputs.
    deterministic : bool, default False
        Sum each dq element's per-key-block parts in one fixed order (key blocks take turns per
        query tile), so two calls give bit-identical results. Otherwise the parts are added with
        fp32 atomics in whatever order the blocks finish: faster, and equal up to rounding.
        dk and dv are always deterministic (each is owned by one block).
    stream : optional
        As in :func:`pyattn.attention` (the stream-order rule).

    Returns
    -------
    dq, dk, dv : array
        q's, k's and v's shapes in q's dtype: NumPy arrays for NumPy inputs, ``pyattn.DeviceArray``
        for device inputs (the caller's own arrays when given). With GQA/MQA, dk and dv are summed
        over the query heads that share each key/value head.

    Notes
    -----
    float16/bfloat16 run on tensor cores (warpgroup MMA on sm_90a up to head dim 128, mma.sync
    otherwise), float32 stays exact on CUDA cores. Scores are
    recomputed in the order of ``pyattn.reference.attention_ref``; accumulation is fp32, dq goes
    through an fp32 buffer and is rounded once. A query row that saw no key (``lse`` -inf) gets a
    dq row of 0 and adds nothing to dk, dv: never NaN. All validation happens before any GPU work.

    Examples
    --------
    >>> o, lse = pyattn.attention(q, k, v, causal=True, return_lse=True)  # doctest: +SKIP
    >>> dq, dk, dv = pyattn.attention_backward(do, q, k, v, o, lse, causal=True)  # doctest: +SKIP
    """
    params = locals()
    check_stream_arg(stream)
    args = read_args(params, _ARRAYS, _REQUIRED)
    key = signature(params, args)
    P = _memo.get(key)
    if P is None:
        P = make_backward_problem(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"],
                                  causal=causal, window=window, softcap=softcap, alibi=args["alibi_slopes"],
                                  scale=scale, layout=layout, dq=args["dq"], dk=args["dk"], dv=args["dv"],
                                  deterministic=deterministic)
        _memo.put(key, P)
    return _run(P, args, stream, ())


@keeps_context
def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, causal=False, window=None, softcap=None, alibi_slopes=None, scale=None,
                              dq=None, dk=None, dv=None, deterministic=False, stream=None):
    """Gradients of :func:`pyattn.attention_varlen` with respect to the packed q, k and v.

    Parameters
    ----------
    dout, out : array, shape (total_q, heads_q, head_dim)
        Upstream gradient and the forward's output, q's dtype.
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As :func:`pyattn.attention_varlen` takes them: offsets checked the same way, and device
        offsets with both maxima given not read on the host (no synchronisation; clamped in the
        kernels, so wrong ones give wrong gradients, never accesses outside the arrays).
    lse : array, float32, shape (heads_q, total_q)
        The forward's LSE as ``attention_varlen(..., return_lse=True)`` returns it.
    causal, window, softcap, alibi_slopes, scale, dq, dk, dv, deterministic, stream
        As in :func:`pyattn.attention_backward`, per sequence.

    Returns
    -------
    dq, dk, dv : array
        Shapes of q, k, v; equal to :func:`pyattn.attention_backward` on each sequence alone.
    """
    params = locals()
    check_stream_arg(stream)
    names = _ARRAYS + ("cu_seqlens_q", "cu_seqlens_k")
    args = read_args(params, names, _REQUIRED + ("cu_seqlens_q", "cu_seqlens_k"))
    P, cus = make_varlen_backward_problem(
        args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], args["cu_seqlens_q"],
        args["cu_seqlens_k"], lambda a: fetch_values(a) if a.on_device else a.obj, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, causal=causal, window=window, softcap=softcap, alibi=args["alibi_slopes"],
        scale=scale, dq=args["dq"], dk=args["dk"], dv=args["dv"], deterministic=deterministic)
    return _run(P, args, stream, tuple(c.astype(np.int32) for c in cus) if cus is not None else None, True)


def _run(P, args, stream, cus, varlen=False):
    """Run a validated call: the NumPy path (``cus``: host offsets of a varlen call) or the device one
    (``varlen``: with the device offsets, checked or not)."""
    alibi, grads = args["alibi_slopes"], [args[n] for n in ("dq", "dk", "dv")]
    if not P.on_device:  # NumPy in, NumPy out (a device alibi_slopes is read in place)
        ins = [args[n].obj for n in ("q", "k", "v", "out", "dout", "lse")] + list(cus)
        ins.append(np.asarray(alibi.obj, np.float32) if alibi is not None and not alibi.on_device else None)

        def run(dev, s):
            device = dev[0].device
            if alibi is not None and alibi.on_device:
                order_inputs(s, device, [alibi])
            al = dev[-1].ptr if dev[-1] is not None else (alibi.ptr if alibi is not None else 0)
            extras = (al, dev[6].ptr, dev[7].ptr) if cus else (al,)
            return run_bwd(get_plan(build_bwd_plan, P, device), device, s, tuple(d.ptr for d in dev[:6]),
                           (None, None, None), extras)

        return tuple(host.call(run, ins, [g.obj if g is not None else None for g in grads], stream))
    check_pointers(P.base, args["q"], args["k"], args["v"])
    _check(P, args)
    names = _ARRAYS + (("cu_seqlens_q", "cu_seqlens_k") if varlen else ())
    device, s, a = start(stream, [args[n] for n in names], lambda a: _recheck(P, dict(zip(names, a))))
    a = dict(zip(names, a))
    _, alibi_ptr, keep = device_extras(None, a["alibi_slopes"], device, s)
    extras = (alibi_ptr, a["cu_seqlens_q"].ptr, a["cu_seqlens_k"].ptr) if varlen else (alibi_ptr,)
    plan = get_plan(build_bwd_plan, P, device)
    new = run_bwd(plan, device, s, tuple(a[n].ptr for n in ("q", "k", "v", "out", "dout", "lse")),
                  tuple(None if a[n] is None else a[n].ptr for n in ("dq", "dk", "dv")), extras)
    finish(s, [x for x in a.values() if x is not None])
    return tuple(n if n is not None else g.obj for n, g in zip(new, grads))


def _check(P, args) -> None:
    ptr = lambda n: 0 if args[n] is None else args[n].ptr  # noqa: E731
    check_backward_addresses(P, ptr("dout"), ptr("dk"), ptr("dv"))


def _recheck(P, args) -> None:
    """The address checks again, on DLPack imports (their addresses are known only then)."""
    check_pointers(P.base, args["q"], args["k"], args["v"])
    _check(P, args)

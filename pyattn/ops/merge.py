"""``pyattn.merge_states``: combine partial attention states by their log-sum-exp.

The combine step of split-KV (flash-decoding) and cascade attention: attention over a key set
split into parts equals the LSE-weighted sum of the per-part outputs. One kernel launch merges a
state "a" with a stack "b" of states at a fixed address step, so a stacked array, or a list whose
arrays after the first lie at equally spaced addresses (views of one stack), is one launch. Any
other list is folded: merge(0, 1) into the output, then merge(output, k) in place for each k >= 2.
LSEs are taken in the shape every pyattn op returns them (``pyattn.validate.merge``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..array import c_strides
from ..interop.inputs import read
from ..kernels.registry import get_kernel
from ..kernels.specs import DTYPES, HEAD_DIM_BUCKETS, KernelSpec
from ..pipeline import host
from ..pipeline.device import finish, output, start
from ..pipeline.plans import get_plan, ptx_requested
from ..runtime.device import keeps_context
from ..runtime.launch import launch
from ..runtime.stream import check_stream_arg
from ..validate.merge import check_merge, lse_row_strides

__all__ = ["merge_states"]

_F32 = np.dtype(np.float32)


class _Plan(NamedTuple):
    spec: object
    kernel: object


def _build(key, device) -> _Plan:
    dtype_name, head_dim = key
    bucket = next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)
    spec = KernelSpec("merge_states", DTYPES[dtype_name][0], bucket, device.arch, ptx_requested())
    return _Plan(spec, get_kernel(spec, device))


class _Operand(NamedTuple):
    """One kernel operand: address, element strides of the 3 row indices, state step."""

    ptr: int
    strides: tuple
    step: int = 0


def _lead3(strides) -> tuple:
    """Left-pad row strides to 3 (a padded index has size 1; its stride is unused)."""
    return (0,) * (3 - len(strides)) + tuple(strides)


def _state_operands(req, os_, ls_, o_out: _Operand, l_out: _Operand):
    """The launches as ``[(a, lse_a, b, lse_b, n_b), ...]``, run in order into the outputs."""
    rows = lambda lse, strides: _lead3(lse_row_strides(strides, req.layout))  # noqa: E731
    if req.stacked:
        (o,), (lse,) = os_, ls_
        a = _Operand(o.ptr, _lead3(o.strides[1:-1]))
        la = _Operand(lse.ptr, rows(lse, lse.strides[1:]))
        b = _Operand(o.ptr + o.strides[0] * req.dtype.itemsize, a.strides, o.strides[0])
        lb = _Operand(lse.ptr + 4 * lse.strides[0], la.strides, lse.strides[0])
        return [(a, la, b, lb, req.n_states - 1)]
    ops = [_Operand(o.ptr, _lead3(o.strides[:-1])) for o in os_]
    lops = [_Operand(x.ptr, rows(x, x.strides)) for x in ls_]
    if len(ops) == 1:
        return [(ops[0], lops[0], ops[0], lops[0], 0)]
    step = _common_step(os_[1:], req.dtype.itemsize)
    lstep = _common_step(ls_[1:], 4)
    if step is not None and lstep is not None:  # b = states 1.. are views of one stack: one launch
        return [(ops[0], lops[0], ops[1]._replace(step=step), lops[1]._replace(step=lstep), len(ops) - 1)]
    launches = [(ops[0], lops[0], ops[1], lops[1], 1)]
    # Fold the rest into the output in place (safe: see kernels_src/merge_states.cuh).
    launches += [(o_out, l_out, op, lop, 1) for op, lop in zip(ops[2:], lops[2:])]
    return launches


def _common_step(arrays, itemsize: int):
    """The element step between consecutive arrays of equal layout at equally spaced addresses, or None."""
    if len(arrays) == 1:
        return 0
    layouts = {tuple(st for st, n in zip(x.strides, x.shape) if n > 1) for x in arrays}  # size-1 dims: any stride
    if len(layouts) != 1:
        return None
    step = arrays[1].ptr - arrays[0].ptr
    if step % itemsize or any(y.ptr - x.ptr != step for x, y in zip(arrays, arrays[1:])):
        return None
    return step // itemsize


def _pack(spec, dims, head_dim, a, la, b, lb, n_b, out, lout) -> bytes:
    values = {"o_a": a.ptr, "lse_a": la.ptr, "o_b": b.ptr, "lse_b": lb.ptr, "out": out.ptr, "out_lse": lout.ptr,
              "o_b_stride_n": b.step, "lse_b_stride_n": lb.step, "dim0": dims[0], "dim1": dims[1],
              "dim2": dims[2], "head_dim": head_dim, "n_b": n_b}
    for prefix, op in (("o_a", a), ("o_b", b), ("out", out), ("lse_a", la), ("lse_b", lb), ("out_lse", lout)):
        for axis, st in enumerate(op.strides):
            values[f"{prefix}_stride_{axis}"] = st
    return spec.params.pack(values)


def _run(req, device, s, os_, ls_, o_out, l_out):
    """Launch the merge of device Args ``os_``/``ls_`` on ``s``; ``o_out``/``l_out`` the caller's
    (Args) or None. Returns ``(o, lse)``: new DeviceArrays for the missing outputs."""
    plan = get_plan(_build, (req.dtype.name, req.shape[-1]), device)
    shape, lse_shape = req.shape, req.lse_shape
    o_new = output(device, s, shape, req.dtype) if o_out is None else None
    l_new = output(device, s, lse_shape, _F32) if l_out is None else None
    o_dst, l_dst = o_out or o_new, l_out or l_new
    rows = int(np.prod(shape[:-1]))
    if rows:
        o_strides = o_dst.strides if o_out is not None else c_strides(shape)
        l_strides = l_dst.strides if l_out is not None else c_strides(lse_shape)
        dims = (1,) * (4 - len(shape)) + tuple(shape[:-1])
        oo = _Operand(o_dst.ptr, _lead3(o_strides[:-1]))
        lo = _Operand(l_dst.ptr, _lead3(lse_row_strides(l_strides, req.layout)))
        spec = plan.spec
        grid, block = (-(-rows // spec.tiles.warps), 1, 1), (spec.threads, 1, 1)
        for a, la, b, lb, n_b in _state_operands(req, os_, ls_, oo, lo):
            launch(plan.kernel, grid, block, spec.shared_bytes, s, _pack(spec, dims, shape[-1], a, la, b, lb, n_b,
                                                                         oo, lo))
    return o_new, l_new


@keeps_context
def merge_states(*args, layout="bshd", out=None, stream=None):
    """Merge partial attention states: ``lse = logaddexp_i(lse_i)``, ``o = sum_i exp(lse_i - lse) o_i``.

    Attention over a key set split into disjoint parts (split-KV decoding, cascade attention
    over a shared prefix) equals the merge of the per-part outputs and log-sum-exps.

    Call as ``merge_states(o_a, lse_a, o_b, lse_b)`` for two states, or ``merge_states(os, lses)``
    with ``os`` one stacked array (n_states, ...) and ``lses`` (n_states, ...), or ``os``/``lses``
    two equally long lists (or tuples) of per-state arrays.

    Parameters
    ----------
    o_a, o_b : array
        Partial outputs, one dtype for all states (float16, bfloat16 or float32), in ``layout``:
        (batch, seq, heads, head_dim), (batch, heads, seq, head_dim) or packed (total, heads,
        head_dim). head_dim is a multiple of 8 up to 256. Device arrays may have any element
        strides as long as the head_dim axis is contiguous.
    lse_a, lse_b : array, float32
        Natural-log LSEs in the shape every pyattn op returns them: (batch, heads, seq) for both
        4-D layouts, (heads, total) for ``"thd"``. So the ``(out, lse)`` of
        ``pyattn.attention(..., return_lse=True)`` (or ``attention_varlen``, ``decode``, the sparse
        ops) merges as it is, read in place whatever its strides.
    os, lses : array or list of arrays
        Stacked: one launch. A list: one launch when ``os[1:]`` (and ``lses[1:]``) share a layout
        and lie at equally spaced addresses (e.g. ``list(stack)`` of a device stack); any other
        list is folded with ``n_states - 1`` launches, rounding the running output to its dtype
        after each (an extra half-ulp per launch for 16-bit dtypes; stack the states to avoid it).
    layout : {"bshd", "bhsd", "thd"}, default "bshd"
        The layout of the outputs (and so of which LSE shape goes with them).
    out : array or (array, array), optional
        Where to write ``o`` (one state's shape and dtype, head_dim axis contiguous), or
        ``(o, lse)`` (either may be None). Device arrays for device inputs, writeable NumPy arrays
        for NumPy inputs. Must not overlap the inputs.
    stream : optional
        As in :func:`pyattn.attention` (the stream-order rule).

    Returns
    -------
    o : array, one state's shape and dtype
    lse : array, float32, the LSE shape of ``layout``
        NumPy arrays for NumPy inputs; ``pyattn.DeviceArray`` (or ``out``) for device inputs.

    Raises
    ------
    TypeError
        A non-array argument, mixed host and device arrays, unsupported or mixed dtypes, a
        non-float32 LSE, a wrong number of positional arguments.
    ValueError
        A bad layout, shapes that do not match it, head_dim not a multiple of 8 in [8, 256], a
        non-contiguous head_dim axis, a bad ``out``, empty lists, NaN/+inf in a NumPy LSE; all
        before any GPU work.

    Notes
    -----
    A state with ``lse = -inf`` (no key seen) contributes nothing, and its output is never read,
    so it may hold NaN or garbage. A row whose states all have ``lse = -inf`` gets ``o = 0`` and
    ``lse = -inf``. The math is float32; ``o`` is rounded to its dtype once (stacked form). LSEs
    on the device are not checked: a NaN or +inf there gives NaN in that row.

    Examples
    --------
    >>> o1, l1 = pyattn.attention(q, k[:, :512], v[:, :512], return_lse=True)  # doctest: +SKIP
    >>> o2, l2 = pyattn.attention(q, k[:, 512:], v[:, 512:], return_lse=True)  # doctest: +SKIP
    >>> o, lse = pyattn.merge_states(o1, l1, o2, l2)  # doctest: +SKIP
    """
    check_stream_arg(stream)
    req = check_merge(args, out, layout, read)
    if not req.on_device:  # stack on the host (one upload per operand), merge as a stack, copy back
        o_host = np.ascontiguousarray(req.os[0].obj) if req.stacked else np.stack([o.obj for o in req.os])
        l_host = np.ascontiguousarray(req.lses[0].obj) if req.stacked else np.stack([x.obj for x in req.lses])
        stacked = req._replace(stacked=True)

        def run(dev, s):
            d_o, d_l = (read(n, x) for n, x in (("os", dev[0]), ("lses", dev[1])))
            return _run(stacked, dev[0].device, s, [d_o], [d_l], None, None)

        return tuple(host.call(run, [o_host, l_host], [o.obj if o is not None else None for o in req.out], stream))
    device, s, ordered = start(stream, [*req.os, *req.lses, *req.out])
    n = len(req.os)
    os_, ls_, (o_out, l_out) = ordered[:n], ordered[n:2 * n], ordered[2 * n:]
    o_new, l_new = _run(req, device, s, os_, ls_, o_out, l_out)
    finish(s, ordered)
    outs = out if isinstance(out, (list, tuple)) else (out, None)
    return (outs[0] if o_new is None else o_new), (outs[1] if l_new is None else l_new)

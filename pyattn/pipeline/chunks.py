"""``attention`` on NumPy arrays: uploads, kernels and result copies overlapped.

The inputs go up through :func:`pyattn.pipeline.host.upload` (worker threads stage pieces into
pinned memory and queue each piece's H2D copy on the caller's stream). The call is cut into
chunks whose kernels start as soon as their inputs are queued, on two streams that take turns,
each chunk's result copied device-to-host right after its kernel, straight into a pinned NumPy
array (``runtime.pinned.pinned_empty``): the DMA engines and the SMs work at the same time, and
the last chunk's copy is all that follows the last kernel.

Chunks, all contiguous on the host:

- batch entries ``[b0, b1)``, when the batch has more than one entry;
- query rows ``[s0, s1)`` of a single sequence, with K and V sent first (they are needed by every
  chunk). Rows are independent problems only when their scores do not depend on the number of
  query rows: for bottom-right causal attention, rows ``[s0, s1)`` with the key prefix
  ``[0, s1 + Sk - Sq)`` reproduce the diagonal offset exactly (window and ALiBi included, and the
  keys past the prefix are masked for every such row anyway); without causal, only when there is
  no window and no ALiBi; top-left causal only when Sq == Sk (it is bottom-right then). Other calls
  on one sequence are one chunk.

A host mask and host ALiBi slopes are sent first, whole, and every chunk reads its part in place.
The two streams are made per device on first use and reused; a lock gives them to one call at a
time. A call returns when its results are on the host.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import numpy as np

from ..array import DeviceArray
from ..runtime._resource import per_device
from ..runtime.device import get_device
from ..runtime.pinned import get_staging, pinned_empty
from ..runtime.stream import Event, Stream, as_stream, refuse_capture
from . import host, transfer

__all__ = ["attention_numpy", "Chunk", "plan_chunks", "row_chunkable", "prepare_mask"]

# Tuning constants (read at call time, so tests and benchmarks may change them).
_MIN_PIPELINE_BYTES = 8 << 20  # below this (inputs + outputs), one chunk: per-chunk overhead would dominate
_CHUNK_BYTES = 24 << 20  # a few chunks: each is an op call on the main thread (~50-100 us while workers stage)
_MAX_CHUNKS = 16
_STREAMS = 2  # chunk i's result copy overlaps chunk i+1's kernel

_pipelines: dict = {}
_CAUSAL_ARG = {0: False, 1: True, 2: "top_left"}  # the kernel's causal code -> attention's argument


class Chunk(NamedTuple):
    """Batch entries ``[b0, b1)``, query rows ``[s0, s1)``, the first ``kv_len`` keys, causal code."""

    b0: int
    b1: int
    s0: int
    s1: int
    kv_len: int
    causal: int


def row_chunkable(P) -> bool:
    """Whether query-row chunks of problem ``P`` reproduce the whole (see the module notes)."""
    if P.causal == 1:
        return True
    if P.causal == 2:
        return P.seqlen_q == P.seqlen_k
    return P.window == (-1, -1) and P.alibi is None


def plan_chunks(P, nbytes: int) -> list:
    """Cut problem ``P`` (``nbytes`` moved over PCIe) into :class:`Chunk` objects."""
    B, Sq, Sk = P.batch, P.seqlen_q, P.seqlen_k
    whole = [Chunk(0, B, 0, Sq, Sk, P.causal)]
    if nbytes < _MIN_PIPELINE_BYTES or B < 1 or Sq < 1:
        return whole
    want = max(2, min(_MAX_CHUNKS, math.ceil(nbytes / _CHUNK_BYTES)))
    if B > 1:
        return [Chunk(a, b, 0, Sq, Sk, P.causal) for a, b in transfer.split_range(B, want)]
    if not row_chunkable(P):
        return whole
    code = 1 if P.causal else 0
    return [Chunk(0, 1, a, b, Sk if not code else min(max(b + Sk - Sq, 0), Sk), code)
            for a, b in transfer.split_range(Sq, want)]


def prepare_mask(mask, shape: tuple):
    """Return ``(mask4, dtype)``: the mask as a 4-D (B, Hq, Sq, Sk) view and its staged dtype.

    Axes of stride 0 (``numpy.broadcast_to``) shrink to size 1, so a broadcast mask is moved once,
    not materialised. float64 is staged as float32: the kernel adds the mask in float32.
    """
    if mask is None:
        return None, None
    m = np.asarray(mask)
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    m = m[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for n, st in zip(m.shape, m.strides))]
    return m, (np.dtype(np.float32) if m.dtype == np.float64 else m.dtype)


def _rows(layout: str, s0: int, s1: int):
    """Index of query rows ``[s0, s1)`` in an array of ``layout`` (batch axis first)."""
    rows = slice(s0, s1)
    return (slice(None), rows) if layout == "bshd" else (slice(None), slice(None), rows)


class _Pipeline:
    """One device's two chunk streams and the event they wait on, reused by every call (one call at
    a time): a wait takes the event's state when it is queued, so one event re-recorded per chunk
    serves them all (a new one per chunk cost two more driver calls and a finalizer)."""

    def __init__(self, device):
        self.lock = threading.Lock()
        self.streams = [Stream(device) for _ in range(_STREAMS)]
        self.ready = Event(device)


def _device_attention(q, k, v, **kwargs):
    from ..ops.attention import attention  # at call time: ops sit above the pipeline

    return attention(q, k, v, **kwargs)


def attention_numpy(P, q, k, v, *, mask, alibi_slopes, options: dict, return_lse: bool, stream, out=None):
    """Attention on NumPy arrays of the validated problem ``P``.

    ``q, k, v`` are NumPy arrays in ``P.layout``; ``mask``/``alibi_slopes`` NumPy or None (a device
    mask or device slopes make the call one chunk); ``options`` the keyword options of
    ``pyattn.attention`` besides those (``window``, ``softcap``, ``scale``, ``allow_tf32``).
    Returns ``(out, lse or None)``: pinned NumPy arrays, or ``out`` itself when given.
    """
    device = get_device()  # first: the driver, before any pinned allocation
    device.activate()
    s = as_stream(stream, device)
    refuse_capture(s, "NumPy arrays go through host memory on every call, which a graph's replay would not "
                      "read again: pass device arrays")
    B, Hq, Sq = P.batch, P.heads_q, P.seqlen_q
    on_device = [x for x in (mask, alibi_slopes) if x is not None and not isinstance(x, np.ndarray)]
    mask4, mask_dt = prepare_mask(mask, (B, Hq, Sq, P.seqlen_k)) if isinstance(mask, np.ndarray) else (None, None)
    slopes = np.asarray(alibi_slopes, np.float32) if isinstance(alibi_slopes, np.ndarray) else None
    out_host = pinned_empty(P.out_shape(), q.dtype)
    lse_host = pinned_empty(P.lse_shape(), np.float32) if return_lse else None
    nbytes = q.nbytes + k.nbytes + v.nbytes + out_host.nbytes + (lse_host.nbytes if return_lse else 0)
    nbytes += mask4.size * mask_dt.itemsize if mask4 is not None else 0
    chunks = [Chunk(0, B, 0, Sq, P.seqlen_k, P.causal)] if on_device else plan_chunks(P, nbytes)
    pipe = per_device(_pipelines, device, _Pipeline)
    extra = {"mask": mask, "alibi_slopes": alibi_slopes} if on_device else {}
    with pipe.lock:
        _Call(device, pipe, s, chunks, P, dict(options, **extra), return_lse, (out_host, lse_host)).run(
            q, k, v, (mask4, mask_dt), slopes)
    if out is not None:
        transfer.finish_copies(transfer.start_copies([(out, out_host)]))
        out_host = out
    return out_host, lse_host


def _slice(x: DeviceArray, axis: int, a: int, b: int, stream) -> DeviceArray:
    """``x[..., a:b, ...]`` along ``axis``: a view, ordered on ``stream``."""
    shape = x.shape[:axis] + (b - a,) + x.shape[axis + 1:]
    return DeviceArray(x.ptr + a * x.strides[axis], shape, x.dtype, x.device, strides=x.strides, owner=x.owner,
                       stream=stream)


def _on(x: DeviceArray, stream) -> DeviceArray:
    """All of ``x``, ordered on ``stream``."""
    return _slice(x, 0, 0, x.shape[0], stream)


class _Call:
    """One host call: sends its inputs, launches each chunk once its inputs are queued, collects."""

    def __init__(self, device, pipe, s, chunks, P, opts, return_lse, results):
        self.device, self.s, self.chunks, self.P, self.opts = device, s, chunks, P, opts
        self.return_lse, self.results = return_lse, results
        self.rows = len(chunks) > 1 and P.batch == 1  # query-row chunks, shared K/V
        self.streams = pipe.streams if len(chunks) > 1 else [s]
        self.ready = pipe.ready
        self.seq_axis = 1 if P.layout == "bshd" else 2

    def run(self, q, k, v, mask, slopes) -> None:
        """Send the inputs (shared ones first, then chunk by chunk) and launch the chunks as they land."""
        mask4, mask_dt = mask
        arrays = [(mask4, mask_dt) if mask4 is not None else None, slopes]
        if self.rows:
            arrays += [k, v] + [q[_rows(self.P.layout, c.s0, c.s1)] for c in self.chunks]
        else:
            arrays += [x[c.b0:c.b1] for c in self.chunks for x in (q, k, v)]
        width = 1 if self.rows else 3  # arrays per chunk, after the shared ones
        shared = len(arrays) - width * len(self.chunks)

        def on_ready(i, dev):
            j = i - shared
            if j >= 0 and j % width == width - 1:
                self._launch(j // width, dev, shared, width)
        held = []  # a small upload's staging buffer: released below, with no event once s is idle
        try:
            host.upload(arrays, self.device, self.s, on_ready, held=held)
            for st in self.streams:  # the results are on the host when the call returns
                st.synchronize()
        except BaseException:
            for st in (self.s, *self.streams):  # nothing may still write to the results or read the inputs
                try:
                    st.synchronize()
                except Exception:
                    pass
            raise
        finally:
            for buf in held:  # (small uploads are one chunk: self.s is among the streams synchronised)
                get_staging(self.device).release(buf, None if self.s in self.streams else self.s)

    def _launch(self, i: int, dev: list, shared: int, width: int) -> None:
        """Queue chunk ``i``'s kernel and D2H copies on its stream, after its inputs' H2D copies."""
        c, P, ax = self.chunks[i], self.P, self.seq_axis
        st = self.streams[i % len(self.streams)]
        if st is not self.s:
            st.wait(self.s.record(self.ready))
        # The chunk's views name its stream, which now waits for their copies: the op then adds no
        # wait of its own for a producer on another stream.
        dmask, dslopes = (None if x is None else _on(x, st) for x in dev[:2])
        if self.rows:
            dq = _on(dev[shared + i], st)
            dk, dv = (_slice(x, ax, 0, c.kv_len, st) for x in dev[2:4])
        else:
            dq, dk, dv = (_on(x, st) for x in dev[shared + 3 * i: shared + 3 * i + 3])
        opts = dict(self.opts, causal=_CAUSAL_ARG[c.causal])
        if dmask is not None:
            m = _slice(dmask, 0, c.b0, c.b1, st) if dmask.shape[0] > 1 else dmask
            m = _slice(m, 2, c.s0, c.s1, st) if m.shape[2] > 1 else m
            opts["mask"] = _slice(m, 3, 0, c.kv_len, st) if m.shape[3] > 1 else m
        if dslopes is not None:
            opts["alibi_slopes"] = _slice(dslopes, 0, c.b0, c.b1, st) if dslopes.ndim == 2 else dslopes
        res = _device_attention(dq, dk, dv, stream=st, layout=P.layout, return_lse=self.return_lse, **opts)
        out, lse = res if self.return_lse else (res, None)
        b = slice(c.b0, c.b1)
        transfer.d2h_region(self.results[0][b][_rows(P.layout, c.s0, c.s1)], out, st)
        if lse is not None:
            transfer.d2h_region(self.results[1][b][:, :, c.s0:c.s1], lse, st)

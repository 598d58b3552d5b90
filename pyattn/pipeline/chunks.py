"""``attention`` on NumPy arrays, chunked so that host copies, PCIe transfers and kernels overlap.

Done serially (stage q, k, v into pinned memory, copy, compute, copy back) the DMA engines idle
during the kernel and the GPU during every copy. Here the call is cut into chunks that go host ->
pinned -> H2D -> kernel -> D2H on one of three streams, so one chunk's kernel overlaps the next
one's H2D and the previous one's D2H, while worker threads stage the next chunk. Results land by
D2H straight in pinned NumPy arrays (``runtime.memory.pinned_empty``): no copy-out.

Chunks, all contiguous on the host:

- batch entries ``[b0, b1)``, when the batch has more than one entry;
- query rows ``[s0, s1)`` of a single sequence, with K and V uploaded once first (they are the
  first two thirds of the bytes, and their H2D overlaps the staging of the first query rows).
  Rows are independent problems only when their scores do not depend on the number of query
  rows: for bottom-right causal attention, rows ``[s0, s1)`` with the key prefix
  ``[0, s1 + Sk - Sq)`` reproduce the diagonal offset exactly (window and ALiBi included, and the
  keys past the prefix are masked for every such row anyway); without causal, only when there is
  no window and no ALiBi; top-left causal only when Sq == Sk (it is bottom-right then). Other calls
  on one sequence are one chunk.

Streams, events and staging buffers are made per device on first use and reused; a lock gives
them to one call at a time. A call returns when its results are on the host.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import wait as _wait_futures
from typing import NamedTuple

import numpy as np

from ..array import DeviceArray
from ..runtime._resource import per_device
from ..runtime.device import get_device
from ..runtime.memory import PinnedBuffer, get_pool, pinned_empty
from ..runtime.stream import Event, Stream, as_stream
from . import host

__all__ = ["attention_numpy", "Chunk", "plan_chunks", "row_chunkable", "prepare_mask"]

# Tuning constants (read at call time, so tests and benchmarks may change them).
_MIN_PIPELINE_BYTES = 8 << 20  # below this (inputs + outputs), one chunk: per-chunk overhead would dominate
_CHUNK_BYTES = 8 << 20  # ~150 us of PCIe gen5 per chunk
_MAX_CHUNKS = 64
_STREAMS = 3  # chunks in flight: one copying in, one computing, one copying out

_pipelines: dict = {}


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
        return [Chunk(a, b, 0, Sq, Sk, P.causal) for a, b in host.split_range(B, want)]
    if not row_chunkable(P):
        return whole
    code = 1 if P.causal else 0
    return [Chunk(0, 1, a, b, Sk if not code else min(max(b + Sk - Sq, 0), Sk), code)
            for a, b in host.split_range(Sq, want)]


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
    """One device's streams, events and pinned staging buffers, reused by every call (one at a time)."""

    def __init__(self, device):
        self.device = device
        self.lock = threading.Lock()
        self.streams = [Stream(device) for _ in range(_STREAMS)]
        self.h2d_done = [Event(device) for _ in range(_STREAMS)]  # slot's input buffer free again
        self.d2h_done = [Event(device) for _ in range(_STREAMS)]  # slot's results on the host
        self._pinned: dict = {}

    def pinned(self, slot: int, nbytes: int) -> PinnedBuffer:
        """Slot ``slot``'s staging buffer of at least ``nbytes``; call only while no copy uses it."""
        buf = self._pinned.get(slot)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.close()
            buf = self._pinned[slot] = PinnedBuffer(1 << max(int(nbytes) - 1, (1 << 20) - 1).bit_length())
        return buf


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
    B, Hq, Sq = P.batch, P.heads_q, P.seqlen_q
    on_device = [x for x in (mask, alibi_slopes) if x is not None and not isinstance(x, np.ndarray)]
    mask4, mask_dt = prepare_mask(mask, (B, Hq, Sq, P.seqlen_k)) if isinstance(mask, np.ndarray) else (None, None)
    slopes = np.asarray(alibi_slopes, np.float32) if isinstance(alibi_slopes, np.ndarray) else None
    out_host = pinned_empty(P.out_shape(), q.dtype)
    lse_host = pinned_empty(P.lse_shape(), np.float32) if return_lse else None
    nbytes = q.nbytes + k.nbytes + v.nbytes + out_host.nbytes + (lse_host.nbytes if return_lse else 0)
    nbytes += mask4.size * mask_dt.itemsize if mask4 is not None else 0
    chunks = [Chunk(0, B, 0, Sq, P.seqlen_k, P.causal)] if on_device else plan_chunks(P, nbytes)
    device = get_device()
    device.activate()
    caller = as_stream(stream, device)
    pipe = per_device(_pipelines, device, _Pipeline)
    extra = {"mask": mask, "alibi_slopes": alibi_slopes} if on_device else {}
    with pipe.lock:
        _Call(pipe, caller, chunks, P, (q, k, v, mask4, mask_dt, slopes), dict(options, **extra), return_lse,
              (out_host, lse_host)).run()
    if out is not None:
        host.finish_copies(host.start_copies([(out, out_host)]))
        out_host = out
    return out_host, lse_host


class _Call:
    """One host call: stages, launches and collects its chunks through a :class:`_Pipeline`."""

    def __init__(self, pipe, caller, chunks, P, inputs, opts, return_lse, results):
        q, k, v, mask4, mask_dt, slopes = inputs
        self.pipe, self.caller, self.chunks, self.P, self.opts = pipe, caller, chunks, P, opts
        self.return_lse, self.results = return_lse, results
        self.multi = len(chunks) > 1
        self.rows = self.multi and chunks[0].b1 - chunks[0].b0 == P.batch  # query-row chunks, shared K/V
        self.n_slots = min(_STREAMS, len(chunks))
        self.streams = pipe.streams[:self.n_slots] if self.multi else [caller]
        self.k, self.v = k, v
        self.inputs, self.in_offsets, self.in_bytes = [], [], []
        for c in chunks:
            b, r = slice(c.b0, c.b1), _rows(P.layout, c.s0, c.s1)
            ins = [("q", q[b][r], q.dtype)]
            if not self.rows:
                ins += [("k", k[b], k.dtype), ("v", v[b], v.dtype)]
            if mask4 is not None:
                m = mask4[b if mask4.shape[0] > 1 else slice(None)]
                m = m[:, :, c.s0:c.s1] if m.shape[2] > 1 else m
                ins.append(("mask", m[..., :c.kv_len] if m.shape[3] > 1 else m, mask_dt))
            if slopes is not None:
                ins.append(("alibi", slopes[b] if slopes.ndim == 2 else slopes, np.dtype(np.float32)))
            offs, off = [], 0
            for _, src, dt in ins:
                offs.append(off)
                off += -(-src.size * dt.itemsize // 256) * 256
            self.inputs.append(ins)
            self.in_offsets.append(offs)
            self.in_bytes.append(off)

    def run(self) -> None:
        pipe, S, n = self.pipe, self.n_slots, len(self.chunks)
        pending: dict = {}
        try:
            self.bufs = [pipe.pinned(slot, max(self.in_bytes[slot::S])) for slot in range(S)]
            if self.multi:  # the caller's earlier work comes first, as on any stream it passes
                ready = self.caller.record()
                for st in self.streams:
                    st.wait(ready)
            if self.rows:  # K and V once, on the first stream; every chunk's kernel waits for them
                self.kv = host.upload([self.k, self.v], pipe.device, self.streams[0])
                kv_ready = self.streams[0].record()
                for st in self.streams[1:]:
                    st.wait(kv_ready)
            pending[0] = self._stage(0)
            for i in range(n):
                host.finish_copies(pending.pop(i))
                if i + 1 < n:  # stage the next chunk while this one's GPU work is issued
                    if i + 1 >= S:
                        pipe.h2d_done[(i + 1) % S].synchronize()  # its slot's last H2D has read the buffer
                    pending[i + 1] = self._stage(i + 1)
                self._launch(i)
            for st in self.streams:  # the results are on the host when the call returns
                st.synchronize()
        except BaseException:
            # Nothing may still write to or read from the pinned buffers once we return.
            for futures in pending.values():
                _wait_futures(futures)
            for st in self.streams:
                try:
                    st.synchronize()
                except Exception:
                    pass
            raise
        finally:
            self.bufs = self.kv = None

    def _stage(self, i: int) -> list:
        """Start copying chunk ``i``'s inputs into its slot's pinned buffer."""
        raw = self.bufs[i % self.n_slots].array(np.uint8, (self.bufs[i % self.n_slots].nbytes,))
        pairs = [(raw[off:off + src.size * dt.itemsize].view(dt).reshape(src.shape), src)
                 for (_, src, dt), off in zip(self.inputs[i], self.in_offsets[i])]
        return host.start_copies(pairs)

    def _launch(self, i: int) -> None:
        """Queue chunk ``i``'s H2D copy, kernel and D2H copies on its slot's stream."""
        c, slot, P = self.chunks[i], i % self.n_slots, self.P
        st, pipe = self.streams[slot], self.pipe
        alloc = get_pool(pipe.device).allocate(self.in_bytes[i], st)  # one block per chunk: one H2D
        host.h2d(alloc.ptr, self.bufs[slot].ptr, self.in_bytes[i], st)
        st.record(pipe.h2d_done[slot])
        dev = {name: DeviceArray(alloc.ptr + off, src.shape, dt, pipe.device, owner=alloc, stream=st)
               for (name, src, dt), off in zip(self.inputs[i], self.in_offsets[i])}
        if self.rows:
            dk, dv = (self._key_prefix(x, c.kv_len) for x in self.kv)
        else:
            dk, dv = dev["k"], dev["v"]
        opts = dict(self.opts, causal=c.causal)
        if "mask" in dev:
            opts["mask"] = dev["mask"]
        if "alibi" in dev:
            opts["alibi_slopes"] = dev["alibi"]
        res = _device_attention(dev["q"], dk, dv, stream=st, layout=P.layout, return_lse=self.return_lse, **opts)
        out, lse = res if self.return_lse else (res, None)
        b = slice(c.b0, c.b1)
        host.d2h_region(self.results[0][b][_rows(P.layout, c.s0, c.s1)], out, st)
        if lse is not None:
            host.d2h_region(self.results[1][b][:, :, c.s0:c.s1], lse, st)
        st.record(pipe.d2h_done[slot])

    def _key_prefix(self, x: DeviceArray, n: int) -> DeviceArray:
        """The first ``n`` keys of the shared K or V (a strided view for bhsd)."""
        axis = 1 if self.P.layout == "bshd" else 2
        shape = x.shape[:axis] + (n,) + x.shape[axis + 1:]
        return DeviceArray(x.ptr, shape, x.dtype, x.device, strides=x.strides, owner=x.owner, stream=x.stream)

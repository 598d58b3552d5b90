"""A fake CUDA driver for CPU runs of the device-resident op path (attention/decode on device arrays).

The entry points of ``cuda.bindings.driver`` that pyattn calls are replaced (monkeypatch) by ones
that answer like an idle H100: handles are counters, device memory is an address range nothing on
the host reads, pinned host memory is real NumPy memory (pyattn writes into it), and kernels are
"built" without NVRTC. Every call is counted by name, so a test can assert which driver calls a
repeat call makes, and ``dev/host_cost_cpu.py`` can report the host cost of pyattn's own Python
per call. Nothing here runs work: a launch or a copy to the device is a recorded no-op.
Test and dev code only (it reads the launched parameter struct through ctypes).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import itertools
import sys
import types
import weakref

import numpy as np
from cuda.bindings import driver

from pyattn import jit
from pyattn.runtime import memory

from fake_state import fresh_state
from fake_torch import fake_torch

OK = driver.CUresult.CUDA_SUCCESS
CALLS: collections.Counter = collections.Counter()  # driver entry point -> calls since the last reset
LAUNCHES: list = []  # (kernel name, grid, stream handle, first 16 struct words) per launch, when recording
PDL_LAUNCHES: list = []  # kernel names launched as programmatic dependents (cuLaunchKernelEx), always
MEMSETS: list = []  # (launches recorded before it, address, byte, bytes) per cuMemsetD8Async, when recording
TMAP_L2: list = []  # the L2 promotion each tensor map was encoded with (CUtensorMapL2promotion), always
OCCUPANCY: dict = {}  # blocks an SM of the kernels whose entry name holds the key (2 for the others)
_CTX = 0xC0000


class _Fake:
    """The replaced entry points; each returns what ``cuda.bindings`` would on success."""

    def __init__(self):
        self.ids = itertools.count(0x100)
        self.dev_next = 0x7F0000000000  # device addresses: never dereferenced on the host
        self.handed_out = set()  # every device address the fake allocated (uninstall() blanks them)
        self.host = {}  # pinned address -> the NumPy block behind it
        self.host_flags = {}  # pinned address -> its cuMemHostAlloc flags
        self.current = 0
        # Contexts (one a device: _CTX + ordinal), as far as the driver would hold pyattn to them: the
        # context each stream, event, module and function was made in; each call on a
        # context-relative stream handle (0 / 1: the legacy stream, 2: the per-thread one of the
        # *current* context) with the context current then; and every call that mixed contexts
        # (a launch outside its function's context or on another context's stream, an event
        # recorded on another context's stream), which a real driver refuses or runs elsewhere.
        self.ctx_of = {}  # handle -> context it was made in
        self.ctx_stack = []  # cuCtxPushCurrent's
        self.relative = []  # (entry point, handle, current context)
        self.mixed = []  # (entry point, what mixed, expected context, found context)
        self.kernel_names = {}
        self.record_launches = False
        # CUDA graph capture, as far as pyattn can tell it apart (begin_capture / end_capture): the
        # capture id of each capturing stream, the capture each graph allocation and each event
        # record was made in, and the driver's refusals inside a capture (the calls named below).
        self.capturing = {}  # stream handle -> capture id
        self.graph_blocks = {}  # device address -> id of the capture that allocated it
        self.event_capture = {}  # event handle -> id of the capture its last record was in (0: none)
        self.captured = []  # (driver entry point, stream handle) of each call made on a capturing stream
        self.free_modes = []  # this thread's capture mode at each cuMemFreeAsync
        self.refused = []  # (driver entry point, stream handle) of each call refused there (a real driver
        # would have invalidated the capture; pyattn swallows a free's error, so tests look here)
        self._capture_ids = itertools.count(1)

    def begin_capture(self, s) -> int:
        """Start capturing on stream ``s`` (a pyattn Stream or handle); returns the capture id."""
        cid = self.capturing[int(getattr(s, "handle", s))] = next(self._capture_ids)
        return cid

    def end_capture(self, s) -> None:
        self.capturing.pop(int(getattr(s, "handle", s)))

    def _stream_ctx(self, name, s):
        """The context stream ``s`` belongs to (None for a foreign stream pyattn did not make); a
        context-relative handle is noted under ``name`` (when given)."""
        if int(s) in (0, 1, 2):
            if name:
                self.relative.append((name, int(s), self.current))
            return self.current
        return self.ctx_of.get(int(s))

    def _same(self, name, what, expected, found):
        if expected is not None and found is not None and expected != found:
            self.mixed.append((name, what, expected, found))

    def _in_capture(self, name, s):
        self._stream_ctx(name, s)
        cid = self.capturing.get(int(s), 0)
        if cid:
            self.captured.append((name, int(s)))
        return cid

    def _refuse(self, name, s, why):
        self.refused.append((name, int(s)))
        return (getattr(driver.CUresult, f"CUDA_ERROR_STREAM_CAPTURE_{why}"),)

    def cuThreadExchangeStreamCaptureMode(self, mode):
        old, self.capture_mode = getattr(self, "capture_mode", driver.CUstreamCaptureMode(0)), mode
        return OK, old

    def cuStreamIsCapturing(self, s):
        status = driver.CUstreamCaptureStatus
        return OK, (status.CU_STREAM_CAPTURE_STATUS_ACTIVE if int(s) in self.capturing
                    else status.CU_STREAM_CAPTURE_STATUS_NONE)

    def cuStreamGetCaptureInfo(self, s):
        cid = self.capturing.get(int(s), 0)
        status = driver.CUstreamCaptureStatus
        return OK, (status.CU_STREAM_CAPTURE_STATUS_ACTIVE if cid else status.CU_STREAM_CAPTURE_STATUS_NONE), \
            cid, None, [], [], 0

    def _handle(self, kind):
        return kind(next(self.ids) * 0x100)

    def cuDriverGetVersion(self):
        return OK, 13000

    def cuInit(self, flags):
        return (OK,)

    def cuDeviceGetCount(self):
        return OK, 2  # two devices, so that a changed device can be tested

    def cuDeviceGet(self, ordinal):
        return OK, driver.CUdevice(ordinal)

    def cuDeviceGetAttribute(self, attr, dev):
        A = driver.CUdevice_attribute
        return OK, {A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
                    A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                    A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
                    A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
                    A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: 50 << 20}[attr]

    def cuDeviceGetName(self, n, dev):
        return OK, b"Fake H100\0"

    def cuDevicePrimaryCtxRetain(self, dev):
        return OK, driver.CUcontext(_CTX + int(dev))

    def cuCtxGetCurrent(self):
        return OK, driver.CUcontext(self.current)

    def cuCtxSetCurrent(self, ctx):
        self.current = int(ctx)
        return (OK,)

    def cuCtxPushCurrent(self, ctx):
        self.ctx_stack.append(self.current)
        self.current = int(ctx)
        return (OK,)

    def cuCtxPopCurrent(self):
        popped, self.current = self.current, self.ctx_stack.pop()
        return OK, driver.CUcontext(popped)

    def cuCtxGetDevice(self):
        return OK, driver.CUdevice(max(self.current - _CTX, 0))

    def cuCtxSynchronize(self):
        return (OK,)

    def cuStreamCreate(self, flags):
        h = self._handle(driver.CUstream)
        self.ctx_of[int(h)] = self.current
        return OK, h

    def cuStreamSynchronize(self, s):
        if self._in_capture("cuStreamSynchronize", s):
            return self._refuse("cuStreamSynchronize", s, "UNSUPPORTED")
        return (OK,)

    def cuStreamWaitEvent(self, s, ev, flags):
        cid = self._in_capture("cuStreamWaitEvent", s)
        if cid and self.event_capture.get(int(ev), 0) != cid:  # an event recorded outside the capture
            return self._refuse("cuStreamWaitEvent", s, "ISOLATION")
        return (OK,)

    def cuStreamGetCtx(self, s):  # a foreign handle (torch's, CuPy's): the current context's stream
        return OK, driver.CUcontext(self.ctx_of.get(int(s), self.current))

    def cuStreamDestroy(self, s):
        return (OK,)

    def cuEventCreate(self, flags):
        h = self._handle(driver.CUevent)
        self.ctx_of[int(h)] = self.current
        return OK, h

    def cuEventRecord(self, ev, s):
        self._same("cuEventRecord", "event and stream", self.ctx_of.get(int(ev)), self._stream_ctx("", s))
        self.event_capture[int(ev)] = self._in_capture("cuEventRecord", s)
        return (OK,)

    def cuEventQuery(self, ev):
        return (OK,)

    def cuEventSynchronize(self, ev):
        if self.event_capture.get(int(ev), 0):  # recorded in a capture: not a point in any stream's work
            return self._refuse("cuEventSynchronize", 0, "UNSUPPORTED")
        return (OK,)

    def cuEventDestroy(self, ev):
        return (OK,)

    def cuEventElapsedTime(self, start, end):
        return OK, 0.0

    def cuMemPoolCreate(self, props):
        return OK, self._handle(driver.CUmemoryPool)

    def cuMemPoolSetAttribute(self, pool, attr, value):
        return (OK,)

    def cuMemPoolTrimTo(self, pool, keep):
        return (OK,)

    def cuMemAllocFromPoolAsync(self, nbytes, pool, s):
        ptr, self.dev_next = self.dev_next, self.dev_next + ((int(nbytes) + 511) // 512) * 512
        self.handed_out.add(ptr)
        cid = self._in_capture("cuMemAllocFromPoolAsync", s)
        if cid:
            self.graph_blocks[ptr] = cid
        return OK, driver.CUdeviceptr(ptr)

    def cuMemFreeAsync(self, ptr, s):
        self._same("cuMemFreeAsync", "stream and current context", self._stream_ctx("", s), self.current)
        self.free_modes.append(getattr(self, "capture_mode", driver.CUstreamCaptureMode(0)))
        cid = self._in_capture("cuMemFreeAsync", s)
        if cid and self.graph_blocks.get(int(ptr)) != cid:  # a block from outside the capture
            return self._refuse("cuMemFreeAsync", s, "UNSUPPORTED")
        return (OK,)

    def cuMemsetD8Async(self, ptr, byte, n, s):
        self._in_capture("cuMemsetD8Async", s)
        if self.record_launches:
            MEMSETS.append((len(LAUNCHES), int(ptr), int(byte), int(n)))
        return (OK,)

    def cuMemHostAlloc(self, nbytes, flags):
        block = np.zeros(int(nbytes), np.uint8)
        ptr = block.__array_interface__["data"][0]
        self.host[ptr] = block
        self.host_flags[ptr] = int(flags)
        return OK, ptr

    def cuMemFreeHost(self, ptr):
        self.host.pop(int(ptr), None)
        return (OK,)

    def cuMemHostGetDevicePointer(self, ptr, flags):
        return OK, int(ptr)  # unified addressing: the device reads pinned memory at its host address

    def cuPointerGetAttribute(self, attr, ptr):
        return OK, 0  # every pointer is on device 0

    def cuMemcpyHtoDAsync(self, dst, src, n, s):
        self._in_capture("cuMemcpyHtoDAsync", s)
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst, src, n, s):
        self._in_capture("cuMemcpyDtoHAsync", s)
        return (OK,)

    def cuStreamWaitValue32(self, s, addr, value, flags):
        return (OK,)

    def cuMemcpyDtoDAsync(self, dst, src, n, s):
        return (OK,)

    def cuModuleLoadData(self, image):
        h = self._handle(driver.CUmodule)
        self.ctx_of[int(h)] = self.current
        return OK, h

    def cuModuleUnload(self, module):
        self._same("cuModuleUnload", "module and current context", self.ctx_of.get(int(module)), self.current)
        return (OK,)

    def cuModuleGetFunction(self, module, name):
        fn = self._handle(driver.CUfunction)
        self.ctx_of[int(fn)] = self.ctx_of.get(int(module))
        self.kernel_names[int(fn)] = name.decode()
        return OK, fn

    def cuFuncGetName(self, fn):
        return OK, self.kernel_names.get(int(fn), "").encode()

    def cuFuncGetAttribute(self, attr, fn):
        return OK, 0

    def cuFuncSetAttribute(self, fn, attr, value):
        return (OK,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, threads, smem):
        name = self.kernel_names.get(int(fn), "")
        return OK, next((n for part, n in OCCUPANCY.items() if part in name), 2)

    def cuTensorMapEncodeTiled(self, dtype, rank, ptr, dims, strides, box, elem_strides, interleave, swizzle, l2,
                               fill):
        # A map's 128 bytes: here the address and a counter (a kernel never reads them).
        TMAP_L2.append(l2)
        return OK, types.SimpleNamespace(opaque=[int(ptr), next(self.ids)] + [0] * 14)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, s, argv, extra):
        fn_ctx = self.ctx_of.get(int(fn))
        self._same("cuLaunchKernel", "function and current context", fn_ctx, self.current)
        self._same("cuLaunchKernel", "function and stream", fn_ctx, self._stream_ctx("", s))
        self._in_capture("cuLaunchKernel", s)
        if self.record_launches:  # the struct's leading pointers: argv -> [address of the struct]
            struct = ctypes.c_uint64.from_address(int(argv)).value
            ptrs = tuple((ctypes.c_uint64 * 16).from_address(struct))
            LAUNCHES.append((self.kernel_names.get(int(fn)), (gx, gy, gz), int(s), ptrs))
        return (OK,)

    def cuLaunchKernelEx(self, config, fn, argv, extra):
        """A launch with attributes (pyattn's only one, every launch's on sm_90+: programmatic
        stream serialization, which test_host_path_decode checks on the config itself): recorded as
        a plain launch, its kernel's name added to :data:`PDL_LAUNCHES`. (Reading ``config.attrs``
        back costs ~3 us, which the host-cost probes would count as pyattn's.)"""
        if config.numAttrs:
            PDL_LAUNCHES.append(self.kernel_names.get(int(fn)))
        return self.cuLaunchKernel(fn, config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX,
                                   config.blockDimY, config.blockDimZ, config.sharedMemBytes, config.hStream, argv,
                                   extra)


def _counted(name, fn):
    def call(*args):
        CALLS[name] += 1
        return fn(*args)

    return call


def _fake_build(spec):
    """``jit.build`` without NVRTC: an empty image and an entry point named after the spec's family."""
    return b"\0", {"entry": f"{spec.family}_{spec.dtype}_{spec.head_dim}"}, None


def install(monkeypatch) -> _Fake:
    """Install the fake driver (and fresh pyattn device state) for the life of ``monkeypatch``;
    returns the fake (``.record_launches = True`` fills :data:`LAUNCHES`)."""
    fake = _Fake()
    for name in dir(_Fake):
        if name.startswith("cu"):
            monkeypatch.setattr(driver, name, _counted(name, getattr(fake, name)))
    monkeypatch.setattr(jit, "build", _fake_build)
    fresh_state(monkeypatch)
    CALLS.clear()
    LAUNCHES.clear()
    PDL_LAUNCHES.clear()
    MEMSETS.clear()
    TMAP_L2.clear()
    fake.finalizers_before = set(weakref.finalize._registry)  # see uninstall()
    return fake


def uninstall(fake: _Fake) -> None:
    """Before the fake goes (at a fixture's teardown, ahead of monkeypatch's): release what was made
    under it while the fake still answers, and detach the finalizers of whatever outlives that
    (module caches the monkeypatch swaps back out, test locals). Such a finalizer would hand a fake
    handle to the real driver later, and on a GPU machine that is a segfault, not an error (the
    first GPU run of these tests crashed in release_quietly)."""
    gc.collect()
    for f in set(weakref.finalize._registry) - fake.finalizers_before:
        f.detach()
    # Device blocks free themselves in __del__ (no finalizer object): blank the fake ones still
    # alive (e.g. a fixture's cache, released by pytest after every teardown), so their free is a
    # no-op.
    for obj in gc.get_objects():
        if type(obj) is memory.Allocation and obj.ptr in fake.handed_out:
            obj.ptr = 0


@contextlib.contextmanager
def installed(monkeypatch, *, torch: bool = False, record_launches: bool = False):
    """The fake driver for a test fixture's life: :func:`install`, optionally the fake ``torch`` as
    ``sys.modules["torch"]`` (and ``fake.torch``) and launch recording, then :func:`uninstall` (nothing
    made under the fake may reach a real driver later)."""
    fake = install(monkeypatch)
    if torch:
        fake.torch = fake_torch()
        monkeypatch.setitem(sys.modules, "torch", fake.torch)
    fake.record_launches = record_launches
    try:
        yield fake
    finally:
        uninstall(fake)


"""GPU discovery: driver initialisation, devices, their primary contexts and arch strings.

Nothing here runs at import. The first call to :func:`get_device` initialises the driver;
devices are then cached per ordinal for the life of the process (a device and its retained
primary context are process-wide facts, like the driver's own).

Thread safety: :func:`get_device` is safe to call from several threads; a :class:`Device`
is immutable after construction, and :meth:`Device.activate` only sets the calling thread's
current context (put back at the end of the public call that changed it: :func:`keeps_context`).
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass

from .errors import NoDeviceError, check, no_device_error

__all__ = ["Device", "get_device", "device_count", "driver_version", "arch_for_capability", "SUPPORTED_ARCHS",
           "ARCH_GPUS", "MIN_DRIVER_CUDA", "keeps_context"]

# Archs we compile for. The "a" suffix selects the arch-specific instruction set (wgmma,
# setmaxnreg, tcgen05), which only runs on exactly that arch; cubins are never shared across archs.
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
#: Examples of the GPUs behind each arch (for messages and help; the capability is what counts).
ARCH_GPUS = {
    "sm_80": "A100, A30",
    "sm_86": "A10, A40, RTX 30xx, RTX A6000",
    "sm_89": "L4, L40, L40S, RTX 40xx, RTX 6000 Ada",
    "sm_90a": "H100, H200, GH200",
    "sm_100a": "B200, GB200",
}

_lock = threading.Lock()
_devices: dict[int, "Device"] = {}
_initialised = False
_driver_module = None


_put_back: dict = {}  # thread ident -> the context its outermost public call puts back as it ends
_CALL_CODE = None  # the code of keeps_context's wrapper (one code object for every wrapped function)


def keeps_context(fn):
    """``fn`` (a public function or method that may do device work) made to leave the calling
    thread's current CUDA context as it found it.

    CUDA's runtime takes the thread's current context for its current device, so a call on arrays
    of device 1 that left device 1's context current would move torch's (and CuPy's) current
    device under their feet: ``torch.empty(n, device="cuda")`` would then land on ``cuda:1``.
    torch's own ops put the device back (its ``DeviceGuard``); pyattn does the same: when
    :meth:`Device.activate` replaces another context inside such a call, the outermost such call
    on the thread puts that context back as it returns or raises. A thread with no context current
    gets none back, except after a call on device 0, whose context stays: to CUDA's runtime both
    mean device 0 (it binds device 0's primary context on first use), and a one-GPU loop then pays
    no switch a call.

    The common case (no context replaced) costs the wrapper's frame and one dict test (~0.15 us a
    call): no per-thread state is written. Only a call that did replace one walks the Python stack,
    in :meth:`Device.activate` and here, to tell the outermost wrapped call from a nested one.
    """
    global _CALL_CODE

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if _put_back:  # some thread replaced a context: is it this one, and is this its outermost call?
                ident = threading.get_ident()
                if ident in _put_back and not _in_public_call(sys._getframe(1)):
                    check(_driver_module.cuCtxSetCurrent(_put_back.pop(ident)), "cuCtxSetCurrent")

    _CALL_CODE = call.__code__
    return call


def _in_public_call(frame) -> bool:
    """Whether ``frame`` or a caller of it is a :func:`keeps_context` wrapper's."""
    while frame is not None:
        if frame.f_code is _CALL_CODE:
            return True
        frame = frame.f_back
    return False


def arch_for_capability(major: int, minor: int) -> str:
    """Map a compute capability to the arch pyattn compiles for.

    Parameters
    ----------
    major, minor : int
        The device's compute capability.

    Returns
    -------
    str
        One of :data:`SUPPORTED_ARCHS`.

    Raises
    ------
    PyattnError
        For a capability with no supported arch. We never silently compile for a
        different arch: sm_87 (Orin) and sm_120 (consumer Blackwell) differ in shared
        memory size and instruction set enough that a kernel tuned elsewhere may not launch.
    """
    from .errors import PyattnError

    table = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90a", (10, 0): "sm_100a"}
    try:
        return table[(major, minor)]
    except KeyError:
        raise PyattnError(
            f"compute capability {major}.{minor} is not supported; pyattn builds for "
            f"{', '.join(SUPPORTED_ARCHS)} (capabilities 8.0, 8.6, 8.9, 9.0, 10.0)"
        ) from None


# cuda-bindings 13 is built against the CUDA 13 driver API; CUDA minor-version compatibility
# covers any 13.x driver (R580 and newer), not a 12.x one.
MIN_DRIVER_CUDA = (13, 0)


def _init_driver():
    """Import the driver bindings and initialise the driver, or raise a classified NoDeviceError.

    The three failures a user can act on are told apart (today's cuda.bindings raises
    cuda.pathfinder's ``DynamicLibNotFoundError`` from the first call when libcuda.so.1 is not
    there; a stub libcuda answers CUDA_ERROR_STUB_LIBRARY): no driver library, a driver too old
    for CUDA 13, and a working driver with no GPU.
    """
    from cuda.bindings import driver

    try:
        # cuDriverGetVersion works before cuInit: ask first, so a pre-13 driver is reported as
        # too old rather than by whatever cuInit or a later call answers.
        result = driver.cuDriverGetVersion()
    except Exception as exc:
        from cuda.pathfinder import DynamicLibNotFoundError

        if isinstance(exc, DynamicLibNotFoundError):
            raise NoDeviceError(-1, "DRIVER_LIBRARY_NOT_FOUND", str(exc), "cuDriverGetVersion",
                                reason="no_driver") from exc
        raise NoDeviceError(-1, type(exc).__name__, str(exc), "cuDriverGetVersion",
                            reason="driver_error") from exc
    if int(result[0]) != 0:
        raise no_device_error(result[0], "cuDriverGetVersion")
    version = int(result[1])
    have = (version // 1000, (version % 1000) // 10)
    if have < MIN_DRIVER_CUDA:
        raise NoDeviceError(-1, "DRIVER_TOO_OLD", f"the installed driver supports CUDA "
                            f"{have[0]}.{have[1]}", "cuDriverGetVersion", reason="driver_too_old")
    code = driver.cuInit(0)[0]
    if int(code) != 0:
        raise no_device_error(code, "cuInit")
    return driver


def _driver():
    """The initialised driver bindings (initialised once), or raise :class:`NoDeviceError`.

    A failed initialisation is not remembered: the next call tries again (a driver may be
    installed, or a device node appear, while the process runs).
    """
    global _initialised, _driver_module
    if _initialised:  # hot path: every op activates its device
        return _driver_module
    with _lock:
        if not _initialised:
            _driver_module = _init_driver()
            _initialised = True
    return _driver_module


def device_count() -> int:
    """Return the number of CUDA devices, 0 when there is no driver or no GPU."""
    try:
        driver = _driver()
        return int(check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))
    except NoDeviceError:
        return 0


def driver_version() -> tuple[int, int]:
    """Return the driver's CUDA version as ``(major, minor)``."""
    driver = _driver()
    v = int(check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
    return v // 1000, (v % 1000) // 10


@dataclass(frozen=True, eq=False)
class Device:
    """One CUDA device and its retained primary context.

    Obtain instances through :func:`get_device`; they live as long as the process.

    Attributes
    ----------
    ordinal : int
    name : str
    capability : tuple of int
    sm_count : int
    max_shared_per_block_optin : int
        Bytes of shared memory a block may use after opting in.
    l2_bytes : int
    """

    ordinal: int
    name: str
    capability: tuple
    sm_count: int
    max_shared_per_block_optin: int
    l2_bytes: int
    handle: object
    context: object

    def __post_init__(self):
        # The context's address, compared with the current one by every op's activate().
        object.__setattr__(self, "_context_ptr", int(self.context))

    @property
    def arch(self) -> str:
        """The arch kernels are compiled for; raises ``PyattnError`` on an unsupported GPU. (Kept
        once known: per-call paths ask for it.)"""
        arch = self.__dict__.get("_arch")
        if arch is None:
            arch = arch_for_capability(*self.capability)
            object.__setattr__(self, "_arch", arch)
        return arch

    def activate(self) -> None:
        """Make this device's primary context current on the calling thread (cheap when it already
        is). Inside a public call, another context it replaces is put back when the call ends
        (:func:`keeps_context`)."""
        driver = _driver_module if _initialised else _driver()  # (the hot path skips a call)
        err, current = driver.cuCtxGetCurrent()
        if err or int(current) != self._context_ptr:
            # Another context, or none while this is not device 0: put back at the end of the public
            # call (none and device 0 both read as "device 0" to CUDA's runtime: kept, so a one-GPU
            # loop in a thread that chose no device pays no switch a call).
            if not err and (int(current) or self.ordinal):
                ident = threading.get_ident()
                if ident not in _put_back and _in_public_call(sys._getframe(1)):
                    _put_back[ident] = current
            check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def push(self) -> bool:
        """Make this device's context current for a stretch of driver calls outside any public call
        (a finalizer's free, which may run on any thread at any time): pushed only when another
        context (or none) is current. Returns whether it was; then :meth:`pop` puts the thread's
        context back."""
        driver = _driver_module if _initialised else _driver()
        err, current = driver.cuCtxGetCurrent()
        if not err and int(current) == self._context_ptr:
            return False
        check(driver.cuCtxPushCurrent(self.context), "cuCtxPushCurrent")
        return True

    def pop(self) -> None:
        """Undo a :meth:`push` that returned True."""
        check(_driver_module.cuCtxPopCurrent(), "cuCtxPopCurrent")

    @keeps_context
    def synchronize(self) -> None:
        """Wait for all work on this device. Prefer ``Stream.synchronize``; this is for tests and teardown."""
        self.activate()
        check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")

    def __repr__(self) -> str:
        cc = "%d.%d" % self.capability
        return f"<pyattn.Device {self.ordinal}: {self.name} (compute {cc}, {self.sm_count} SMs)>"


def _attribute(driver, dev, attr) -> int:
    return int(check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))


def get_device(ordinal: int | None = None) -> Device:
    """Return the :class:`Device` for ``ordinal`` (default: the current context's device, else 0).

    Parameters
    ----------
    ordinal : int, optional
        CUDA device ordinal.

    Raises
    ------
    NoDeviceError
        When no driver or no device is present.
    ValueError
        When ``ordinal`` is out of range.
    """
    driver = _driver()
    if ordinal is None:
        ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        ordinal = int(check(driver.cuCtxGetDevice(), "cuCtxGetDevice")) if int(ctx) else 0
    dev = _devices.get(ordinal)
    if dev is not None:
        return dev
    with _lock:
        if ordinal in _devices:
            return _devices[ordinal]
        count = int(check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))
        if count == 0:
            raise NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", "the driver reports no CUDA device", "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise ValueError(f"device: expected an ordinal in [0, {count}), got {ordinal}")
        handle = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        A = driver.CUdevice_attribute
        major = _attribute(driver, handle, A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = _attribute(driver, handle, A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        raw_name = check(driver.cuDeviceGetName(256, handle), "cuDeviceGetName")
        # Retained for the process lifetime: releasing it while arrays or modules live would
        # destroy them under the user's feet, and the driver tears it down at exit anyway.
        context = check(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
        dev = Device(
            ordinal=ordinal,
            name=raw_name.split(b"\0", 1)[0].decode(),
            capability=(major, minor),
            sm_count=_attribute(driver, handle, A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            max_shared_per_block_optin=_attribute(
                driver, handle, A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            ),
            l2_bytes=_attribute(driver, handle, A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            handle=handle,
            context=context,
        )
        _devices[ordinal] = dev
        return dev

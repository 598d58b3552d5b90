"""Driver initialisation failures are told apart: no driver library, a driver too old, no GPU.

No GPU here: the driver bindings' entry points are replaced (monkeypatch) to answer as each kind
of machine would, and ``python -m pyattn info``/``warmup`` are run in-process on top.
"""

from __future__ import annotations

import pytest
from cuda.bindings import driver
from cuda.pathfinder import DynamicLibNotFoundError

from pyattn.__main__ import main
from pyattn.runtime import device
from pyattn.runtime.errors import CudaError, NoDeviceError

R = driver.CUresult


class _FakeDriver:
    """cuDriverGetVersion / cuInit answering as a given machine; records which were called."""

    def __init__(self, version=13000, version_error=None, init_result=R.CUDA_SUCCESS, missing=False):
        self.version, self.version_error = version, version_error
        self.init_result, self.missing = init_result, missing
        self.calls = []

    def cuDriverGetVersion(self):
        self.calls.append("cuDriverGetVersion")
        if self.missing:  # what cuda.bindings raises when libcuda.so.1 is not on the system
            raise DynamicLibNotFoundError('"cuda" is an NVIDIA driver library and can only be found '
                                          "via system search.")
        return (self.version_error or R.CUDA_SUCCESS, self.version)

    def cuInit(self, flags):
        self.calls.append("cuInit")
        return (self.init_result,)


MACHINES = {  # name -> (fake driver, expected reason, words the message must contain)
    "no_library": (dict(missing=True), "no_driver", ["libcuda.so.1", "R580", "system search"]),
    "stub_library": (dict(version_error=R.CUDA_ERROR_STUB_LIBRARY), "no_driver",
                     ["libcuda.so.1", "CUDA_ERROR_STUB_LIBRARY (34) in cuDriverGetVersion"]),
    "driver_12_8": (dict(version=12080), "driver_too_old", ["supports CUDA 12.8", "13.0", "R580"]),
    "needs_newer": (dict(init_result=R.CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER), "driver_too_old",
                    ["CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER (36) in cuInit"]),
    "no_gpu": (dict(init_result=R.CUDA_ERROR_NO_DEVICE), "no_device",
               ["no GPU", "CUDA_ERROR_NO_DEVICE (100) in cuInit"]),
    "no_device_nodes": (dict(init_result=R.CUDA_ERROR_UNKNOWN), "driver_error",
                        ["failed to initialise", "CUDA_ERROR_UNKNOWN (999) in cuInit"]),
}


@pytest.fixture
def machine(monkeypatch):
    """Install a fake driver; the real initialisation state is restored afterwards."""

    def install(**kwargs):
        fake = _FakeDriver(**kwargs)
        monkeypatch.setattr(driver, "cuDriverGetVersion", fake.cuDriverGetVersion)
        monkeypatch.setattr(driver, "cuInit", fake.cuInit)
        monkeypatch.setattr(device, "_initialised", False)
        monkeypatch.setattr(device, "_driver_module", None)
        monkeypatch.setattr(device, "_devices", {})
        return fake

    return install


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_initialisation_failure_is_classified(machine, name):
    kwargs, reason, words = MACHINES[name]
    fake = machine(**kwargs)
    with pytest.raises(NoDeviceError) as info:
        device.get_device()
    exc = info.value
    assert exc.reason == reason
    message = str(exc)
    assert message.startswith(NoDeviceError.REASONS[reason]), message
    for word in words:
        assert word in message, (word, message)
    if reason != "no_device":
        assert "CUDA_ERROR_NO_DEVICE" not in message  # the misreport this replaces
    if name == "driver_12_8":
        assert fake.calls == ["cuDriverGetVersion"], "a too-old driver is not initialised"
    assert device.device_count() == 0
    assert device._initialised is False, "a failure is not remembered: the next call tries again"


def test_the_four_headlines_are_distinct():
    assert len(set(NoDeviceError.REASONS.values())) == len(NoDeviceError.REASONS) == 4


def test_a_working_driver_initialises_once(machine):
    fake = machine(version=13000)
    assert device._driver() is driver
    assert device._driver() is driver
    assert fake.calls == ["cuDriverGetVersion", "cuInit"]


def test_no_device_error_keeps_its_cuda_error_interface():
    exc = NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", "blocked for the test", "cuInit")
    assert isinstance(exc, CudaError)
    assert (exc.code, exc.name, exc.description, exc.call, exc.reason) == (
        100, "CUDA_ERROR_NO_DEVICE", "blocked for the test", "cuInit", "no_device")
    assert "blocked for the test" in str(exc)
    with pytest.raises(ValueError, match="reason"):
        NoDeviceError(100, "CUDA_ERROR_NO_DEVICE", "x", "cuInit", reason="on_vacation")


def test_the_real_machine_is_classified_by_whether_libcuda_loads():
    """Nothing patched: this machine's answer agrees with whether the driver library loads."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    try:
        load_nvidia_dynamic_lib("cuda")
    except DynamicLibNotFoundError:
        with pytest.raises(NoDeviceError) as info:
            device.get_device()
        assert info.value.reason == "no_driver"
        return
    if device.device_count() > 0:
        pytest.skip("a GPU is present: nothing to classify")
    with pytest.raises(NoDeviceError) as info:
        device.get_device()
    assert info.value.reason != "no_driver"


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_cli_says_which(machine, name, capsys, cache_dir):
    kwargs, reason, _ = MACHINES[name]
    machine(**kwargs)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"GPU: none ({NoDeviceError.REASONS[reason]}" in out, out
    assert main(["warmup"]) == 2
    err = capsys.readouterr().err
    assert f"no usable GPU ({NoDeviceError.REASONS[reason]}" in err and "--arch" in err, err

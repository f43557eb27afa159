"""GPU health from NVML, against a stand-in for nvidia-ml-py's module (no GPU here): what makes a GPU unhealthy."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from supervisor.launch.gpu_health import gpu_problems


class NotSupported(Exception):
    """NVMLError_NotSupported: this GPU or driver cannot answer."""


class FakeNvml:
    """The calls gpu_problems makes, answering per GPU from plain values (None: NotSupported)."""

    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 274

    def __init__(self, *gpus: dict[str, Any], init_fails: bool = False) -> None:
        self.gpus, self.init_fails, self.shut_down = gpus, init_fails, False

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.gpus[index]

    def nvmlDeviceGetFieldValues(self, gpu: dict[str, Any], fields: list[int]) -> list[Any]:
        assert fields == [274]
        action = self._answer(gpu, "action")
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=action))]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: dict[str, Any]) -> int:
        return self._answer(gpu, "pages_pending")

    def nvmlDeviceGetRemappedRows(self, gpu: dict[str, Any]) -> tuple[int, int, int, int]:
        return self._answer(gpu, "remapped")

    @staticmethod
    def _answer(gpu: dict[str, Any], key: str) -> Any:
        if gpu.get(key) is None:
            raise NotSupported(key)
        return gpu[key]


HEALTHY = {"action": 0, "pages_pending": 0, "remapped": (3, 0, 0, 0)}


def test_healthy_gpus_have_no_problems_and_nvml_is_shut_down():
    nvml = FakeNvml(HEALTHY, HEALTHY)
    assert gpu_problems(nvml) == [] and nvml.shut_down


def test_a_gpu_that_needs_a_reset_or_has_pending_pages_or_remapping_is_named_with_why():
    nvml = FakeNvml(
        HEALTHY,
        {**HEALTHY, "action": 1, "pages_pending": 1},
        {**HEALTHY, "remapped": (0, 2, 1, 0)},
        {**HEALTHY, "action": 2, "remapped": (0, 0, 0, 1)},
    )
    assert gpu_problems(nvml) == [
        "GPU 1: NVML asks for a GPU reset",
        "GPU 1: retired memory pages are pending (an ECC error; takes effect after a reset)",
        "GPU 2: row remapping is pending (needs a reset)",
        "GPU 3: NVML asks for a node reboot",
        "GPU 3: row remapping failed",
    ]


def test_queries_a_gpu_does_not_support_do_not_judge_it():
    assert gpu_problems(FakeNvml({"action": None, "pages_pending": None, "remapped": None})) == []


def test_without_nvml_nothing_is_known():
    assert gpu_problems(FakeNvml(init_fails=True)) is None

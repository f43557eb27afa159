"""A stand-in for nvidia-ml-py on PYTHONPATH (the NVML calls supervisor/launch/gpu_health.py makes; the others do not
exist): one GPU whose driver asks for a reset; or, with FAKE_NVML_GPUS naming a file, as many healthy GPUs as that
file says at each call (a test, or a rank, changes the number between attempts)."""

import os
from pathlib import Path
from types import SimpleNamespace

NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 274


class NVMLError_NotSupported(Exception):  # noqa: N801 - pynvml's name
    pass


def nvmlInit() -> None:  # noqa: N802 - pynvml's names
    pass


def nvmlShutdown() -> None:  # noqa: N802
    pass


def nvmlDeviceGetCount() -> int:  # noqa: N802
    counted = os.environ.get("FAKE_NVML_GPUS")
    return int(Path(counted).read_text()) if counted else 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:  # noqa: N802
    return index


def nvmlDeviceGetFieldValues(handle: int, fields: list[int]) -> list[SimpleNamespace]:  # noqa: N802
    action = 0 if os.environ.get("FAKE_NVML_GPUS") else 1  # 1: a GPU reset
    return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=action)) for _ in fields]


def nvmlDeviceGetRetiredPagesPendingStatus(handle: int) -> int:  # noqa: N802
    raise NVMLError_NotSupported


def nvmlDeviceGetRemappedRows(handle: int) -> tuple[int, int, int, int]:  # noqa: N802
    raise NVMLError_NotSupported

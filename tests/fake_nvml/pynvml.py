"""A stand-in for nvidia-ml-py on PYTHONPATH: one GPU whose driver asks for a reset (the NVML calls
supervisor/launch/gpu_health.py makes; the others do not exist)."""

from types import SimpleNamespace

NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 274


class NVMLError_NotSupported(Exception):  # noqa: N801 - pynvml's name
    pass


def nvmlInit() -> None:  # noqa: N802 - pynvml's names
    pass


def nvmlShutdown() -> None:  # noqa: N802
    pass


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:  # noqa: N802
    return index


def nvmlDeviceGetFieldValues(handle: int, fields: list[int]) -> list[SimpleNamespace]:  # noqa: N802
    return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=1)) for _ in fields]  # 1: a GPU reset


def nvmlDeviceGetRetiredPagesPendingStatus(handle: int) -> int:  # noqa: N802
    raise NVMLError_NotSupported


def nvmlDeviceGetRemappedRows(handle: int) -> tuple[int, int, int, int]:  # noqa: N802
    raise NVMLError_NotSupported

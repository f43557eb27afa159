"""GPU health between attempts, from NVML (nvidia-ml-py, the optional `[gpu]` extra; nothing without it).

Checked on each node before an attempt's ranks start there. A GPU is unhealthy when NVML says so itself:
- its recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, driver 570+) is not NONE: a reset, a node reboot,
  or a drain is needed (NVRx's GPUHealthCheck reads the same field);
- retired pages are pending (an ECC error retired memory that takes effect only after a reset);
- row remapping is pending or has failed.
A GPU whose NVML lacks a query is not judged by it (NotSupported). Xid errors reach NVML only as events while one
listens; they are not read here. The caller decides: locally the launch fails with EXIT_REQUEUE (another machine
is needed), on Slurm the node is charged in the ledger and the attempt starts without it.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["RECOVERY_ACTIONS", "gpu_problems"]

RECOVERY_ACTIONS = {
    0: None,
    1: "a GPU reset",
    2: "a node reboot",
    3: "draining its peer-to-peer traffic",
    4: "draining and a reset",
}
FIELD_RECOVERY_ACTION = 274  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, for an nvidia-ml-py too old to name it


def gpu_problems(nvml: Any = None) -> list[str] | None:
    """One line per unhealthy GPU of this machine; None when NVML is not there (no package, no driver)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPUs to judge
        return None
    try:
        return [
            f"GPU {index}: {problem}"
            for index in range(nvml.nvmlDeviceGetCount())
            for problem in _device_problems(nvml, nvml.nvmlDeviceGetHandleByIndex(index))
        ]
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _device_problems(nvml: Any, handle: Any) -> list[str]:
    problems = []
    action = _query(lambda: _recovery_action(nvml, handle))
    if action:
        problems.append(f"NVML asks for {RECOVERY_ACTIONS.get(action, f'recovery action {action}')}")
    if _query(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)):
        problems.append("retired memory pages are pending (an ECC error; takes effect after a reset)")
    remapped = _query(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    if remapped and (remapped[2] or remapped[3]):
        problems.append("row remapping " + ("failed" if remapped[3] else "is pending (needs a reset)"))
    return problems


def _recovery_action(nvml: Any, handle: Any) -> int:
    field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FIELD_RECOVERY_ACTION)
    (value,) = nvml.nvmlDeviceGetFieldValues(handle, [field])
    if getattr(value, "nvmlReturn", 0) != 0:
        return 0  # the driver does not know the field
    return int(value.value.uiVal)


def _query(ask: Any) -> Any:
    """What NVML answers; None when this GPU or driver does not support the question."""
    try:
        return ask()
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends: not judged by this query
        return None

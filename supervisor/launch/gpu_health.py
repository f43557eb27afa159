"""This node's GPUs before each attempt: how many the ranks can see, and whether NVML calls one unhealthy.

The count (`count_gpus`, for `device: cuda`: a GPU per rank) comes from NVML when nvidia-ml-py is installed, else
from the driver's /proc/driver/nvidia/gpus (a directory per GPU), else from `nvidia-smi -L`; none of them: no GPU.
CUDA_VISIBLE_DEVICES then narrows it as CUDA does (`visible_gpus`). Torch-free, like the whole supervisor.

Health, from NVML (nvidia-ml-py, the optional `[gpu]` extra; nothing without it), is checked on each node before an
attempt's ranks start there. A GPU is unhealthy when NVML says so itself:
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
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.config import JobConfig

__all__ = [
    "DRIVER_GPUS",
    "ENV_VISIBLE",
    "RECOVERY_ACTIONS",
    "GpuCount",
    "count_gpus",
    "gpu_problems",
    "gpu_shortage",
    "preflight",
    "reported_shortage",
    "visible_gpus",
]

RECOVERY_ACTIONS = {
    0: None,
    1: "a GPU reset",
    2: "a node reboot",
    3: "draining its peer-to-peer traffic",
    4: "draining and a reset",
}
FIELD_RECOVERY_ACTION = 274  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, for an nvidia-ml-py too old to name it
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # the NVIDIA driver's: one directory per GPU, named by its PCI address
ENV_VISIBLE = "CUDA_VISIBLE_DEVICES"
SMI_TIMEOUT_S = 5.0  # below the supervisor's wait for an agent's hello (MAX_HELLO_WAIT_S), which counts first
MAX_SETTING_CHARS = 80  # of a CUDA_VISIBLE_DEVICES value shown in a message
_LEADING_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class GpuCount:
    """The GPUs this node's driver shows (before CUDA_VISIBLE_DEVICES), and how they were counted."""

    gpus: int
    how: str  # "counted by NVML", ..., or why none could be counted ("no NVIDIA driver here: ...")

    def to_json(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "how": self.how}

    @staticmethod
    def from_json(value: Any) -> GpuCount | None:
        """From a node agent's hello; None for anything else than a count and a short text."""
        if not isinstance(value, dict) or type(value.get("gpus")) is not int or not isinstance(value.get("how"), str):
            return None
        return GpuCount(max(0, value["gpus"]), "".join(c if c.isprintable() else " " for c in value["how"][:200]))


def count_gpus(nvml: Any = None, driver_dir: Path = DRIVER_GPUS, smi: str = "nvidia-smi") -> GpuCount:
    """This node's GPUs: NVML's count when nvidia-ml-py is installed and a driver answers, else the driver's
    directories, else the lines of `nvidia-smi -L`; 0 when none of them is there (no driver: no GPU)."""
    by_nvml = _nvml_count(nvml)
    if by_nvml is not None:
        return GpuCount(by_nvml, "counted by NVML")
    try:
        with os.scandir(driver_dir) as entries:
            return GpuCount(sum(1 for e in entries if e.is_dir(follow_symlinks=False)), f"counted in {driver_dir}")
    except OSError:  # no driver loaded here (or a /proc without it): ask nvidia-smi
        pass
    try:
        done = subprocess.run(
            [smi, "-L"], stdin=subprocess.DEVNULL, capture_output=True, timeout=SMI_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        return GpuCount(0, f"no NVIDIA driver here: no NVML, no {driver_dir}, no {smi}")
    except subprocess.TimeoutExpired:
        return GpuCount(0, f"{smi} -L did not answer within {SMI_TIMEOUT_S:g} s")
    except OSError as exc:
        return GpuCount(0, f"{smi} -L could not run: {exc.strerror or exc}")
    said = done.stdout.decode("utf-8", errors="replace").splitlines()
    if done.returncode != 0:
        last = (done.stderr or done.stdout).decode("utf-8", errors="replace").strip().splitlines()
        why = f": {_brief(last[-1])}" if last else ""
        return GpuCount(0, f"{smi} -L exited with code {done.returncode}{why}")
    return GpuCount(sum(1 for line in said if line.startswith("GPU ")), f"counted by {smi} -L")


def visible_gpus(gpus: int, setting: str | None) -> int:
    """How many of `gpus` a CUDA program sees under CUDA_VISIBLE_DEVICES=`setting` (None: unset, all), read as
    torch.cuda reads it: indices up to the first that is not one or is negative, cut at the first past the last GPU;
    UUIDs (GPU-..., MIG-...) counted as entries while they keep the first one's prefix; any entry given twice: none."""
    if setting is None or gpus == 0:
        return gpus
    entries = [entry.strip() for entry in setting.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        named: list[str] = []
        for entry in entries:
            if not entry.startswith(prefix):
                break
            if entry in named:
                return 0
            named.append(entry)
        return len(named) if prefix == "MIG-" else min(len(named), gpus)  # a GPU holds several MIG instances
    indices: list[int] = []
    for entry in entries:
        match = _LEADING_INT.match(entry)  # CUDA reads each with strtoul: "1gpu" is 1
        index = int(match.group()) if match else -1
        if index < 0:
            break
        if index in indices:
            return 0
        indices.append(index)
    return next((i for i, index in enumerate(indices) if index >= gpus), len(indices))


def gpu_shortage(config: JobConfig, count: GpuCount, inherited: str | None, where: str = "this machine") -> str | None:
    """With `device: cuda`: one line naming both numbers when a node showing `count` GPUs cannot give each of its
    `nproc_per_node` ranks one, under the ranks' CUDA_VISIBLE_DEVICES (the config's `env:` value, else `inherited`,
    the node's own; None: unset). None when it can, and always with `device: cpu`."""
    if config.device != "cuda":
        return None
    needed, setting = config.nproc_per_node, config.env.get(ENV_VISIBLE, inherited)
    visible = visible_gpus(count.gpus, setting)
    if visible >= needed:
        return None
    how = count.how
    if setting is not None and visible < count.gpus:  # CUDA_VISIBLE_DEVICES hid some
        how += f": {count.gpus}, of which {ENV_VISIBLE}={_brief(setting)!r} leaves {visible}"
    return (
        f"device: cuda needs a GPU per rank (nproc_per_node: {needed}), "
        f"but {where} shows {visible} GPU{'' if visible == 1 else 's'} ({how})"
    )


def preflight(config: JobConfig) -> str | None:
    """Before every launch on this machine: why its GPUs cannot run the job's ranks (`gpu_shortage`), or None."""
    if config.device != "cuda":
        return None  # nothing is counted for a CPU job
    return gpu_shortage(config, count_gpus(), os.environ.get(ENV_VISIBLE))


def reported_shortage(config: JobConfig, hello: Mapping[str, Any], node: str) -> str | None:
    """`preflight` for another node, from its agent's hello (`gpus`, `cuda_visible_devices`); None when the hello
    says nothing of them."""
    count, setting = GpuCount.from_json(hello.get("gpus")), hello.get("cuda_visible_devices")
    if count is None:
        return None
    return gpu_shortage(config, count, setting if isinstance(setting, str) else None, f"node {node}")


def gpu_problems(nvml: Any = None) -> list[str] | None:
    """One line per unhealthy GPU of this machine; None when NVML is not there (no package, no driver)."""
    with _nvml_session(nvml) as session:
        if session is None:
            return None
        return [
            f"GPU {index}: {problem}"
            for index in range(session.nvmlDeviceGetCount())
            for problem in _device_problems(session, session.nvmlDeviceGetHandleByIndex(index))
        ]


def _nvml_count(nvml: Any) -> int | None:
    """NVML's count of this node's GPUs; None without nvidia-ml-py or a driver it can talk to."""
    with _nvml_session(nvml) as session:
        if session is None:
            return None
        try:
            return int(session.nvmlDeviceGetCount())
        except Exception:  # noqa: BLE001 - an NVML that cannot count: another way to count
            return None


@contextlib.contextmanager
def _nvml_session(nvml: Any) -> Iterator[Any]:
    """NVML initialised (`nvml`, else the pynvml module), shut down afterwards; None where there is none to talk
    to (no nvidia-ml-py, no driver)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            yield None
            return
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no NVML to ask
        yield None
        return
    try:
        yield nvml
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


def _brief(text: str) -> str:
    """One printable piece of a line, at most MAX_SETTING_CHARS."""
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return text if len(text) <= MAX_SETTING_CHARS else text[: MAX_SETTING_CHARS - 3] + "..."

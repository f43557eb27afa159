"""This node's GPUs, against stand-ins for nvidia-ml-py's module, the driver's directory and nvidia-smi (no GPU here):
what makes a GPU unhealthy, how many the ranks can see, and the preflight of `device: cuda`."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from supervisor.cli import main
from supervisor.config import parse_config
from supervisor.launch.gpu_health import (
    GpuCount,
    count_gpus,
    gpu_problems,
    gpu_shortage,
    reported_shortage,
    visible_gpus,
)
from worker.contract import EXIT_CONFIG


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


# ---- how many GPUs: count_gpus, visible_gpus, the preflight ----

NO_SMI = "/nonexistent/nvidia-smi"


def test_nvml_counts_the_gpus_first_and_is_shut_down(tmp_path):
    """With NVML there, its count is the answer (the driver's directory is not looked at)."""
    nvml = FakeNvml(HEALTHY, HEALTHY, HEALTHY)
    assert count_gpus(nvml, driver_dir=tmp_path / "absent", smi=NO_SMI) == GpuCount(3, "counted by NVML")
    assert nvml.shut_down


def test_without_nvml_the_driver_directory_counts_a_directory_per_gpu(tmp_path):
    """No NVML: one directory per GPU under the driver's folder, a file or a symlink there not counted."""
    gpus = tmp_path / "gpus"
    for bus in ("0000:07:00.0", "0000:0a:00.0"):
        (gpus / bus).mkdir(parents=True)
    (gpus / "stray").write_text("")
    (gpus / "link").symlink_to(gpus / "0000:07:00.0")
    assert count_gpus(FakeNvml(init_fails=True), gpus, NO_SMI) == GpuCount(2, f"counted in {gpus}")


def test_without_nvml_or_driver_directory_nvidia_smi_lists_the_gpus(tmp_path):
    """Last, `nvidia-smi -L`: a GPU per "GPU n:" line, its MIG instances not counted again."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1c3d)"\n'
        'echo "  MIG 3g.40gb     Device  0: (UUID: MIG-5e2a)"\n'
        'echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-9f01)"\n'
    )
    smi.chmod(0o755)
    assert count_gpus(FakeNvml(init_fails=True), tmp_path / "absent", str(smi)) == GpuCount(2, f"counted by {smi} -L")


def test_nvidia_smi_that_fails_counts_no_gpu_and_says_why(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver.' >&2\nexit 9\n"
    )
    smi.chmod(0o755)
    count = count_gpus(FakeNvml(init_fails=True), tmp_path / "absent", str(smi))
    assert count == GpuCount(
        0, f"{smi} -L exited with code 9: NVIDIA-SMI has failed because it could not communicate with the driver."
    )


def test_a_machine_without_any_nvidia_driver_has_no_gpu(tmp_path):
    count = count_gpus(FakeNvml(init_fails=True), tmp_path / "absent", NO_SMI)
    assert count == GpuCount(0, f"no NVIDIA driver here: no NVML, no {tmp_path / 'absent'}, no {NO_SMI}")


@pytest.mark.parametrize(
    ("setting", "gpus", "visible"),
    [
        (None, 4, 4),  # unset: all of them
        ("", 4, 0),
        ("0,1", 4, 2),
        (" 3 , 1 ", 4, 2),
        ("2", 2, 0),  # no GPU 2 on a machine of two
        ("0,5,1", 4, 1),  # cut at the first index past the last GPU
        ("1,-1,0", 4, 1),  # and at a negative one
        ("0,gpu1", 4, 1),  # and at one that is no number
        ("1gpu,0", 4, 2),  # CUDA reads each entry's leading digits
        ("0,1,0", 4, 0),  # a repeated entry: no GPU at all
        ("GPU-1c3d,GPU-9f01", 4, 2),
        ("GPU-1c3d,GPU-9f01", 1, 1),  # more UUIDs than GPUs: at most the GPUs
        ("GPU-1c3d,0", 4, 1),  # UUIDs end at an entry that is not one
        ("GPU-1c3d,GPU-1c3d", 4, 0),
        ("MIG-5e2a,MIG-77b0,MIG-0c19", 1, 3),  # MIG instances of one GPU
        ("0,1", 0, 0),  # no driver: nothing to make visible
    ],
)
def test_cuda_visible_devices_narrows_the_gpus_as_cuda_reads_it(setting, gpus, visible):
    assert visible_gpus(gpus, setting) == visible


CUDA_JOB = parse_config({"command": ["train"], "device": "cuda", "nproc_per_node": 2})


def test_a_cpu_job_is_never_short_of_gpus():
    assert gpu_shortage(parse_config({"command": ["train"], "nproc_per_node": 2}), GpuCount(0, "none"), None) is None


def test_a_cuda_job_needs_a_gpu_per_rank_and_is_told_both_numbers():
    assert gpu_shortage(CUDA_JOB, GpuCount(2, "counted by NVML"), None) is None
    assert gpu_shortage(CUDA_JOB, GpuCount(1, "counted by NVML"), None) == (
        "device: cuda needs a GPU per rank (nproc_per_node: 2), but this machine shows 1 GPU (counted by NVML)"
    )


def test_the_ranks_cuda_visible_devices_counts_the_configs_env_first():
    """The ranks inherit the node's CUDA_VISIBLE_DEVICES unless the config's `env:` sets it."""
    assert gpu_shortage(CUDA_JOB, GpuCount(8, "counted by NVML"), "0,1") is None
    assert gpu_shortage(CUDA_JOB, GpuCount(8, "counted by NVML"), "3") == (
        "device: cuda needs a GPU per rank (nproc_per_node: 2), but this machine shows 1 GPU "
        "(counted by NVML: 8, of which CUDA_VISIBLE_DEVICES='3' leaves 1)"
    )
    pinned = parse_config(
        {"command": ["train"], "device": "cuda", "nproc_per_node": 2, "env": {"CUDA_VISIBLE_DEVICES": ""}}
    )
    assert gpu_shortage(pinned, GpuCount(8, "counted by NVML"), "0,1") == (
        "device: cuda needs a GPU per rank (nproc_per_node: 2), but this machine shows 0 GPUs "
        "(counted by NVML: 8, of which CUDA_VISIBLE_DEVICES='' leaves 0)"
    )


def test_a_node_agents_hello_is_judged_the_same_and_names_the_node():
    """On Slurm each node's agent counts its GPUs; a hello without a readable count is not judged."""
    hello = {"gpus": {"gpus": 4, "how": "counted by NVML"}, "cuda_visible_devices": "0"}
    assert reported_shortage(CUDA_JOB, hello, "n7") == (
        "device: cuda needs a GPU per rank (nproc_per_node: 2), but node n7 shows 1 GPU "
        "(counted by NVML: 4, of which CUDA_VISIBLE_DEVICES='0' leaves 1)"
    )
    assert reported_shortage(CUDA_JOB, {**hello, "cuda_visible_devices": None}, "n7") is None
    assert reported_shortage(CUDA_JOB, {**hello, "gpus": {"gpus": 1, "how": "counted by NVML"}}, "n7") == (
        "device: cuda needs a GPU per rank (nproc_per_node: 2), but node n7 shows 1 GPU (counted by NVML)"
    )  # CUDA_VISIBLE_DEVICES hides none of them: not worth a word
    for junk in ({}, {"gpus": None}, {"gpus": {"gpus": "4", "how": "x"}}, {"gpus": {"gpus": True, "how": "x"}}):
        assert reported_shortage(CUDA_JOB, junk, "n7") is None


def test_run_refuses_a_cuda_job_short_of_gpus_in_one_line_before_touching_the_run_dir(tmp_path, monkeypatch, capsys):
    """`trainwarden run` with device: cuda on a machine whose NVML shows 1 GPU for 2 ranks: exit 78 at once."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"command": [sys.executable, "-c", "pass"], "nproc_per_node": 2}))
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(HEALTHY))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TRAINWARDEN_SET", raising=False)
    code = main(["run", str(config), "--set", "device=cuda", "--run-dir", str(tmp_path / "run")])
    assert (code, capsys.readouterr().err) == (
        EXIT_CONFIG,
        "trainwarden: cannot launch: device: cuda needs a GPU per rank (nproc_per_node: 2), "
        "but this machine shows 1 GPU (counted by NVML)\n",
    )
    assert not (tmp_path / "run").exists()

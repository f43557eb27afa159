"""A trainer's own job on the simulated Slurm cluster: trainwarden supervising Lightning across two nodes, with
Lightning's SLURM plugin out of the way (docs/integrations.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO
from tests.slurm.test_multinode import JOB_TIMEOUT_S, events, submit, wait_for_step
from worker.manifest import manifest_problem

pytest.importorskip("lightning", reason="the [lightning] extra")
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]


def rank_events(run_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_lightning_on_two_nodes_resumes_its_own_checkpoint_and_the_time_limit_warning_requeues_through_trainwarden(
    slurm, tmp_path
):
    """The Lightning example on twnode1 and twnode2, one rank each: the rank on twnode2 is killed after step 8 and
    the run resumes from Lightning's checkpoint 5; then the time-limit warning (USR1 to the batch shell) stops
    both ranks at one agreed step with Lightning's checkpoint recorded on both, and the job exits 75 to be requeued.
    In the allocation's environment Lightning still takes its ranks from torchrun's variables: its SLURM plugin,
    which would save its own `hpc_ckpt` and `scontrol requeue` the job from rank 0, is not in charge."""
    job, run_dir = submit(
        slurm,
        tmp_path,
        sbatch=("-N2",),
        nodes=2,
        nproc_per_node=1,
        spare_nodes=0,
        script=str(REPO / "examples" / "lightning_train.py"),
        args=["--steps", "100000", "--batch-size", "8", "--block", "32", "--samples", "160"],
        env={"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS": "1:sigkill@8"},
        worker={"save_checkpoint_steps": 5, "prefix": "ckpt"},
        hang={"first_heartbeat_s": 120, "phase_timeouts_s": {"startup": 120, "train": 60, "save": 60, "eval": 60}},
    )
    wait_for_step(slurm, run_dir, 12, attempt=1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job)], check=True, timeout=30)
    state, code = slurm.wait_job(job, JOB_TIMEOUT_S)

    assert code == 75, (tmp_path / f"job-{job}.out").read_text()[-3000:]
    assert [e["resume_step"] for e in events(run_dir, "ranks_launched")] == [None, 5]
    (stopped,) = events(run_dir, "run_stopped")
    step = stopped["step"]
    directory = run_dir / "checkpoint" / f"ckpt-{step}"
    assert manifest_problem(directory, step, require_healthy=True) is None
    assert json.loads((directory / "MANIFEST.json").read_text())["world_size"] == 2
    for rank in (0, 1):
        environments = {e["cluster_environment"] for e in rank_events(run_dir, rank, "framework_started")}
        assert environments == {"TorchElasticEnvironment"}
    assert not list(run_dir.rglob("hpc_ckpt_*")) and not list(REPO.glob("hpc_ckpt_*"))

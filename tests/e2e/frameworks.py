"""The Lightning and Hugging Face examples under the real supervisor: a job config of the test's size, and what
every framework test checks the same way (tests/e2e/test_lightning_example.py, test_hf_example.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_until
from tests.e2e.conftest import (
    FAST_HANG,
    REPO,
    Finished,
    finish,
    heartbeat,
    journal,
    run_supervisor,
    start_supervisor,
    trainwarden_status,
)
from worker.files import read_json
from worker.manifest import manifest_problem

STEPS = 40
SAVE_EVERY = 10
# 160 windows in batches of 8 on 2 ranks: an epoch is 10 steps, so every checkpoint is at an epoch's end.
SIZE = ["--batch-size", "8", "--block", "32", "--samples", "160", "--eval-every", "15"]
# Each fires once: rank 0's gradients of step 5 hold a NaN (skipped on both ranks: the reference run has it too);
# rank 1 is killed after step 15 (resumed from 10), then hangs inside its save of 30 (resumed from 20).
SKIP = "0:nan@5"
FAULTS = f"{SKIP},1:sigkill@15,1:hang_in_save@30"
# The ranks' environment inside a Slurm allocation: under the supervisor, Lightning must still take its ranks from
# torchrun's variables and leave Slurm's signals to trainwarden (its SLURM plugin would requeue the job itself).
SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_NODEID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NAME": "train",
}
UNTIL_STOPPED = 100_000


@dataclass(frozen=True)
class Framework:
    """One example: its job config, how its step is saved, and how to read a saved model's tensors."""

    name: str  # lightning, hf
    config: str  # examples/NAME.yaml
    prefix: str  # the checkpoint directories' names: PREFIX-STEP
    weights: str  # the file in a checkpoint directory that holds the weights
    # Through FAULTS' two resumes, the newest step still bitwise as the uninterrupted run's: the Trainer's resume is
    # exact; Lightning's (2.6) from an epoch's end is, but a checkpoint written after it resumes into another epoch
    # (its loop counters), so the second resume is not.
    exact_through: int

    def job(
        self, tmp: Path, *, steps: int = STEPS, faults: str = SKIP, env: dict[str, str] | None = None, **worker: Any
    ) -> Path:
        config = yaml.safe_load((REPO / "examples" / self.config).read_text())
        config["script"] = str(REPO / config["script"])
        config["args"] = [*SIZE, "--steps", str(steps)]
        config["env"] = {**config["env"], **(env or {}), "TRAINWARDEN_FAULTS": faults, "TRAINWARDEN_FAULTS_ONCE": "1"}
        config["worker"] = {**config["worker"], "save_checkpoint_steps": SAVE_EVERY, "keep_checkpoint_max": 0, **worker}
        config["restart"] = {"max_restarts": 5, "backoff_initial_s": 0.2}
        config["stop"] = {"kill_grace_s": 2.0}
        config["hang"] = {
            **FAST_HANG,
            "first_heartbeat_s": 120,
            "phase_timeouts_s": {**FAST_HANG["phase_timeouts_s"], "startup": 120, "eval": 30},
        }
        path = tmp / f"{self.name}_{steps}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def directory(self, run_dir: Path, step: int) -> Path:
        return run_dir / "checkpoint" / f"{self.prefix}-{step}"

    def tensors(self, run_dir: Path, step: int) -> dict[str, Any]:
        """Model and optimizer tensors of a checkpoint, loaded as the framework would (weights only)."""
        import torch

        directory = self.directory(run_dir, step)
        if self.name == "lightning":
            saved = torch.load(directory / "model.ckpt", weights_only=True)
            return {"model": saved["state_dict"], "optimizer": saved["optimizer_states"][0]["state"]}
        from safetensors.torch import load_file

        return {
            "model": load_file(directory / "model.safetensors"),
            "optimizer": torch.load(directory / "optimizer.pt", weights_only=True)["state"],
        }


LIGHTNING = Framework("lightning", "lightning.yaml", "ckpt", "model.ckpt", exact_through=20)
HF = Framework("hf", "hf.yaml", "checkpoint", "model.safetensors", exact_through=STEPS)


def run(framework: Framework, tmp: Path, name: str, **job: Any) -> Finished:
    done = run_supervisor(framework.job(tmp, **job), tmp / name, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def stop_midway(framework: Framework, tmp: Path, name: str, after_step: int) -> Finished:
    """A long run stopped with `trainwarden stop` once both ranks are past `after_step`."""
    proc = start_supervisor(framework.job(tmp, steps=UNTIL_STOPPED), tmp / name)
    wait_until(
        lambda: all((b := heartbeat(tmp / name, rank)) and b["step"] > after_step for rank in (0, 1)),
        timeout=120,
        what=f"both ranks past step {after_step}",
    )
    subprocess.run(
        [sys.executable, "-m", "supervisor", "stop", str(tmp / name)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=30,
    )
    return finish(proc, tmp / name, timeout=120)


def events(run_dir: Path, name: str, attempt: int | None = None) -> list[dict[str, Any]]:
    return [e for e in journal(run_dir) if e["event"] == name and attempt in (None, e.get("attempt"))]


def rank_events(run_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def assert_recorded(framework: Framework, run_dir: Path, step: int) -> dict[str, Any]:
    """The framework's checkpoint of `step` is complete on both ranks, intact and healthy: its manifest."""
    directory = framework.directory(run_dir, step)
    assert manifest_problem(directory, step, require_healthy=True) is None
    manifest = read_json(directory / "MANIFEST.json")
    assert (manifest["framework"], manifest["world_size"], manifest["step"]) == (framework.name, 2, step)
    return manifest


def assert_same_tensors(framework: Framework, run_dir: Path, reference: Path, step: int) -> None:
    import torch

    ours, theirs = framework.tensors(run_dir, step), framework.tensors(reference, step)
    for part in ("model", "optimizer"):
        flat_ours, flat_theirs = _flat(ours[part]), _flat(theirs[part])
        assert flat_ours.keys() == flat_theirs.keys()
        different = [k for k in flat_ours if not torch.equal(flat_ours[k], flat_theirs[k])]
        assert not different, f"{part} differs from the uninterrupted run's at step {step}: {different[:5]}"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix: tree} if hasattr(tree, "shape") else {}


def copy_checkpoints(reference: Path, run_dir: Path) -> None:
    """A fresh run dir holding the reference run's checkpoints, nothing else."""
    shutil.copytree(reference / "checkpoint", run_dir / "checkpoint")


# ---- the tests both framework modules run (each defines the `framework` fixture) ----


@pytest.fixture(scope="module")
def reference(framework: Framework, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of STEPS steps."""
    tmp = tmp_path_factory.mktemp(f"{framework.name}_reference")
    return run(framework, tmp, "run").run_dir


@pytest.fixture(scope="module")
def faulted(framework: Framework, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run through FAULTS, its ranks in a Slurm allocation's environment, that exited 0."""
    tmp = tmp_path_factory.mktemp(f"{framework.name}_faults")
    return run(framework, tmp, "run", faults=FAULTS, env=SLURM_ENV).run_dir


def test_a_kill_and_a_hang_in_a_save_resume_from_the_frameworks_checkpoints_and_end_bitwise(
    framework: Framework, faulted: Path, reference: Path
) -> None:
    """Rank 1 killed after step 15: relaunched from the framework's checkpoint 10; then hung inside the save of 30:
    declared in phase save, stacks taken, relaunched from 20 (30 has no manifest); the run ends at step 40, every
    checkpoint recorded on both ranks, with the same model and optimizer as an uninterrupted run as far as the
    framework's own resume is exact."""
    status = trainwarden_status(faulted)
    assert (status["state"], status["restarts"]) == ("finished", 2)
    assert [e["resume_step"] for e in events(faulted, "ranks_launched")] == [None, 10, 20]
    skipped = [(e["step"], e["reasons"]) for rank in (0, 1) for e in rank_events(faulted, rank, "step_skipped")]
    assert skipped == [(5, ["non_finite"]), (5, [])]  # rank 0 saw it, rank 1 skipped with it
    (crash,) = events(faulted, "rank_crashed", attempt=0)
    assert (crash["rank"], crash["returncode"], crash["step"]) == (1, -9, 15)
    # Its peer ends at once, of the supervisor's SIGTERM or of the broken collective, whichever comes first; never
    # through a trainer's own SIGTERM handler (Lightning's broadcasts to the dead rank), never needing SIGKILL.
    (peer,) = events(faulted, "rank_stopped", attempt=0)
    assert (peer["rank"], peer["description"]) in ((0, "killed by SIGTERM"), (0, "exited with code 1"))
    assert "_sigterm_notifier_fn" not in (faulted / "logs" / "attempt_0" / "rank_0.err").read_text()
    (hang,) = events(faulted, "hang_detected", attempt=1)
    assert (hang["phase"], hang["step"]) == ("save", 30)
    (stacks,) = events(faulted, "stacks_collected", attempt=1)
    assert "in hang_forever" in (faulted / "ranks" / "rank_1" / "stacks_attempt_1.txt").read_text()
    assert stacks["paths"]
    # The save of 30 began on rank 0 (rank 1 hung first): if its directory is there, it has no manifest.
    passed = [(e["step"], e["reason"]) for e in events(faulted, "checkpoint_passed_over", attempt=2)]
    assert passed in ([], [(30, "incomplete: no manifest (a save in flight, or killed before every rank was done)")])
    # A complete checkpoint's files are listed in its manifest; only the torn save's are left alone, and said.
    assert {Path(p).parent.name for e in events(faulted, "checkpoint_dir_junk") for p in e["paths"]} <= {
        framework.directory(faulted, 30).name
    }
    for step in (10, 20, 30, 40):
        assert_recorded(framework, faulted, step)
    health = {e["step"]: e["is_health"] for e in read_json(faulted / "health_ckpts.json")}
    assert health == {10: 0, 20: 0, 30: 0, 40: 0}
    assert status["last_checkpoint"]["step"] == STEPS
    assert_same_tensors(framework, faulted, reference, framework.exact_through)


def test_a_stop_ends_every_rank_at_one_step_with_a_checkpoint_and_a_rerun_resumes_there(
    framework: Framework, tmp_path: Path
) -> None:
    """`trainwarden stop` mid-run: every rank stops at the same step, the framework saves it (recorded on both
    ranks), exit 0; the rerun resumes from it and finishes."""
    stopped = stop_midway(framework, tmp_path, "run", after_step=12)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    step = stopped.status()["stopped_at"]["step"]
    assert [e["step"] for rank in (0, 1) for e in rank_events(tmp_path / "run", rank, "stop_order_done")] == [step] * 2
    assert_recorded(framework, tmp_path / "run", step)
    (tmp_path / "run" / "stop").unlink()  # as its user would: the stop file keeps a rerun from starting
    rerun = run(framework, tmp_path, "run", steps=step + 5)
    assert [e["resume_step"] for e in events(rerun.run_dir, "ranks_launched")][-1] == step
    assert rerun.status()["state"] == "finished"
    assert_recorded(framework, rerun.run_dir, step + 5)  # the final state, though no multiple of the cadence
    inexact = rank_events(rerun.run_dir, 0, "resume_inexact")
    # Lightning's resume inside an epoch with a plain DataLoader is not exact, and the rank says so.
    assert bool(inexact) == (framework.name == "lightning" and step % SAVE_EVERY != 0)


def test_a_damaged_checkpoint_is_passed_over_with_its_reason(
    framework: Framework, reference: Path, tmp_path: Path
) -> None:
    """The reference's checkpoints with 40's weights corrupted and 30's manifest gone: both passed over, each
    with its reason; the run resumes from 20 and ends as the reference did."""
    run_dir = tmp_path / "run"
    copy_checkpoints(reference, run_dir)
    weights = framework.directory(run_dir, 40) / framework.weights
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    (framework.directory(run_dir, 30) / "MANIFEST.json").unlink()
    run(framework, tmp_path, "run")
    passed = [(e["step"], e["reason"]) for e in events(run_dir, "checkpoint_passed_over", attempt=0)]
    assert passed == [
        (40, f"corrupted: checksum differs from the one written (rank 0's {framework.weights})"),
        (30, "incomplete: no manifest (a save in flight, or killed before every rank was done)"),
    ]
    assert [e["resume_step"] for e in events(run_dir, "ranks_launched")] == [20]
    assert_same_tensors(framework, run_dir, reference, STEPS)

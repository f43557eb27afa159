"""Helpers for end-to-end tests: write a job config, run the real supervisor, read its status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.status import read_status
from tests.checkpoint_files import assert_bitwise_equal, load_saved
from tests.conftest import wait_until
from worker.contract import RunLayout

REPO = Path(__file__).resolve().parents[2]
DEMO_STEPS = 60
DEMO_SCRIPT = REPO / "examples" / "demo_train.py"
DEMO_SAVE_EVERY = 10


@dataclass
class Finished:
    """A supervisor run that ended."""

    returncode: int
    stderr: str
    run_dir: Path

    def status(self) -> dict[str, Any]:
        return trainwarden_status(self.run_dir)


def write_config(path: Path, **overrides: Any) -> Path:
    """A job config based on configs/demo.yaml, shortened for tests, with `overrides` on top."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["script"] = str(DEMO_SCRIPT)
    config["args"] = ["--steps", str(DEMO_STEPS)]
    config["worker"]["save_checkpoint_steps"] = DEMO_SAVE_EVERY
    config["restart"]["backoff_initial_s"] = 0.2
    # A rank blocked in a gloo collective with a live peer (a hang) only dies by SIGKILL: do not wait 5 s for it.
    config["stop"]["kill_grace_s"] = 1.0
    # Standbys cost two torch imports a run (CPU the suite is short of); test_warm_standby.py turns them on.
    config["standby"] = {"enabled": False}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


def start_supervisor(config: Path, run_dir: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(run_dir), *options],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 120) -> Finished:
    """Wait (bounded) for a supervisor to exit."""
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
        pytest.fail(f"supervisor did not finish within {timeout} s; stderr tail:\n{stderr[-3000:]}")
    return Finished(proc.returncode, stderr, run_dir)


def run_supervisor(config: Path, run_dir: Path, timeout: float = 120) -> Finished:
    return finish(start_supervisor(config, run_dir), run_dir, timeout)


def trainwarden_status(run_dir: Path) -> dict[str, Any]:
    """What `trainwarden status --json RUN_DIR` prints (read in this process: a CLI start costs 0.3 s of CPU; the
    command itself is tested in test_status_pipe.py and tests/unit)."""
    return json.loads(json.dumps(read_status(RunLayout(run_dir))))


def journal(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "supervisor" / "events.jsonl").read_text().splitlines()]


def signal_rank_at_step(run_dir: Path, rank: int, step: int, signum: int) -> None:
    """Send `signum` to `rank` once its heartbeat shows `step` or later (bounded wait)."""
    beat = wait_until(lambda: (hb := heartbeat(run_dir, rank)) and hb["step"] >= step and hb, timeout=90,
                      what=f"rank {rank} to pass step {step}")
    os.kill(beat["pid"], signum)


def heartbeat(run_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "ranks" / f"rank_{rank}" / "heartbeat.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def final_state(run_dir: Path, rank: int) -> dict[str, Any]:
    return load_saved(run_dir / "checkpoint" / f"rank_{rank}" / f"demo_rank_{rank}-{DEMO_STEPS}.ckpt")


def assert_same_training_state(run_dir: Path, reference: Path) -> None:
    """Both ranks' final model, optimizer, scheduler, RNG and data position equal the reference's, bit for bit."""
    for rank in (0, 1):
        got, want = final_state(run_dir, rank), final_state(reference, rank)
        for part in ("model", "optimizer", "scheduler", "rng", "data_position"):
            assert_bitwise_equal(got[part], want[part], f"rank {rank} {part}")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of the demo job: the state every interrupted run must end in (one per session)."""
    tmp = tmp_path_factory.mktemp("reference")
    done = run_supervisor(write_config(tmp / "job.yaml"), tmp / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.status()["restarts"] == 0
    return tmp / "run"

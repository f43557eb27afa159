"""Helpers for end-to-end tests: write a job config, run the real supervisor, read its status."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.observe.status import read_status
from tests.checkpoint_files import assert_bitwise_equal, load_saved
from tests.conftest import wait_until
from worker.contract import RunLayout

REPO = Path(__file__).resolve().parents[2]
DEMO_STEPS = 60
DEMO_SCRIPT = REPO / "examples" / "demo_train.py"
DEMO_SAVE_EVERY = 10
# A quarter of the demo's batch (8 sequences of 32 characters, not 16 of 64): training is 40 % of an end-to-end
# run's CPU at the demo's size, and no test depends on what the model learns.
DEMO_SIZE = ["--batch-size", "8", "--block", "32"]
# The reference run tags its checkpoints healthy or not, by a threshold the demo stays under (seed 000's health
# monitor: it only reads the state), for the tests that start from a copy of its checkpoints.
REFERENCE_WORKER = {"use_checkpoint_health_monitor": True, "embedding_local_norm_threshold": 1000.0}
# The step guard with a fixed threshold (the adaptive rule needs 64 steps of history first); 3 anomalies in a row abort.
GUARDED = {
    "save_checkpoint_steps": 10,
    "use_skip_data_by_global_norm": True,
    "monitor_config": {"global_norm_spike_threshold": 3.0, "global_norm_spike_count_threshold": 3},
}
# Three gradient-norm spikes in a row on rank 1 from step 45 abort the run (exit 65): rolled back 10 steps (to
# checkpoint 30), and the data skipped up to 5 batches past the streak.
SPIKE_STREAK: dict[str, Any] = {
    "env": {"TRAINWARDEN_FAULTS": "1:spike@45:5"},
    "worker": GUARDED,
    "anomaly": {"rollback_steps": 10, "skip_after_steps": 5},
}
# Hang timeouts short enough to declare hangs in seconds; calibration off, so they are exactly these.
TRAIN_TIMEOUT_S, SAVE_TIMEOUT_S = 3.0, 8.0
FAST_HANG = {
    "heartbeat": "required",
    "phase_timeouts_s": {"train": TRAIN_TIMEOUT_S, "save": SAVE_TIMEOUT_S},
    "calibration": {"enabled": False},
}


@dataclass
class Finished:
    """A supervisor run that ended."""

    returncode: int
    stderr: str
    run_dir: Path

    def status(self) -> dict[str, Any]:
        return trainwarden_status(self.run_dir)


def write_config(path: Path, steps: int = DEMO_STEPS, **overrides: Any) -> Path:
    """A job config based on configs/demo.yaml, shortened to `steps` and DEMO_SIZE for tests, `overrides` on top."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["script"] = str(DEMO_SCRIPT)
    config["args"] = ["--steps", str(steps), *DEMO_SIZE]
    config["worker"]["save_checkpoint_steps"] = DEMO_SAVE_EVERY
    config["restart"]["backoff_initial_s"] = 0.2
    # A rank blocked in a gloo collective with a live peer (a hang) only dies by SIGKILL: do not wait 5 s for it.
    config["stop"]["kill_grace_s"] = 1.0
    # The memory tier (on by default: `auto`) has its own tests; the others keep the saves and collectives, and so
    # the timing, they were written for (a rank's own disk saves and faults inside them; which rank meets a desync).
    config["worker"]["snapshot_steps"] = 0
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


# Beats like the worker library (without torch); optional behaviour by environment.
BEATING_RANK = """
import os, subprocess, sys, time
from pathlib import Path
from worker.contract import RunLayout
from worker.heartbeat import Heartbeat
rank, attempt = int(os.environ["RANK"]), int(os.environ["TRAINWARDEN_ATTEMPT"])
layout = RunLayout(Path(os.environ["TRAINWARDEN_RUN_DIR"]))
marker = layout.root / f"grandchildren_started_{rank}"
if os.environ.get("SPAWN") and not marker.exists():
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    subprocess.Popen(sleep)                           # stays in the rank's process group
    subprocess.Popen(sleep, start_new_session=True)   # escapes it
    marker.touch()
if os.environ.get("GARBAGE"):
    layout.heartbeat(rank).write_text('{"seq": 1, "ste')  # a torn write, as a non-atomic writer leaves
    time.sleep(1.5)
    layout.heartbeat(rank).write_text("\\x00\\xff garbage")
    time.sleep(1.5)
beat = Heartbeat(layout.heartbeat(rank), root=layout.root, rank=rank, attempt=attempt, interval_s=0.1)
for step in range(int(os.environ.get("STEPS", "20"))):
    beat.beat(step, "train")
    time.sleep(0.05)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def fake_job(tmp_path: Path, **overrides: object) -> Path:
    """A job of BEATING_RANKs (no torch) with `overrides` on top, in tmp_path/job.yaml."""
    config = {
        "command": [sys.executable, "-c", BEATING_RANK],
        "nproc_per_node": 2,
        "restart": {"max_restarts": 0},
        "stop": {"kill_grace_s": 2.0},
        "hang": {"heartbeat": "required", "first_heartbeat_s": 30.0, "phase_timeouts_s": {"train": 3.0}},
        "worker": {"snapshot_steps": 0},  # no worker library: no memory directory to make (or leave, if SIGKILLed)
        **overrides,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_supervisor(config: Path, run_dir: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(run_dir), *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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


def outcome_lines(stderr: str) -> tuple[str, str]:
    """The supervisor's final words: its outcome line ("trainwarden: run failed: ...") and the line after it
    (the cause, or the goodput)."""
    lines = stderr.strip().splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith("trainwarden: run "))
    return lines[first], (lines[first + 1 :] or [""])[0]


def trainwarden_status(run_dir: Path) -> dict[str, Any]:
    """What `trainwarden status --json RUN_DIR` prints (read in this process: a CLI start costs 0.3 s of CPU; the
    command itself is tested in test_status_pipe.py and tests/unit)."""
    return json.loads(json.dumps(read_status(RunLayout(run_dir))))


def journal(run_dir: Path) -> list[dict[str, Any]]:
    return json_lines(run_dir / "supervisor" / "events.jsonl")


def json_lines(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines log's records, read while it may grow: a last line still being appended (no newline yet) is
    left for the next read."""
    text = path.read_text()
    whole = text if text.endswith("\n") else text.rpartition("\n")[0]
    return [json.loads(line) for line in whole.splitlines()]


def signal_rank_at_step(run_dir: Path, rank: int, step: int, signum: int) -> None:
    """Send `signum` to `rank` once its heartbeat shows `step` or later (bounded wait)."""
    beat = wait_until(
        lambda: (hb := heartbeat(run_dir, rank)) and hb["step"] >= step and hb,
        timeout=90,
        what=f"rank {rank} to pass step {step}",
    )
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
    """An uninterrupted run of the demo job, its ranks started cold: the state every interrupted run (its ranks
    forked from the fork server, by default) must end in."""
    run_dir = shared_run(tmp_path_factory, "reference", worker=REFERENCE_WORKER, standby={"enabled": False})
    assert trainwarden_status(run_dir)["restarts"] == 0
    return run_dir


@pytest.fixture(scope="session")
def rollback_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run through SPIKE_STREAK, its ranks started cold."""
    return shared_run(tmp_path_factory, "rollback", **SPIKE_STREAK, standby={"enabled": False})


def run_to_the_end(tmp: Path, **overrides: Any) -> Path:
    """The run dir of a demo run with `overrides` (write_config's) in `tmp`, which must exit 0."""
    done = run_supervisor(write_config(tmp / "job.yaml", **overrides), tmp / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides: Any) -> Path:
    """The run dir of a demo run that exited 0, made once per session for the tests that read it (none may change
    it): pytest-xdist's workers share it, the first to need it runs it while the others wait on its lock."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: popen-gwN's parent
    run_dir, finished = shared / name / "run", shared / name / "finished"
    with held_lock(shared / f"{name}.lock", timeout=180):
        if not finished.exists():
            shutil.rmtree(run_dir.parent, ignore_errors=True)  # a failed try of another worker
            run_dir.parent.mkdir()
            done = run_supervisor(write_config(run_dir.parent / "job.yaml", **overrides), run_dir)
            assert done.returncode == 0, done.stderr[-3000:]
            finished.touch()
    return run_dir


def checkpoints_of(reference: Path, run_dir: Path) -> Path:
    """`run_dir` holding a copy of the reference run's checkpoints and health file, as a finished run leaves them
    (its journal and logs are not copied)."""
    shutil.copytree(reference / "checkpoint", run_dir / "checkpoint")
    shutil.copy2(reference / "health_ckpts.json", run_dir / "health_ckpts.json")
    return run_dir


@contextlib.contextmanager
def held_lock(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive flock on `path`, waited for at most `timeout` seconds."""
    with path.open("a") as file:

        def locked() -> bool:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        wait_until(locked, timeout=timeout, interval=0.2, what=f"the lock {path}")
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)

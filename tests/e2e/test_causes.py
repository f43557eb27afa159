"""Why a run stops, end to end: each deterministic failure ends early with its exit code and its cause, verbatim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import REPO, Finished, finish, journal, outcome_lines, run_supervisor, start_supervisor

pytestmark = pytest.mark.timeout(60)

# Rank 1 raises at step 5 of every attempt; rank 0 beats until the supervisor stops it.
RAISE_AT_STEP_5 = """
import os, sys, time
from pathlib import Path
from worker.contract import RunLayout
from worker.heartbeat import Heartbeat
rank, attempt = int(os.environ["RANK"]), int(os.environ["TRAINWARDEN_ATTEMPT"])
layout = RunLayout(Path(os.environ["TRAINWARDEN_RUN_DIR"]))
beat = Heartbeat(layout.heartbeat(rank), root=layout.root, rank=rank, attempt=attempt, interval_s=0.1)
def train_step(step):
    if rank == 1 and step == 5:
        raise ValueError(f"boom at step {step}")
for step in range(1, 400):
    train_step(step)
    beat.beat(step, "train", force=True)
    time.sleep(0.02)
"""
# A real state_dict from an older, wider model loaded into the current one.
LOAD_MISMATCHED = """
from torch import nn
def resume(model):
    checkpoint = nn.Linear(8, 4).state_dict()
    model.load_state_dict(checkpoint)
resume(nn.Linear(8, 2))
"""
# Every attempt saves at step 3 onto a disk that is full (FULL_DIR, a tiny tmpfs).
SAVE_ONTO_FULL_DISK = """
import os
from pathlib import Path
from worker.contract import RunLayout
from worker.heartbeat import Heartbeat
attempt = int(os.environ["TRAINWARDEN_ATTEMPT"])
layout = RunLayout(Path(os.environ["TRAINWARDEN_RUN_DIR"]))
beat = Heartbeat(layout.heartbeat(0), root=layout.root, rank=0, attempt=attempt, interval_s=0.1)
def save(step):
    with open(os.path.join(os.environ["FULL_DIR"], f"ckpt-{attempt}-{step}.bin"), "wb") as f:
        f.write(b"w" * (1 << 20))
for step in range(1, 10):
    beat.beat(step, "train", force=True)
    if step == 3:
        save(step)
"""


def job(path: Path, program: str, **overrides: object) -> Path:
    config = {
        "command": [sys.executable, "-c", program],
        "nproc_per_node": 1,
        "restart": {"max_restarts": 5, "backoff_initial_s": 0.1},
        "stop": {"kill_grace_s": 2.0},
        **overrides,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def status_json(run_dir: Path, cwd: Path = REPO) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--json", str(run_dir)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)


def attempts_launched(run_dir: Path) -> int:
    return [e["event"] for e in journal(run_dir)].count("ranks_launched")


def said(done: Finished) -> tuple[str, str]:
    """The supervisor's last words: the reason line (first) and the cause line after it."""
    return outcome_lines(done.stderr)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 64 KiB tmpfs (needs root, or CAP_SYS_ADMIN); unmounted afterwards."""
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, timeout=10, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10, check=False)


def test_script_raising_at_the_same_step_ends_as_a_crash_loop(tmp_path: Path) -> None:
    """Rank 1 raising at step 5 in every attempt ends the run after 3 attempts with exit 70, naming the cause."""
    run_dir = tmp_path / "run"
    done = run_supervisor(job(tmp_path / "job.yaml", RAISE_AT_STEP_5, nproc_per_node=2), run_dir, timeout=45)

    assert done.returncode == 70, done.stderr[-2000:]
    status = status_json(run_dir)
    cause = "ValueError: boom at step 5 (<string>:11 in train_step)"
    assert (status["state"], status["attempt"], attempts_launched(run_dir)) == ("failed", 2, 3)
    assert status["cause"] == cause
    assert status["reason"] == f"crash loop: 3 attempts in a row failed the same way at step 4: {cause}"
    assert [(f["attempt"], f["rank"], f["step"], f["cause"]) for f in status["failures"]] == [
        (a, 1, 4, cause) for a in range(3)
    ]
    crashes = [e for e in journal(run_dir) if e["event"] == "rank_crashed"]
    assert [(e["rank"], e["cause"]) for e in crashes] == [(1, cause)] * 3
    reason_line, cause_line = said(done)
    assert reason_line.startswith(
        "trainwarden: run failed: crash loop: 3 attempts in a row failed the same way at step 4 (rank logs: "
    )
    assert cause_line == f"trainwarden: cause: {cause}"


def test_a_supervisor_killed_mid_crash_loop_is_restarted_and_the_breaker_still_trips_at_its_count(
    tmp_path: Path,
) -> None:
    """SIGKILL of the supervisor in its backoff after two of the three failures the breaker counts: the next
    supervisor carries the failures over (its first attempt is number 2) and ends the run after one more, exit 70."""
    run_dir = tmp_path / "run"
    config = job(
        tmp_path / "job.yaml",
        RAISE_AT_STEP_5,
        nproc_per_node=2,
        restart={"max_restarts": 5, "backoff_initial_s": 30, "backoff_factor": 1},
    )
    first = start_supervisor(config, run_dir)
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not (run_dir / "supervisor" / "events.jsonl").exists():
            time.sleep(0.1)
        while time.monotonic() < deadline and [e["event"] for e in journal(run_dir)].count("relaunch_scheduled") < 2:
            time.sleep(0.1)
        assert status_json(run_dir)["state"] == "backoff" and status_json(run_dir)["attempt"] == 1
    finally:
        first.kill()
        first.communicate(timeout=10)
    done = run_supervisor(config, run_dir, timeout=45)

    assert done.returncode == 70, done.stderr[-2000:]
    status = status_json(run_dir)
    assert status["reason"].startswith("crash loop: 3 attempts in a row failed the same way at step 4")
    assert [f["attempt"] for f in status["failures"]] == [0, 1, 2]
    assert [e["attempt"] for e in journal(run_dir) if e["event"] == "ranks_launched"] == [0, 1, 2]


def test_missing_script_is_refused_before_any_attempt(tmp_path: Path) -> None:
    """A script that does not exist is exit 78 with 'cannot launch', and nothing is launched at all."""
    config = job(tmp_path / "job.yaml", "", command=None, script=str(tmp_path / "no_such_train.py"))
    done = run_supervisor(config, tmp_path / "run", timeout=30)

    assert done.returncode == 78
    assert done.stderr == f"trainwarden: cannot launch: {tmp_path / 'no_such_train.py'} not found\n"
    assert not (tmp_path / "run").exists()


def test_relative_script_from_another_directory_is_refused_naming_it(tmp_path: Path) -> None:
    """`script: train.py` started from another directory is exit 78 naming where it looked; from its own, it runs."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "train.py").write_text("print('trained')\n")
    config = job(project / "job.yaml", "", command=None, script="train.py", run_dir=str(tmp_path / "run"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run_from(cwd: Path) -> Finished:
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", str(config)],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return finish(proc, tmp_path / "run", timeout=30)

    refused = run_from(elsewhere)
    assert refused.returncode == 78
    assert refused.stderr == (
        "trainwarden: cannot launch: train.py not found (relative paths are taken from the "
        f"working directory {elsewhere})\n"
    )
    assert not (tmp_path / "run").exists()
    ran = run_from(project)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert (tmp_path / "run" / "logs" / "attempt_0" / "rank_0.out").read_text() == "trained\n"


def test_checkpoint_incompatible_with_the_model_is_not_retried(tmp_path: Path) -> None:
    """A real load_state_dict size mismatch fails the first attempt with exit 78, no relaunch, naming the mismatch."""
    run_dir = tmp_path / "run"
    done = run_supervisor(job(tmp_path / "job.yaml", LOAD_MISMATCHED), run_dir, timeout=45)

    assert done.returncode == 78, done.stderr[-2000:]
    status = status_json(run_dir)
    assert (status["state"], status["restarts"], attempts_launched(run_dir)) == ("failed", 0, 1)
    cause = (
        "checkpoint incompatible with the model: RuntimeError: Error(s) in loading state_dict for Linear: "
        "size mismatch for weight: copying a param with shape torch.Size([4, 8]) from checkpoint, the shape in "
        "current model is torch.Size([2, 8]). (<string>:5 in resume)"
    )
    assert status["cause"] == cause
    assert status["reason"] == f"not retryable: rank 0 failed in attempt 0: {cause}"
    reason_line, cause_line = said(done)
    assert reason_line.startswith("trainwarden: run failed: not retryable: rank 0 failed in attempt 0 (rank logs: ")
    assert cause_line == f"trainwarden: cause: {cause}"


def test_disk_full_at_the_same_step_ends_as_a_crash_loop(tmp_path: Path, full_disk: Path) -> None:
    """Saving onto a full disk (a real ENOSPC) at step 3 of every attempt ends the run after 3 attempts, exit 70."""
    run_dir = tmp_path / "run"
    config = job(tmp_path / "job.yaml", SAVE_ONTO_FULL_DISK, env={"FULL_DIR": str(full_disk)})
    done = run_supervisor(config, run_dir, timeout=45)

    assert done.returncode == 70, done.stderr[-2000:]
    status = status_json(run_dir)
    assert (status["state"], status["attempt"], attempts_launched(run_dir)) == ("failed", 2, 3)
    cause = "disk full: OSError: [Errno 28] No space left on device (<string>:11 in save)"
    assert status["cause"] == cause
    assert [f["kind"] for f in status["failures"]] == ["disk_full"] * 3
    assert status["reason"] == f"crash loop: 3 attempts in a row failed the same way at step 3: {cause}"
    assert said(done)[1] == f"trainwarden: cause: {cause}"


def test_a_gpu_that_nvml_says_needs_a_reset_is_not_launched_on_and_the_run_asks_for_another_machine(tmp_path: Path):
    """nvidia-ml-py (a stand-in on PYTHONPATH) says GPU 0 needs a reset: nothing is launched, the run ends with
    EXIT_REQUEUE (75: a relaunch here fails the same way) and says why."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"command": [sys.executable, "-c", "pass"], "nproc_per_node": 1}))
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "fake_nvml")}
    argv = [sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = finish(proc, tmp_path / "run", timeout=30)

    assert done.returncode == 75, done.stderr[-3000:]
    (unhealthy,) = [e for e in journal(tmp_path / "run") if e["event"] == "gpu_unhealthy"]
    assert unhealthy["problems"] == ["GPU 0: NVML asks for a GPU reset"]
    assert "unhealthy GPU on this machine: GPU 0: NVML asks for a GPU reset" in done.status()["reason"]
    assert not [e for e in journal(tmp_path / "run") if e["event"] == "ranks_launched"]


def test_a_gpu_lost_between_attempts_stops_the_run_with_exit_78_before_the_relaunch(tmp_path: Path):
    """device: cuda with 2 ranks: NVML (a stand-in on PYTHONPATH) shows 2 GPUs for the first attempt, whose rank 0
    then takes one away and fails; the relaunch is refused before any rank starts, exit 78, naming 1 GPU and 2 ranks."""
    gpus = tmp_path / "gpus"
    gpus.write_text("2")
    # Rank 0 takes a GPU away and fails; rank 1 waits to be stopped (had it failed first, the relaunch could come
    # before rank 0 wrote).
    lose_one = (
        "import os, sys, time; os.environ['RANK'] == '1' and time.sleep(60); "
        "open(sys.argv[1], 'w').write('1'); sys.exit(3)"
    )
    config = tmp_path / "job.yaml"
    job = {
        "command": [sys.executable, "-c", lose_one, str(gpus)],
        "nproc_per_node": 2,
        "device": "cuda",
        "restart": {"max_restarts": 3, "backoff_initial_s": 0.0},
    }
    config.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=str(REPO / "tests" / "fake_nvml"), FAKE_NVML_GPUS=str(gpus))
    argv = [sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = finish(proc, tmp_path / "run", timeout=30)

    assert done.returncode == 78, done.stderr[-3000:]
    short = "device: cuda needs a GPU per rank (nproc_per_node: 2), but this machine shows 1 GPU (counted by NVML)"
    assert said(done)[0].startswith(f"trainwarden: run failed: not launched: {short}")
    (failed,) = [e for e in journal(tmp_path / "run") if e["event"] == "launch_failed"]
    assert (failed["attempt"], failed["error"], failed["retryable"]) == (1, short, False)
    assert attempts_launched(tmp_path / "run") == 1

"""Goodput of a real 2-rank gloo run with an injected kill: the split matches what the logs say happened."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from supervisor.observe.goodput import REPORTED, describe
from tests.e2e.conftest import REPO, journal, run_supervisor, trainwarden_status, write_config

pytestmark = pytest.mark.timeout(180)


def seconds(stamp: str) -> float:
    """A journal or rank-log time (ISO 8601, UTC) as seconds since the epoch."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def step_times(run_dir: Path, rank: int) -> dict[tuple[int, int], float]:
    """(attempt, step) -> when `rank` logged finishing it."""
    events = (json.loads(line) for line in (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").open())
    return {(e["attempt"], e["step"]): seconds(e["time"]) for e in events if e.get("event") == "step"}


def test_goodput_of_a_run_with_one_kill(tmp_path: Path):
    """Rank 1 SIGKILLed after step 28 of 40 (checkpoints every 10): the relaunch resumes from 20, the training of
    steps 21-28 is lost, start-up is its own share, kill-to-first-step is restart time, and the categories add up
    to wall_s."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "job.yaml", steps=40, env={"TRAINWARDEN_FAULTS": "1:sigkill@28"})
    launched = time.time()  # the stopwatch starts with the command: the supervisor's own start-up counts
    done = run_supervisor(config, run_dir, timeout=120)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["state"], status["restarts"], status["resumed_from"]) == ("finished", 1, {"step": 20})
    goodput = status["goodput"]
    # Not a moment from before the command (the boot time psutil adds is whole seconds); a clock tick's rounding.
    assert goodput["wall_s"] <= ended - launched + 0.02, (goodput["wall_s"], ended - launched)

    # Rank 1's: it logs step 28 before it kills itself; rank 0 may be told to unwind first (a loaded machine).
    steps, events = step_times(run_dir, 1), journal(run_dir)
    crash = seconds(next(e["time"] for e in events if e["event"] == "rank_crashed"))
    lost = steps[0, 28] - steps[0, 20]  # heartbeats show steps up to 0.5 s late; the step in flight adds a little
    assert lost - 0.6 <= goodput["lost_s"] <= lost + 1.0, (lost, goodput)
    startup, restart = steps[0, 1] - launched, steps[1, 21] - crash  # each to a step's heartbeat, dated by its age
    assert startup - 0.75 <= goodput["startup_s"] <= startup + 1.0, (startup, goodput)
    assert restart - 0.75 <= goodput["restart_s"] <= restart + 1.0, (restart, goodput)
    assert goodput["save_s"] > 0
    assert goodput["hang_s"] == goodput["stopped_s"] == 0
    assert sum(goodput[name] for name in REPORTED) == pytest.approx(goodput["wall_s"], rel=0.01)
    assert 0 < goodput["ratio"] < 1
    assert goodput["ratio"] == pytest.approx(goodput["productive_s"] / goodput["wall_s"], abs=1e-3)

    line = describe(goodput)
    assert line is not None and f"trainwarden: {line}\n" in done.stderr  # the final message
    human = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert f"\n  {line}\n" in human.stdout


def test_a_fault_free_run_spends_no_time_on_restarts(reference_run: Path):
    """`status --json` of an uninterrupted demo run: its start-up is start-up, and no second went to restarts."""
    goodput = trainwarden_status(reference_run)["goodput"]
    assert goodput["restart_s"] == 0, goodput
    assert goodput["startup_s"] > 0, goodput
    assert "start-up" in describe(goodput)

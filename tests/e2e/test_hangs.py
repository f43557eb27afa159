"""Hung ranks, with real processes: detection by phase, stacks before the kill, whole trees, a dead supervisor."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import TAG_ENV, tagged_processes, wait_until
from tests.e2e.conftest import (
    finish,
    heartbeat,
    journal,
    run_supervisor,
    signal_rank_at_step,
    start_supervisor,
    write_config,
)

pytestmark = pytest.mark.timeout(180)

# Short timeouts so hangs are declared in seconds; calibration off so they are exactly these.
FAST_HANG = {
    "heartbeat": "required",
    "phase_timeouts_s": {"train": 3.0, "save": 5.0},
    "calibration": {"enabled": False},
}


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in journal(run_dir) if e["event"] == name]


def test_gloo_hang_is_detected_stacks_name_the_frames_and_run_resumes(tmp_path: Path) -> None:
    """Rank 1 stops before an all-reduce, rank 0 blocks in it: hang declared, stacks saved, run resumes from 20."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "job.yaml", env={"TRAINWARDEN_FAULTS": "1:hang@25"}, hang=FAST_HANG)
    done = run_supervisor(config, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["state"], status["restarts"], status["resumed_from"]) == ("finished", 1, {"step": 20})
    hang = status["hang"]
    # Heartbeats cannot tell a collective hang's culprit from its victims; the stacks can.
    assert (hang["attempt"], hang["rank"], hang["named_by"], hang["step"]) == (0, 1, "stacks", 25)
    # last_failure, the failure history and the cause name the same rank as the hang record.
    assert status["last_failure"].startswith("rank 1 hung in phase train (last heartbeat at step 25): ")
    assert [(f["rank"], f["step"], f["kind"]) for f in status["failures"]] == [(1, 25, "hang")]
    assert status["cause"].startswith("hang: rank 1 (the only rank outside a collective) silent in phase train "
                                      "after step 25 for ")
    assert (hang["phase"], hang["timeout_s"]) == ("train", 3.0)
    assert 3.0 <= hang["silent_s"] < 5.0
    faulthandler = {rank: run_dir / "ranks" / f"rank_{rank}" / "stacks_attempt_0.txt" for rank in (0, 1)}
    assert {str(path) for path in faulthandler.values()} <= set(hang["stacks"]), "both dumps are referenced"
    assert "in hang_forever" in faulthandler[1].read_text()  # the rank that stopped before the all-reduce
    assert "in backward" in faulthandler[0].read_text()  # the rank blocked inside it
    detected = events(run_dir, "hang_detected")
    assert len(detected) == 1 and detected[0]["timeout_s"] == 3.0
    stopped = events(run_dir, "rank_stopped")
    assert sorted((e["rank"], e["description"]) for e in stopped) == [(r, "killed by SIGTERM") for r in (0, 1)]


def test_rank_frozen_from_outside_with_sigstop_is_a_hang(tmp_path: Path) -> None:
    """A rank SIGSTOPped from outside stalls the job; the hang is declared, the frozen rank killed, the run done."""
    run_dir = tmp_path / "run"
    proc = start_supervisor(write_config(tmp_path / "job.yaml", hang=FAST_HANG), run_dir)
    signal_rank_at_step(run_dir, 1, 25, signal.SIGSTOP)
    done = finish(proc, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["state"], status["restarts"]) == ("finished", 1)
    assert status["hang"]["phase"] in ("train", "save")  # wherever SIGSTOP caught it
    assert status["hang"]["stacks"], "py-spy or faulthandler stacks of the frozen job were collected"


def test_slow_save_inside_its_phase_timeout_is_not_killed(tmp_path: Path) -> None:
    """Rank 0 saving for 5 s, longer than the 3 s train timeout but inside the save timeout, is left alone."""
    hang = {**FAST_HANG, "phase_timeouts_s": {"train": 3.0, "save": 60.0}}
    config = write_config(tmp_path / "job.yaml", env={"TRAINWARDEN_FAULTS": "0:slow_save@20:5"}, hang=hang)
    done = run_supervisor(config, tmp_path / "run")

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["state"], status["restarts"], status["hang"]) == ("finished", 0, None)
    rank_events = (tmp_path / "run" / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines()
    slow = [e for e in map(json.loads, rank_events) if e["event"] == "checkpoint_saved" and e["step"] == 20]
    assert slow and slow[0]["duration_s"] >= 5.0


def test_hang_inside_a_save_is_declared_after_the_save_timeout(tmp_path: Path) -> None:
    """A rank stuck inside its checkpoint save is declared hung in phase save, and the run recovers."""
    hang = {**FAST_HANG, "phase_timeouts_s": {"train": 3.0, "save": 4.0}}
    config = write_config(tmp_path / "job.yaml", env={"TRAINWARDEN_FAULTS": "1:hang_in_save@30"}, hang=hang)
    done = run_supervisor(config, tmp_path / "run")

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["restarts"], status["resumed_from"]) == (1, {"step": 20})
    hang = status["hang"]
    assert (hang["rank"], hang["phase"], hang["timeout_s"], hang["step"]) == (1, "save", 4.0, 30)


# ---- tiny fake trainers ----------------------------------------------------------------------------

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
    config = {
        "command": [sys.executable, "-c", BEATING_RANK],
        "nproc_per_node": 2,
        "restart": {"max_restarts": 0},
        "stop": {"kill_grace_s": 2.0},
        "hang": {"heartbeat": "required", "first_heartbeat_s": 30.0, "phase_timeouts_s": {"train": 3.0}},
        **overrides,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_grandchildren_die_with_their_rank_even_outside_its_process_group(tmp_path: Path) -> None:
    """A crashed rank's grandchildren, one in its group and one in a session of its own, are all killed."""
    config = fake_job(tmp_path, env={"SPAWN": "1", "EXIT": "3"})
    done = run_supervisor(config, tmp_path / "run")

    assert done.returncode == 1
    killed = events(tmp_path / "run", "leftovers_killed")
    assert killed and len(killed[0]["pids"]) >= 2
    # The autouse fixture fails the test if any of them is still alive.
    assert wait_until(lambda: not tagged_processes(os.environ[TAG_ENV]), timeout=5, what="no process left")


def test_first_heartbeat_timeout_declares_a_hang_at_launch(tmp_path: Path) -> None:
    """With heartbeats required, a rank silent since launch is hung after first_heartbeat_s."""
    config = fake_job(tmp_path, command=[sys.executable, "-c", "import time; time.sleep(60)"],
                      hang={"heartbeat": "required", "first_heartbeat_s": 1.0})
    done = run_supervisor(config, tmp_path / "run", timeout=60)

    assert done.returncode == 1
    status = done.status()
    assert (status["hang"]["phase"], status["hang"]["timeout_s"], status["hang"]["step"]) == ("launch", 1.0, None)
    assert status["reason"].startswith("rank ") and "before its first heartbeat" in status["reason"]


def test_script_without_heartbeats_is_never_declared_hung_in_auto_mode(tmp_path: Path) -> None:
    """In `auto` mode a script that never beats runs to its end, however long it is silent."""
    config = fake_job(tmp_path, command=[sys.executable, "-c", "import time; time.sleep(2.5)"],
                      hang={"heartbeat": "auto", "first_heartbeat_s": 1.0})
    done = run_supervisor(config, tmp_path / "run", timeout=60)

    assert done.returncode == 0
    assert done.status()["heartbeats"] == "off"


def test_torn_and_garbage_heartbeat_files_are_reported_not_fatal(tmp_path: Path) -> None:
    """Unreadable heartbeat files produce one warning per rank and streak; the run finishes normally."""
    done = run_supervisor(fake_job(tmp_path, env={"GARBAGE": "1"}), tmp_path / "run", timeout=60)

    assert done.returncode == 0, done.stderr[-2000:]
    warnings = events(tmp_path / "run", "heartbeat_unreadable")
    assert sorted({w["rank"] for w in warnings}) == [0, 1]
    assert all("heartbeat.json" in w["error"] for w in warnings)
    assert done.status()["heartbeats"] == "on"


def test_sigkill_of_the_supervisor_takes_every_rank_along(tmp_path: Path) -> None:
    """Ranks have a parent-death signal: SIGKILL of the supervisor leaves no rank alive within 2 s."""
    run_dir = tmp_path / "run"
    proc = start_supervisor(fake_job(tmp_path, env={"STEPS": "100000"}), run_dir)
    beats = [wait_until(lambda r=r: heartbeat(run_dir, r), timeout=30, what=f"rank {r} beating") for r in (0, 1)]
    proc.kill()
    proc.communicate(timeout=10)

    def ranks_gone() -> bool:
        return not any(psutil.pid_exists(b["pid"]) and psutil.Process(b["pid"]).status() != "zombie" for b in beats)

    wait_until(ranks_gone, timeout=2.0, what="ranks to die with the supervisor")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_restarted_supervisor_kills_what_its_killed_predecessor_left(tmp_path: Path) -> None:
    """A grandchild that outlived a SIGKILLed supervisor is killed by the next supervisor before it launches."""
    run_dir = tmp_path / "run"
    config = fake_job(tmp_path, env={"SPAWN": "1", "STEPS": "100000"})
    first = start_supervisor(config, run_dir)

    def recorded() -> list:
        try:
            return json.loads((run_dir / "supervisor" / "pids.json").read_text())["processes"]
        except (FileNotFoundError, ValueError):
            return []

    try:
        wait_until(lambda: len(recorded()) >= 6, timeout=30, what="2 ranks and 4 grandchildren recorded")
        ranks = [wait_until(lambda r=r: heartbeat(run_dir, r), timeout=30, what=f"rank {r} beating")["pid"]
                 for r in (0, 1)]
    finally:
        first.kill()
        first.communicate(timeout=10)
    # The ranks die with the supervisor (parent-death signal), a moment later on a busy machine: not leftovers.
    wait_until(lambda: not any(map(alive, ranks)), timeout=10, what="the ranks to die with the supervisor")
    escaped = [p for p in tagged_processes(os.environ[TAG_ENV]) if os.getpgid(p.pid) == p.pid]
    assert escaped, "the grandchild in its own session outlives the supervisor"

    done = run_supervisor(fake_job(tmp_path, env={"SPAWN": "1", "STEPS": "5"}), run_dir, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    killed = {e["pid"] for e in events(run_dir, "predecessor_leftover_killed")}
    assert {p.pid for p in escaped} <= killed
    wait_until(lambda: not any(p.is_running() and p.status() != "zombie" for p in escaped), timeout=5,
               what="the leftovers to be gone")

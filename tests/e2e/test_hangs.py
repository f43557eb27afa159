"""Hung ranks, with real processes: detection by phase, stacks before the kill, whole trees, a dead supervisor."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import TAG_ENV, tagged_processes, wait_until
from tests.e2e.conftest import (
    fake_job,
    heartbeat,
    journal,
    run_supervisor,
    start_supervisor,
)

pytestmark = pytest.mark.timeout(180)


def events(run_dir: Path, name: str, attempt: int | None = None) -> list[dict]:
    return [e for e in journal(run_dir) if e["event"] == name and attempt in (None, e.get("attempt"))]


# The demo's hangs and slow saves: tests/e2e/test_fault_stream.py.

# ---- tiny fake trainers (fake_job) ----------------------------------------------------------------


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
    config = fake_job(
        tmp_path,
        command=[sys.executable, "-c", "import time; time.sleep(60)"],
        hang={"heartbeat": "required", "first_heartbeat_s": 1.0},
    )
    done = run_supervisor(config, tmp_path / "run", timeout=60)

    assert done.returncode == 1
    status = done.status()
    assert (status["hang"]["phase"], status["hang"]["timeout_s"], status["hang"]["step"]) == ("launch", 1.0, None)
    assert status["reason"].startswith("rank ") and "before its first heartbeat" in status["reason"]


def test_script_without_heartbeats_is_never_declared_hung_in_auto_mode(tmp_path: Path) -> None:
    """In `auto` mode a script that never beats runs to its end, however long it is silent."""
    config = fake_job(
        tmp_path,
        command=[sys.executable, "-c", "import time; time.sleep(2.5)"],
        hang={"heartbeat": "auto", "first_heartbeat_s": 1.0},
    )
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
        ranks = [
            wait_until(lambda r=r: heartbeat(run_dir, r), timeout=30, what=f"rank {r} beating")["pid"] for r in (0, 1)
        ]
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
    wait_until(
        lambda: not any(p.is_running() and p.status() != "zombie" for p in escaped),
        timeout=5,
        what="the leftovers to be gone",
    )

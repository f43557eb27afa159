"""The supervisor against tiny real child programs: crash relaunch, exhaustion, stop grace, signals, bad config."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import wait_until
from tests.e2e.conftest import (
    REPO,
    finish,
    journal,
    outcome_lines,
    run_supervisor,
    start_supervisor,
    trainwarden_status,
)

pytestmark = pytest.mark.timeout(120)

# Rank 1 of the first attempt crashes once rank 0 is up; every rank of later attempts exits 0.
CRASH_ONCE = """
import os, sys, time
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
if first and os.environ["RANK"] == "1":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(30 if first else 0.1)
"""
ALWAYS_CRASH = "import sys; sys.exit(7)"
IGNORE_SIGTERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    sys.exit(1)
time.sleep(60)
"""
SLEEP = "import time; time.sleep(60)"


def job(tmp_path: Path, program: str, **overrides: object) -> Path:
    config = {
        "command": [sys.executable, "-c", program],
        "nproc_per_node": 2,
        "restart": {"max_restarts": 2, "backoff_initial_s": 0.1},
        "stop": {"kill_grace_s": 5.0},
        **overrides,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_script_without_worker_library_gets_crash_relaunch(tmp_path: Path) -> None:
    """A plain script that crashes once is relaunched on all ranks and finishes; status says heartbeats are off."""
    done = run_supervisor(job(tmp_path, CRASH_ONCE), tmp_path / "run")

    assert done.returncode == 0, done.stderr[-2000:]
    status = done.status()
    assert (status["state"], status["attempt"], status["restarts"]) == ("finished", 1, 1)
    assert status["heartbeats"] == "off"
    assert status["last_failure"] == "rank 1 exited with code 3 in attempt 0"
    events = [e["event"] for e in journal(tmp_path / "run")]
    assert events.count("ranks_launched") == 2 and "rank_crashed" in events
    human = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "heartbeats: none seen" in human and "finished" in human


def test_restarts_exhausted_exit_nonzero_with_one_line_reason(tmp_path: Path) -> None:
    """With the crash-loop breaker off, a rank that always crashes is relaunched max_restarts times, then the
    supervisor exits 1 and says why, with the cause on a line of its own."""
    no_breaker = {"max_restarts": 2, "backoff_initial_s": 0.1, "crash_loop_attempts": 0}
    config = job(tmp_path, ALWAYS_CRASH, restart=no_breaker)
    done = run_supervisor(config, tmp_path / "run")

    assert done.returncode == 1
    status = done.status()
    assert (status["state"], status["restarts"]) == ("failed", 2)
    assert "exited with code 7" in status["reason"] and "restarts exhausted (2/2)" in status["reason"]
    reason_line, cause_line = outcome_lines(done.stderr)
    assert reason_line.startswith("trainwarden: run failed: ") and "restarts exhausted" in reason_line
    assert "logs/attempt_2" in reason_line
    assert cause_line == "trainwarden: cause: exited with code 7"
    for rank in (0, 1):
        assert (tmp_path / "run" / "logs" / "attempt_2" / f"rank_{rank}.err").exists()


def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    """When a peer crashes, a rank that ignores SIGTERM gets SIGKILL once the grace has passed."""
    config = job(tmp_path, IGNORE_SIGTERM, restart={"max_restarts": 0}, stop={"kill_grace_s": 0.5})
    done = run_supervisor(config, tmp_path / "run")

    assert done.returncode == 1
    events = journal(tmp_path / "run")
    names = [e["event"] for e in events]
    assert "stop_grace_expired" in names
    kills = [e for e in events if e["event"] == "ranks_signalled" and e["signal"] == "SIGKILL"]
    assert [k["ranks"] for k in kills] == [[0]]
    stopped = [e for e in events if e["event"] == "rank_stopped"]
    assert [(e["rank"], e["description"]) for e in stopped] == [(0, "killed by SIGKILL")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_supervisor_stops_ranks_and_exits_zero(tmp_path: Path, signum: int) -> None:
    """SIGTERM or SIGINT to the supervisor stops every rank and ends the run as stopped, exit 0."""
    run_dir = tmp_path / "run"
    proc = start_supervisor(job(tmp_path, SLEEP), run_dir)
    wait_until(
        lambda: (run_dir / "supervisor" / "state.json").exists() and trainwarden_status(run_dir)["state"] == "running",
        timeout=30,
        what="ranks running",
    )
    proc.send_signal(signum)
    done = finish(proc, run_dir, timeout=30)

    assert done.returncode == 0, done.stderr[-2000:]
    status = done.status()
    assert (status["state"], status["reason"]) == ("stopped", "stopped on request")
    assert [r["returncode"] for r in status["ranks"]] == [-signal.SIGTERM, -signal.SIGTERM]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("command: [python]\nnproc_per_nod: 2\n", "unknown key 'nproc_per_nod' (did you mean 'nproc_per_node'?)"),
        ("command: [python]\nrestart: {max_restarts: three}\n", "'restart.max_restarts' must be an integer"),
        ("command: [python]\nnproc_per_node: 0\n", "'nproc_per_node' must be between 1 and 1024"),
        ("command: [python\n", "not valid YAML"),
        ("nproc_per_node: 2\n", "give exactly one of 'script'"),
    ],
)
def test_bad_config_is_refused_and_nothing_starts(tmp_path: Path, text: str, expected: str) -> None:
    """An invalid config exits 78 with a message naming the file and the key; no run dir, no process."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    done = run_supervisor(config, tmp_path / "run", timeout=30)

    assert done.returncode == 78
    assert done.stderr.startswith(f"trainwarden: config error: {config}: ")
    assert expected in done.stderr
    assert not (tmp_path / "run").exists()


def test_missing_command_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A command that does not exist exits 78 before launching, naming the missing file; no run dir."""
    config = job(tmp_path, SLEEP, command=[str(tmp_path / "no-such-trainer")])
    done = run_supervisor(config, tmp_path / "run", timeout=30)

    assert done.returncode == 78
    assert done.stderr == f"trainwarden: cannot launch: {tmp_path / 'no-such-trainer'} not found\n"
    assert not (tmp_path / "run").exists()


def test_command_that_cannot_start_fails_without_retrying(tmp_path: Path) -> None:
    """A command that exists but cannot be executed fails the run at once, exit 1, naming the file."""
    trainer = tmp_path / "not-a-program"
    trainer.write_bytes(b"\x00\x01 not an executable format")
    trainer.chmod(0o755)
    done = run_supervisor(job(tmp_path, SLEEP, command=[str(trainer)]), tmp_path / "run", timeout=30)

    assert done.returncode == 1
    status = done.status()
    assert (status["state"], status["restarts"]) == ("failed", 0)
    assert status["reason"] == f"could not launch ranks: Exec format error: {trainer}"


def test_second_supervisor_on_the_same_run_dir_is_refused(tmp_path: Path) -> None:
    """While one supervisor runs a run dir, another one exits 1 naming the holder's pid and starts nothing."""
    run_dir = tmp_path / "run"
    first = start_supervisor(job(tmp_path, SLEEP), run_dir)
    wait_until(lambda: (run_dir / "supervisor" / "state.json").exists(), timeout=30, what="first supervisor up")
    second = run_supervisor(job(tmp_path, SLEEP), run_dir, timeout=30)
    first.send_signal(signal.SIGTERM)
    finish(first, run_dir, timeout=30)

    assert second.returncode == 1
    assert second.stderr.strip() == f"trainwarden: {run_dir} is already supervised by pid {first.pid}"
    assert [e["event"] for e in journal(run_dir)].count("supervisor_started") == 1

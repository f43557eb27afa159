"""Acting on re-run verdicts with the real supervisor and 2 gloo ranks on one machine: transient strikes and a
persistent fault are journalled and charged in the node ledger, and a run that cannot move off the device ends with
EXIT_REQUEUE, saying what it would have done."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import GUARDED, REPO, journal, run_supervisor, write_config
from worker.contract import EXIT_BAD_DEVICE, EXIT_REQUEUE

pytestmark = pytest.mark.timeout(240)
HOST = socket.gethostname()


def rank_events(run_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def nodes_table(run_dir: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "nodes", str(run_dir)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_transient_strikes_then_a_persistent_fault_end_a_run_that_cannot_move(tmp_path: Path) -> None:
    """Rank 1's GPU (here its CPU) flips a bit once at step 8: transient, the step goes on, a strike on this host.
    From step 14 it flips at every backward: persistent, both ranks leave with EXIT_BAD_DEVICE, the host is excluded
    for good, and on one machine the run ends 75, naming the device and the relaunch it would have made. Status
    shows the verdicts; `trainwarden nodes` shows the ledger that outlives this supervisor."""
    run_dir = tmp_path / "run"
    faults = "1:bitflip@8,1:bitflip_persistent@14"
    config = write_config(tmp_path / "job.yaml", env={"TRAINWARDEN_FAULTS": faults}, worker=GUARDED)
    done = run_supervisor(config, run_dir)

    assert done.returncode == EXIT_REQUEUE, done.stderr[-3000:]
    # The ranks: rank 0 re-ran rank 1's batch and got a clean result; step 14 was skipped, never applied, and the
    # ranks left with EXIT_BAD_DEVICE; rank 1's own verdict names its host and no GPU (a CPU rank).
    (said,) = [e for e in rank_events(run_dir, 0, "sdc_verdict") if e["verdict"] == "persistent"]
    assert "reproduced only on rank 1" in said["evidence"] and "node" not in said  # rank 0 speaks for no device
    (own,) = [e for e in rank_events(run_dir, 1, "sdc_verdict") if e["verdict"] == "persistent"]
    assert (own["node"], own["gpu"], own["count"]) == (HOST, None, 1)
    (skipped,) = rank_events(run_dir, 0, "step_skipped")
    assert (skipped["step"], skipped["reasons"][-1]) == (14, "sdc_persistent")
    assert rank_events(run_dir, 0, "step")[-1]["step"] == 13
    assert EXIT_BAD_DEVICE in [r["returncode"] for r in done.status()["ranks"]]  # the other: 69, or the stop's TERM
    records = journal(run_dir)
    verdicts = [
        (r["rank"], r["verdict"], r["step"], r["node"], r["gpu"]) for r in records if r["event"] == "sdc_verdict"
    ]
    assert verdicts == [(1, "transient", 8, HOST, None), (1, "persistent", 14, HOST, None)]
    (cannot,) = [r for r in records if r["event"] == "cannot_move"]
    assert cannot["would"] == f"relaunch without {HOST}"
    assert f"would relaunch without {HOST}, but this run cannot move off it" in done.stderr
    status = done.status()
    assert (status["restarts"], status["exit_code"]) == (0, EXIT_REQUEUE)
    assert [(v["node"], v["verdict"]) for v in status["device_verdicts"]] == [(HOST, "transient"), (HOST, "persistent")]
    shown = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", str(run_dir)], cwd=REPO, capture_output=True, text=True
    ).stdout
    assert "re-run verdicts: 1 transient, 1 persistent" in shown
    assert f"device verdict on {HOST} at " in shown
    table = nodes_table(run_dir)
    assert HOST in table and "excluded for good" in table and "persistent silent data corruption on rank 1" in table


def test_transient_strikes_that_add_up_exclude_the_device_of_a_running_attempt(tmp_path: Path) -> None:
    """With `slurm.max_sdc_strikes: 2`, the second one-off flip on rank 1 (steps 8 and 12) excludes this host while
    the ranks train: the attempt ends, and on one machine the run with it (75), the strikes named."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "job.yaml",
        env={"TRAINWARDEN_FAULTS": "1:bitflip@8,1:bitflip@12"},
        worker=GUARDED,
        slurm={"max_sdc_strikes": 2},
    )
    done = run_supervisor(config, run_dir)

    assert done.returncode == EXIT_REQUEUE, done.stderr[-3000:]
    records = journal(run_dir)
    assert [(r["verdict"], r["step"]) for r in records if r["event"] == "sdc_verdict"] == [
        ("transient", 8),
        ("transient", 12),
    ]
    assert any(r["event"] == "cannot_move" for r in records)
    assert f"{HOST} is excluded: 2 transient faults in 8h00m" in done.stderr
    assert "excluded" in nodes_table(run_dir)

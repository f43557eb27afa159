"""`trainwarden status` into a pipe whose reader is gone (`status RUN | head -1`): a quiet exit, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.core import HeartbeatSeen, Policy, RanksLaunched, decide, initial_state
from supervisor.observe.status import snapshot, write_status
from tests.e2e.conftest import REPO
from worker.contract import RunLayout

pytestmark = pytest.mark.timeout(60)


def run_dir_with_status(tmp_path: Path) -> Path:
    """A run dir whose state file says 2 ranks are running and one has beaten."""
    policy = Policy(
        nproc=2, max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=5.0, kill_grace_s=10.0
    )
    state, _ = decide(initial_state(policy), RanksLaunched(0, (100, 101), None), 0.0)
    state, _ = decide(state, HeartbeatSeen(0, 0, seq=1, step=3, phase="train"), 0.0)
    layout = RunLayout(tmp_path / "run")
    write_status(layout, snapshot(state, now=1.0, extra={"run_dir": str(layout.root)}), durable=False)
    return layout.root


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_status_into_a_pipe_nobody_reads_exits_1_without_a_traceback(tmp_path: Path, json_flag: list[str]) -> None:
    """The reader closed before the first write: exit 1 (what Python does on EPIPE) and nothing on stderr."""
    run_dir = run_dir_with_status(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", "status", *json_flag, str(run_dir)],
            cwd=REPO,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (1, "")


def test_status_piped_into_head_prints_its_first_line_only(tmp_path: Path) -> None:
    """`trainwarden status RUN | head -1` through a real shell: the summary's first line, nothing on stderr."""
    run_dir = run_dir_with_status(tmp_path)
    done = subprocess.run(
        ["bash", "-c", f'set -o pipefail; "{sys.executable}" -m supervisor status "{run_dir}" | head -1'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.stdout == f"run {run_dir}: running, attempt 0, restarts 0/3\n"
    assert done.stderr == "" and done.returncode in (0, 1)  # 1 only if head left before the whole summary was written

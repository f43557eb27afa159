"""`trainwarden run` at a terminal (a real pty): readable events and a live status line; elsewhere JSON lines. The
run at the terminal has a slow rank: it alone is flagged, on the line, in the journal and in status."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, journal, trainwarden_status, write_config

pytestmark = pytest.mark.timeout(120)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_in_pty(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run `argv` with stdout and stderr on a pseudo-terminal; its exit code and everything it showed."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # a wide one: the line is whole
    # The size comes from the terminal: readline, loaded by some import here, exports COLUMNS and LINES of its own.
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    shown = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            try:
                data = os.read(controller, 65536) if ready else b""
            except OSError:  # the terminal closed: the process is gone
                break
            shown += data
            if ready and not data:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), ANSI.sub("", shown.decode(errors="replace"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(controller)


@dataclass(frozen=True)
class Shown:
    """A run of `trainwarden run` at a terminal: its exit code, what it showed, its run dir."""

    code: int
    text: str
    run_dir: Path


@pytest.fixture(scope="module")
def slowed(tmp_path_factory: pytest.TempPathFactory) -> Shown:
    """The demo at a terminal, 40 steps, rank 1 slowed by 0.1 s a step from step 5 (`1:slow@5:0.1`), a straggler
    flagged once it has been slower for 2 s."""
    tmp = tmp_path_factory.mktemp("slowed")
    config = write_config(
        tmp / "job.yaml",
        steps=40,
        stragglers={"sustain_s": 2},
        env={"TRAINWARDEN_FAULTS": "1:slow@5:0.1", "OMP_NUM_THREADS": "1"},
    )
    code, text = run_in_pty(
        [sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(tmp / "run")], timeout=90
    )
    return Shown(code, text, tmp / "run")


def test_at_a_terminal_events_are_readable_and_a_status_line_shows_progress(slowed: Shown) -> None:
    """Events as readable lines, no JSON; the live line, redrawn in place, shows the step, loss, speed and the slow
    rank; the last one says the run finished."""
    assert slowed.code == 0, slowed.text[-3000:]
    assert re.search(r"\d\d:\d\d:\d\d \[info\s*\] supervisor_started", slowed.text), slowed.text[:2000]
    assert re.search(r"\[warning\s*\] straggler_flagged", slowed.text), slowed.text[-3000:]
    lines = [frame for frame in slowed.text.split("\r\x1b[2K") if frame.startswith("running | step")]
    assert lines, slowed.text[-3000:]
    assert re.search(r"running \| step \d+/40 \| loss [\d.]+ \| [\d.]+ steps/s", slowed.text), lines[-3:]
    assert any("slow rank 1" in line for line in lines), lines[-3:]
    assert "finished | step 40/40" in slowed.text
    assert '{"' not in slowed.text  # no JSON lines for people


def test_only_the_rank_slowed_by_a_fault_is_flagged_and_the_run_finishes(slowed: Shown) -> None:
    """`1:slow@5:0.1` with sustain_s 2: one `straggler_flagged` naming rank 1, none for rank 0, status lists rank 1,
    and the run exits 0."""
    assert slowed.code == 0, slowed.text[-3000:]
    flagged = [e for e in journal(slowed.run_dir) if e["event"] == "straggler_flagged"]
    assert [(e["rank"], e["level"]) for e in flagged] == [(1, "warning")]
    assert flagged[0]["slower_by"] > 0.2 and flagged[0]["sustained_s"] >= 2
    assert [e for e in journal(slowed.run_dir) if e["event"] == "straggler_cleared"] == []
    status = trainwarden_status(slowed.run_dir)
    assert [s["rank"] for s in status["stragglers"]] == [1]
    assert sorted(status["rank_compute_s"]) == ["0", "1"]
    assert status["rank_compute_s"]["1"] > status["rank_compute_s"]["0"]


def test_elsewhere_events_are_json_lines(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text('command: ["true"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    events = [json.loads(line)["event"] for line in done.stderr.splitlines() if line.startswith("{")]
    assert events[0] == "supervisor_started" and "run_finished" in events

"""`trainwarden run` at a terminal (a real pty): readable events and a live status line; elsewhere JSON lines."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, write_config

pytestmark = pytest.mark.timeout(120)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_in_pty(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run `argv` with stdout and stderr on a pseudo-terminal; its exit code and everything it showed."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
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


def test_at_a_terminal_events_are_readable_and_a_status_line_shows_progress(tmp_path: Path) -> None:
    config = write_config(tmp_path / "job.yaml", steps=60)
    code, shown = run_in_pty([sys.executable, "-m", "supervisor", "run", str(config), "--run-dir",
                              str(tmp_path / "run")], timeout=90)
    assert code == 0, shown[-3000:]
    assert re.search(r"\d\d:\d\d:\d\d \[info\s*\] supervisor_started", shown), shown[:2000]
    lines = [frame for frame in shown.split("\r\x1b[2K") if frame.startswith("running | step")]
    assert lines, shown[-3000:]  # the live line, redrawn in place
    assert re.search(r"running \| step \d+/60 \| loss [\d.]+ \| [\d.]+ steps/s", shown), lines[-3:]
    assert "finished | step 60/60" in shown
    assert '{"' not in shown  # no JSON lines for people


def test_elsewhere_events_are_json_lines(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text('command: ["true"]\n')
    done = subprocess.run([sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(tmp_path / "run")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    events = [json.loads(line)["event"] for line in done.stderr.splitlines() if line.startswith("{")]
    assert events[0] == "supervisor_started" and "run_finished" in events

"""Standing checks on the repository itself: lint clean, and the supervisor never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean() -> None:
    """`ruff check` finds nothing in the project's code."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "supervisor", "worker", "tests", "bench", "examples"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_supervisor_does_not_import_torch() -> None:
    """Importing the whole supervisor (CLI, runner, config) leaves torch unloaded: it must start fast and small."""
    code = "import sys, supervisor.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0

"""What the worker library does as a rank's interpreter exits (a real process: atexit only runs at a real exit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import REPO

# The handler registered before the Warden runs after the Warden's (atexit is last in, first out).
SCRIPT = """
import atexit, gc, torch
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
from worker import Warden
model = torch.nn.Linear(2, 2)
Warden(model, torch.optim.SGD(model.parameters(), lr=0.1)).finish(save=False)
print("frozen before exit:", gc.get_freeze_count() > 0, flush=True)
"""


def test_the_garbage_collector_is_frozen_only_once_the_script_is_done(tmp_path: Path):
    """Python's last collections would walk torch's object graph (0.8 s per rank): frozen after the script's own
    code and atexit handlers, not before."""
    env = {"TRAINWARDEN_RUN_DIR": str(tmp_path / "run"), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["frozen before exit: False", "frozen at exit: True"]

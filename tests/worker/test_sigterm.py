"""SIGTERM during a checkpoint save: the save finishes first, then the rank dies of the signal as it would have."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import wait_until
from worker.contract import ENV_RUN_DIR, ENV_WORKER_CONFIG, RunLayout
from worker.faults import ENV_FAULTS

REPO = Path(__file__).resolve().parents[2]
# Trains 3 steps saving at step 2; then waits in a `train` phase to be signalled.
SCRIPT = """
import signal, sys, time, torch
from worker.warden import Warden
if sys.argv[1] in ("own-handler", "framework"):
    signal.signal(signal.SIGTERM, lambda *_: (print("own handler ran", flush=True), sys.exit(3)))
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
class AskTrainer:  # a trainer that saves after its callbacks (the Hugging Face Trainer's way)
    deferred = True
    def __call__(self, step): pass
warden = Warden(model, opt, framework_save=AskTrainer() if sys.argv[1] == "framework" else None)
for _ in range(3):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    warden.step_done(loss=0.0)
print("trained", flush=True)
time.sleep(60)
"""


def start(tmp_path: Path, mode: str, faults: str = "") -> subprocess.Popen:
    env = {
        **os.environ,
        ENV_RUN_DIR: str(tmp_path),
        ENV_FAULTS: faults,
        "RANK": "0",
        "WORLD_SIZE": "1",
        ENV_WORKER_CONFIG: json.dumps({"save_checkpoint_steps": 2}),
    }
    return subprocess.Popen([sys.executable, "-c", SCRIPT, mode], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def phase(layout: RunLayout) -> str | None:
    try:
        return json.loads(layout.heartbeat(0).read_text())["phase"]
    except (OSError, ValueError):
        return None


def events(layout: RunLayout) -> list[str]:
    return [json.loads(line)["event"] for line in layout.rank_events(0).read_text().splitlines()]


def test_sigterm_during_a_save_lets_the_save_finish_then_kills(tmp_path: Path) -> None:
    """SIGTERM 0.5 s into a 2 s save: checkpoint 2 and its completion record exist, then death by SIGTERM."""
    layout = RunLayout(tmp_path)
    proc = start(tmp_path, "default", faults="0:slow_save@2:2")
    try:
        wait_until(lambda: phase(layout) == "save", timeout=60, what="the save to begin")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert layout.checkpoints.complete_steps(1, "ckpt") == [2]
    assert events(layout)[-2:] == ["checkpoint_saved", "stopped_after_save"]


def test_sigterm_outside_a_save_kills_at_once(tmp_path: Path) -> None:
    """Between saves SIGTERM acts as it would without the worker library: the default action, death."""
    proc = start(tmp_path, "default")
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "trained\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert "stopped_after_save" not in events(RunLayout(tmp_path))


def test_the_scripts_own_sigterm_handler_still_runs(tmp_path: Path) -> None:
    """A handler the script installed before the Warden is called, not replaced."""
    proc = start(tmp_path, "own-handler")
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "trained\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 3
        assert proc.stdout.readline() == "own handler ran\n"
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_a_trainers_sigterm_handler_is_not_called(tmp_path: Path) -> None:
    """Under worker.integrations the handler installed before the Warden is a trainer's (Lightning's broadcasts to
    its peers, which hangs when one is dead): the rank dies of SIGTERM at once, as the supervisor expects."""
    proc = start(tmp_path, "framework")
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "trained\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert proc.stdout.read() == ""
    finally:
        proc.kill()
        proc.communicate(timeout=10)

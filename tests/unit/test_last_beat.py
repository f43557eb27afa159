"""What a successor reads of the attempt whose supervisor died mid-run: the newest step its ranks beat, and when."""

from __future__ import annotations

import os

from supervisor.runner import _last_beat
from worker.contract import RunLayout
from worker.heartbeat import Heartbeat


def beat(layout: RunLayout, rank: int, attempt: int, step: int) -> None:
    layout.heartbeat(rank).parent.mkdir(parents=True, exist_ok=True)
    Heartbeat(layout.heartbeat(rank), root=layout.root, rank=rank, attempt=attempt, interval_s=0).beat(step, "train")


def test_the_newest_step_of_the_dead_supervisors_attempt_and_when_it_was_written(tmp_path):
    layout = RunLayout(tmp_path)
    beat(layout, 0, 2, 48)
    beat(layout, 3, 2, 50)  # the last rank: another node
    os.utime(layout.heartbeat(3), (5005.0, 5005.0))
    assert _last_beat(layout, {"state": "running", "attempt": 2}, 4) == (50, 5005.0)
    assert _last_beat(layout, {"state": "running", "attempt": 3}, 4) is None  # beats of another attempt
    assert _last_beat(layout, {"state": "stopped", "attempt": 2}, 4) is None  # it did not die mid-run
    layout.heartbeat(3).write_text("garbage")
    assert _last_beat(layout, {"state": "running", "attempt": 2}, 4) == (48, os.lstat(layout.heartbeat(0)).st_mtime)

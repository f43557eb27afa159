"""A real loop's heartbeat carries its progress: the last loss, compute per step, the total steps and save time."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from tests.worker.conftest import GUARDED
from tests.worker.test_guard import events
from worker.contract import RunLayout
from worker.faults import SLOW_S, Fault, parse_faults

SAVING = dataclasses.replace(GUARDED, save_checkpoint_steps=2)


def heartbeat(tmp_path: Path) -> dict[str, Any]:
    return json.loads(RunLayout(tmp_path).heartbeat(0).read_text(encoding="utf-8"))


def test_a_warden_loop_writes_loss_compute_total_steps_and_save_time(loop, tmp_path):
    """`steps(5)` with a save every 2 steps: the final beat has total_steps 5, the last loss, compute_s > 0 and the
    seconds spent in the two saves."""
    run = loop(config=SAVING)
    losses = []
    for _ in run.warden.steps(5):
        losses.append(run.backward())
        if run.warden.guard_step(losses[-1], max_norm=1.0):
            run.optimizer.step()
        run.warden.step_done(loss=losses[-1])
    run.warden.finish(save=False)
    beat = heartbeat(tmp_path)
    assert (beat["step"], beat["total_steps"], beat["loss"]) == (5, 5, losses[-1])
    assert 0 < beat["compute_s"] <= beat["step_time_s"]
    saves = sum(e["duration_s"] for e in events(tmp_path, "checkpoint_saved"))
    # the same two measurements, one rounded to 6 places per save, the other to 4
    assert len(events(tmp_path, "checkpoint_saved")) == 2 and saves > 0
    assert beat["save_s"] == pytest.approx(saves, abs=2e-4)


def test_without_guard_step_or_steps_compute_s_and_total_steps_are_null(loop, tmp_path):
    """A loop calling only step_done has no all-reduce to time and no total: both null; save_s is 0."""
    run = loop()
    for _ in range(3):
        loss = run.backward()
        run.optimizer.step()
        run.warden.step_done(loss=loss)
    run.warden.finish(save=False)
    beat = heartbeat(tmp_path)
    assert (beat["compute_s"], beat["total_steps"], beat["save_s"], beat["loss"]) == (None, None, 0, loss)


def test_an_endless_loop_has_no_total_steps(loop, tmp_path):
    """`steps(math.inf)` trains on; the heartbeat says total_steps null."""
    run = loop()
    for step in run.warden.steps(math.inf):
        run.train_batch()
        if step == 2:
            break
    run.warden.finish(save=False)
    assert (heartbeat(tmp_path)["step"], heartbeat(tmp_path)["total_steps"]) == (2, None)


def test_a_non_finite_loss_is_written_as_null(loop, tmp_path):
    """A NaN loss (the guard skips the step) is no number in JSON: the heartbeat says null, and stays readable."""
    run = loop()
    run.backward()
    run.warden.guard_step(float("nan"), max_norm=1.0)
    run.warden.step_done(loss=float("nan"))
    run.warden.finish(save=False)
    assert heartbeat(tmp_path)["loss"] is None


def test_an_eval_phase_between_steps_is_not_compute(loop, tmp_path):
    """0.3 s in an `eval` phase between two steps counts in step_time_s, not in compute_s."""
    run = loop()
    run.train_batch()
    with run.warden.phase("eval"):
        time.sleep(0.3)
    run.train_batch()
    run.warden.finish(save=False)
    beat = heartbeat(tmp_path)
    assert beat["step_time_s"] >= 0.2 * 0.3 and beat["compute_s"] < 0.2 * 0.3


def test_a_slow_fault_adds_its_seconds_to_every_step_from_its_step_on(loop, tmp_path):
    """`0:slow@3`: steps 1-2 are quick, then each step sleeps SLOW_S before the guard; announced once."""
    run = loop(faults="0:slow@3")
    for _ in range(2):
        run.train_batch()
    assert events(tmp_path, "fault_injected") == []
    started = time.monotonic()
    for _ in range(12):
        run.train_batch()
    assert time.monotonic() - started >= 12 * SLOW_S
    run.warden.finish(save=False)
    assert heartbeat(tmp_path)["compute_s"] >= SLOW_S * (1 - 0.8**12)  # the smoothed figure has caught up
    assert [(e["kind"], e["step"]) for e in events(tmp_path, "fault_injected")] == [("slow", 3)]


def test_a_slow_faults_seconds_are_parsed_and_bounded():
    """`1:slow@5:0.1` parses; negative, NaN or over an hour of sleep per step is refused by name."""
    assert parse_faults("1:slow@5:0.1,0:slow@2") == [Fault(1, "slow", 5, 0.1), Fault(0, "slow", 2)]
    for bad in ("1:slow@5:-1", "1:slow@5:nan", "1:slow@5:3601"):
        with pytest.raises(ValueError, match="slow fault"):
            parse_faults(bad)


def test_skips_anomalies_and_the_newest_save_are_in_the_heartbeat(loop, tmp_path):
    """A NaN at step 2 and a spike over the fixed threshold at step 3 are skipped and counted by kind; the newest
    save's duration is there too."""
    run = loop("0:nan@2,0:spike@3", config=SAVING)
    for _ in run.warden.steps(4):
        run.train_batch()
    beat = heartbeat(tmp_path)
    assert beat["skipped"] == 2
    assert beat["anomalies"] == {"non_finite": 1, "global_norm_above_threshold": 1}
    newest = events(tmp_path, "checkpoint_saved")[-1]["duration_s"]
    assert beat["last_save_s"] == pytest.approx(newest, abs=1e-3)

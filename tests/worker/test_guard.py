"""The step guard in a real single-process torch loop: skipped steps change nothing, streaks abort with code 65."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint_files import bitwise_equal
from tests.worker.conftest import MAX_NORM
from worker.anomaly import MonitorConfig
from worker.contract import (
    EXIT_ANOMALY,
    RunLayout,
    WorkerConfig,
)


def events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    """Rank 0's logged events named `name`, oldest first, without their timestamps."""
    lines = RunLayout(tmp_path).rank_events(0).read_text(encoding="utf-8").splitlines()
    found = [json.loads(line) for line in lines]
    return [{k: v for k, v in e.items() if k != "time"} for e in found if e["event"] == name]


def spiked_norm(model: torch.nn.Module) -> float:
    """The global norm the guard will see after the `spike` fault scales the current gradients by 1000."""
    return float(torch.nn.utils.get_total_norm([p.grad * 1000.0 for p in model.parameters()]))


def test_normal_step_returns_true_and_advances(loop):
    """A step with a global norm under the threshold is applied: `guard_step` is True and the step counts."""
    run = loop()
    loss = run.backward()
    assert run.warden.guard_step(loss, max_norm=MAX_NORM) is True
    run.optimizer.step()
    run.scheduler.step()
    run.warden.step_done(loss=loss)
    assert (run.warden.step, run.warden.batches) == (1, 1)
    (step,) = events(run.warden.layout.root, "step")
    assert (step["step"], step["batch"], step["skipped"]) == (1, 0, False)
    assert step["grad_norm"] < 3.0
    assert events(run.warden.layout.root, "step_skipped") == []


def test_skipped_step_changes_nothing(loop, tmp_path):
    """A spiked step is skipped: parameters, optimizer and scheduler state stay bitwise equal, only the batch moves."""
    run = loop("0:spike@2")
    assert run.train_batch() is True
    before = run.snapshot()
    loss = run.backward()
    norm = spiked_norm(run.model)
    assert run.warden.guard_step(loss, max_norm=MAX_NORM) is False
    assert bitwise_equal(run.snapshot(), before)
    run.warden.step_done(loss=loss)
    assert (run.warden.step, run.warden.batches) == (1, 2)
    assert bitwise_equal(run.snapshot(), before)
    run.warden.finish()
    assert events(tmp_path, "step_skipped") == [
        {
            "event": "step_skipped",
            "level": "warning",
            "rank": 0,
            "attempt": 0,
            "opt_global_step": 1,
            "step": 2,
            "batch": 1,
            "global_norm": norm,
            "loss": loss,
            "skip_data_grad_norm_threshold": 3.0,
            "is_skip": True,
            "consecutive": 1,
            "reasons": ["global_norm_above_threshold"],
            "local": True,
        }
    ]
    skipped = events(tmp_path, "step")[-1]
    assert (skipped["step"], skipped["batch"], skipped["skipped"], skipped["grad_norm"]) == (1, 1, True, norm)


def test_training_continues_after_a_skip(loop):
    """After a skipped batch, the next normal batch applies the step the skip did not."""
    run = loop("0:spike@2")
    assert [run.train_batch() for _ in range(3)] == [True, False, True]
    assert (run.warden.step, run.warden.batches) == (2, 3)
    assert [e["step"] for e in events(run.warden.layout.root, "step")] == [1, 1, 2]


def test_nan_gradient_is_skipped_as_non_finite(loop, tmp_path):
    """A NaN in the gradients skips the step with reason `non_finite` and changes nothing."""
    run = loop("0:nan@2")
    assert run.train_batch() is True
    before = run.snapshot()
    loss = run.backward()
    assert run.warden.guard_step(loss, max_norm=MAX_NORM) is False
    run.warden.step_done(loss=loss)
    assert bitwise_equal(run.snapshot(), before)
    assert (run.warden.step, run.warden.batches) == (1, 2)
    run.warden.finish()
    (skipped,) = events(tmp_path, "step_skipped")
    assert (skipped["global_norm"], skipped["reasons"], skipped["is_skip"], skipped["consecutive"]) == (
        "nan",
        ["non_finite"],
        True,
        1,
    )


def test_nan_is_skipped_even_without_skip_data(loop, tmp_path):
    """With `use_skip_data_by_global_norm` off, a NaN step is still skipped, with no threshold in the event."""
    run = loop("0:nan@2", config=WorkerConfig())
    assert [run.train_batch() for _ in range(2)] == [True, False]
    run.warden.finish()
    (skipped,) = events(tmp_path, "step_skipped")
    assert (skipped["reasons"], skipped["skip_data_grad_norm_threshold"]) == (["non_finite"], None)


def test_spike_is_applied_without_skip_data(loop, tmp_path):
    """With `use_skip_data_by_global_norm` off, a spiked step is clipped and applied, not skipped."""
    run = loop("0:spike@2", config=WorkerConfig())
    before = run.snapshot()
    assert [run.train_batch() for _ in range(2)] == [True, True]
    assert (run.warden.step, run.warden.batches) == (2, 2)
    assert not bitwise_equal(run.snapshot()["model"], before["model"])
    run.warden.finish()
    assert events(tmp_path, "step_skipped") == []


def test_spike_is_applied_with_monitor_off(loop, tmp_path):
    """With `monitor_on` false, the global-norm threshold does not apply and a spike is applied."""
    config = WorkerConfig(use_skip_data_by_global_norm=True, monitor_config=MonitorConfig(monitor_on=False))
    run = loop("0:spike@2", config=config)
    assert [run.train_batch() for _ in range(2)] == [True, True]
    run.warden.finish()
    assert events(tmp_path, "step_skipped") == []


def test_streak_reaching_count_threshold_exits_65(loop, tmp_path):
    """Three consecutive spikes exit with EXIT_ANOMALY (65) after logging where the streak began and ended."""
    run = loop("0:spike@2:3")
    assert run.train_batch() is True
    before = run.snapshot()
    assert [run.train_batch() for _ in range(2)] == [False, False]
    loss = run.backward()
    norm = spiked_norm(run.model)
    with pytest.raises(SystemExit) as exited:
        run.warden.guard_step(loss, max_norm=MAX_NORM)
    assert exited.value.code == EXIT_ANOMALY == 65
    assert (run.warden.step, run.warden.batches) == (1, 3)
    assert bitwise_equal(run.snapshot(), before)
    run.warden.finish()
    assert [e["consecutive"] for e in events(tmp_path, "step_skipped")] == [1, 2, 3]
    assert events(tmp_path, "anomaly_abort") == [
        {
            "event": "anomaly_abort",
            "level": "error",
            "rank": 0,
            "attempt": 0,
            "step": 2,
            "batch": 3,
            "global_norm": norm,
            "threshold": 3.0,
            "consecutive": 3,
            "count_threshold": 3,
            "first_anomaly_step": 2,
            "first_anomaly_batch": 1,
        }
    ]


def test_normal_step_resets_the_streak(loop, tmp_path):
    """Two spikes, a normal step, then another spike stay below the count threshold of 3: no abort."""
    run = loop("0:spike@2:2,0:spike@3")
    assert [run.train_batch() for _ in range(5)] == [True, False, False, True, False]
    assert (run.warden.step, run.warden.batches) == (2, 5)
    run.warden.finish()
    skipped = events(tmp_path, "step_skipped")
    assert [(e["step"], e["batch"], e["consecutive"]) for e in skipped] == [(2, 1, 1), (2, 2, 2), (3, 4, 1)]
    assert events(tmp_path, "anomaly_abort") == []

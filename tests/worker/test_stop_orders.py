"""Stop orders in a real loop: carried out at their step, late ones at once, and never twice or after a resume."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.worker.test_guard import events
from worker.contract import ENV_RESUME_STEP, RunLayout, StopOrder, WorkerConfig
from worker.files import atomic_write_json

CONFIG = WorkerConfig(save_checkpoint_steps=0)


def order(tmp_path: Path, step: int, *, exit: bool, id: int = 1) -> None:
    atomic_write_json(RunLayout(tmp_path).stop_order, asdict(StopOrder(id, step, exit)), root=tmp_path)


def saved_steps(tmp_path: Path) -> list[int]:
    return sorted(RunLayout(tmp_path).checkpoints.steps(0, "ckpt"))


def test_continue_order_saves_at_its_step_once_and_training_goes_on(loop, tmp_path):
    """An order for step 3 read at step 1: checkpoint 3, `stop_order_done`, and nothing more at later steps."""
    run = loop(config=CONFIG)
    run.train_batch()
    order(tmp_path, 3, exit=False)
    for _ in range(5):
        run.train_batch()
    assert saved_steps(tmp_path) == [3]
    assert [(e["step"], e["exit"]) for e in events(tmp_path, "stop_order_done")] == [(3, False)]
    assert events(tmp_path, "stop_order_late") == []


def test_exit_order_saves_then_leaves_with_code_0(loop, tmp_path):
    """An exit order: the rank saves at its step and raises SystemExit(0) out of step_done."""
    run = loop(config=CONFIG)
    order(tmp_path, 2, exit=True)
    run.train_batch()
    with pytest.raises(SystemExit) as left:
        run.train_batch()
    assert left.value.code == 0 and saved_steps(tmp_path) == [2]
    assert events(tmp_path, "rank_finished")[0]["step"] == 2


def test_an_order_read_after_its_step_is_carried_out_at_once_with_a_warning(loop, tmp_path):
    """Every rank holds the order only after its step passed: all act at the next step, and say so."""
    run = loop(config=CONFIG)
    for _ in range(4):
        run.train_batch()
    order(tmp_path, 2, exit=False)
    run.train_batch()
    assert saved_steps(tmp_path) == [5]
    (late,) = events(tmp_path, "stop_order_late")
    assert (late["step"], late["ordered_step"]) == (5, 2)


def test_without_guard_step_an_order_is_carried_out_only_at_its_step(loop, tmp_path):
    """A loop without guard_step has no collective to agree by: the order's step as named, or never."""
    run = loop(config=CONFIG)
    order(tmp_path, 2, exit=False, id=1)
    for _ in range(3):
        run.backward()
        run.optimizer.step()
        run.warden.step_done(loss=0.0)
    order(tmp_path, 2, exit=False, id=2)  # already passed
    run.backward()
    run.warden.step_done(loss=0.0)
    assert saved_steps(tmp_path) == [2]


def test_a_resumed_rank_ignores_orders_for_steps_it_resumed_past(loop, tmp_path, monkeypatch):
    """The checkpoint of a save-and-continue order resumed from: the same order is not carried out again."""
    run = loop(config=CONFIG)
    order(tmp_path, 2, exit=False)
    for _ in range(2):
        run.train_batch()
    run.warden.finish()
    monkeypatch.setenv(ENV_RESUME_STEP, "2")
    again = loop(config=CONFIG)
    assert again.warden.resume() == 2
    for _ in range(2):
        again.train_batch()
    done = [json.loads(line) for line in RunLayout(tmp_path).rank_events(0).read_text().splitlines()]
    assert [e["step"] for e in done if e["event"] == "stop_order_done"] == [2]
    assert saved_steps(tmp_path) == [2]

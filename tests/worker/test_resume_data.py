"""Seed 001's data position on resume: continue exactly, or follow a changed dataset or global batch size."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.worker.conftest import GUARDED
from worker.contract import ENV_RESUME_STEP, RunLayout


def train_and_save(loop: Any, batches: int) -> None:
    for _ in range(batches):
        loop.train_batch()
    loop.warden.save(loop.warden.step)
    loop.warden.finish()


def resumed(loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: Any) -> Any:
    """A new loop resuming from step 6, as the supervisor would tell it."""
    monkeypatch.setenv(ENV_RESUME_STEP, "6")
    config = replace(GUARDED, **options.pop("config", {}))
    again = loop(config=config, **options)
    assert again.warden.resume() == 6
    return again


def resume_events(tmp_path: Path) -> list[dict[str, Any]]:
    lines = RunLayout(tmp_path).rank_events(0).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "resumed"]


def test_resume_continues_the_data_exactly_where_the_checkpoint_left_it(loop, tmp_path, monkeypatch):
    """Without dataset options the next batch is the one after the last batch the checkpoint consumed."""
    train_and_save(loop(), 6)
    again = resumed(loop, tmp_path, monkeypatch)
    assert (again.warden.step, again.warden.batches) == (6, 6)


def test_ignore_data_skip_reads_a_new_dataset_from_its_beginning(loop, tmp_path, monkeypatch):
    """Seed 001 scenario 1: `ignore_data_skip` keeps the trained state but starts the data at batch 0."""
    train_and_save(loop(), 6)
    again = resumed(loop, tmp_path, monkeypatch, config={"ignore_data_skip": True})
    assert (again.warden.step, again.warden.batches) == (6, 0)
    assert resume_events(tmp_path)[-1]["saved_data_position"] == 6


def test_data_skip_steps_sets_how_much_of_a_new_dataset_was_trained(loop, tmp_path, monkeypatch):
    """Seed 001 scenario 2: `data_skip_steps: 2` starts the new dataset at its third batch."""
    train_and_save(loop(), 6)
    again = resumed(loop, tmp_path, monkeypatch, config={"data_skip_steps": 2})
    assert (again.warden.step, again.warden.batches) == (6, 2)


def test_doubled_global_batch_size_halves_the_skipped_batches_rounding_down(loop, tmp_path, monkeypatch):
    """Seed 001 scenario 3: with twice the global batch size, 5 batches of the old size are 2 of the new."""
    first = loop(global_batch_size=8)
    for _ in range(5):
        first.train_batch()
    first.warden.save(6)  # named 6 so `resumed` finds it; the data position saved is 5 batches of 8 samples
    first.warden.finish()
    again = resumed(loop, tmp_path, monkeypatch, global_batch_size=16)
    assert again.warden.batches == 2  # 5 * 8 // 16


def test_data_skip_steps_wins_over_batch_size_scaling(loop, tmp_path, monkeypatch):
    """An explicit `data_skip_steps` is taken as given, already in batches of the new size (as the seed says)."""
    train_and_save(loop(global_batch_size=8), 6)
    again = resumed(loop, tmp_path, monkeypatch, global_batch_size=16, config={"data_skip_steps": 1})
    assert again.warden.batches == 1

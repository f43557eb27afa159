"""Seed 004's snapshots: two alternating slots besides the regular checkpoints, resumed from like them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from worker.contract import RunLayout, WorkerConfig

SNAPSHOTTING = WorkerConfig(save_checkpoint_steps=6, snapshot_steps=2)


def steps_in(store: Any) -> set[int]:
    return store.steps(0, SNAPSHOTTING.prefix)


def test_snapshots_alternate_between_two_slots_and_skip_regular_checkpoint_steps(loop, tmp_path: Path) -> None:
    """Snapshots at 2, 4, 8 (6 is a regular checkpoint): at most two exist, one per slot, each complete."""
    run = loop(config=SNAPSHOTTING)
    seen = []
    layout = RunLayout(tmp_path)
    for _ in range(8):
        run.train_batch()
        seen.append((steps_in(layout.snapshot_slot(0)), steps_in(layout.snapshot_slot(1))))
    assert seen[1] == (set(), {2})
    assert seen[3] == ({4}, {2})
    assert seen[7] == ({8}, {2})
    assert steps_in(layout.checkpoints) == {6}
    assert sorted(p.name for p in layout.snapshot_slot(0).rank_dir(0).iterdir()) == [
        "ckpt_rank_0-8.ckpt",
        "ckpt_rank_0-8.json",
        "meta.json",
    ]


def test_without_a_supervisor_the_newest_snapshot_is_resumed_exactly(loop, tmp_path: Path) -> None:
    """A rank restarted under plain torchrun resumes from the snapshot at 8, newer than checkpoint 6."""
    run = loop(config=SNAPSHOTTING)
    for _ in range(8):
        run.train_batch()
    trained = run.snapshot()
    run.warden.finish()

    again = loop(config=SNAPSHOTTING)
    assert again.warden.resume() == 8
    assert again.warden.batches == 8
    resumed = again.snapshot()
    for key, value in trained["model"].items():
        assert torch.equal(resumed["model"][key], value)
    assert resumed["optimizer"]["state"][0]["exp_avg"].equal(trained["optimizer"]["state"][0]["exp_avg"])
    assert resumed["scheduler"] == trained["scheduler"]


def test_reusing_a_slot_deletes_only_our_own_files(loop, tmp_path: Path) -> None:
    """Files in a snapshot slot that the library did not write (notes, other prefixes, a directory) survive reuse."""
    slot = RunLayout(tmp_path).snapshot_slot(1).rank_dir(0)
    slot.mkdir(parents=True)
    strangers = [slot / "notes.txt", slot / "other_rank_0-2.ckpt", slot / "ckpt_rank_1-2.ckpt"]
    for path in strangers:
        path.write_text("not yours")
    (slot / "keep").mkdir()
    run = loop(config=SNAPSHOTTING)
    for _ in range(2):
        run.train_batch()  # step 2 is saved into slot 1, which is emptied first
    assert sorted(p.name for p in slot.iterdir()) == sorted(
        ["ckpt_rank_0-2.ckpt", "ckpt_rank_0-2.json", "meta.json", "keep", *(p.name for p in strangers)]
    )
    assert all(path.read_text() == "not yours" for path in strangers)

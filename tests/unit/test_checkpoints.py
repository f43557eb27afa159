"""Choosing where to resume: complete, intact and healthy on every rank, with a reason for each candidate passed."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from supervisor.checkpoints import Choice, choose_resume, health_entries
from worker.contract import RunLayout

PREFIX = "demo"


def save(layout: RunLayout, step: int, ranks: tuple[int, ...] = (0, 1), *, unhealthy: tuple[int, ...] = ()) -> None:
    """What a finished save leaves: each rank's file, then its completion record."""
    for rank in ranks:
        data = f"rank {rank} step {step} ".encode() * 100
        path = layout.checkpoint_file(rank, step, PREFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        bad = rank in unhealthy
        record = {"step": step, "file": path.name, "size": len(data), "crc32": f"{zlib.crc32(data):08x}",
                  "is_health": int(bad), "health_reasons": ["embedding_local_norm 9 above 1"] if bad else []}
        layout.checkpoint_record(rank, step, PREFIX).write_text(json.dumps(record))


def choose(layout: RunLayout, **options: object) -> Choice:
    return choose_resume(layout, 2, PREFIX, **options)


def test_newest_good_checkpoint_is_chosen(tmp_path: Path) -> None:
    """With every candidate intact, the newest is chosen and nothing is passed over."""
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30):
        save(layout, step)
    assert choose(layout) == Choice(30, ())


def test_seed_001_deleted_newest_file_of_one_rank_falls_back(tmp_path: Path) -> None:
    """Seed 001's example: delete rank 1's newest file and the previous checkpoint is used."""
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30):
        save(layout, step)
    layout.checkpoint_file(1, 30, PREFIX).unlink()
    assert choose(layout) == Choice(20, ((30, "incomplete: rank 1 has no checkpoint file"),))


def test_truncated_file_is_passed_over(tmp_path: Path) -> None:
    """A rank file shorter than its record says is truncated."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20)
    path = layout.checkpoint_file(0, 20, PREFIX)
    path.write_bytes(path.read_bytes()[:-7])
    assert choose(layout) == Choice(10, ((20, "truncated on rank 0: 1493 bytes, 1500 written"),))


def test_flipped_byte_is_passed_over_as_corrupted(tmp_path: Path) -> None:
    """One flipped byte, same size, fails the checksum."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20)
    path = layout.checkpoint_file(1, 20, PREFIX)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    assert choose(layout) == Choice(10, ((20, "corrupted on rank 1: checksum differs from the one written"),))


def test_save_killed_before_its_completion_record_is_never_chosen(tmp_path: Path) -> None:
    """A file without its completion record (killed between the two writes) does not count."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20)
    layout.checkpoint_record(1, 20, PREFIX).unlink()
    assert choose(layout) == Choice(10, ((20, "incomplete: rank 1 has no completion record"),))


def test_unhealthy_newest_falls_back_to_older_healthy(tmp_path: Path) -> None:
    """A checkpoint one rank tagged unhealthy is passed over when health is required, used when it is not."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20, unhealthy=(1,))
    assert choose(layout) == Choice(10, ((20, "unhealthy on rank 1: embedding_local_norm 9 above 1"),))
    assert choose(layout, require_healthy=False) == Choice(20, ())


def test_rollback_point_limits_the_choice(tmp_path: Path) -> None:
    """Candidates after `at_most` are passed over as after the rollback point."""
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30):
        save(layout, step)
    assert choose(layout, at_most=25) == Choice(20, ((30, "after the rollback point (step 25)"),))


def test_junk_in_the_checkpoint_dir_is_ignored(tmp_path: Path) -> None:
    """Stray files, temporary files and other prefixes are not candidates."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    for junk in ("notes.txt", ".demo_rank_0-20.ckpt.abc.tmp", "other_rank_0-40.ckpt", "demo_rank_0-x.ckpt"):
        (layout.rank_checkpoint_dir(0) / junk).write_text("junk")
    assert choose(layout) == Choice(10, ())


def test_nothing_usable_means_start_from_scratch_with_reasons(tmp_path: Path) -> None:
    """When every candidate fails, no step is chosen and each is named with its reason."""
    layout = RunLayout(tmp_path)
    save(layout, 10, ranks=(0,))
    assert choose(layout) == Choice(None, ((10, "incomplete: rank 1 has no completion record"),))
    assert choose(RunLayout(tmp_path / "empty")) == Choice(None, ())


def test_health_entries_follow_seed_000_format(tmp_path: Path) -> None:
    """Each complete checkpoint gets `is_health` 0 only if every rank's part is healthy, named by rank 0's file."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20, unhealthy=(0,))
    assert health_entries(layout, 2, PREFIX, [10, 20]) == [
        {"is_health": 0, "ckpt_name": "demo_rank_0-10.ckpt", "step": 10, "unhealthy_ranks": []},
        {"is_health": 1, "ckpt_name": "demo_rank_0-20.ckpt", "step": 20, "unhealthy_ranks": [0]},
    ]

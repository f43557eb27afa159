"""Choosing where to resume: complete, intact and healthy on every rank, with a reason for each candidate passed."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from supervisor.rundir.checkpoints import find_junk
from worker.contract import RunLayout, WorkerConfig, named_store, resume_stores
from worker.store import CheckpointStore, Choice, choose_resume, health_entries

PREFIX = "demo"


def save(
    layout: RunLayout | CheckpointStore, step: int, ranks: tuple[int, ...] = (0, 1), *, unhealthy: tuple[int, ...] = ()
) -> None:
    """What a finished save leaves in a store (a run's regular one by default): each rank's file, then its record."""
    store = layout.checkpoints if isinstance(layout, RunLayout) else layout
    for rank in ranks:
        data = f"rank {rank} step {step} ".encode() * 100
        path = store.file(rank, step, PREFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        bad = rank in unhealthy
        record = {
            "step": step,
            "file": path.name,
            "size": len(data),
            "crc32": f"{zlib.crc32(data):08x}",
            "is_health": int(bad),
            "health_reasons": ["embedding_local_norm 9 above 1"] if bad else [],
        }
        store.record(rank, step, PREFIX).write_text(json.dumps(record))


def choose(layout: RunLayout, **options: object) -> Choice:
    return choose_resume(layout.checkpoint_stores(), 2, PREFIX, **options)


def test_newest_good_checkpoint_is_chosen(tmp_path: Path) -> None:
    """With every candidate intact, the newest is chosen and nothing is passed over."""
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30):
        save(layout, step)
    assert choose(layout) == Choice(30, (), layout.checkpoints)


def test_seed_001_deleted_newest_file_of_one_rank_falls_back(tmp_path: Path) -> None:
    """Seed 001's example: delete rank 1's newest file and the previous checkpoint is used."""
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30):
        save(layout, step)
    layout.checkpoints.file(1, 30, PREFIX).unlink()
    assert choose(layout) == Choice(20, ((30, "incomplete: rank 1 has no checkpoint file"),), layout.checkpoints)


def test_truncated_file_is_passed_over(tmp_path: Path) -> None:
    """A rank file shorter than its record says is truncated."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20)
    path = layout.checkpoints.file(0, 20, PREFIX)
    path.write_bytes(path.read_bytes()[:-7])
    assert choose(layout) == Choice(10, ((20, "truncated on rank 0: 1493 bytes, 1500 written"),), layout.checkpoints)


def test_flipped_byte_is_passed_over_as_corrupted(tmp_path: Path) -> None:
    """One flipped byte, same size, fails the checksum."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20)
    path = layout.checkpoints.file(1, 20, PREFIX)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    assert choose(layout) == Choice(
        10, ((20, "corrupted on rank 1: checksum differs from the one written"),), layout.checkpoints
    )


def test_save_killed_before_its_completion_record_is_never_chosen(tmp_path: Path) -> None:
    """A file without its completion record (killed between the two writes) does not count."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20)
    layout.checkpoints.record(1, 20, PREFIX).unlink()
    assert choose(layout) == Choice(10, ((20, "incomplete: rank 1 has no completion record"),), layout.checkpoints)


def test_unhealthy_newest_falls_back_to_older_healthy(tmp_path: Path) -> None:
    """A checkpoint one rank tagged unhealthy is passed over when health is required, used when it is not."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout, 20, unhealthy=(1,))
    assert choose(layout) == Choice(
        10, ((20, "unhealthy on rank 1: embedding_local_norm 9 above 1"),), layout.checkpoints
    )
    assert choose(layout, require_healthy=False) == Choice(20, (), layout.checkpoints)


def test_rollback_point_limits_the_choice(tmp_path: Path) -> None:
    """Candidates after `at_most` are passed over as after the rollback point."""
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30):
        save(layout, step)
    assert choose(layout, at_most=25) == Choice(20, ((30, "after the rollback point (step 25)"),), layout.checkpoints)


def test_refused_steps_are_passed_over_with_the_refusal(tmp_path: Path) -> None:
    """An intact checkpoint a rank refused to load is passed over with the reason the supervisor recorded."""
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30):
        save(layout, step)
    refused = {30: "refused by rank 1: not tensors and plain data only"}
    assert choose(layout, refused=refused) == Choice(
        20, ((30, "refused by rank 1: not tensors and plain data only"),), layout.checkpoints
    )


def test_junk_in_the_checkpoint_dir_is_ignored(tmp_path: Path) -> None:
    """Stray files, temporary files and other prefixes are not candidates."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    for junk in ("notes.txt", ".demo_rank_0-20.ckpt.abc.tmp", "other_rank_0-40.ckpt", "demo_rank_0-x.ckpt"):
        (layout.checkpoints.rank_dir(0) / junk).write_text("junk")
    assert choose(layout) == Choice(10, (), layout.checkpoints)


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
    assert health_entries(layout.checkpoints, 2, PREFIX, [10, 20]) == [
        {"is_health": 0, "ckpt_name": "demo_rank_0-10.ckpt", "step": 10, "unhealthy_ranks": []},
        {"is_health": 1, "ckpt_name": "demo_rank_0-20.ckpt", "step": 20, "unhealthy_ranks": [0]},
    ]


def test_snapshot_newer_than_the_last_regular_checkpoint_is_chosen(tmp_path: Path) -> None:
    """Seed 004: snapshots are candidates like regular checkpoints; the newest usable one wins."""
    layout = RunLayout(tmp_path)
    save(layout, 20)
    save(layout.snapshot_slot(0), 24)
    save(layout.snapshot_slot(1), 26)
    assert choose(layout) == Choice(26, (), layout.snapshot_slot(1))


def test_broken_snapshot_is_passed_over_with_its_slot_named(tmp_path: Path) -> None:
    """A snapshot missing a rank's record falls back to the other slot, the reason naming the slot."""
    layout = RunLayout(tmp_path)
    save(layout, 20)
    save(layout.snapshot_slot(0), 24)
    save(layout.snapshot_slot(1), 26, ranks=(0,))
    assert choose(layout) == Choice(
        24, ((26, "snapshot slot 1: incomplete: rank 1 has no completion record"),), layout.snapshot_slot(0)
    )


def test_unhealthy_snapshot_falls_back_to_an_older_healthy_regular_checkpoint(tmp_path: Path) -> None:
    """The same health rule holds for snapshots; on equal steps the regular checkpoint comes first."""
    layout = RunLayout(tmp_path)
    save(layout, 20)
    save(layout.snapshot_slot(1), 20)
    save(layout.snapshot_slot(0), 30, unhealthy=(1,))
    assert choose(layout) == Choice(
        20, ((30, "snapshot slot 0: unhealthy on rank 1: embedding_local_norm 9 above 1"),), layout.checkpoints
    )


def test_load_checkpoint_directory_is_a_candidate_and_where_names_are_looked_up(tmp_path: Path) -> None:
    """Seed 001's load_checkpoint: another run's checkpoints compete with this run's; a name is looked up there."""
    layout, other = RunLayout(tmp_path / "run"), RunLayout(tmp_path / "other")
    save(other, 40)
    config = WorkerConfig(load_checkpoint=str(other.checkpoint_dir))
    stores = resume_stores(layout, config)
    assert choose_resume(stores, 2, PREFIX) == Choice(40, (), stores[-1])
    assert stores[-1].root == other.checkpoint_dir
    save(layout, 50)  # this run went on from there: its own newer checkpoint wins
    assert choose_resume(stores, 2, PREFIX) == Choice(50, (), layout.checkpoints)
    assert named_store(layout, config).root == other.checkpoint_dir
    assert named_store(layout, WorkerConfig()) == layout.checkpoints


def test_find_junk_tells_our_torn_temporaries_from_foreign_files(tmp_path: Path) -> None:
    """Temporaries of our own files are torn saves (deletable); everything else not ours is foreign."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save(layout.snapshot_slot(0), 12)
    rank0, slot0 = layout.checkpoints.rank_dir(0), layout.snapshot_slot(0).rank_dir(1)
    torn = [
        rank0 / ".demo_rank_0-20.ckpt.ab_d1234.tmp",
        rank0 / ".meta.json.x1y2z3w4.tmp",
        slot0 / ".demo_rank_1-14.json.q1w2e3r4.tmp",
    ]
    foreign = [
        rank0 / "notes.txt",
        rank0 / "other_rank_0-40.ckpt",
        rank0 / ".other_rank_0-40.ckpt.ab_d1234.tmp",
        rank0 / "demo_rank_1-10.ckpt",
        layout.checkpoint_dir / "rank_7",
        layout.checkpoint_dir / "old_run",
    ]
    for path in torn + foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if path.name in ("rank_7", "old_run") else path.write_text("x")
    junk = find_junk(layout, 2, PREFIX)
    assert sorted(junk.torn) == sorted(torn)
    assert sorted(junk.foreign) == sorted(foreign)


def test_find_junk_never_takes_a_directory_or_symlink_for_our_temporary(tmp_path: Path) -> None:
    """Only a regular file named like our temporary is deletable; a directory or symlink of that name is foreign."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    rank0 = layout.checkpoints.rank_dir(0)
    (rank0 / ".demo_rank_0-20.ckpt.ab_d1234.tmp").mkdir()
    (rank0 / ".demo_rank_0-30.ckpt.ab_d1234.tmp").symlink_to(tmp_path / "victim")
    junk = find_junk(layout, 2, PREFIX)
    assert junk.torn == ()
    assert sorted(p.name for p in junk.foreign) == [
        ".demo_rank_0-20.ckpt.ab_d1234.tmp",
        ".demo_rank_0-30.ckpt.ab_d1234.tmp",
    ]


def test_a_record_that_is_not_an_object_or_lacks_typed_fields_is_passed_over(tmp_path: Path) -> None:
    """Records `[]`, `null`, a string size or a numeric checksum make their checkpoint passed over, not a crash."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    records = {20: "[]", 30: "null", 40: '{"size": "12", "crc32": "0"}', 50: '{"size": 1, "crc32": 7}'}
    for step, record in records.items():
        save(layout, step)
        layout.checkpoints.record(1, step, PREFIX).write_text(record)
    choice = choose(layout)
    assert choice.step == 10
    assert [(step, why.split(":", 1)[1].strip()) for step, why in choice.passed_over] == [
        (50, "'crc32' is '7', not a checksum"),
        (40, "'size' is '12', not a byte count"),
        (30, "not a JSON object"),
        (20, "not a JSON object"),
    ]
    assert [e["is_health"] for e in health_entries(layout.checkpoints, 2, PREFIX, [10, 20, 30])] == [0, 1, 1]

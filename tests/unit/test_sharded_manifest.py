"""Sharded checkpoints as the supervisor sees them, without torch: complete only with a manifest, every file it lists
checked by size and checksum, resumable at any world size, rotated and cleaned as whole directories."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from supervisor.rundir.checkpoints import find_junk
from tests.unit.test_checkpoints import PREFIX, save
from worker.contract import RunLayout
from worker.manifest import (
    MANIFEST,
    METADATA,
    ManifestError,
    build_manifest,
    is_our_file,
    manifest_problem,
    read_manifest,
    remove_sharded,
)
from worker.store import (
    CheckpointStore,
    Choice,
    choose_explicit,
    choose_resume,
    completed_at,
    health_entries,
    parse_sharded_name,
    world_size_mismatch,
)


def save_sharded(
    store: CheckpointStore, step: int, world_size: int = 2, *, manifest: bool = True, unhealthy: tuple[int, ...] = ()
) -> Path:
    """What a finished sharded save leaves: every rank's shard, state and record, DCP's .metadata, the manifest."""
    directory = store.sharded_dir(step, PREFIX)
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for rank in range(world_size):
        names = [f"__{rank}_0.distcp", f"rank_{rank}.pt"] + ([METADATA] if rank == 0 else [])
        files = {}
        for name in names:
            data = f"{name} of step {step} ".encode() * 50
            (directory / name).write_bytes(data)
            files[name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        bad = rank in unhealthy
        record = {
            "rank": rank,
            "step": step,
            "files": files,
            "is_health": int(bad),
            "health_reasons": ["non-finite parameter"] if bad else [],
        }
        (directory / f"rank_{rank}.json").write_text(json.dumps(record))
        records.append(record)
    if manifest:
        built = build_manifest(step, records, torch_version="2.13.0", common={"samples": step * 8})
        (directory / MANIFEST).write_text(json.dumps(built))
    return directory


def test_a_sharded_checkpoint_counts_once_its_manifest_exists_at_any_world_size(tmp_path: Path) -> None:
    """complete_steps lists a manifest's step whatever world size asks; a directory without one is only 'any'."""
    store = RunLayout(tmp_path).checkpoints
    save_sharded(store, 10)
    save_sharded(store, 20, manifest=False)
    (store.root / "other-30.dcp").mkdir()
    assert store.complete_steps(2, PREFIX) == store.complete_steps(4, PREFIX) == [10]
    assert store.sharded_steps(PREFIX, kind="any") == {10, 20}
    assert store.is_sharded(20, PREFIX) and not store.is_sharded(30, PREFIX)
    assert parse_sharded_name("demo-20.dcp") == ("demo", 20) and parse_sharded_name("demo-x.dcp") is None


def test_resume_picks_the_newest_complete_sharded_checkpoint_and_says_why_others_were_passed(tmp_path: Path) -> None:
    """A save in flight or torn (no manifest), a truncated shard and a corrupted .metadata are passed over with
    their reasons; the run of another world size resumes the intact one."""
    layout = RunLayout(tmp_path)
    store = layout.checkpoints
    save_sharded(store, 10)
    truncated = save_sharded(store, 20) / "__1_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:-5])
    metadata = save_sharded(store, 30) / METADATA
    metadata.write_bytes(b"X" + metadata.read_bytes()[1:])
    save_sharded(store, 40, manifest=False)

    choice = choose_resume(layout.checkpoint_stores(), 4, PREFIX)

    assert choice.step == 10 and choice.store == store
    assert [step for step, _ in choice.passed_over] == [40, 30, 20]
    reasons = dict(choice.passed_over)
    assert reasons[40].startswith("incomplete: no manifest")
    assert reasons[30] == "corrupted: checksum differs from the one written (rank 0's .metadata)"
    assert reasons[20].startswith("truncated: ") and reasons[20].endswith("(rank 1's __1_0.distcp)")
    assert world_size_mismatch(layout.checkpoint_stores(), 4, PREFIX) is None


def test_unhealthy_sharded_checkpoints_are_skipped_only_when_health_is_required(tmp_path: Path) -> None:
    store = RunLayout(tmp_path).checkpoints
    save_sharded(store, 10)
    save_sharded(store, 20, unhealthy=(1,))
    healthy = choose_resume([store], 2, PREFIX)
    assert healthy == Choice(10, ((20, "unhealthy on rank 1: non-finite parameter"),), store)
    assert choose_resume([store], 2, PREFIX, require_healthy=False).step == 20
    assert choose_explicit(store, 2, PREFIX, 20).step == 20  # named: used, healthy or not
    entries = health_entries(store, 2, PREFIX, [10, 20])
    assert [(e["ckpt_name"], e["is_health"], e["unhealthy_ranks"]) for e in entries] == [
        ("demo-10.dcp", 0, []),
        ("demo-20.dcp", 1, [1]),
    ]
    assert completed_at(store, 2, PREFIX, 20) == os.stat(store.sharded_dir(20, PREFIX) / MANIFEST).st_mtime


def test_a_manifest_that_lies_about_its_files_or_points_outside_is_refused(tmp_path: Path) -> None:
    """Names not ours (a path, another directory's file), a missing rank state, another step: unreadable manifest."""
    directory = save_sharded(RunLayout(tmp_path).checkpoints, 10)
    manifest = json.loads((directory / MANIFEST).read_text())
    for name in ("../../etc/passwd", "rank_0.pt/../x", ".bashrc"):
        forged = {**manifest, "files": {**manifest["files"], name: {"size": 1, "crc32": "00000000"}}}
        (directory / MANIFEST).write_text(json.dumps(forged))
        assert "not a file name of ours" in manifest_problem(directory, 10, require_healthy=True)
    (directory / MANIFEST).write_text(json.dumps({**manifest, "step": 11}))
    assert "the manifest is of step 11" in manifest_problem(directory, 10, require_healthy=True)
    files = dict(manifest["files"])
    del files["rank_1.pt"]
    (directory / MANIFEST).write_text(json.dumps({**manifest, "files": files}))
    with pytest.raises(ManifestError, match="lacks DCP's .metadata or a rank's state"):
        read_manifest(directory)


def test_a_symlinked_shard_is_refused_not_followed(tmp_path: Path) -> None:
    directory = save_sharded(RunLayout(tmp_path).checkpoints, 10)
    shard = directory / "__0_0.distcp"
    (tmp_path / "elsewhere").write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere")
    assert manifest_problem(directory, 10, require_healthy=True).startswith("unreadable: a symbolic link")


def test_torn_sharded_saves_are_junk_to_remove_and_strangers_inside_are_reported(tmp_path: Path) -> None:
    """Before a launch: a directory without manifest holding only our files is torn (removed whole); a foreign file
    inside any of ours is reported, never deleted; a complete one is left alone."""
    layout = RunLayout(tmp_path)
    complete = save_sharded(layout.checkpoints, 10)
    torn = save_sharded(layout.checkpoints, 20, manifest=False)
    (torn / ".__1_0.distcp.ab12cd34.tmp").write_bytes(b"half")
    strange = save_sharded(layout.checkpoints, 30, manifest=False)
    (strange / "notes.txt").write_text("mine")

    junk = find_junk(layout, 2, PREFIX)

    assert junk.torn == (torn,)
    assert junk.foreign == (strange / "notes.txt",)
    assert remove_sharded(torn) == [] and not torn.exists()
    assert remove_sharded(strange) == ["notes.txt"] and (strange / "notes.txt").exists()
    assert not (strange / "__0_0.distcp").exists()
    assert complete.exists() and layout.checkpoints.complete_steps(2, PREFIX) == [10]


def test_per_rank_and_sharded_checkpoints_side_by_side_are_both_candidates(tmp_path: Path) -> None:
    """A run that switched format: the newest usable of either kind wins."""
    layout = RunLayout(tmp_path)
    save(layout, 10)
    save_sharded(layout.checkpoints, 20)
    assert choose_resume([layout.checkpoints], 2, PREFIX).step == 20
    remove_sharded(layout.checkpoints.sharded_dir(20, PREFIX))
    assert choose_resume([layout.checkpoints], 2, PREFIX).step == 10


def test_our_file_names(tmp_path: Path) -> None:
    for name in (
        "__0_0.distcp",
        "__12_0.distcp",
        ".metadata",
        ".metadata.tmp",
        "rank_3.pt",
        "rank_3.json",
        "MANIFEST.json",
        ".rank_0.pt.a1b2c3d4.tmp",
    ):
        assert is_our_file(name), name
    for name in ("x.distcp", "rank_a.pt", "../rank_0.pt", "notes.txt", ".hidden", "MANIFEST.json.bak"):
        assert not is_our_file(name), name

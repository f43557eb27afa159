"""Checkpoints of another world size: never resumed, and a first launch with nothing else to resume is refused."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from supervisor.core import LaunchFailed, Phase, decide, initial_state
from tests.unit.test_checkpoints import PREFIX
from tests.unit.test_core import NOW, POLICY, shape
from worker.contract import EXIT_CONFIG, RunLayout, WorkerConfig, resume_stores
from worker.store import CheckpointStore, Choice, WorldSizeMismatch, choose_resume, world_size_mismatch, world_sizes

FOUR = (0, 1, 2, 3)


def save(store: CheckpointStore, step: int, ranks: tuple[int, ...], world_size: object = None) -> None:
    """What a finished save leaves on `ranks`; the records name `world_size` unless None (records from before)."""
    for rank in ranks:
        data = f"rank {rank} step {step} ".encode() * 10
        path = store.file(rank, step, PREFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written = {} if world_size is None else {"world_size": world_size}
        record = {
            "step": step,
            "file": path.name,
            "size": len(data),
            "crc32": f"{zlib.crc32(data):08x}",
            **written,
            "is_health": 0,
            "health_reasons": [],
        }
        store.record(rank, step, PREFIX).write_text(json.dumps(record))


def stores(tmp_path: Path, config: WorkerConfig | None = None) -> list[CheckpointStore]:
    """Where a run in `tmp_path/run` resumes from: its checkpoints, its snapshots, `load_checkpoint`'s directory."""
    return resume_stores(RunLayout(tmp_path / "run"), config or WorkerConfig())


def test_four_rank_checkpoints_refuse_a_two_rank_resume_naming_both_sizes_and_the_way_out(tmp_path: Path) -> None:
    """Records saying 4 ranks, a job of 2: the newest such checkpoint, both sizes, a new run dir or a fresh start."""
    own = stores(tmp_path)
    for step in (10, 20):
        save(own[0], step, FOUR, world_size=4)

    mismatch = world_size_mismatch(own, 2, PREFIX)
    assert mismatch == WorldSizeMismatch(own[0], 20, 4, 2)
    assert mismatch.message() == (
        f"the checkpoints in {own[0].root} were written by 4 ranks (newest: step 20), but this job runs 2 "
        "(nproc_per_node: 2); use a new --run-dir (this one stays as it is), or set worker.resume_training: false "
        "to start from scratch here"
    )


@pytest.mark.parametrize(("written", "ranks", "world"), [(FOUR, FOUR, 2), ((0, 1), (0, 1), 4)])
def test_records_from_before_world_sizes_were_recorded_are_counted_by_rank_dirs(
    tmp_path: Path, written: tuple[int, ...], ranks: tuple[int, ...], world: int
) -> None:
    """Without `world_size` in the records, the rank dirs holding the step tell: more ranks or fewer, refused."""
    own = stores(tmp_path)
    save(own[0], 10, ranks)
    assert world_size_mismatch(own, world, PREFIX) == WorldSizeMismatch(own[0], 10, len(written), world)


def test_a_checkpoint_of_this_world_size_is_resumed_and_newer_others_are_passed_over_by_name(tmp_path: Path) -> None:
    """A 2-rank checkpoint (a deliberate fresh start) beside newer 4-rank ones: no refusal; resume picks it,
    passing each 4-rank one over with its reason."""
    own = stores(tmp_path)
    save(own[0], 500, FOUR, world_size=4)
    save(own[0], 20, (0, 1), world_size=2)

    assert world_size_mismatch(own, 2, PREFIX) is None
    assert choose_resume(own, 2, PREFIX) == Choice(
        20, ((500, "written by 4 ranks (rank 0's record says); this run has 2"),), own[0]
    )


def test_a_four_rank_checkpoint_from_before_is_passed_over_by_a_two_rank_relaunch(tmp_path: Path) -> None:
    """An old record without `world_size`: rank 2 holding the same step gives it away."""
    own = stores(tmp_path)
    save(own[0], 30, FOUR)
    assert choose_resume(own, 2, PREFIX) == Choice(
        None, ((30, "written by more than 2 ranks (rank 2 has it too); this run has 2"),)
    )


def test_a_torn_newest_save_is_not_taken_for_another_world_size(tmp_path: Path) -> None:
    """Old records, step 20 killed before rank 3 finished: step 10 on all 4 ranks means no refusal."""
    own = stores(tmp_path)
    save(own[0], 10, FOUR)
    save(own[0], 20, (0, 1, 2))
    assert world_size_mismatch(own, 4, PREFIX) is None


def test_a_load_checkpoint_directory_of_another_world_size_is_named(tmp_path: Path) -> None:
    """`worker.load_checkpoint` pointing at a 4-rank run, nothing of our own: the refusal names that directory."""
    other = CheckpointStore(tmp_path / "other" / "checkpoint")
    save(other, 40, FOUR, world_size=4)
    both = stores(tmp_path, WorkerConfig(load_checkpoint=str(other.root)))
    mismatch = world_size_mismatch(both, 2, PREFIX)
    assert mismatch is not None and (mismatch.store.root, mismatch.step) == (other.root, 40)


def test_no_checkpoints_at_all_is_no_mismatch(tmp_path: Path) -> None:
    """A new run dir: nothing to refuse."""
    assert world_size_mismatch(stores(tmp_path), 2, PREFIX) is None


@pytest.mark.parametrize("declared", ["4", True, 0, -4, 10**9, 4.0, None])
def test_a_record_declaring_no_usable_world_size_is_counted_by_rank_dirs(tmp_path: Path, declared: object) -> None:
    """A record's `world_size` counts only as a whole number of ranks; anything else falls back to the rank dirs."""
    own = stores(tmp_path)
    save(own[0], 10, (0, 1, 2), world_size=declared)
    assert world_sizes(own[0], [10], PREFIX) == {10: 3}


def test_an_unreadable_rank_0_record_gives_no_world_size(tmp_path: Path) -> None:
    """Garbage in rank 0's record: unknown (None), neither a match nor a mismatch."""
    own = stores(tmp_path)
    save(own[0], 10, (0, 1), world_size=2)
    own[0].record(0, 10, PREFIX).write_text("{not json")
    assert world_sizes(own[0], [10], PREFIX) == {10: None}
    assert world_size_mismatch(own, 4, PREFIX) is None


def test_a_launch_refused_as_not_retryable_fails_the_run_with_78() -> None:
    """The core ends a run whose launch can never succeed FAILED with EXIT_CONFIG and the refusal as its reason."""
    state, actions = decide(initial_state(POLICY), LaunchFailed(0, "written by 4 ranks", retryable=False), NOW)
    assert (state.phase, state.exit_code) == (Phase.FAILED, EXIT_CONFIG)
    assert state.reason == "not launched: written by 4 ranks"
    assert shape(actions) == ["launch_failed"]

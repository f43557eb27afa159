"""worker.store: every kind of checkpoint answers the same questions, in every tier's stores (the run's checkpoint
directory, a memory slot), and the choice, health, world size and completion time follow from those answers alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from worker.contract import RunLayout
from worker.store import (
    DIRECTORY,
    PER_RANK,
    CheckpointStore,
    choose_resume,
    completed_at,
    health_entries,
    kind_of,
    prefixes,
    rank_0_steps,
    world_sizes,
)

from .test_persist import PREFIX, WORLD, flip_byte, sharded, snapshot


def per_rank(store: CheckpointStore, step: int) -> Path:
    snapshot(store, step)
    return store.file(1, step, PREFIX)


def directory(store: CheckpointStore, step: int) -> Path:
    return sharded(store, step) / "__1_0.distcp"


TIERS: dict[str, Callable[[Path], CheckpointStore]] = {
    "disk": lambda root: RunLayout(root).checkpoints,
    "memory": lambda root: RunLayout(root, memory=root / "shm").memory_slot(0),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(("kind", "write"), [(PER_RANK, per_rank), (DIRECTORY, directory)])
def test_each_kind_answers_the_same_questions_in_every_tier(tmp_path, tier, kind, write) -> None:
    store = TIERS[tier](tmp_path)
    damaged = write(store, 20)
    write(store, 10)
    assert kind_of(store, 20, PREFIX) is kind and kind.steps(store, WORLD, PREFIX) == {10, 20}
    assert store.complete_steps(WORLD, PREFIX) == [10, 20] and rank_0_steps(store, PREFIX) == {10, 20}
    assert kind.problem(store, 20, WORLD, PREFIX, require_healthy=True) is None
    assert health_entries(store, WORLD, PREFIX, [20])[0]["is_health"] == 0
    assert completed_at(store, WORLD, PREFIX, 20) is not None and prefixes(store) == {PREFIX}
    assert world_sizes(store, [20], PREFIX) == ({20: WORLD} if kind is PER_RANK else {})  # a directory: any size
    flip_byte(damaged)
    choice = choose_resume([store], WORLD, PREFIX)
    assert choice.step == 10 and choice.store == store
    ((step, why),) = choice.passed_over
    assert step == 20 and ("corrupted" in why or "checksum" in why), why

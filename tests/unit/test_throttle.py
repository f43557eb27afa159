"""The persister's pace (`worker.persist_mb_s`): a copy's chunks average at most the rate set, checked with a fake
clock; no limit never waits, and a stop lifts the limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.rundir.persist import Persister, persist_snapshot
from supervisor.rundir.throttle import MB, Throttle
from tests.unit.test_persist import PREFIX, WORLD, Log, sharded, snapshot
from worker.contract import RunLayout
from worker.store import CheckpointStore

NOW = 1000.0


class Clock:
    """A fake monotonic clock; `wait` advances it and records each wait."""

    def __init__(self) -> None:
        self.now = NOW
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def test_without_a_limit_a_copy_never_waits() -> None:
    clock = Clock()
    throttle = Throttle(0, clock=clock, wait=clock.wait)
    assert [throttle.sent(10 * MB) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert clock.waits == []


def test_a_copy_ahead_of_its_rate_waits_until_its_average_is_the_rate() -> None:
    """2 MB/s: 1 MB sent at once waits 0.5 s; 1 MB more after 2 s of reading is behind its rate and goes on."""
    clock = Clock()
    throttle = Throttle(2 * MB, clock=clock, wait=clock.wait)
    assert throttle.sent(MB) == 0.5
    clock.now += 2.0  # a slow read: the copy is now behind its pace
    assert throttle.sent(MB) == 0.0
    assert throttle.sent(4 * MB) == 0.5  # 6 MB at 2 MB/s: 3 s since it began
    assert clock.waits == [0.5, 0.5] and clock.now == NOW + 3.0


def test_a_sharded_copy_is_paced_chunk_by_chunk_and_lands_whole(tmp_path: Path) -> None:
    """Every file of a sharded snapshot passes through the throttle: the waits add up to its bytes over the rate,
    and the copy on disk is complete, byte for byte."""
    source, dest = CheckpointStore(tmp_path / "memory"), CheckpointStore(tmp_path / "checkpoint")
    directory = sharded(source, 8)
    clock = Clock()
    written = persist_snapshot(
        source, dest, 8, range(WORLD), PREFIX, throttle=Throttle(1000, clock=clock, wait=clock.wait)
    )

    assert len(clock.waits) == 5  # two shards, two rank states, .metadata
    assert sum(clock.waits) == pytest.approx((written - len((directory / "MANIFEST.json").read_bytes())) / 1000)
    assert dest.sharded_steps(PREFIX) == {8}
    for path in directory.iterdir():
        assert (dest.sharded_dir(8, PREFIX) / path.name).read_bytes() == path.read_bytes()


def test_a_stopped_persister_copies_at_full_speed(tmp_path: Path) -> None:
    """At the run's end (the persister stopped: no rank trains) a limit of 1 byte per second no longer applies: the
    newest snapshot is copied at once (this test would otherwise outlive its timeout by hours)."""
    layout = RunLayout(tmp_path / "run", memory=tmp_path / "memory")
    snapshot(layout.memory_slot(0), 6)
    persister = Persister(layout, WORLD, PREFIX, Log(), persist_mb_s=1 / MB)
    persister.stop()
    done = persister.persist_newest()

    assert done is not None and done.step == 6
    assert layout.checkpoints.complete_steps(WORLD, PREFIX) == [6]

"""The memory tier on the supervisor's side: pinned snapshots persisted to disk, the resume choice over both tiers,
the end-of-run persist, `status`'s memory block, metrics, the plot and the ranks' environment, with real files in a
real memory directory under /dev/shm."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import parse_config
from supervisor.core import Phase
from supervisor.launch.ranks import Attempt, rank_envs
from supervisor.observe import plot
from supervisor.observe.metrics import families
from supervisor.observe.status import render
from supervisor.rundir.checkpoints import find_junk
from supervisor.rundir.journal import open_journal
from supervisor.rundir.persist import Persister, bytes_held, memory_status, newest_memory_snapshot
from supervisor.runner import Supervisor, lock_run_dir
from worker.contract import ENV_MEMORY_DIR, RunLayout
from worker.files import atomic_write_json
from worker.manifest import MANIFEST, build_manifest, rank_record_name, rank_state_name
from worker.memory import check_memory_dir, create_memory_dir, memory_dir_for, remove_memory_dir
from worker.store import CheckpointStore, choose_resume, passed_over_event

PREFIX = "demo"
WORLD = 2


class Log:
    """What the persister journals: (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.records.append((level, event, fields))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for _, event, fields in self.records if event == name]


@pytest.fixture
def layout(tmp_path: Path) -> Iterator[RunLayout]:
    """A run dir with its memory directory in /dev/shm, removed afterwards whatever the test left there."""
    memory = create_memory_dir(memory_dir_for(tmp_path / "run"))
    try:
        yield RunLayout(tmp_path / "run", memory=memory)
    finally:
        remove_memory_dir(memory)
    assert not memory.exists()


def snapshot(store: CheckpointStore, step: int, ranks: tuple[int, ...] = (0, 1), *, world: int = WORLD) -> None:
    """What a rank's finished save leaves in a store: its file, then its record (size, CRC-32, health)."""
    for rank in ranks:
        data = f"rank {rank} step {step} ".encode() * 300
        path = store.file(rank, step, PREFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        record = {
            "step": step,
            "file": path.name,
            "size": len(data),
            "crc32": f"{zlib.crc32(data):08x}",
            "world_size": world,
            "is_health": 0,
            "health_reasons": [],
        }
        store.record(rank, step, PREFIX).write_text(json.dumps(record))


def pin(layout: RunLayout, slot: int, step: int, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Each rank's pin as the worker makes it: hard links to its slot's file, then its record."""
    source, target = layout.memory_slot(slot), layout.memory_pin(step)
    for rank in ranks:
        target.rank_dir(rank).mkdir(parents=True, exist_ok=True)
        os.link(source.file(rank, step, PREFIX), target.file(rank, step, PREFIX))
        os.link(source.record(rank, step, PREFIX), target.record(rank, step, PREFIX))


def sharded(store: CheckpointStore, step: int, *, manifest: bool = True) -> Path:
    """A sharded checkpoint directory of two ranks: shards, states, records, DCP's .metadata and the manifest."""
    directory = store.root / f"{PREFIX}-{step}.dcp"
    directory.mkdir(parents=True)
    records = []
    for rank in range(WORLD):
        files = {}
        for name in (f"__{rank}_0.distcp", rank_state_name(rank), *([".metadata"] if rank == 0 else [])):
            data = f"{name} of step {step} ".encode() * 200
            (directory / name).write_bytes(data)
            files[name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        record = {"rank": rank, "files": files, "is_health": 0, "health_reasons": []}
        (directory / rank_record_name(rank)).write_text(json.dumps(record))
        records.append(record)
    if manifest:
        built = build_manifest(step, records, torch_version="2.13.0", common={})
        atomic_write_json(directory / MANIFEST, built, root=store.root)
    return directory


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_complete_pin_is_copied_to_disk_checked_and_then_removed(layout: RunLayout) -> None:
    """Every rank's file, its record and meta.json land in the checkpoint store, byte for byte, the pin is removed,
    `snapshot_persisted` says step and bytes, and the resume choice finds the disk checkpoint."""
    snapshot(layout.memory_slot(0), 8)
    pin(layout, 0, 8)
    log = Log()
    done = Persister(layout, WORLD, PREFIX, log).persist_pins()

    disk, slot = layout.checkpoints, layout.memory_slot(0)
    for rank in range(WORLD):
        assert disk.file(rank, 8, PREFIX).read_bytes() == slot.file(rank, 8, PREFIX).read_bytes()
        assert json.loads(disk.record(rank, 8, PREFIX).read_text()) == json.loads(
            slot.record(rank, 8, PREFIX).read_text()
        )
        meta = json.loads(disk.meta(rank).read_text())
        assert meta == {"last_epoch": 0, "last_step": 8, "last_ckpt_file": f"{PREFIX}_rank_{rank}-8.ckpt"}
    size = sum(slot.file(rank, 8, PREFIX).stat().st_size for rank in range(WORLD))
    assert [(d.step, d.bytes) for d in done] == [(8, size)]
    assert [(e["step"], e["bytes"]) for e in log.events("snapshot_persisted")] == [(8, size)]
    assert layout.memory_pins() == []
    chosen = choose_resume(layout.checkpoint_stores(), WORLD, PREFIX)
    assert (chosen.step, chosen.store) == (8, layout.checkpoints)


def test_a_pin_with_a_flipped_byte_is_not_persisted(layout: RunLayout) -> None:
    """A byte flipped in rank 1's pinned file: `persist_failed` with the reason, nothing of the step on disk (rank
    0's copy undone), the pin removed."""
    snapshot(layout.memory_slot(0), 8)
    pin(layout, 0, 8)
    flip_byte(layout.memory_pin(8).file(1, 8, PREFIX))
    log = Log()
    assert Persister(layout, WORLD, PREFIX, log).persist_pins() == []

    assert [(e["step"], e["reason"]) for e in log.events("persist_failed")] == [
        (8, f"rank 1's {PREFIX}_rank_1-8.ckpt: checksum differs from the one written")
    ]
    assert layout.checkpoints.steps(0, PREFIX, kind="any") == set()
    assert layout.checkpoints.steps(1, PREFIX, kind="any") == set()
    assert not [p for p in layout.checkpoint_dir.rglob("*") if p.is_file() and p.name != "meta.json"]
    assert layout.memory_pins() == []


def test_a_pin_missing_a_rank_waits_and_is_not_persisted(layout: RunLayout) -> None:
    """Only rank 0 has pinned step 8 (rank 1 is still copying, or was killed first): nothing is copied, the pin
    stays."""
    snapshot(layout.memory_slot(0), 8)
    pin(layout, 0, 8, ranks=(0,))
    log = Log()
    assert Persister(layout, WORLD, PREFIX, log).persist_pins() == []
    assert log.records == []
    assert layout.memory_pins() == [8]
    assert layout.checkpoints.complete_steps(WORLD, PREFIX) == []


def test_an_older_pin_is_superseded_by_the_newest_complete_one(layout: RunLayout) -> None:
    """Pins of steps 4 and 8, both complete: 8 is persisted, 4 removed unpersisted and journaled as superseded; an
    incomplete newer pin (12) is left for its ranks to finish."""
    snapshot(layout.memory_slot(0), 4)
    snapshot(layout.memory_slot(1), 8)
    snapshot(layout.memory_slot(0), 12, ranks=(0,))
    pin(layout, 0, 4)
    pin(layout, 1, 8)
    pin(layout, 0, 12, ranks=(0,))
    log = Log()
    Persister(layout, WORLD, PREFIX, log).persist_pins()
    assert layout.checkpoints.complete_steps(WORLD, PREFIX) == [8]
    assert log.events("snapshot_pin_superseded") == [{"step": 4, "by": 8}]
    assert layout.memory_pins() == [12]


def test_a_sharded_pin_is_copied_with_its_manifest_last(layout: RunLayout) -> None:
    """A pinned DCP directory: every listed file copied and checked, each rank's record too, the manifest written
    after them all; the resume choice checks it like any sharded checkpoint."""
    source = sharded(layout.memory_pin(6), 6)
    pinned = {path.name: path.read_bytes() for path in source.iterdir()}
    Persister(layout, WORLD, PREFIX, Log()).persist_pins()
    target = layout.checkpoint_dir / source.name
    listed = json.loads(pinned[MANIFEST])["files"]
    assert {path.name: path.read_bytes() for path in target.iterdir()} == {
        name: data for name, data in pinned.items() if name in listed or name == MANIFEST or name.endswith(".json")
    }
    manifest_written = (target / MANIFEST).stat().st_mtime_ns
    assert all((target / name).stat().st_mtime_ns <= manifest_written for name in listed)
    chosen = choose_resume(layout.checkpoint_stores(), WORLD, PREFIX)
    assert (chosen.step, chosen.store) == (6, layout.checkpoints)


def test_a_damaged_sharded_pin_leaves_no_manifest_on_disk(layout: RunLayout) -> None:
    """A shard of the pinned DCP directory corrupted: `persist_failed`, and no directory of the step on disk."""
    source = sharded(layout.memory_pin(6), 6)
    flip_byte(source / "__1_0.distcp")
    log = Log()
    Persister(layout, WORLD, PREFIX, log).persist_pins()
    assert [e["step"] for e in log.events("persist_failed")] == [6]
    assert not (layout.checkpoint_dir / source.name).exists()


def test_a_torn_sharded_copy_a_killed_persister_left_is_cleared_before_the_step_is_copied_again(
    layout: RunLayout,
) -> None:
    """A supervisor killed while copying step 6 left a shard renamed into place and a temporary beside it, no
    manifest: the next copy of the pin clears them first, so the checkpoint holds its files and no leftover."""
    source = sharded(layout.memory_pin(6), 6)
    pinned = {path.name: path.read_bytes() for path in source.iterdir()}
    target = layout.checkpoint_dir / source.name
    target.mkdir(parents=True)
    (target / "__0_0.distcp").write_bytes(b"half of an older copy")
    (target / ".__1_0.distcp.0a1b2c3d.tmp").write_bytes(b"torn")
    Persister(layout, WORLD, PREFIX, Log()).persist_pins()
    assert {path.name: path.read_bytes() for path in target.iterdir()} == pinned
    assert choose_resume(layout.checkpoint_stores(), WORLD, PREFIX).step == 6


def test_resume_prefers_a_newer_memory_snapshot_over_an_older_disk_checkpoint(layout: RunLayout) -> None:
    """Disk holds step 4, memory step 6: step 6 from memory (label "memory", resume_source in ranks_launched)."""
    snapshot(layout.checkpoints, 4)
    snapshot(layout.memory_slot(1), 6)
    chosen = choose_resume(layout.checkpoint_stores(), WORLD, PREFIX)
    assert (chosen.step, chosen.store, chosen.passed_over) == (6, layout.memory_slot(1), ())
    assert chosen.store is not None and chosen.store.label == "memory"


def test_a_damaged_memory_snapshot_is_passed_over_as_a_snapshot_then_disk_is_used(layout: RunLayout) -> None:
    """A byte flipped in memory's step 6: passed over with its reason (journaled as `snapshot_passed_over`), and
    the disk checkpoint of step 4 chosen; a disk candidate passed over stays `checkpoint_passed_over`."""
    snapshot(layout.checkpoints, 4)
    snapshot(layout.checkpoints, 5, ranks=(0,))
    snapshot(layout.memory_slot(1), 6)
    flip_byte(layout.memory_slot(1).file(0, 6, PREFIX))
    chosen = choose_resume(layout.checkpoint_stores(), WORLD, PREFIX)
    assert (chosen.step, chosen.store) == (4, layout.checkpoints)
    assert chosen.passed_over == (
        (6, "memory: corrupted on rank 0: checksum differs from the one written"),
        (5, "incomplete: rank 1 has no completion record"),
    )
    assert [passed_over_event(reason) for _, reason in chosen.passed_over] == [
        "snapshot_passed_over",
        "checkpoint_passed_over",
    ]


def test_at_the_end_the_newest_memory_snapshot_is_persisted_then_the_directory_removed(layout: RunLayout) -> None:
    """A stopped run with step 6 in memory and step 4 on disk: step 6 is persisted from its slot, the memory
    directory removed; with disk as new as memory nothing is copied."""
    snapshot(layout.checkpoints, 4)
    snapshot(layout.memory_slot(0), 6)
    log = Log()
    persister = Persister(layout, WORLD, PREFIX, log)
    done = persister.persist_newest()
    assert done is not None and done.step == 6
    assert layout.checkpoints.complete_steps(WORLD, PREFIX) == [4, 6]
    assert persister.persist_newest() is None  # disk now as new as memory
    assert layout.memory is not None
    remove_memory_dir(layout.memory)
    assert not layout.memory.exists()
    assert choose_resume(RunLayout(layout.root).checkpoint_stores(), WORLD, PREFIX).step == 6


def test_a_copy_in_flight_is_not_junk(layout: RunLayout) -> None:
    """While step 8 is being copied its temporaries (and meta.json's) are the persister's; others' are junk."""
    persister = Persister(layout, WORLD, PREFIX, Log())
    rank_dir = layout.checkpoints.rank_dir(0)
    mine = rank_dir / f".{PREFIX}_rank_0-8.ckpt.abcd1234.tmp"
    older = rank_dir / f".{PREFIX}_rank_0-4.ckpt.abcd1234.tmp"
    meta = rank_dir / ".meta.json.abcd1234.tmp"
    dcp = layout.checkpoint_dir / f"{PREFIX}-8.dcp"
    assert not persister.in_flight(mine)  # nothing is being copied
    persister._busy.add(8)
    assert [persister.in_flight(p) for p in (mine, older, meta, dcp)] == [True, False, True, True]


def test_junk_removal_in_the_memory_directory_touches_only_our_torn_temporaries(layout: RunLayout) -> None:
    """A killed snapshot's temporary in a memory slot is torn (ours, removed before a launch); a stranger's file
    there is reported, never deleted; the memory directory's own layout (slots, pins) is no junk."""
    snapshot(layout.memory_slot(0), 6)
    pin(layout, 0, 6)
    torn = layout.memory_slot(1).rank_dir(0) / f".{PREFIX}_rank_0-8.ckpt.abcd1234.tmp"
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b"half")
    stranger = layout.memory_slot(0).rank_dir(1) / "notes.txt"
    stranger.write_text("mine")
    junk = find_junk(layout, WORLD, PREFIX)
    assert junk.torn == (torn,)
    assert junk.foreign == (stranger,)


def test_status_shows_the_memory_block_and_its_line(layout: RunLayout) -> None:
    """The memory block: the newest complete snapshot (slots and pins), its age, bytes held (a pin's hard links
    counted once), pins waiting; `status` says it in one line, and names memory as where the run resumed from."""
    snapshot(layout.memory_slot(0), 6)
    snapshot(layout.memory_slot(1), 8)
    pin(layout, 1, 8)
    held = sum(p.stat().st_size for slot in (0, 1) for p in layout.memory_slot(slot).root.rglob("*") if p.is_file())
    assert layout.memory is not None
    assert bytes_held(layout.memory) == held
    found = newest_memory_snapshot(layout, WORLD, PREFIX)
    assert found is not None
    written = max(layout.memory_slot(1).record(r, 8, PREFIX).stat().st_mtime for r in range(WORLD))
    block = memory_status(layout, found, WORLD, PREFIX, written + 0.4)
    assert block == {
        "dir": str(layout.memory),
        "snapshot_step": 8,
        "snapshot_age_s": 0.4,
        "bytes": held,
        "pins_waiting": 1,
    }
    status = {
        "run_dir": str(layout.root),
        "state": "running",
        "attempt": 0,
        "restarts": 0,
        "ranks": [],
        "memory": block,
        "last_checkpoint": {"step": 4},
        "resumed_from": {"step": 8, "source": "memory"},
    }
    line = f"  memory: snapshot step 8 (0.4 s old), {held / 1e6:.1f} MB in {layout.memory}, 1 waiting to be persisted"
    assert line in render(status).splitlines()
    assert "  last checkpoint: step 4; resumed from step 8 (memory)" in render(status).splitlines()
    assert memory_status(RunLayout(layout.root), None, WORLD, PREFIX, 0.0) is None


def test_status_ignores_a_tampered_memory_block(layout: RunLayout) -> None:
    """A memory block that is not what the supervisor writes (a string for bytes) gives no memory line."""
    status = {"run_dir": "r", "state": "running", "attempt": 0, "restarts": 0, "ranks": []}
    for memory in ("x", {"dir": "/dev/shm/x", "bytes": "lots"}, {"dir": 3, "bytes": 1}):
        assert "memory:" not in render({**status, "memory": memory})


def test_the_memory_directory_is_private(layout: RunLayout) -> None:
    """The supervisor's memory directory is mode 0700 and passes the workers' check."""
    assert layout.memory is not None
    assert os.stat(layout.memory).st_mode & 0o777 == 0o700
    assert check_memory_dir(layout.memory) == layout.memory


def test_the_plot_marks_a_resume_from_memory() -> None:
    """A relaunch from memory reads `from step 24 (memory)` on the plot; one from the regular checkpoints as before."""
    assert plot._label("launch", {"resume_step": 24, "resume_source": "memory"}, None, None) == "from step 24 (memory)"
    assert plot._label("launch", {"resume_step": 20, "resume_source": None}, None, None) == "from step 20"


def test_metrics_give_the_memory_tier_bytes_and_step() -> None:
    """The status's memory block becomes two gauges: bytes held in shared memory, the newest snapshot's step."""
    memory = {"dir": "/dev/shm/x", "snapshot_step": 8, "snapshot_age_s": 0.2, "bytes": 3 << 30, "pins_waiting": 0}
    found = {family.name: family.samples[0].value for family in families({"memory": memory}, {}, now=0.0)}
    assert (found["trainwarden_memory_tier_bytes"], found["trainwarden_memory_snapshot_step"]) == (3 << 30, 8)


def test_every_rank_is_given_the_memory_directory_and_none_without_it(tmp_path: Path) -> None:
    """The rank environment names the memory directory the supervisor created; without a memory tier the variable is
    empty, so nothing inherited from the supervisor's environment passes for it."""
    config = parse_config({"command": ["true"], "nproc_per_node": 2, "worker": {"snapshot_steps": 4}})
    attempt = Attempt(0, None, None, None)
    memory = tmp_path / "memory"
    with_tier = rank_envs(config, RunLayout(tmp_path, memory=memory), attempt, port=1)
    without = rank_envs(config, RunLayout(tmp_path), attempt, port=1)
    assert [env[ENV_MEMORY_DIR] for env in with_tier.values()] == [str(memory)] * 2
    assert [env[ENV_MEMORY_DIR] for env in without.values()] == [""] * 2


@pytest.fixture
def supervisor_for() -> Iterator[Any]:
    """Makes a supervisor of a run dir that launches nothing (never run here), with what it journals; its journal is
    closed after the test."""
    journals: list[Any] = []

    class NoLauncher:
        def details(self) -> dict[str, Any]:
            return {}

    def make(run_dir: Path, **worker: Any) -> tuple[Supervisor, list[dict[str, Any]]]:
        said: list[dict[str, Any]] = []

        class Sink:
            def event(self, event_dict: dict[str, Any]) -> None:
                said.append(event_dict)

        config = parse_config({"command": ["true"], "nproc_per_node": 2, "worker": {"prefix": PREFIX, **worker}})
        layout = RunLayout(run_dir)
        lock_run_dir(layout).close()  # makes the run dir as `trainwarden run` does
        journals.append(open_journal(layout.journal, root=layout.root, echo=Sink()))
        launcher: Any = lambda *_: NoLauncher()  # noqa: E731 - the factory's signature is the launcher's
        return Supervisor(config, layout, journals[-1], config_path="job.yaml", launcher=launcher), said

    yield make
    for journal in journals:
        journal.close()


def test_the_supervisor_makes_the_memory_directory_when_snapshots_are_on(tmp_path: Path, supervisor_for: Any) -> None:
    """With snapshots on, the supervisor's layout has the run's memory directory, created private; with them off,
    none is made."""
    memory = memory_dir_for((tmp_path / "run").resolve())
    try:
        supervisor, said = supervisor_for(tmp_path / "run", snapshot_steps="auto")
        assert supervisor.layout.memory == memory
        assert os.stat(memory).st_mode & 0o777 == 0o700
        assert not [e for e in said if e["event"] == "memory_tier_off"]
    finally:
        remove_memory_dir(memory)
    supervisor, _ = supervisor_for(tmp_path / "off", snapshot_steps=0)
    assert supervisor.layout.memory is None
    assert not memory_dir_for((tmp_path / "off").resolve()).exists()


def test_a_memory_directory_that_cannot_be_made_turns_the_tier_off_with_a_warning(
    tmp_path: Path, supervisor_for: Any
) -> None:
    """A file where the memory directory goes (another's, a leftover): `memory_tier_off` with the reason, no memory
    tier (snapshots go to the disk slots), the file left alone."""
    blocker = memory_dir_for((tmp_path / "run").resolve())
    blocker.write_text("not a directory")
    try:
        supervisor, said = supervisor_for(tmp_path / "run", snapshot_steps=4)
        assert supervisor.layout.memory is None
        (off,) = [e for e in said if e["event"] == "memory_tier_off"]
        assert (off["path"], off["level"]) == (str(blocker), "warning")
        assert "not a directory" in off["reason"]
        assert blocker.read_text() == "not a directory"
    finally:
        blocker.unlink()


def test_a_stopped_run_persists_its_newer_memory_snapshot_then_removes_the_memory_directory(
    tmp_path: Path, supervisor_for: Any
) -> None:
    """The run ended stopped with step 6 in memory and step 4 on disk: step 6 is persisted (`snapshot_persisted`),
    the memory directory removed (`memory_tier_removed`), health_ckpts.json lists both disk checkpoints with their
    tier and no memory entry, and the state file has no memory block."""
    supervisor, said = supervisor_for(tmp_path / "run", snapshot_steps=2)
    layout = supervisor.layout
    assert layout.memory is not None
    try:
        snapshot(layout.checkpoints, 4)
        snapshot(layout.memory_slot(1), 6)
        supervisor._write_status(durable=False)  # while it runs: the memory snapshot is listed
        listed = json.loads((layout.root / "health_ckpts.json").read_text())
        assert [(e["step"], e["tier"]) for e in listed] == [(4, "disk"), (6, "memory")]
        supervisor.state = replace(supervisor.state, phase=Phase.STOPPED)
        supervisor._end_memory_tier()
    finally:
        remove_memory_dir(layout.memory)
    assert [e["step"] for e in said if e["event"] == "snapshot_persisted"] == [6]
    assert [e["persisted"] for e in said if e["event"] == "memory_tier_removed"] == [6]
    assert not layout.memory.exists()
    assert layout.checkpoints.complete_steps(WORLD, PREFIX) == [4, 6]
    listed = json.loads((layout.root / "health_ckpts.json").read_text())
    assert [(e["step"], e["tier"], e["is_health"]) for e in listed] == [(4, "disk", 0), (6, "disk", 0)]
    assert json.loads(layout.state_file.read_text())["memory"] is None


def test_a_supervisor_that_hands_over_keeps_the_memory_directory(tmp_path: Path, supervisor_for: Any) -> None:
    """Handed over (a successor may resume from memory), the supervisor neither persists nor removes anything."""
    supervisor, said = supervisor_for(tmp_path / "run", snapshot_steps=2)
    layout = supervisor.layout
    assert layout.memory is not None
    try:
        snapshot(layout.memory_slot(1), 6)
        supervisor.state = replace(supervisor.state, phase=Phase.STOPPED)
        supervisor.handed_over = "deposed"
        supervisor._end_memory_tier()
        assert layout.memory.exists() and layout.checkpoints.complete_steps(WORLD, PREFIX) == []
    finally:
        remove_memory_dir(layout.memory)
    assert not [e for e in said if e["event"] in ("snapshot_persisted", "memory_tier_removed")]

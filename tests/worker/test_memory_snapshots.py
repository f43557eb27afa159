"""The memory tier from the rank's side: snapshots in two slots in /dev/shm, pins for the supervisor to persist,
the memory bound, refused directories, and exact resume from memory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from supervisor.rundir.persist import persist_snapshot
from tests.checkpoint_files import assert_bitwise_equal
from worker import warden as warden_module
from worker.contract import (
    ENV_MEMORY_DIR,
    ENV_RESUME_DIR,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    ENV_WORKER_CONFIG,
    RunLayout,
    WorkerConfig,
)
from worker.faults import ENV_FAULTS
from worker.manifest import MANIFEST
from worker.memory import create_memory_dir, memory_dir_for, remove_memory_dir
from worker.memory_tier import memory_room, snapshot_room_problem

REPO = Path(__file__).resolve().parents[2]
EVERY_STEP = WorkerConfig(snapshot_steps=1, save_checkpoint_steps=0, save_checkpoint_interval_s=600)
PINNING = WorkerConfig(snapshot_steps=1, save_checkpoint_steps=2)
PREFIX = EVERY_STEP.prefix


@pytest.fixture
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's memory directory in /dev/shm, given to the ranks as the supervisor gives it; removed after."""
    path = create_memory_dir(memory_dir_for(tmp_path))
    monkeypatch.setenv(ENV_MEMORY_DIR, str(path))
    yield path
    path.chmod(0o700)  # a test may have opened it to others, which remove_memory_dir would leave alone
    remove_memory_dir(path)
    assert not path.exists()


@pytest.fixture(autouse=True)
def _short_persist_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """No supervisor persists pins here: a final save of a pinned step (the loop fixture's finish()) waits 1 s."""
    monkeypatch.setattr(warden_module, "PERSIST_WAIT_S", 1.0)


def events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    lines = RunLayout(tmp_path).rank_events(0).read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["event"] == name]


def slot_steps(layout: RunLayout) -> tuple[set[int], set[int]]:
    return layout.memory_slot(0).steps(0, PREFIX), layout.memory_slot(1).steps(0, PREFIX)


def heartbeat(tmp_path: Path) -> dict[str, Any]:
    return json.loads(RunLayout(tmp_path).heartbeat(0).read_text())


def test_snapshots_alternate_between_memory_slots_and_never_overwrite_the_newest(loop, tmp_path, memory) -> None:
    """Steps 1, 2, 3 land in slots 0, 1, 0, nothing on disk; a new process writes next into the other slot."""
    layout = RunLayout(tmp_path, memory=memory)
    run = loop(config=EVERY_STEP)
    seen = []
    for _ in range(3):
        run.train_batch()
        seen.append(slot_steps(layout))
    assert seen == [({1}, set()), ({1}, {2}), ({3}, {2})]
    assert layout.snapshot_slot(0).steps(0, PREFIX) == layout.snapshot_slot(1).steps(0, PREFIX) == set()
    assert [e["step"] for e in events(tmp_path, "snapshot_saved")] == [1, 2, 3]
    sizes = [os.path.getsize(layout.memory_slot(slot).file(0, step, PREFIX)) for slot, step in ((0, 3), (1, 2))]
    run.warden.finish(save=False)
    beat = heartbeat(tmp_path)  # the final beat carries them (a snapshot forces no write: it would cost more)
    assert beat["memory_step"] == 3 and beat["memory_bytes"] == sum(sizes)

    again = loop(config=EVERY_STEP)
    assert again.warden.resume() == 3  # without a supervisor: the newest complete, here in memory
    again.train_batch()
    assert slot_steps(layout) == ({3}, {4})


def test_after_a_resume_from_a_slot_every_rank_writes_next_into_the_other_one(
    loop, tmp_path, memory, monkeypatch
) -> None:
    """The supervisor resumes from slot 1's step 2 (step 3, in slot 0, was incomplete on another rank): the next
    snapshot goes to slot 0, the other one than the resume's, on every rank alike — not to the slot this rank's own
    newest snapshot is not in (slot 1: it would overwrite the state just resumed from, and ranks whose newest
    differ would split each snapshot between the slots, never complete on every rank again)."""
    layout = RunLayout(tmp_path, memory=memory)
    run = loop(config=EVERY_STEP)
    for _ in range(3):
        run.train_batch()
    run.warden.finish(save=False)
    assert slot_steps(layout) == ({3}, {2})
    monkeypatch.setenv(ENV_RESUME_STEP, "2")
    monkeypatch.setenv(ENV_RESUME_DIR, str(layout.memory_slot(1).root))
    again = loop(config=EVERY_STEP)
    assert again.warden.resume() == 2
    again.train_batch()
    assert slot_steps(layout) == ({3}, {2}) and events(tmp_path, "snapshot_saved")[-1]["path"].startswith(
        str(layout.memory_slot(0).root)
    )


def test_a_scheduled_save_pins_the_snapshot_and_writes_nothing_to_disk(loop, tmp_path, memory) -> None:
    """Save steps 2 and 4 become pins: hard links to the slot's files, which later snapshots into that slot leave
    alone; the final save at finish() goes to disk itself and drops its step's pin."""
    layout = RunLayout(tmp_path, memory=memory)
    run = loop(config=PINNING)
    for _ in range(2):
        run.train_batch()
    pin, slot = layout.memory_pin(2), layout.memory_slot(1)
    names = sorted(p.name for p in pin.rank_dir(0).iterdir())
    assert names == ["ckpt_rank_0-2.ckpt", "ckpt_rank_0-2.json", "meta.json"]
    for name in names:
        assert (pin.rank_dir(0) / name).stat().st_ino == (slot.rank_dir(0) / name).stat().st_ino
    pinned_inode = pin.file(0, 2, PREFIX).stat().st_ino
    assert layout.checkpoints.steps(0, PREFIX, kind="any") == set()
    (pinned,) = events(tmp_path, "snapshot_pinned")
    assert pinned["step"] == 2 and pinned["bytes"] == pin.file(0, 2, PREFIX).stat().st_size
    assert pinned["pin"] == str(pin.root) and pinned["stall_s"] >= 0

    for _ in range(2):
        run.train_batch()  # 3 into slot 0, 4 into slot 1 (pinned too)
    assert pin.file(0, 2, PREFIX).stat().st_ino == pinned_inode != slot.file(0, 4, PREFIX).stat().st_ino
    assert pin.steps(0, PREFIX) == {2} and layout.memory_pins() == [2, 4]
    assert layout.checkpoints.steps(0, PREFIX, kind="any") == set()


def test_the_final_save_of_a_pinned_step_takes_the_supervisors_copy(loop, tmp_path, memory) -> None:
    """Step 2 pinned, then finish(): the rank does not write step 2 beside the supervisor's copy of its pin (one
    write's file could meet the other's record); it waits for that copy and takes it as its final checkpoint."""
    layout = RunLayout(tmp_path, memory=memory)
    run = loop(config=PINNING)
    for _ in range(2):
        run.train_batch()
    copier = threading.Timer(0.3, persist_snapshot, (layout.memory_pin(2), layout.checkpoints, 2, (0,), PREFIX))
    copier.start()
    run.warden.finish()
    copier.join()
    (saved,) = events(tmp_path, "checkpoint_saved")
    assert (saved["step"], saved["persisted_by"]) == (2, "supervisor") and saved["duration_s"] >= 0.2
    assert layout.checkpoints.steps(0, PREFIX) == {2}


def test_without_a_copy_in_time_the_final_save_of_a_pinned_step_is_written_by_the_rank(
    loop, tmp_path, memory, monkeypatch
) -> None:
    """Nobody copies the pin (the supervisor is gone): after PERSIST_WAIT_S the rank drops its pin, says so and
    writes the step to disk itself."""
    monkeypatch.setattr(warden_module, "PERSIST_WAIT_S", 0.2)
    layout = RunLayout(tmp_path, memory=memory)
    run = loop(config=PINNING)
    for _ in range(2):
        run.train_batch()
    run.warden.finish()
    assert [e["step"] for e in events(tmp_path, "persist_wait_timed_out")] == [2]
    assert layout.checkpoints.steps(0, PREFIX) == {2} and layout.memory_pins() == []


def test_a_sharded_scheduled_save_pins_the_whole_directory_manifest_included(loop, tmp_path, memory) -> None:
    """A DCP snapshot is written synchronously into memory; its pin links every file of the directory."""
    layout = RunLayout(tmp_path, memory=memory)
    run = loop(config=WorkerConfig(checkpoint_format="dcp", save_checkpoint_steps=2, snapshot_steps=1))
    for _ in range(2):
        run.train_batch()
    slot_dir = layout.memory_slot(1).sharded_dir(2, PREFIX)
    pin_dir = layout.memory_pin(2).root / slot_dir.name
    names = sorted(p.name for p in slot_dir.iterdir())
    assert MANIFEST in names and sorted(p.name for p in pin_dir.iterdir()) == names
    assert all((pin_dir / n).stat().st_ino == (slot_dir / n).stat().st_ino for n in names)
    assert layout.memory_slot(0).sharded_steps(PREFIX) == {1}
    assert layout.checkpoints.sharded_steps(PREFIX, kind="any") == set()
    assert events(tmp_path, "snapshot_pinned")[0]["bytes"] > 0


def test_the_memory_bound_turns_the_tier_off_with_the_numbers(loop, tmp_path, memory) -> None:
    """snapshot_max_bytes below three copies of the state: snapshots go to the disk slots, said once."""
    run = loop(config=WorkerConfig(snapshot_steps=1, save_checkpoint_steps=0, snapshot_max_bytes=100))
    for _ in range(2):
        run.train_batch()
    (off,) = events(tmp_path, "memory_tier_off")
    assert "snapshots need 3 x " in off["reason"] and "worker.snapshot_max_bytes is 100 B" in off["reason"]
    layout = RunLayout(tmp_path)
    assert layout.snapshot_slot(1).steps(0, PREFIX) == {1} and layout.snapshot_slot(0).steps(0, PREFIX) == {2}
    assert os.listdir(memory) == []
    assert "memory_step" not in heartbeat(tmp_path)


def test_the_memory_bound_says_what_is_needed_and_what_is_free() -> None:
    """Three copies per rank for every rank of the node, against 90 % of the room or the configured bound."""
    room = (8_000_000_000, "/dev/shm free")
    assert snapshot_room_problem(1_200_000_000, 4, room) == (
        "snapshots need 3 x 1.2 GB x 4 rank(s) = 14.4 GB (two slots and a pin per rank); "
        "8.0 GB available (/dev/shm free), at most 90% of it used"
    )
    assert snapshot_room_problem(1_000_000_000, 2, room) is None  # 6 GB of 7.2 GB usable
    assert snapshot_room_problem(1_000_000_000, 2, room, max_bytes=5_000_000_000) == (
        "snapshots need 3 x 1.0 GB x 2 rank(s) = 6.0 GB (two slots and a pin per rank); "
        "worker.snapshot_max_bytes is 5.0 GB"
    )


@pytest.mark.parametrize("kind", ["symlink", "mode 755"])
def test_a_memory_directory_not_ours_alone_is_not_used(loop, tmp_path, memory, monkeypatch, kind) -> None:
    """A symlink to the memory directory, or one open to others, is refused: snapshots go to disk as without it."""
    if kind == "symlink":
        link = tmp_path / "shm-link"
        link.symlink_to(memory)
        monkeypatch.setenv(ENV_MEMORY_DIR, str(link))
    else:
        memory.chmod(0o755)
    run = loop(config=EVERY_STEP)
    run.train_batch()
    (off,) = events(tmp_path, "memory_tier_off")
    assert off["reason"] in ("not a directory (a symlink is not followed)", "open to others (mode 755, 700 wanted)")
    assert run.warden.layout.memory is None
    assert RunLayout(tmp_path).snapshot_slot(1).steps(0, PREFIX) == {1} and os.listdir(memory) == []


def test_resuming_from_a_memory_slot_is_bitwise_the_same_as_from_disk(loop, tmp_path, memory, monkeypatch) -> None:
    """The supervisor's choice of a memory slot restores exactly what the disk checkpoint of the same step does."""
    run = loop(config=EVERY_STEP)
    for _ in range(4):
        run.train_batch()
    run.warden.finish()  # the final save: step 4 on disk too, and in memory slot 1
    layout = RunLayout(tmp_path, memory=memory)
    assert slot_steps(layout) == ({3}, {4}) and layout.checkpoints.steps(0, PREFIX) == {4}

    resumed = {}
    for source, store in (("memory", layout.memory_slot(1)), ("disk", layout.checkpoints)):
        monkeypatch.setenv(ENV_RESUME_STEP, "4")
        monkeypatch.setenv(ENV_RESUME_DIR, str(store.root))
        again = loop(config=EVERY_STEP)
        assert again.warden.resume() == 4
        again.train_batch()  # the RNG, scheduler and data position restored too: the next step is the same
        resumed[source] = again.snapshot()
        again.warden.finish(save=False)
    assert_bitwise_equal(resumed["memory"], resumed["disk"])
    assert [e["source"] for e in events(tmp_path, "resumed")] == ["memory", "checkpoint"]


# Trains 5 steps under a Warden with a snapshot each step; the fault kills it inside the snapshot of step 3.
KILLED = """
import torch
from tests.worker.test_memory_snapshots import train
train(5, {})
"""


def train(steps: int, warden_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Linear(4, 2) and AdamW from seed 0, step k on data seeded k, under a Warden (`warden_options`: resuming
    where the environment says) or none (None); the state at the end."""
    from worker.warden import Warden

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    warden = None if warden_options is None else Warden(model, opt, **warden_options)
    for step in range(0 if warden is None else warden.resume(), steps):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if warden is not None:
            warden.step_done(loss=0.0)
    if warden is not None:
        warden.finish(save=False)
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def test_a_rank_killed_while_writing_a_snapshot_leaves_the_previous_one_whole(loop, tmp_path, memory, monkeypatch):
    """SIGKILL halfway through the snapshot of step 3 (slot 0): slot 1 still holds step 2, complete, and a rank
    resumed from it ends where an uninterrupted one does, bit for bit."""
    env = {
        **os.environ,
        ENV_RUN_DIR: str(tmp_path),
        ENV_FAULTS: "0:sigkill_in_save@3",
        ENV_WORKER_CONFIG: EVERY_STEP.to_env(),
    }
    child = subprocess.run([sys.executable, "-c", KILLED], cwd=REPO, env=env, timeout=60, check=False)
    assert child.returncode == -signal.SIGKILL
    layout = RunLayout(tmp_path, memory=memory)
    assert slot_steps(layout) == (set(), {2})
    assert any(name.endswith(".tmp") for name in os.listdir(layout.memory_slot(0).rank_dir(0)))  # the torn copy

    monkeypatch.delenv(ENV_FAULTS, raising=False)
    monkeypatch.setenv(ENV_RESUME_STEP, "2")
    monkeypatch.setenv(ENV_RESUME_DIR, str(layout.memory_slot(1).root))
    resumed = train(5, {"config": EVERY_STEP})
    assert [(e["step"], e["source"]) for e in events(tmp_path, "resumed")] == [(2, "memory")]
    assert_bitwise_equal(resumed, train(5))


def test_the_room_for_snapshots_is_the_smaller_of_free_space_and_memavailable(tmp_path) -> None:
    """A tmpfs page is RAM: MemAvailable bounds the room when it is below the filesystem's free space."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:       1000 kB\n")
    assert memory_room(tmp_path, meminfo) == (1_024_000, "MemAvailable")
    meminfo.write_text("MemAvailable: 999999999999 kB\n")
    free, limit = memory_room(tmp_path, meminfo)
    assert limit == f"{tmp_path} free" and free < 999999999999 * 1024
    meminfo.write_text("nothing here\n")
    assert memory_room(tmp_path, meminfo)[1] == f"{tmp_path} free"


TWO_RANKS = """
import torch, torch.distributed as dist
from tests.worker.test_memory_snapshots import train
dist.init_process_group("gloo")
train(2, {})
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_ranks_agree_to_keep_snapshots_on_disk_when_one_cannot_use_memory(tmp_path, memory) -> None:
    """Rank 1 refuses its memory directory (a symlink): at the first snapshot rank 0 learns it and both snapshot
    to disk, so that every rank's snapshot of a step is in the same place."""
    link = tmp_path / "shm-link"
    link.symlink_to(memory)
    env = {
        **os.environ,
        ENV_RUN_DIR: str(tmp_path),
        ENV_WORKER_CONFIG: EVERY_STEP.to_env(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(20000 + os.getpid() % 20000),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS],
            cwd=REPO,
            env={**env, "RANK": str(rank), ENV_MEMORY_DIR: str(link if rank else memory)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for rank in ranks:
        _, err = rank.communicate(timeout=90)
        assert rank.returncode == 0, err[-2000:]
    layout = RunLayout(tmp_path)
    for rank in (0, 1):
        assert [layout.snapshot_slot(slot).steps(rank, PREFIX) for slot in (0, 1)] == [{2}, {1}]
    reasons = [
        [e["reason"] for e in map(json.loads, layout.rank_events(rank).read_text().splitlines()) if "reason" in e]
        for rank in (0, 1)
    ]
    assert reasons == [
        ["another rank cannot keep its snapshots in memory"],
        ["not a directory (a symlink is not followed)"],
    ]
    assert os.listdir(memory) == []


def test_a_rank_waiting_for_the_supervisors_copy_keeps_beating(loop, tmp_path, memory, monkeypatch) -> None:
    """The final save of a pinned step waits for the supervisor's copy, which may queue behind others: the rank's
    heartbeat goes on meanwhile, so the supervisor does not take the wait for a hung save."""
    monkeypatch.setattr(warden_module, "PERSIST_WAIT_S", 2.5)
    run = loop(config=replace(PINNING, heartbeat_interval_s=0.2))
    for _ in range(2):
        run.train_batch()
    beats: set[int] = set()
    waiting = threading.Event()

    def watch() -> None:
        while not waiting.is_set():
            with contextlib.suppress(OSError, ValueError):
                if (beat := heartbeat(tmp_path))["phase"] == "save":
                    beats.add(beat["seq"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    run.warden.finish()
    waiting.set()
    watcher.join(timeout=10)
    assert [e["step"] for e in events(tmp_path, "persist_wait_timed_out")] == [2]
    assert len(beats) >= 5, beats  # 2.5 s of waiting, a beat every 0.2 s

"""Snapshots into memory written off the training thread: the loop pays only a copy into kept buffers, the snapshot
holds exactly its own step however the training goes on meanwhile, and a kill at any instant leaves the newest
complete snapshot whole and exact."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint_files import assert_bitwise_equal
from worker import warden as warden_module
from worker.checkpoint import load_checkpoint
from worker.contract import ENV_MEMORY_DIR, ENV_RUN_DIR, ENV_WORKER_CONFIG, RunLayout, WorkerConfig
from worker.memory import create_memory_dir, memory_dir_for, remove_memory_dir
from worker.snapshot_writer import StagedState

REPO = Path(__file__).resolve().parents[2]
EVERY_STEP = WorkerConfig(snapshot_steps=1, save_checkpoint_steps=0, save_checkpoint_interval_s=600)
PREFIX = EVERY_STEP.prefix


@pytest.fixture
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's memory directory in /dev/shm, given to the rank as the supervisor gives it; removed after."""
    path = create_memory_dir(memory_dir_for(tmp_path))
    monkeypatch.setenv(ENV_MEMORY_DIR, str(path))
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield path
    remove_memory_dir(path)
    assert not path.exists()


def train(steps: int, width: int, under_warden: bool = False, stepped: Any = None, done: Any = None) -> tuple[Any, Any]:
    """Linear(width, width) and AdamW from seed 0, step k on data seeded k, under a Warden if asked; `stepped(k)` is
    called once the optimizer has stepped, `done(k)` once step_done returned. The model and optimizer at the end."""
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    warden = warden_module.Warden(model, optimizer) if under_warden else None
    if warden is not None:
        assert warden.resume() == 0
    for step in range(1, steps + 1):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, width, generator=data), torch.randn(8, width, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if stepped is not None:
            stepped(step)
        if warden is not None:
            warden.step_done(loss=0.0)
        if done is not None:
            done(step)
    if warden is not None:
        warden.finish(save=False)
    return model, optimizer


def reference(step: int, width: int) -> dict[str, Any]:
    """What an uninterrupted run without snapshots holds after `step` steps."""
    model, optimizer = train(step, width)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def complete_snapshots(layout: RunLayout) -> dict[int, int]:
    """Step -> slot of every snapshot whose record exists, after checking its file against the record."""
    found = {}
    for slot in (0, 1):
        store = layout.memory_slot(slot)
        for step in store.steps(0, PREFIX):
            record = json.loads(store.record(0, step, PREFIX).read_text())
            data = store.file(0, step, PREFIX).read_bytes()
            assert (len(data), f"{zlib.crc32(data):08x}") == (record["size"], record["crc32"]), (slot, step)
            found[step] = slot
    return found


def test_the_loop_goes_on_while_a_snapshot_is_written_and_the_snapshot_holds_its_own_step(
    tmp_path: Path, memory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of step 1's snapshot is held back while steps 2 and 3 train: step_done returns at once, nothing of
    step 1 is complete yet, step 2's snapshot waits for step 1's to end; once written, step 1's snapshot is the state
    after step 1 bit for bit, not the one the later steps made of the live tensors."""
    monkeypatch.setenv(ENV_WORKER_CONFIG, EVERY_STEP.to_env())
    gate, writing = threading.Event(), threading.Event()
    real_save = warden_module.save_checkpoint

    def held_save(*args: Any, **kwargs: Any) -> Any:
        if kwargs["step"] == 1:
            writing.set()
            assert gate.wait(timeout=30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(warden_module, "save_checkpoint", held_save)
    layout = RunLayout(tmp_path, memory=memory)
    seen: dict[int, Any] = {}

    def done(step: int) -> None:
        if step == 1:
            assert writing.wait(timeout=30)  # the background thread is inside step 1's write, held
            seen[step] = complete_snapshots(layout)
            threading.Timer(0.5, gate.set).start()  # released while step 2 trains or its snapshot waits

    train(3, 16, under_warden=True, done=done)
    assert seen[1] == {}  # step 1's write was held: its record did not exist when step_done returned
    assert complete_snapshots(layout) == {3: 0, 2: 1}
    events = [json.loads(line) for line in layout.rank_events(0).read_text().splitlines()]
    written = [e for e in events if e["event"] == "snapshot_saved"]
    assert [e["step"] for e in written] == [1, 2, 3] and all(e["write_s"] >= 0 for e in written)
    assert written[0]["write_s"] >= 0.4 and written[0]["stall_s"] < written[0]["write_s"]  # held, off the loop
    saved = load_checkpoint(layout.memory_slot(1), rank=0, step=2, prefix=PREFIX)
    assert_bitwise_equal({"model": saved["model"], "optimizer": saved["optimizer"]}, reference(2, 16))


def test_a_held_write_still_holds_the_state_of_its_step(tmp_path: Path, memory: Path, monkeypatch) -> None:
    """Step 1's snapshot, written only after step 2 changed every parameter and moment in place, is the state after
    step 1 exactly: the loop copied it before going on."""
    monkeypatch.setenv(ENV_WORKER_CONFIG, EVERY_STEP.to_env())
    gate = threading.Event()
    real_save = warden_module.save_checkpoint
    kept: dict[str, Any] = {}

    def held_save(*args: Any, **kwargs: Any) -> Any:
        if kwargs["step"] == 1:
            assert gate.wait(timeout=30)
        path = real_save(*args, **kwargs)
        if kwargs["step"] == 1:  # read before step 3 reuses the slot
            kept.update(load_checkpoint(args[0], rank=0, step=1, prefix=PREFIX))
        return path

    monkeypatch.setattr(warden_module, "save_checkpoint", held_save)
    train(2, 16, under_warden=True, stepped=lambda step: step == 2 and gate.set())
    assert_bitwise_equal({"model": kept["model"], "optimizer": kept["optimizer"]}, reference(1, 16))


# Trains STEPS steps of Linear(WIDTH, WIDTH) with a snapshot into memory every step, saying when it has begun.
KILLED = """
import sys
from pathlib import Path
from tests.worker.test_snapshot_writer import train

train(100000, 256, under_warden=True, done=lambda step: step == 1 and Path(sys.argv[1]).touch())
"""


@pytest.mark.parametrize("seed", [1])
def test_a_rank_killed_at_any_instant_leaves_its_newest_complete_snapshot_whole_and_exact(
    tmp_path: Path, memory: Path, seed: int
) -> None:
    """SIGKILL at a random instant of a run snapshotting every step (its writes in the background): every snapshot
    with a record matches its size and checksum, the other slot holds the step before the newest or nothing
    complete (it was being written), and the newest loads bitwise equal to an uninterrupted run's state there."""
    began = tmp_path / "began"
    env = {**os.environ, ENV_WORKER_CONFIG: EVERY_STEP.to_env()}
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(began)], cwd=REPO, env=env)
    try:
        deadline = 60.0
        while not began.exists() and deadline > 0 and child.poll() is None:
            threading.Event().wait(0.02)
            deadline -= 0.02
        assert began.exists(), "the child never trained"
        threading.Event().wait(random.Random(seed).uniform(0.2, 0.8))  # any instant: in a step, a copy or a write
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    complete = complete_snapshots(RunLayout(tmp_path, memory=memory))
    newest = max(complete)
    assert newest > 1 and set(complete) <= {newest, newest - 1}
    assert complete.get(newest - 1, 1 - complete[newest]) == 1 - complete[newest]
    slot = RunLayout(tmp_path, memory=memory).memory_slot(complete[newest])
    saved = load_checkpoint(slot, rank=0, step=newest, prefix=PREFIX)
    assert_bitwise_equal({"model": saved["model"], "optimizer": saved["optimizer"]}, reference(newest, 256))


def test_staged_copies_reuse_their_buffers_and_keep_tied_tensors_tied() -> None:
    """A second copy of a state of the same shapes lands in the first copy's buffers; two entries of one tensor
    share one buffer; a module state dict stays an OrderedDict with its versions; plain values are copies."""
    weight = torch.arange(6.0).reshape(2, 3)
    state: dict[str, Any] = OrderedDict(a=weight, b=weight.detach(), n=torch.tensor(3))
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    outer = {"model": state, "groups": [{"lr": 0.1, "params": [0, 1]}], "step": 7}
    staged = StagedState()
    first, ready = staged.copy(outer)
    assert ready is None  # CPU copies are done when copy returns
    assert first["model"]["a"] is first["model"]["b"] and first["model"]["a"].data_ptr() != weight.data_ptr()
    assert isinstance(first["model"], OrderedDict) and first["model"]._metadata == {"": {"version": 1}}
    assert first["groups"] == outer["groups"] and first["groups"][0] is not outer["groups"][0]
    weight.add_(1)
    assert torch.equal(first["model"]["a"], torch.arange(6.0).reshape(2, 3))  # the copy, not the live tensor
    second, _ = staged.copy(outer)
    assert second["model"]["a"] is first["model"]["a"] and torch.equal(second["model"]["a"], weight)

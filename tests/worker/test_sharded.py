"""Sharded (DCP) checkpoints from the worker's side: saved in the background, exact on resume, checksummed while
written, never loaded before the manifest checks out, and never a way to run code from the run dir.

One-process tests need no process group (and no NumPy); the two-rank test trains FSDP2 over gloo for real."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from supervisor.export import export_weights
from supervisor.rundir.checkpoints import find_junk
from tests.checkpoint_files import assert_bitwise_equal
from tests.conftest import wait_until
from worker.contract import EXIT_CHECKPOINT_REFUSED, RunLayout, WorkerConfig
from worker.manifest import MANIFEST, METADATA, read_manifest
from worker.sharded import _load_planner, _MetadataUnpickler, numpy_missing
from worker.store import choose_resume

REPO = Path(__file__).resolve().parents[2]
SHARDED = WorkerConfig(checkpoint_format="dcp", save_checkpoint_steps=3)


def test_a_background_save_is_complete_once_logged_and_resumes_bitwise_exactly(loop, tmp_path: Path) -> None:
    """Saves at 3 and 6 in the background; a new process resumed at 6 trains to 9 exactly as one that went on."""
    run = loop(config=SHARDED, global_batch_size=8)
    for _ in range(6):
        run.train_batch()
    run.warden._note_background_save(wait=True)
    store = RunLayout(tmp_path).checkpoints
    assert store.complete_steps(1, SHARDED.prefix) == [3, 6]
    for _ in range(3):
        run.train_batch()
    went_on = run.snapshot()
    run.warden._note_background_save(wait=True)

    assert loop(config=SHARDED, global_batch_size=8).warden.resume() == 9  # the newest, once written
    resumed = loop(
        config=WorkerConfig(checkpoint_format="dcp", save_checkpoint_steps=3, resume_training="6"), global_batch_size=8
    )
    assert resumed.warden.resume() == 6 and resumed.warden.samples == 48
    for _ in range(3):
        resumed.train_batch()
    assert_bitwise_equal(resumed.snapshot(), went_on, "state after resuming at 6")
    events = [json.loads(line) for line in (tmp_path / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines()]
    staged = [e for e in events if e["event"] == "checkpoint_staged"]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in staged][:3] == [e["step"] for e in saved][:3] == [3, 6, 9]
    assert all(e["background"] and e["stall_s"] <= e["duration_s"] for e in saved)


def rank_events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_save_due_while_the_previous_one_is_written_counts_the_wait_and_says_so_once(loop, tmp_path: Path) -> None:
    """The write of 3 is stretched by 1 s (slow_async_write): the save of 6 waits for it, and its stall holds the
    wait; the rank says once, in its log and its heartbeat, that its writes outlast its save interval, and what to
    set."""
    run = loop("0:slow_async_write@3:1", config=SHARDED)
    for _ in range(9):
        run.train_batch()
    run.warden.finish()

    staged = {e["step"]: e for e in rank_events(tmp_path, "checkpoint_staged")}
    (said,) = rank_events(tmp_path, "save_slower_than_interval")  # once, though the quick writes may overlap too
    assert (said["step"], said["interval_steps"]) == (6, 3)
    assert said["write_s"] >= 1.0 > said["interval_s"]
    assert staged[6]["waited_s"] >= 1.0 - said["interval_s"] - 0.05  # the write began as the loop went on
    assert staged[6]["waited_s"] <= staged[6]["stall_s"] and staged[6]["waited_s"] == pytest.approx(
        said["waited_s"], abs=1e-3
    )
    assert staged[3]["waited_s"] == 0.0  # nothing in flight before the first save
    key, steps, more = said["setting"].split(" ", 2)  # as many steps as the write takes at the pace seen
    assert (key, more) == ("worker.save_checkpoint_steps:", "or more") and int(steps) > 3
    # ceil(write_s x 3 / interval_s) of the unrounded figures, which the logged ones (rounded to 3 decimals) bound:
    # 3 steps take a few ms here, so a relative tolerance on the rounded interval failed
    error = 0.0005
    lowest = said["write_s"] - error, said["interval_s"] + error
    highest = said["write_s"] + error, max(said["interval_s"] - error, 1e-6)
    assert math.ceil(lowest[0] * 3 / lowest[1]) <= int(steps) <= math.ceil(highest[0] * 3 / highest[1])
    beat = json.loads((tmp_path / "ranks" / "rank_0" / "heartbeat.json").read_text())
    assert beat["slow_saves"] == {
        "write_s": said["write_s"],
        "interval_s": said["interval_s"],
        "setting": said["setting"],
    }
    assert beat["save_s"] >= staged[6]["stall_s"]  # goodput's save time holds the wait


def test_what_to_set_is_a_save_interval_the_write_fits_in_for_the_cadence_in_use(loop) -> None:
    """In steps at the pace seen (snapshots' when they set the pace), or the write's seconds rounded up."""
    steps, snapshots = (WorkerConfig(checkpoint_format="dcp", save_checkpoint_steps=n) for n in (5, 100))
    for config, setting in (
        (steps, "worker.save_checkpoint_steps: 32 or more"),
        (replace(snapshots, snapshot_steps=5), "worker.snapshot_steps: 32 or more"),
        (
            replace(steps, save_checkpoint_steps=0, save_checkpoint_interval_s=1),
            "worker.save_checkpoint_interval_s: 4 or more",
        ),
    ):
        assert loop(config=config).warden._save_interval_setting(3.2, 0.5, 5) == setting


def test_the_first_saves_staging_buffers_are_allocated_after_the_first_step(loop) -> None:
    """After the first step a thread allocates the staging buffers (and touches their pages); the first save copies
    into those very buffers instead of allocating its own."""
    run = loop(config=SHARDED)
    run.train_batch()
    preparing = run.warden._sharded._preparing
    preparing.join(timeout=30)
    assert not preparing.is_alive()
    buffers = run.warden._sharded._staged
    pointers = [t.data_ptr() for t in buffers["model"].values()]
    for _ in range(2):
        run.train_batch()
    run.warden._note_background_save(wait=True)
    assert run.warden._sharded._staged is buffers
    assert [t.data_ptr() for t in buffers["model"].values()] == pointers


def test_every_checksum_in_the_manifest_is_the_file_as_written(loop, tmp_path: Path) -> None:
    """The CRC-32s, computed while the files were written, match what is on disk; each rank's state is apart."""
    run = loop(config=SHARDED)
    for _ in range(3):
        run.train_batch()
    run.warden.finish()
    directory = RunLayout(tmp_path).checkpoints.sharded_dir(3, SHARDED.prefix)
    manifest = read_manifest(directory, 3)
    assert set(manifest["files"]) == {"__0_0.distcp", METADATA, "rank_0.pt"}
    for name, entry in manifest["files"].items():
        data = (directory / name).read_bytes()
        assert (len(data), f"{zlib.crc32(data):08x}") == (entry["size"], entry["crc32"]), name
    assert (manifest["world_size"], manifest["step"], manifest["torch"]) == (1, 3, torch.__version__)


class Boom:
    """A pickle that would create a file when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_a_crafted_dcp_metadata_pickle_is_refused_without_running_it(loop, tmp_path: Path) -> None:
    """An attacker rewrites .metadata and fixes up the manifest's size and checksum: the resume is refused (66) by
    the allow-list unpickler, and the payload never runs."""
    run = loop(config=SHARDED)
    for _ in range(3):
        run.train_batch()
    run.warden.finish()
    directory = RunLayout(tmp_path).checkpoints.sharded_dir(3, SHARDED.prefix)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Boom(marker))
    (directory / METADATA).write_bytes(payload)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][METADATA].update(size=len(payload), crc32=f"{zlib.crc32(payload):08x}")
    (directory / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(SystemExit) as exited:
        loop(config=SHARDED).warden.resume()
    assert exited.value.code == EXIT_CHECKPOINT_REFUSED
    assert not marker.exists()
    refused = (tmp_path / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines()[-1]
    assert "posix.system, which is not DCP's metadata" in refused


def test_non_tensor_items_load_as_plain_data_only(tmp_path: Path) -> None:
    """DCP's planner loads non-tensor items with weights_only=False; ours refuses anything but plain data."""
    planner = _load_planner()
    planner.flatten_state_dict = False
    planner.state_dict = {}
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "lr"})()})()
    buffer = io.BytesIO()
    torch.save(0.125, buffer)
    planner.load_bytes(item, io.BytesIO(buffer.getvalue()))
    assert planner.state_dict == {"lr": 0.125}
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, io.BytesIO(pickle.dumps(Boom(tmp_path / "pwned"))))
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(pickle.UnpicklingError):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Boom(tmp_path / "pwned")))).load()


def test_snapshot_slots_hold_one_sharded_checkpoint_each(loop, tmp_path: Path) -> None:
    run = loop(
        config=WorkerConfig(
            checkpoint_format="dcp",
            save_checkpoint_steps=0,
            save_checkpoint_interval_s=0,
            snapshot_steps=2,
            async_save=False,
        )
    )
    layout = RunLayout(tmp_path)
    for _ in range(6):
        run.train_batch()
    assert [layout.snapshot_slot(slot).complete_steps(1, "ckpt") for slot in (0, 1)] == [[4], [6]]
    assert sorted(p.name for p in layout.snapshot_slot(1).root.iterdir()) == ["ckpt-6.dcp"]


KILLED_WRITER = """
import torch
from worker import Warden
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters())
warden = Warden(model, optimizer)
for _ in warden.steps(6):
    optimizer.zero_grad()
    loss = model(torch.randn(4, 64)).square().mean()
    loss.backward()
    if warden.guard_step(loss.item()):
        optimizer.step()
    warden.step_done(loss=loss.item())
warden.finish()
"""


def test_a_rank_killed_while_its_background_write_runs_leaves_the_previous_checkpoint_usable(tmp_path: Path) -> None:
    """SIGKILL inside the background write of step 4: step 2 stays the newest complete checkpoint; 4 is a torn
    directory without manifest, which the supervisor removes before the next launch."""
    env = {
        **os.environ,
        "TRAINWARDEN_RUN_DIR": str(tmp_path),
        "TRAINWARDEN_FAULTS": "0:sigkill_in_async_write@4",
        "TRAINWARDEN_WORKER_CONFIG": json.dumps({"checkpoint_format": "dcp", "save_checkpoint_steps": 2}),
    }
    done = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -9, done.stderr[-2000:]
    layout = RunLayout(tmp_path)
    assert layout.checkpoints.complete_steps(1, "ckpt") == [2]
    choice = choose_resume(layout.checkpoint_stores(), 1, "ckpt")
    assert choice.step == 2 and choice.passed_over[0][0] == 4
    assert find_junk(layout, 1, "ckpt").torn == (layout.checkpoints.sharded_dir(4, "ckpt"),)


TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from worker import Warden
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
torch.manual_seed(100 + rank)  # each rank its own dropout stream
warden = Warden(model, optimizer, global_batch_size=4 * world)
for _ in warden.steps(int(sys.argv[1])):
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(warden.samples + rank)
    loss = model(torch.randn(4, 16, generator=gen)).square().mean()
    loss.backward()
    if warden.guard_step(loss.detach(), max_norm=1.0):
        optimizer.step()
    warden.step_done(loss=loss.item())
print(rank, "rng", torch.get_rng_state().sum().item(), "samples", warden.samples, flush=True)
warden.finish()
from worker.flight import flight_record
print(rank, "groups", sorted({tuple(e["process_group"]) for e in flight_record()["entries"]}), flush=True)
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, world: int, steps: int) -> list[str]:
    """`world` ranks of TWO_RANKS over gloo on this machine; their stdout lines."""
    env = {
        **os.environ,
        "TRAINWARDEN_RUN_DIR": str(tmp_path / "run"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(20000 + os.getpid() % 20000),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_WORKER_CONFIG": json.dumps({"save_checkpoint_steps": 2}),
        "TORCH_FR_BUFFER_SIZE": "2000",  # the flight recorder, as the supervisor turns it on
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(steps)],
            cwd=REPO,
            text=True,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(world)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


@pytest.mark.skipif(numpy_missing(), reason="DCP's collectives need NumPy (the [dcp] extra)")
@pytest.mark.timeout(180)
def test_fsdp2_ranks_keep_their_own_rng_states_and_a_resume_on_one_rank_reshards(tmp_path: Path) -> None:
    """Two FSDP2 ranks save their own RNG states (DCP would keep one copy of a shared key: no collapse here); one
    rank then resumes the same checkpoint, resharded, with the global sample count exact and its RNG derived."""
    outs = run_ranks(tmp_path, 2, 4)
    directory = RunLayout(tmp_path / "run").checkpoints.sharded_dir(4, "ckpt")
    manifest = read_manifest(directory, 4)
    assert (manifest["world_size"], manifest["samples"], manifest["sharding"]["dtensor_params"]) == (2, 32, True)
    states = [torch.load(directory / f"rank_{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert not torch.equal(states[0]["rng"]["torch"], states[1]["rng"]["torch"])
    for rank, out in enumerate(outs):  # each file holds its own rank's state, as that rank had it at the save
        assert f"rng {states[rank]['rng']['torch'].sum().item()} samples 32" in out
        # the background writes' group is named in the flight recorder: the hang analyzer judges it apart
        assert f"{rank} groups [" in out and "'trainwarden_checkpoint_writer')" in out

    (out,) = run_ranks(tmp_path, 1, 6)

    assert "samples 40" in out  # 32 samples at 8 per step, then 2 steps of 4
    events = [
        json.loads(line) for line in (tmp_path / "run" / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines()
    ]
    (changed,) = (e for e in events if e["event"] == "world_size_changed")
    assert (changed["saved_world_size"], changed["world_size"]) == (2, 1)
    resumed = [e for e in events if e["event"] == "resumed"][-1]
    assert (resumed["step"], resumed["samples"], resumed["data_position"]) == (4, 32, 8)


def test_sigterm_waits_for_the_save_in_flight_in_the_save_phase(tmp_path: Path) -> None:
    """A background write that stalls (hang_in_async_write): the loop trained on; SIGTERM then waits for the save,
    with the heartbeat in the save phase (the supervisor's save timeout applies), and the rank dies only of the
    SIGKILL that timeout brings. The stalled save never became a checkpoint."""
    env = {
        **os.environ,
        "TRAINWARDEN_RUN_DIR": str(tmp_path),
        "TRAINWARDEN_FAULTS": "0:hang_in_async_write@2",
        "TRAINWARDEN_WORKER_CONFIG": json.dumps({"checkpoint_format": "dcp", "save_checkpoint_steps": 10**6}),
    }
    script = KILLED_WRITER.replace("warden.steps(6)", "warden.steps(10**6)").replace(
        "warden.step_done(loss=loss.item())",
        "warden.step_done(loss=loss.item())\n    if warden.step == 2: warden.save(2)\n    time.sleep(0.02)",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import time\n{script}"], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        beat = tmp_path / "ranks" / "rank_0" / "heartbeat.json"
        wait_until(lambda: beat.exists() and json.loads(beat.read_text())["step"] >= 5, 60, what="step 5")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: json.loads(beat.read_text())["phase"] == "save", 30, what="the save phase")
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # still waiting for the save
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert RunLayout(tmp_path).checkpoints.complete_steps(1, "ckpt") == []


def test_export_consolidates_a_sharded_checkpoint_into_plain_weights(loop, tmp_path: Path) -> None:
    """`trainwarden export` of a sharded checkpoint: the model's weights as a plain file, loadable with
    weights_only=True (the per-rank format's tests load such a file in a process without trainwarden)."""
    run = loop(config=SHARDED)
    for _ in range(3):
        run.train_batch()
    run.warden.finish()
    exported = export_weights(tmp_path, tmp_path / "weights.pt")
    assert (exported.step, exported.tensors, exported.source) == (3, 2, "checkpoint")
    assert_bitwise_equal(
        dict(torch.load(tmp_path / "weights.pt", weights_only=True)), dict(run.model.state_dict()), "exported"
    )


def test_a_resume_with_another_global_batch_size_starts_the_spike_history_afresh(loop, tmp_path: Path) -> None:
    """Norms of a batch of 16 would judge a batch of 8 (a run resumed on half its ranks): the history is reset."""
    run = loop(config=SHARDED, global_batch_size=16)
    for _ in range(3):
        run.train_batch()
    run.warden.finish()
    assert len(run.warden._guard.detector.state_dict()["norms"]) == 3
    resumed = loop(config=SHARDED, global_batch_size=8)
    assert resumed.warden.resume() == 3 and resumed.warden.samples == 48 and resumed.warden.batches == 6
    assert resumed.warden._guard.detector.state_dict() == {"norms": [], "losses": []}
    said = [json.loads(line) for line in (tmp_path / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines()]
    (reset,) = (e for e in said if e["event"] == "anomaly_history_reset")
    assert (reset["saved_global_batch_size"], reset["global_batch_size"]) == (16, 8)


@pytest.mark.skipif(not numpy_missing(), reason="shows what a rank without NumPy does")
def test_a_multi_rank_sharded_run_without_numpy_exits_78_at_start_saying_what_to_install(
    loop, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exited:
        loop(config=WorkerConfig(checkpoint_format="dcp"))
    assert exited.value.code == 78
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "trainwarden: worker config error: checkpoint_format dcp needs NumPy: torch.distributed's object "
        "collectives, which DCP plans with, use it (pip install 'trainwarden[dcp]')"
    )

"""examples/fsdp_train.py under the real supervisor: FSDP2 with sharded checkpoints written in the background.

A kill -9 during a background write, a hang and a stop, then a rerun, end bitwise equal to an uninterrupted run
(compared through `trainwarden export`), in which a save waits for a slow write before it and says so; the same run
dir goes on with 4 ranks, then with 2 again, and across both changes every sample is trained once: no id skipped,
none seen twice. With snapshots in memory, 4 ranks go on from the same checkpoint through a rank killed while the
supervisor persists a pinned snapshot (resumed from memory) and a damaged snapshot in memory (resumed from disk),
and end bitwise equal to the 4 ranks that went on uninterrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml

from tests.conftest import wait_until
from tests.e2e.conftest import FAST_HANG, REPO, Finished, finish, heartbeat, journal, run_supervisor, start_supervisor
from worker.contract import RunLayout
from worker.manifest import MANIFEST
from worker.memory import memory_dir_for, remove_memory_dir
from worker.sharded import numpy_missing

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(numpy_missing(), reason="DCP's collectives need NumPy (the [dcp] extra)"),
]

SAVE_EVERY = 5
KILL = "1:sigkill_in_async_write@10"  # rank 1 dies inside the background write of 10: resumed from 5
HANG = "0:hang@17"  # once relaunched, rank 0 hangs after step 17: resumed from 15
SLOW_WRITE_S = 3.0
SLOW_WRITE = f"0:slow_async_write@5:{SLOW_WRITE_S:g}"  # uninterrupted: the save of 10 waits for the write of 5
UNTIL_STOPPED = 100_000  # the interrupted run ends by its stop; --lr-decay-steps keeps every run's schedule
STEPS_AFTER_STOP = 5
PER_RANK_BATCH = 2
KEEP = 3  # keep_checkpoint_max: sharded checkpoints are rotated as whole directories
ARGS = ["--lr-decay-steps", "300", "--batch-size", str(PER_RANK_BATCH), "--block", "32", "--n-embd", "32"]
# 4 ranks go on from the reference this long: three pinned saves (every SAVE_EVERY) at least, so that a kill inside
# a persist still finds one if the first persist ended before the step after it was snapshotted.
FOUR_RANK_STEPS = 15
# Snapshots in memory every step; the supervisor persists each pinned save at 0.25 MB/s: the 4 ranks' ~1.1 MB take
# ~4 s, so a kill sent once a persist has begun and the next step is in memory lands inside that persist.
MEMORY_TIER = {"snapshot_steps": 1, "persist_mb_s": 0.25}


def fsdp_job(
    tmp: Path,
    *,
    steps: int,
    nproc: int = 2,
    faults: str = "",
    samples: Path | None = None,
    worker: dict[str, Any] | None = None,
    standby: bool = False,
) -> Path:
    """examples/fsdp.yaml with the test's size, `faults` injected once each, `worker` settings added, and quick
    relaunches."""
    config = yaml.safe_load((REPO / "examples" / "fsdp.yaml").read_text())
    config["script"] = str(REPO / "examples" / "fsdp_train.py")
    config["args"] = [*ARGS, "--steps", str(steps), *(["--samples-file", str(samples)] if samples else [])]
    config["nproc_per_node"] = nproc
    config["env"] = {**config["env"], "TRAINWARDEN_FAULTS": faults, "TRAINWARDEN_FAULTS_ONCE": "1"}
    config["worker"]["save_checkpoint_steps"] = SAVE_EVERY
    config["worker"]["keep_checkpoint_max"] = KEEP
    config["worker"]["snapshot_steps"] = 0  # the background disk writes under test (MEMORY_TIER: the memory tier's)
    config["worker"].update(worker or {})
    config["restart"]["backoff_initial_s"] = 0.2
    config["stop"]["kill_grace_s"] = 1.0
    config["hang"] = {**config["hang"], **FAST_HANG}
    config["standby"] = {"enabled": standby}  # worth its one import where a run relaunches more than once
    path = tmp / f"job_{nproc}_{steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def export(run_dir: Path) -> dict[str, torch.Tensor]:
    """`trainwarden export` of the newest checkpoint, loaded as a script without trainwarden would."""
    out = run_dir.parent / f"{run_dir.name}-export.pt"
    subprocess.run(
        [sys.executable, "-m", "supervisor", "export", str(run_dir), "-o", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """Killed in a background write, hung, then stopped once the third attempt is past step 20: (tmp, stop step)."""
    tmp = tmp_path_factory.mktemp("interrupted")
    proc = start_supervisor(fsdp_job(tmp, steps=UNTIL_STOPPED, faults=f"{KILL},{HANG}", standby=True), tmp / "run")
    wait_until(
        lambda: all((b := heartbeat(tmp / "run", rank)) and b["attempt"] == 2 and b["step"] > 20 for rank in (0, 1)),
        timeout=150,
        what="the third attempt past step 20",
    )
    subprocess.run(
        [sys.executable, "-m", "supervisor", "stop", str(tmp / "run")],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=30,
    )
    done = finish(proc, tmp / "run", timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, done.status()["stopped_at"]["step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, interrupted: tuple[Path, int]) -> Finished:
    """The uninterrupted run to where the interrupted one ends, logging its sample ids; rank 0's write of step 5 takes
    SLOW_WRITE_S longer (nothing else changes)."""
    tmp = tmp_path_factory.mktemp("reference")
    steps = interrupted[1] + STEPS_AFTER_STOP
    job = fsdp_job(tmp, steps=steps, samples=tmp / "ids.jsonl", faults=SLOW_WRITE)
    done = run_supervisor(job, tmp / "run", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_kill_in_a_background_write_a_hang_and_a_stop_end_bitwise_equal_to_an_uninterrupted_run(
    interrupted: tuple[Path, int], reference: Finished
) -> None:
    tmp, stop_step = interrupted
    events = journal(tmp / "run")
    assert [e["returncode"] for e in events if e["event"] == "rank_crashed"][:1] == [-9]
    assert any(e["event"] == "hang_detected" for e in events)
    launches = [e for e in events if e["event"] == "ranks_launched"]
    resumes = [e["resume_step"] for e in launches]
    assert resumes[:3] == [None, 5, 15], resumes  # 10 was being written when rank 1 died: never a checkpoint
    # Both recovered in place: the kill (rank 0's process goes on, rank 1 is replaced), then the hang (its culprit,
    # rank 0, named by the flight recorders and killed alone; rank 1's process goes on).
    kill, hang = [e for e in events if e["event"] == "recovered_in_place"][:2]
    assert (kill["attempt"], kill["kept"], kill["replaced"]) == (1, [0], [1])
    assert launches[1]["pids"][0] == launches[0]["pids"][0]
    assert (hang["attempt"], hang["kept"], hang["replaced"]) == (2, [1], [0])
    assert launches[2]["pids"][1] == launches[1]["pids"][1] != launches[0]["pids"][1]
    assert [e["rank"] for e in events if e["event"] == "hang_culprit_killed"] == [0]

    (tmp / "run" / "stop").unlink()  # the stop file stays until someone removes it: a rerun would not start
    done = run_supervisor(fsdp_job(tmp, steps=stop_step + STEPS_AFTER_STOP), tmp / "run", timeout=120)

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["resumed_from"], status["last_checkpoint"]) == (
        {"step": stop_step},
        {"step": stop_step + STEPS_AFTER_STOP},
    )
    got, want = export(tmp / "run"), export(reference.run_dir)
    assert got.keys() == want.keys() and len(got) > 20
    unequal = [name for name in want if not torch.equal(got[name], want[name])]
    assert not unequal, f"differ from the uninterrupted run: {unequal}"


def test_a_save_due_while_the_previous_write_runs_waits_for_it_counts_the_wait_and_says_so(reference: Finished) -> None:
    """Saves every 5 steps, rank 0's write of 5 stretched by 3 s: its save of 10 waits for it, the stall holding the
    wait; the rank says its writes outlast its save interval and what to set, the supervisor journals it once and
    `status` shows it, and goodput counts the wait as save time."""
    events = rank_events(reference.run_dir, 0)
    staged = {e["step"]: e for e in events if e["event"] == "checkpoint_staged"}
    (said,) = (e for e in events if e["event"] == "save_slower_than_interval")
    assert (said["step"], said["interval_steps"]) == (10, SAVE_EVERY) and said["write_s"] >= SLOW_WRITE_S
    waited = staged[10]["waited_s"]  # the write began as the loop went on, and ran SLOW_WRITE_S at least
    assert SLOW_WRITE_S - said["interval_s"] - 0.1 <= waited <= staged[10]["stall_s"]
    assert said["setting"].startswith("worker.save_checkpoint_steps: ")

    journalled = [e for e in journal(reference.run_dir) if e["event"] == "save_slower_than_interval"]
    assert [e["setting"] for e in journalled if e["rank"] == 0] == [said["setting"]]  # once
    status = reference.status()
    shown = {e["rank"]: e for e in status["save_slower_than_interval"]["slowest"]}
    assert shown[0] == {
        "rank": 0,
        "write_s": said["write_s"],
        "interval_s": said["interval_s"],
        "setting": said["setting"],
    }
    assert status["goodput"]["save_s"] >= waited - 0.5  # the wait is save time, not training


def sample_ids(path: Path) -> list[list[int]]:
    """Each applied step's sample ids, in order (each step appears once in a run without relaunches)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    return [line["ids"] for line in lines]


def from_reference(reference: Finished, run_dir: Path, ids: Path | None = None) -> int:
    """A new run dir holding the reference's checkpoints (and `ids`, a copy of its sample ids); the step it ended at."""
    shutil.copytree(reference.run_dir / "checkpoint", run_dir / "checkpoint")
    if ids is not None:
        shutil.copy2(reference.run_dir.parent / "ids.jsonl", ids)
    return len(sample_ids(reference.run_dir.parent / "ids.jsonl"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory, reference: Finished) -> tuple[Path, int]:
    """The reference gone on with 4 ranks for FOUR_RANK_STEPS steps, uninterrupted, logging its sample ids: (its run
    dir, the step it went on from)."""
    tmp = tmp_path_factory.mktemp("four_ranks")
    run_dir, ids = tmp / "run", tmp / "ids.jsonl"
    first = from_reference(reference, run_dir, ids)
    done = run_supervisor(fsdp_job(tmp, steps=first + FOUR_RANK_STEPS, nproc=4, samples=ids), run_dir, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, first


def test_the_same_run_dir_goes_on_with_4_ranks_then_2_and_every_sample_is_trained_once(
    four_ranks: tuple[Path, int], tmp_path: Path
) -> None:
    """2 -> 4 -> 2 ranks: each change resumes the newest sharded checkpoint, resharded, from its global sample
    count; the global batch doubles and halves with the ranks (a fixed batch per rank)."""
    four_dir, first = four_ranks
    run_dir, ids, last = tmp_path / "run", tmp_path / "ids.jsonl", first + FOUR_RANK_STEPS
    shutil.copytree(four_dir / "checkpoint", run_dir / "checkpoint")
    shutil.copy2(four_dir.parent / "ids.jsonl", ids)

    done = run_supervisor(fsdp_job(tmp_path, steps=last + 4, nproc=2, samples=ids), run_dir, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for directory, nproc in ((four_dir, 4), (run_dir, 2)):
        changed = [e for e in rank_events(directory, 0) if e["event"] == "world_size_changed"]
        assert changed[-1]["world_size"] == nproc and changed[-1]["saved_world_size"] == 6 - nproc

    batches = sample_ids(ids)
    assert [len(b) for b in batches[first:]] == [4 * PER_RANK_BATCH] * FOUR_RANK_STEPS + [2 * PER_RANK_BATCH] * 4
    trained = [i for batch in batches for i in batch]
    assert trained == list(range(len(trained)))  # in order, none skipped, none twice
    kept = sorted(p.name for p in (run_dir / "checkpoint").iterdir())
    saved = {*range(SAVE_EVERY, last + 5, SAVE_EVERY), first, last, last + 4}  # every SAVE_EVERY, each end
    assert kept == sorted(f"fsdp-{step}.dcp" for step in sorted(saved)[-KEEP:])  # rotated to KEEP, as directories
    listed = json.loads((run_dir / "health_ckpts.json").read_text())
    assert [(e["ckpt_name"], e["is_health"]) for e in listed] == [
        (name, 0) for name in sorted(kept, key=lambda n: int(n[5:-4]))
    ]


@pytest.fixture
def memory_dir(tmp_path: Path) -> Iterator[Path]:
    """The memory directory of `tmp_path / "run"`, removed after the test whatever happened."""
    path = memory_dir_for((tmp_path / "run").resolve())
    yield path
    remove_memory_dir(path)


def persist_under_way(run_dir: Path, after: int) -> int | None:
    """The step of a sharded checkpoint after `after` being copied into the checkpoint store (its directory there,
    its manifest not yet: the persister writes that last), or None."""
    for path in (run_dir / "checkpoint").glob("fsdp-*.dcp"):
        step = int(path.name[5:-4])
        if step > after and not (path / MANIFEST).exists():
            return step
    return None


def newest_in_memory(memory: Path) -> int:
    """The newest step of a complete snapshot in the memory slots (0 without one)."""
    return max((int(d.name[5:-4]) for d in memory.glob("snapshot/*/fsdp-*.dcp") if (d / MANIFEST).exists()), default=0)


def launched(run_dir: Path) -> list[tuple[int | None, str | None]]:
    """Each launch's resume step and source, from the journal."""
    events = journal(run_dir) if (run_dir / "supervisor" / "events.jsonl").exists() else []
    return [(e["resume_step"], e["resume_source"]) for e in events if e["event"] == "ranks_launched"]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def flip_shards(memory: Path, name: str) -> None:
    """Flip a byte in every file called `name` in the memory directory, once per inode (a pin links a slot's)."""
    seen: set[int] = set()
    for path in sorted(memory.rglob(name)):
        if path.stat().st_ino not in seen:
            seen.add(path.stat().st_ino)
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))


@pytest.mark.timeout(360)
def test_a_rank_killed_inside_a_persist_resumes_from_memory_a_damaged_snapshot_from_disk_and_ends_bitwise_equal(
    reference: Finished, four_ranks: tuple[Path, int], tmp_path: Path, memory_dir: Path
) -> None:
    """4 ranks go on from the reference with snapshots in memory every step and the supervisor persisting every
    pinned save slowly (MEMORY_TIER). Rank 0 SIGKILLed while a persist is under way, the step after it in memory: the
    relaunch resumes from memory within a step of the kill, and that persist completes. The supervisor SIGKILLed
    inside a later persist, then a byte flipped in rank 1's shard of every snapshot in memory: the next supervisor
    passes each over with its reason, resumes from the newest disk checkpoint and removes the torn copy. The run ends
    bitwise equal to the 4 ranks that went on uninterrupted, with only complete checkpoints on disk and nothing left
    in memory."""
    four_dir, first = four_ranks
    run_dir, last = tmp_path / "run", first + FOUR_RANK_STEPS
    assert from_reference(reference, run_dir) == first
    job = fsdp_job(tmp_path, steps=last, nproc=4, worker=MEMORY_TIER)
    proc = start_supervisor(job, run_dir)
    try:
        # Once a newer step is in memory: a persist ended by the relaunch's choice would make this one a tie, and a
        # tie goes to disk.
        persisting = wait_until(
            lambda: (step := persist_under_way(run_dir, first)) and newest_in_memory(memory_dir) > step and step,
            timeout=120,
            what="a persist under way and the step after it in memory",
        )
        os.kill(heartbeat(run_dir, 0)["pid"], signal.SIGKILL)
        assert persist_under_way(run_dir, first) == persisting  # the kill landed inside that persist
        resumed = wait_until(lambda: launched(run_dir)[1:], timeout=60, what="the relaunch")[0][0]
        second = wait_until(lambda: persist_under_way(run_dir, resumed), timeout=60, what="a persist after it")
        pids = [heartbeat(run_dir, rank)["pid"] for rank in range(4)]
        proc.kill()  # inside the second persist: the ranks die with it (parent-death signal)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert persist_under_way(run_dir, resumed) == second  # torn: nobody finishes it now
    wait_until(lambda: not any(map(alive, pids)), timeout=10, what="the ranks to die with the supervisor")
    on_disk = RunLayout(run_dir).checkpoints.complete_steps(4, "fsdp")[-1]
    in_memory = sorted({int(d.name[5:-4]) for d in memory_dir.rglob("fsdp-*.dcp") if (d / MANIFEST).exists()})
    flip_shards(memory_dir, "__1_0.distcp")
    done = run_supervisor(job, run_dir, timeout=120)

    assert done.returncode == 0, done.stderr[-3000:]
    killed_at = max(e["step"] for e in rank_events(run_dir, 0) if e["event"] == "step" and e["attempt"] == 0)
    assert launched(run_dir) == [(first, None), (resumed, "memory"), (on_disk, None)]
    assert resumed >= killed_at - MEMORY_TIER["snapshot_steps"] and resumed > persisting
    events = journal(run_dir)
    restarted = max(i for i, e in enumerate(events) if e["event"] == "supervisor_started")
    persisted = [(i > restarted, e["step"]) for i, e in enumerate(events) if e["event"] == "snapshot_persisted"]
    assert (False, persisting) in persisted  # the persist the rank's kill landed in was completed
    assert [step for later, step in persisted if later and step > on_disk]  # and the next supervisor's persist
    passed = [(e["step"], e["reason"]) for e in events if e["event"] == "snapshot_passed_over"]
    corrupted = {step for step, reason in passed if reason.startswith("memory: corrupted: checksum differs")}
    assert corrupted == {step for step in in_memory if step > on_disk} != set(), (passed, in_memory, on_disk)
    torn = {step for step, reason in passed if reason.startswith("memory: incomplete: ")}  # one being written
    assert {step for step, _ in passed} == corrupted | torn, passed
    store = run_dir / "checkpoint"
    assert not list(store.rglob("*.tmp"))
    assert all((d / MANIFEST).exists() for d in store.iterdir()), sorted(store.iterdir())
    assert not memory_dir.exists()
    got, want = export(run_dir), export(four_dir)
    assert got.keys() == want.keys() and len(got) > 20
    unequal = [name for name in want if not torch.equal(got[name], want[name])]
    assert not unequal, f"differ from the uninterrupted run: {unequal}"


def rank_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()]

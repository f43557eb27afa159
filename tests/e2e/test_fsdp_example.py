"""examples/fsdp_train.py under the real supervisor: FSDP2 with sharded checkpoints written in the background.

A kill -9 during a background write, a hang and a stop, then a rerun, end bitwise equal to an uninterrupted run
(compared through `trainwarden export`), in which a save waits for a slow write before it and says so; the same run
dir goes on with 4 ranks, then with 2 again, and across both changes every sample is trained once: no id skipped,
none seen twice."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.conftest import wait_until
from tests.e2e.conftest import FAST_HANG, REPO, Finished, finish, heartbeat, journal, run_supervisor, start_supervisor
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


def fsdp_job(tmp: Path, *, steps: int, nproc: int = 2, faults: str = "", samples: Path | None = None) -> Path:
    """examples/fsdp.yaml with the test's size, `faults` injected once each, and quick relaunches."""
    config = yaml.safe_load((REPO / "examples" / "fsdp.yaml").read_text())
    config["script"] = str(REPO / "examples" / "fsdp_train.py")
    config["args"] = [*ARGS, "--steps", str(steps), *(["--samples-file", str(samples)] if samples else [])]
    config["nproc_per_node"] = nproc
    config["env"] = {**config["env"], "TRAINWARDEN_FAULTS": faults, "TRAINWARDEN_FAULTS_ONCE": "1"}
    config["worker"]["save_checkpoint_steps"] = SAVE_EVERY
    config["worker"]["keep_checkpoint_max"] = KEEP
    config["restart"]["backoff_initial_s"] = 0.2
    config["stop"]["kill_grace_s"] = 1.0
    config["hang"] = {**config["hang"], **FAST_HANG}
    config["standby"] = {"enabled": False}
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
    proc = start_supervisor(fsdp_job(tmp, steps=UNTIL_STOPPED, faults=f"{KILL},{HANG}"), tmp / "run")
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
    resumes = [e["resume_step"] for e in events if e["event"] == "ranks_launched"]
    assert resumes[:3] == [None, 5, 15], resumes  # 10 was being written when rank 1 died: never a checkpoint

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


def test_the_same_run_dir_goes_on_with_4_ranks_then_2_and_every_sample_is_trained_once(
    reference: Finished, tmp_path: Path
) -> None:
    """2 -> 4 -> 2 ranks: each change resumes the newest sharded checkpoint, resharded, from its global sample
    count; the global batch doubles and halves with the ranks (a fixed batch per rank)."""
    run_dir, ids = tmp_path / "run", tmp_path / "ids.jsonl"
    shutil.copytree(reference.run_dir / "checkpoint", run_dir / "checkpoint")
    shutil.copy2(reference.run_dir.parent / "ids.jsonl", ids)
    first = len(sample_ids(ids))

    for nproc, steps in ((4, first + 4), (2, first + 8)):
        done = run_supervisor(fsdp_job(tmp_path, steps=steps, nproc=nproc, samples=ids), run_dir, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        changed = [e for e in rank_events(run_dir, 0) if e["event"] == "world_size_changed"]
        assert changed[-1]["world_size"] == nproc and changed[-1]["saved_world_size"] == 6 - nproc

    batches = sample_ids(ids)
    assert [len(b) for b in batches[first:]] == [4 * PER_RANK_BATCH] * 4 + [2 * PER_RANK_BATCH] * 4
    trained = [i for batch in batches for i in batch]
    assert trained == list(range(len(trained)))  # in order, none skipped, none twice
    kept = sorted(p.name for p in (run_dir / "checkpoint").iterdir())
    saved = {*range(SAVE_EVERY, first + 9, SAVE_EVERY), first, first + 4, first + 8}  # every SAVE_EVERY, each end
    assert kept == sorted(f"fsdp-{step}.dcp" for step in sorted(saved)[-KEEP:])  # rotated to KEEP, as directories
    listed = json.loads((run_dir / "health_ckpts.json").read_text())
    assert [(e["ckpt_name"], e["is_health"]) for e in listed] == [
        (name, 0) for name in sorted(kept, key=lambda n: int(n[5:-4]))
    ]


def rank_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()]

"""A real 2-rank gloo run under the supervisor survives kill -9 (and a stream of faults) and resumes bitwise
exactly."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.e2e.conftest import (
    DEMO_SIZE,
    DEMO_STEPS,
    FAULT_STREAM_RESUMES,
    REPO,
    assert_same_training_state,
    finish,
    journal,
    run_supervisor,
    signal_rank_at_step,
    start_supervisor,
    trainwarden_status,
    write_config,
)
from worker.contract import RunLayout

pytestmark = pytest.mark.timeout(300)


def test_a_stream_of_faults_is_relaunched_each_time_and_the_run_ends_bitwise_equal(
        fault_stream_run: Path, reference_run: Path) -> None:
    """FAULT_STREAM's five failures (two kills, three hangs) in one run: each relaunches every rank from the newest
    intact checkpoint, and the run finishes with the same final state as the uninterrupted one."""
    status = trainwarden_status(fault_stream_run)
    assert (status["state"], status["restarts"], status["attempt"]) == ("finished", 5, 5)
    assert status["last_checkpoint"] == {"step": DEMO_STEPS}
    assert [(f["attempt"], f["kind"]) for f in status["failures"]] == [
        (0, "hang"), (1, "signal"), (2, "signal"), (3, "hang"), (4, "hang")]
    # Rank 1 each time; a rank frozen by SIGSTOP is told from its blocked peer by neither heartbeats nor stacks.
    assert [f["rank"] for f in status["failures"][:4]] == [1, 1, 1, 1]
    launches = [e["resume_step"] for e in journal(fault_stream_run) if e["event"] == "ranks_launched"]
    assert launches == FAULT_STREAM_RESUMES
    crashes = [e for e in journal(fault_stream_run) if e["event"] == "rank_crashed"]
    assert [(e["attempt"], e["rank"], e["returncode"], e["step"]) for e in crashes] == [
        (1, 1, -signal.SIGKILL, 20), (2, 1, -signal.SIGKILL, 30)]
    assert_same_training_state(fault_stream_run, reference_run)


def test_sigkill_while_writing_a_checkpoint_leaves_it_incomplete_and_its_temporary_removed(
        fault_stream_run: Path) -> None:
    """Rank 1 killed halfway through writing checkpoint 30 leaves it incomplete: the relaunch passes over it,
    resumes from 20, and the killed save's temporary file (ours) is removed."""
    events = journal(fault_stream_run)
    passed = [(e["attempt"], e["step"], e["reason"]) for e in events if e["event"] == "checkpoint_passed_over"]
    assert (3, 30, "incomplete: rank 1 has no completion record") in passed
    assert [e["resume_step"] for e in events if e["event"] == "ranks_launched" and e["attempt"] == 3] == [20]
    removed = [e["path"] for e in events if e["event"] == "torn_temporary_removed"]
    assert len(removed) == 1 and Path(removed[0]).name.startswith(".demo_rank_1-30.ckpt."), removed
    assert not list((fault_stream_run / "checkpoint").rglob("*.tmp"))


def test_crash_after_a_snapshot_resumes_from_it_and_ends_bitwise_equal(tmp_path: Path, reference_run: Path) -> None:
    """Snapshots every 4 steps besides checkpoints every 10: rank 1 killed after step 26 → resume from the
    snapshot of 24 (slot 0), newer than checkpoint 20, and end exactly like the uninterrupted run."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "job.yaml", env={"TRAINWARDEN_FAULTS": "1:sigkill@26"},
                          worker={"snapshot_steps": 4})
    done = run_supervisor(config, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert status["resumed_from"] == {"step": 24, "source": "snapshot slot 0"}
    assert status["passed_over"] == []
    snapshots = run_dir / "checkpoint" / "snapshot"
    assert sorted(p.name for p in (snapshots / "0" / "rank_1").glob("*.ckpt")) == ["demo_rank_1-56.ckpt"]
    assert sorted(p.name for p in (snapshots / "1" / "rank_1").glob("*.ckpt")) == ["demo_rank_1-52.ckpt"]
    assert_same_training_state(run_dir, reference_run)


def test_a_minimal_config_saves_by_time_and_a_killed_rank_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    """`script` and `nproc_per_node` only: the worker library saves on its time cadence (shortened here from 10
    minutes with `--set`, and the demo to 150 small steps), every rank at the same steps, and a SIGKILL resumes from the
    newest of them."""
    config = tmp_path / "job.yaml"
    config.write_text(f"script: {REPO / 'examples' / 'demo_train.py'}\nnproc_per_node: 2\n")
    run_dir = tmp_path / "run"
    proc = start_supervisor(config, run_dir, "--set", "worker.save_checkpoint_interval_s=1.0",
                            "--set", f"args=[--steps, '150', {', '.join(DEMO_SIZE)}]")
    record = run_dir / "checkpoint" / "rank_1"
    wait_until(lambda: any(record.glob("ckpt_rank_1-*.json")), timeout=90, what="a time-based checkpoint")
    signal_rank_at_step(run_dir, 1, 0, signal.SIGKILL)
    done = finish(proc, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["state"], status["restarts"]) == ("finished", 1)
    assert status["resumed_from"]["step"] > 0
    store = RunLayout(run_dir).checkpoints
    assert store.steps(0, "ckpt") == store.steps(1, "ckpt") and 150 in store.steps(0, "ckpt")


def test_the_supervisor_says_at_start_when_a_run_saves_no_checkpoints(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text('command: ["true"]\n')
    done = finish(start_supervisor(config, tmp_path / "run", "--set", "worker.save_checkpoint_interval_s=0"),
                  tmp_path / "run", timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [e for e in journal(tmp_path / "run") if e["event"] == "checkpointing_off"]
    assert "starts again from step 0" in warning["reason"]

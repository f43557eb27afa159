"""A real 2-rank gloo run under the supervisor survives kill -9 and resumes bitwise exactly (for more faults in one
run: test_fault_stream.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.e2e.conftest import (
    DEMO_SIZE,
    REPO,
    assert_same_training_state,
    finish,
    journal,
    run_supervisor,
    signal_rank_at_step,
    start_supervisor,
    write_config,
)
from worker.contract import RunLayout

pytestmark = pytest.mark.timeout(300)


def test_crash_after_a_snapshot_resumes_from_it_and_ends_bitwise_equal(tmp_path: Path, reference_run: Path) -> None:
    """Snapshots every 4 steps besides checkpoints every 10: rank 1 killed after step 26 → resume from the
    snapshot of 24 (slot 0), newer than checkpoint 20, and end exactly like the uninterrupted run."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "job.yaml", env={"TRAINWARDEN_FAULTS": "1:sigkill@26"}, worker={"snapshot_steps": 4}
    )
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
    proc = start_supervisor(
        config,
        run_dir,
        "--set",
        "worker.save_checkpoint_interval_s=1.0",
        "--set",
        f"args=[--steps, '150', {', '.join(DEMO_SIZE)}]",
    )
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
    done = finish(
        start_supervisor(config, tmp_path / "run", "--set", "worker.save_checkpoint_interval_s=0"),
        tmp_path / "run",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [e for e in journal(tmp_path / "run") if e["event"] == "checkpointing_off"]
    assert "starts again from step 0" in warning["reason"]

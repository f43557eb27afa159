"""A real 2-rank gloo run under the supervisor survives kill -9 and resumes bitwise exactly (for more faults in one
run: test_fault_stream.py)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
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
from worker.memory import memory_dir_for, remove_memory_dir

pytestmark = pytest.mark.timeout(300)


def test_crash_after_a_snapshot_resumes_from_memory_and_ends_bitwise_equal(
    tmp_path: Path, reference_run: Path, memory_dir: Path
) -> None:
    """Snapshots every 4 steps in memory (/dev/shm), disk checkpoints every 10 written by the supervisor from pinned
    snapshots: rank 1 killed after step 26 → resume from the snapshot of 24 in memory, newer than checkpoint 20, end
    exactly like the uninterrupted run, every persisted checkpoint complete and the memory directory removed."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "job.yaml", env={"TRAINWARDEN_FAULTS": "1:sigkill@26"}, worker={"snapshot_steps": 4}
    )
    done = run_supervisor(config, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert status["resumed_from"] == {"step": 24, "source": "memory"}
    assert status["passed_over"] == []
    events = journal(run_dir)
    launched = [(e["resume_step"], e["resume_source"]) for e in events if e["event"] == "ranks_launched"]
    assert launched == [(None, None), (24, "memory")]
    # A pin the persister finds with a newer complete one beside it (the 0.5 s poll, 40 ms steps) is superseded.
    persisted = {e["step"] for e in events if e["event"] == "snapshot_persisted"}
    superseded = {e["step"] for e in events if e["event"] == "snapshot_pin_superseded"}
    # 60, the final save, is a pinned step too: the ranks take the supervisor's copy of it instead of writing it.
    assert persisted | superseded == {10, 20, 30, 40, 50, 60} and 60 in persisted
    assert not [e for e in events if e["event"] in ("persist_failed", "memory_tier_off")]
    assert RunLayout(run_dir).checkpoints.complete_steps(2, "demo") == sorted(persisted)
    assert not memory_dir.exists()
    assert_same_training_state(run_dir, reference_run)


@pytest.fixture
def memory_dir(tmp_path: Path) -> Iterator[Path]:
    """The memory directory of `tmp_path / "run"`, removed after the test whatever happened."""
    path = memory_dir_for((tmp_path / "run").resolve())
    yield path
    remove_memory_dir(path)


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
    # `snapshot_steps: auto` by default: snapshots in memory, at an interval the ranks chose, gone at the end
    ranks_said = {e["event"] for e in map(json.loads, (run_dir / "ranks" / "rank_0" / "events.jsonl").open())}
    assert {"snapshot_saved", "cadence_chosen"} <= ranks_said
    assert any(e["event"] == "memory_tier_removed" for e in journal(run_dir))


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

"""A run dir whose checkpoints 4 ranks wrote, under a 2-rank job: refused before launch, or a deliberate fresh start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import journal, outcome_lines, run_supervisor
from tests.unit.test_checkpoints import PREFIX
from tests.unit.test_world_size import FOUR, save
from worker.contract import EXIT_CONFIG, RunLayout

pytestmark = pytest.mark.timeout(60)


def two_rank_job(tmp_path: Path, **worker: object) -> Path:
    """A 2-rank job of tiny ranks that exit 0 at once, with checkpoint prefix PREFIX and `worker` settings."""
    config = {"command": [sys.executable, "-c", "pass"], "nproc_per_node": 2, "worker": {"prefix": PREFIX, **worker}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def four_rank_run_dir(tmp_path: Path) -> tuple[Path, dict[Path, bytes]]:
    """A run dir holding complete 4-rank checkpoints of steps 10 and 20, as the library writes them; every file's
    bytes, to check nothing was touched."""
    run_dir = tmp_path / "run"
    store = RunLayout(run_dir).checkpoints
    for step in (10, 20):
        save(store, step, FOUR, world_size=4)
    return run_dir, {path: path.read_bytes() for path in store.root.rglob("*") if path.is_file()}


def test_a_two_rank_job_on_four_rank_checkpoints_exits_78_naming_both_sizes_and_launches_nothing(
    tmp_path: Path,
) -> None:
    """Exit 78 with one line naming 4 and 2 and the ways out; no rank started, the checkpoints untouched."""
    run_dir, before = four_rank_run_dir(tmp_path)
    done = run_supervisor(two_rank_job(tmp_path), run_dir, timeout=30)

    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    said = outcome_lines(done.stderr)[0]
    assert said.startswith("trainwarden: run failed: not launched: the checkpoints in ")
    assert "written by 4 ranks (newest: step 20), but this job runs 2" in said
    assert "a new --run-dir" in said and "worker.resume_training: false" in said
    status = done.status()
    assert (status["state"], status["attempt"], status["restarts"]) == ("failed", 0, 0)
    assert "ranks_launched" not in [e["event"] for e in journal(run_dir)]
    assert not (run_dir / "logs").exists()
    assert {path: path.read_bytes() for path in before} == before


def test_resume_training_false_starts_the_two_rank_job_from_scratch_and_leaves_the_checkpoints(tmp_path: Path) -> None:
    """The deliberate fresh start: launched without a resume step, finished, the 4-rank checkpoints neither
    listed as this run's nor touched."""
    run_dir, before = four_rank_run_dir(tmp_path)
    done = run_supervisor(two_rank_job(tmp_path, resume_training=False), run_dir, timeout=30)

    assert done.returncode == 0, done.stderr[-2000:]
    status = done.status()
    assert (status["state"], status["resumed_from"], status["last_checkpoint"]) == ("finished", None, None)
    assert [e["resume_step"] for e in journal(run_dir) if e["event"] == "ranks_launched"] == [None]
    assert (run_dir / "health_ckpts.json").read_text().strip() == "[]"
    assert {path: path.read_bytes() for path in before} == before

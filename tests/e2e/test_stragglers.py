"""A slow rank in a real 2-rank gloo run: it alone is flagged, in the journal and in status, and the run finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import journal, run_supervisor, write_config

pytestmark = pytest.mark.timeout(180)


def test_only_the_rank_slowed_by_a_fault_is_flagged_and_the_run_finishes(tmp_path: Path) -> None:
    """`1:slow@5:0.1` with sustain_s 2: one `straggler_flagged` naming rank 1, none for rank 0, status lists rank 1,
    and the run exits 0."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "job.yaml", steps=40, stragglers={"sustain_s": 2},
                          env={"TRAINWARDEN_FAULTS": "1:slow@5:0.1", "OMP_NUM_THREADS": "1"})
    done = run_supervisor(config, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    flagged = [e for e in journal(run_dir) if e["event"] == "straggler_flagged"]
    assert [(e["rank"], e["level"]) for e in flagged] == [(1, "warning")]
    assert flagged[0]["slower_by"] > 0.2 and flagged[0]["sustained_s"] >= 2
    assert [e for e in journal(run_dir) if e["event"] == "straggler_cleared"] == []
    status = done.status()
    assert [s["rank"] for s in status["stragglers"]] == [1]
    assert sorted(status["rank_compute_s"]) == ["0", "1"]
    assert status["rank_compute_s"]["1"] > status["rank_compute_s"]["0"]

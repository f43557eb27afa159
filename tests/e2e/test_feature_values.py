"""Feature-value checks (seed 002) in real 2-rank gloo training under the supervisor (level 1 faults: with the
other skips in test_anomalies.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import journal, run_supervisor, write_config
from tests.e2e.test_anomalies import FIRST_NORM, rank_events

pytestmark = pytest.mark.timeout(240)


def test_sdc_on_one_rank_aborts_both_and_the_supervisor_rolls_back(tmp_path: Path) -> None:
    """Rank 1's activation gradient x1e12 at step 15: both ranks exit 65 naming rank 1; the relaunch finishes."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "job.yaml",
        env={"TRAINWARDEN_FAULTS": "1:sdc@15"},
        anomaly={"rollback_steps": 0, "skip_after_steps": 5},
    )
    done = run_supervisor(config, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    faults = rank_events(run_dir, 1, "feature_value_fault")
    assert [(e["attempt"], e["step"], e["batch"], e["layer"], e["reasons"]) for e in faults] == [
        (0, 15, 14, FIRST_NORM, ["above_upper_thresh1"])
    ]
    assert faults[0]["val"] > 1e6 and faults[0]["detect_level"] == 2
    assert rank_events(run_dir, 0, "feature_value_fault") == []
    expected = {
        "cause": "feature_value",
        "step": 15,
        "batch": 14,
        "first_anomaly_step": 15,
        "first_anomaly_batch": 14,
        "suspect_ranks": [1],
    }
    (suspect,) = rank_events(run_dir, 1, "anomaly_abort")
    assert {k: suspect[k] for k in expected} == expected and (suspect["local"], suspect["layer"]) == (True, FIRST_NORM)
    peer = [({k: e[k] for k in expected}, e["local"]) for e in rank_events(run_dir, 0, "anomaly_abort")]
    assert peer in ([(expected, False)], [])  # the peer aborts too, unless the supervisor's SIGTERM came first
    noticed = [
        (e["first_step"], e["abort_step"], e["first_batch"], e["abort_batch"])
        for e in journal(run_dir)
        if e["event"] == "anomaly_abort"
    ]
    assert noticed == [(15, 15, 14, 14)]
    assert [e["suspect_ranks"] for e in journal(run_dir) if e["event"] == "anomaly_abort"] == [[1]]
    assert "a feature-value fault seen by rank 1 (suspect hardware)" in done.status()["last_failure"]
    assert [e["resume_step"] for e in journal(run_dir) if e["event"] == "ranks_launched"] == [None, 10]
    assert done.status()["restarts"] == 1

"""Anomalies with real 2-rank gloo training: consistent skips, the streak abort, rollback past the bad data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint_files import load_saved
from tests.e2e.conftest import (
    DEMO_SIZE,
    DEMO_STEPS,
    GUARDED,
    REPO,
    finish,
    journal,
    run_supervisor,
    start_supervisor,
    trainwarden_status,
    write_config,
)

pytestmark = pytest.mark.timeout(240)


def rank_events(run_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


FIRST_NORM = "blocks.layers.0.norm1"  # the demo's first LayerNorm: the default target of an sdc fault


def final(run_dir: Path, rank: int) -> dict[str, Any]:
    return load_saved(run_dir / "checkpoint" / f"rank_{rank}" / f"demo_rank_{rank}-{DEMO_STEPS}.ckpt")


def test_a_spike_a_nan_and_a_level_1_feature_value_fault_on_one_rank_are_re_run_and_judged_alike_on_both(
    tmp_path: Path,
) -> None:
    """Faults on rank 1 only: a gradient spike and a NaN gradient, which stand for bad data (they strike again in a
    re-run), and at feature-value level 1 a NaN activation gradient, once, logged as a fault. Each step that alarms is
    re-run: the spike and the NaN are reproduced, the data's, and skipped on both ranks; the NaN activation gradient
    made rank 1 stand out before the reduction and was not reproduced, a transient fault, so the step goes on with
    the re-run's gradients. Nothing restarts, and the two replicas end bitwise identical."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "job.yaml",
        env={"TRAINWARDEN_FAULTS": "1:spike@15,1:nan@18,1:sdc@25:nan"},
        worker={**GUARDED, "feature_value_check": {"level": 1}},
    )
    done = run_supervisor(config, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.status()["restarts"] == 0
    skips = {rank: rank_events(run_dir, rank, "step_skipped") for rank in (0, 1)}
    for rank in (0, 1):
        assert [(e["step"], e["batch"], e["consecutive"], e["is_skip"]) for e in skips[rank]] == [
            (15, 14, 1, True),
            (18, 18, 1, True),
        ]
        assert rank_events(run_dir, rank, "anomaly_abort") == []
        verdicts = rank_events(run_dir, rank, "sdc_verdict")
        assert [(e["step"], e["suspect"], e["verdict"]) for e in verdicts] == [
            (15, None, "data"),
            (18, None, "data"),
            (25, 1, "transient"),
        ]
    assert [(e["local"], e["reasons"]) for e in skips[1]] == [
        (True, ["global_norm_above_threshold", "sdc_data"]),
        (True, ["non_finite", "sdc_data"]),
    ]
    # Rank 0 skipped 15 and 18 because rank 1 had to.
    assert [e["local"] for e in skips[0]] == [False, False]
    assert skips[1][0]["global_norm"] > 100 and skips[1][1]["global_norm"] == "nan"
    assert skips[1][0]["skip_data_grad_norm_threshold"] == 3.0
    faults = rank_events(run_dir, 1, "feature_value_fault")
    assert [(e["step"], e["layer"], e["reasons"], e["val"]) for e in faults] == [
        (25, FIRST_NORM, ["non_finite"], "nan")
    ]
    assert rank_events(run_dir, 0, "feature_value_fault") == []
    ends = [final(run_dir, rank) for rank in (0, 1)]
    assert all(torch.equal(ends[0]["model"][k], ends[1]["model"][k]) for k in ends[0]["model"])
    assert [e["data_position"] for e in ends] == [DEMO_STEPS + 2, DEMO_STEPS + 2]  # two batches consumed unused
    assert [e["scheduler"]["last_epoch"] for e in ends] == [DEMO_STEPS, DEMO_STEPS]  # the schedule did not move


def test_spike_streak_aborts_and_the_supervisor_rolls_back_past_the_bad_data(rollback_run: Path) -> None:
    """Three consecutive spikes from step 45 exit 65; the relaunch resumes 10+ steps earlier (from 30), skips the
    window and finishes (exit 0), whichever rank's exit the supervisor sees first (the peer may die of the abort,
    by SIGABRT)."""
    run_dir = rollback_run
    aborts = [rank_events(run_dir, rank, "anomaly_abort") for rank in (0, 1)]
    for events in aborts:
        assert [
            (e["step"], e["consecutive"], e["first_anomaly_step"], e["first_anomaly_batch"], e["batch"]) for e in events
        ] == [(45, 3, 45, 44, 46)]
    noticed = [e for e in journal(run_dir) if e["event"] == "anomaly_abort"]
    assert [(e["first_step"], e["abort_step"], e["first_batch"], e["abort_batch"]) for e in noticed] == [
        (45, 45, 44, 46)
    ]
    peer = [e["description"] for e in journal(run_dir) if e["event"] == "rank_stopped"]
    assert peer in (["exited with code 65"], ["killed by SIGTERM"], ["killed by SIGABRT"])  # the rollback regardless
    scheduled = [e for e in journal(run_dir) if e["event"] == "rollback_scheduled"]
    assert [(e["resume_at_most"], e["skip_to_batch"], e["tries"]) for e in scheduled] == [(35, 52, 1)]
    launches = [e["resume_step"] for e in journal(run_dir) if e["event"] == "ranks_launched"]
    assert launches == [None, 30]
    for rank in (0, 1):
        skipped = rank_events(run_dir, rank, "data_window_skipped")
        assert [(e["from_batch"], e["to_batch"]) for e in skipped] == [(30, 52)]
        resumed_batches = [e["batch"] for e in rank_events(run_dir, rank, "step") if e["attempt"] == 1]
        assert resumed_batches[0] == 52 and not any(44 <= b <= 51 for b in resumed_batches)
    status = trainwarden_status(run_dir)
    assert (status["state"], status["restarts"], status["resumed_from"]) == ("finished", 1, {"step": 30})
    assert status["rollback"]["skip_to_batch"] == 52 and status["rollback"]["abort"]["first_step"] == 45
    assert [(f["attempt"], f["kind"], f["step"]) for f in status["failures"]] == [(0, "anomaly", 45)]


def test_demo_at_its_default_settings_skips_nothing(tmp_path: Path) -> None:
    """configs/demo.yaml as shipped (threshold 3.0, 6-sigma adaptive detection, feature-value checks at level 2 with
    seed 002's thresholds) has zero false skips and no feature-value fault or warning in the demo's 600 steps, at
    the tests' batch (DEMO_SIZE: half the CPU of the demo's own)."""
    args = f"args=[--steps, '600', {', '.join(DEMO_SIZE)}]"
    proc = start_supervisor(
        REPO / "configs" / "demo.yaml", tmp_path / "run", "--set", "standby.enabled=false", "--set", args
    )
    done = finish(proc, tmp_path / "run", timeout=200)

    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert rank_events(tmp_path / "run", rank, "step_skipped") == []
        assert len(rank_events(tmp_path / "run", rank, "step")) == 600
        (started,) = rank_events(tmp_path / "run", rank, "feature_value_check_started")
        assert (started["detect_level"], len(started["layers"]), started["min_steps"]) == (2, 5, 100)
        assert rank_events(tmp_path / "run", rank, "feature_value_fault") == []
        assert rank_events(tmp_path / "run", rank, "feature_value_warning") == []

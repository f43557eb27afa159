"""Feature-value checks (seed 002) in a real torch loop: injected faults found at their step, levels act as named."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint_files import bitwise_equal
from tests.worker.test_guard import events
from worker.contract import EXIT_ANOMALY, RunLayout, WorkerConfig
from worker.feature_rule import FeatureValueConfig

FIELDS = ("step", "batch", "layer", "reasons")


def norm_model() -> torch.nn.Module:
    """4 in, 2 out, with a LayerNorm (module "1") and an RMSNorm (module "4") to check."""
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.LayerNorm(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.RMSNorm(8),
        torch.nn.Linear(8, 2),
    )


def checking(**check: object) -> WorkerConfig:
    """`feature_value_check` set to `check`; the step guard skips only NaN/Inf (this model's norms exceed 3.0)."""
    return WorkerConfig(feature_value_check=FeatureValueConfig(**check))


def findings(tmp_path, name: str) -> list[tuple]:
    return [tuple(e[k] for k in FIELDS) for e in events(tmp_path, name)]


def test_norm_layers_and_named_layers_are_checked(loop, tmp_path):
    """LayerNorm and RMSNorm are found by default; `layers` adds a module by name; the start event lists them."""
    loop(config=checking(layers=["3"]), model=norm_model).warden.finish()
    (started,) = events(tmp_path, "feature_value_check_started")
    assert started["layers"] == ["1", "3", "4"]
    assert (started["detect_level"], started["upper_thresh1"], started["sigma_thresh2"]) == (1, 1e6, 5e3)


def test_clean_run_at_defaults_finds_nothing(loop, tmp_path):
    """30 clean steps at the default level and thresholds log no fault and no warning."""
    run = loop(config=WorkerConfig(), model=norm_model)
    assert all(run.train_batch() for _ in range(30))
    run.warden.finish()
    assert events(tmp_path, "feature_value_check_started")[0]["detect_level"] == 1
    assert events(tmp_path, "feature_value_fault") == events(tmp_path, "feature_value_warning") == []


def test_huge_factor_at_level_2_aborts_at_that_step_before_the_optimizer(loop, tmp_path):
    """One layer's activation gradient times 1e9 at step 3: L1 fault at step 3, exit 65, the model as after step 2."""
    run = loop("0:sdc@3:1e9:4", config=checking(level=2), model=norm_model)
    assert run.train_batch() and run.train_batch()
    after_two = run.snapshot()
    loss = run.backward()
    with pytest.raises(SystemExit) as exited:
        run.warden.guard_step(loss, max_norm=1.0)
    assert exited.value.code == EXIT_ANOMALY
    assert bitwise_equal(run.snapshot(), after_two)
    assert [(e["kind"], e["step"]) for e in events(tmp_path, "fault_injected")] == [("sdc", 3)]
    # Backward reaches the corrupted layer first; the corruption then spreads to the layers before it.
    assert findings(tmp_path, "feature_value_fault") == [
        (3, 2, "4", ["above_upper_thresh1"]),
        (3, 2, "1", ["above_upper_thresh1"]),
    ]
    fault = events(tmp_path, "feature_value_fault")[0]
    assert fault["val"] > 1e6 and fault["pre_val"] < 10 and fault["checks"] == 2
    assert fault["min_val"] <= fault["pre_val"] <= fault["max_val"]
    (abort,) = events(tmp_path, "anomaly_abort")
    assert (abort["cause"], abort["layer"], abort["suspect_ranks"], abort["local"]) == ("feature_value", "4", [0], True)
    assert (abort["step"], abort["batch"], abort["first_anomaly_step"], abort["first_anomaly_batch"]) == (3, 2, 3, 2)
    assert abort["val"] == fault["val"] and abort["detect_level"] == 2


def test_nan_injection_is_an_l1_fault(loop, tmp_path):
    """A NaN activation gradient at step 2 is a non-finite L1 fault; at level 2 training exits with 65."""
    run = loop("0:sdc@2:nan:4", config=checking(level=2), model=norm_model)
    run.train_batch()
    with pytest.raises(SystemExit, match=str(EXIT_ANOMALY)):
        run.train_batch()
    fault = events(tmp_path, "feature_value_fault")[0]
    assert (fault["step"], fault["layer"], fault["reasons"], fault["val"]) == (2, "4", ["non_finite"], "nan")
    assert [e["cause"] for e in events(tmp_path, "anomaly_abort")] == ["feature_value"]


def test_level_1_logs_and_continues(loop, tmp_path):
    """At level 1 a NaN fault is logged and training goes on: the step guard skips that batch, nothing aborts."""
    run = loop("0:sdc@3:nan:4", config=checking(level=1), model=norm_model)
    applied = [run.train_batch() for _ in range(6)]
    run.warden.finish()
    assert applied == [True, True, False, True, True, True]
    assert (run.warden.step, run.warden.batches) == (5, 6)
    assert findings(tmp_path, "feature_value_fault") == [(3, 2, "4", ["non_finite"]), (3, 2, "1", ["non_finite"])]
    assert events(tmp_path, "anomaly_abort") == []
    assert [e["step"] for e in events(tmp_path, "step_skipped")] == [3]


def test_level_3_logs_every_normal_value(loop, tmp_path):
    """Level 3 logs each layer's value every step, with the history it was judged against."""
    run = loop(config=checking(level=3), model=norm_model)
    for _ in range(3):
        run.train_batch()
    run.warden.finish()
    normal = events(tmp_path, "feature_value_normal")
    assert [(e["step"], e["layer"], e["checks"]) for e in normal] == [
        (1, "4", 0),
        (1, "1", 0),
        (2, "4", 1),
        (2, "1", 1),
        (3, "4", 2),
        (3, "1", 2),
    ]
    assert normal[0]["pre_val"] is None and normal[2]["pre_val"] == normal[0]["val"]
    assert normal[4]["max_val"] == max(normal[0]["val"], normal[2]["val"])


def test_l2_warning_never_aborts(loop, tmp_path):
    """A value above upper_thresh2 only is a warning: logged at level 2, and training goes on."""
    run = loop("0:sdc@3:100:4", config=checking(level=2, upper_thresh2=3), model=norm_model)
    assert all(run.train_batch() for _ in range(5))
    run.warden.finish()
    assert findings(tmp_path, "feature_value_warning") == [
        (3, 2, "4", ["above_upper_thresh2"]),
        (3, 2, "1", ["above_upper_thresh2"]),
    ]
    assert events(tmp_path, "feature_value_fault") == events(tmp_path, "anomaly_abort") == []


def test_jump_after_min_steps_is_a_fault(loop, tmp_path):
    """Below both absolute thresholds, a rise of thousands of spreads after min_steps values is an L1 fault."""
    run = loop(
        "0:sdc@8:1e4:4", config=checking(level=2, min_steps=5, sigma_thresh1=100, sigma_thresh2=10), model=norm_model
    )
    assert all(run.train_batch() for _ in range(7))
    with pytest.raises(SystemExit, match=str(EXIT_ANOMALY)):
        run.train_batch()
    fault = events(tmp_path, "feature_value_fault")[0]
    assert (fault["step"], fault["layer"], fault["reasons"]) == (8, "4", ["jump_above_sigma_thresh1"])
    assert fault["val"] < 1e4 and fault["jump"] == pytest.approx(
        (fault["val"] - fault["pre_val"]) / (fault["max_val"] - fault["min_val"])
    )
    assert events(tmp_path, "feature_value_warning") == []


def test_without_guard_step_the_fault_aborts_in_step_done_before_the_checkpoint(loop, tmp_path):
    """A loop that never calls guard_step: the fault of step 3 exits 65 in step_done, before step 3 is saved."""
    config = WorkerConfig(save_checkpoint_steps=1, feature_value_check=FeatureValueConfig(level=2))
    run = loop("0:sdc@3:1e9", config=config, model=norm_model)
    for step in (1, 2, 3):
        loss = run.backward()
        run.optimizer.step()
        if step < 3:
            run.warden.step_done(loss=loss)
    with pytest.raises(SystemExit, match=str(EXIT_ANOMALY)):
        run.warden.step_done(loss=loss)
    layout = RunLayout(tmp_path)
    assert [e["step"] for e in events(tmp_path, "checkpoint_saved")] == [1, 2]
    assert not layout.checkpoints.file(0, 3, "ckpt").exists()
    (abort,) = events(tmp_path, "anomaly_abort")
    assert (abort["step"], abort["layer"], abort["suspect_ranks"]) == (3, "1", [0])  # default target: first layer


def test_env_level_overrides_yaml(loop, tmp_path, monkeypatch):
    """TRAINWARDEN_ASD_ENABLE=0 turns off a level-2 config: no hooks, the sdc fault is not armed, nothing aborts."""
    monkeypatch.setenv("TRAINWARDEN_ASD_ENABLE", "0")
    run = loop("0:sdc@2:1e9:4", config=checking(level=2), model=norm_model)
    assert all(run.train_batch() for _ in range(3))
    run.warden.finish()
    assert events(tmp_path, "feature_value_check_started") == []
    assert [(e["kind"], e["layer"]) for e in events(tmp_path, "fault_not_armed")] == [("sdc", "4")]
    assert events(tmp_path, "fault_injected") == events(tmp_path, "anomaly_abort") == []


def test_invalid_env_is_logged_and_yaml_kept(loop, tmp_path, monkeypatch):
    """An invalid TRAINWARDEN_ASD_UPPER_THRESH is logged as feature_value_env_invalid; the YAML values stay."""
    monkeypatch.setenv("TRAINWARDEN_ASD_UPPER_THRESH", "10,1000")
    loop(config=checking(level=2, upper_thresh1=500, upper_thresh2=50), model=norm_model).warden.finish()
    (invalid,) = events(tmp_path, "feature_value_env_invalid")
    assert invalid["problem"].startswith("TRAINWARDEN_ASD_UPPER_THRESH='10,1000' ignored")
    (started,) = events(tmp_path, "feature_value_check_started")
    assert (started["upper_thresh1"], started["upper_thresh2"], started["detect_level"]) == (500, 50, 2)


def test_a_fault_trained_into_the_model_makes_later_checkpoints_unhealthy(loop, tmp_path):
    """Level 1 trains on after a finite fault at step 3; with the health monitor on, checkpoint 2 stays healthy and
    checkpoints 4 and 6 are tagged unhealthy, so a resume falls back to 2."""
    config = WorkerConfig(
        save_checkpoint_steps=2, use_checkpoint_health_monitor=True, feature_value_check=FeatureValueConfig(level=1)
    )
    run = loop("0:sdc@3:1e9:4", config=config, model=norm_model)
    assert all(run.train_batch() for _ in range(6))
    run.warden.finish()
    records = {s: json.loads(RunLayout(tmp_path).checkpoints.record(0, s, "ckpt").read_text()) for s in (2, 4, 6)}
    assert [(s, r["is_health"]) for s, r in records.items()] == [(2, 0), (4, 1), (6, 1)]
    assert records[4]["health_reasons"] == ["feature-value fault at step 3 trained into the model"]

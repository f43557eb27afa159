"""Seed 000's keys in the `worker:` section, the `anomaly:` section, and the nested worker config in the environment."""

from __future__ import annotations

import json

import pytest

from supervisor.config import ConfigError, load_config, parse_config
from supervisor.core.rollback import AnomalyPolicy
from worker.anomaly import AdaptiveConfig, MonitorConfig
from worker.contract import ENV_WORKER_CONFIG, WorkerConfig
from worker.feature_rule import FeatureValueConfig
from worker.store import parse_checkpoint_name

SEED_000 = {
    "use_skip_data_by_global_norm": True,
    "monitor_config": {
        "monitor_on": True,
        "check_for_global_norm": False,
        "global_norm_spike_threshold": 3.0,
        "global_norm_spike_count_threshold": 10,
    },
}


def refusal(raw: dict) -> str:
    """The ConfigError message for the job config `raw` (a script plus the given sections)."""
    with pytest.raises(ConfigError) as info:
        parse_config({"script": "t.py", **raw}, source="job.yaml")
    message = str(info.value)
    assert message.startswith("job.yaml: ")
    return message


# ---- seed 000 keys ----------------------------------------------------------------------------


def test_seed_000_keys_parse_in_worker_section():
    """Seed 000's `use_skip_data_by_global_norm` and `monitor_config` keys parse into the WorkerConfig."""
    config = parse_config({"script": "t.py", "worker": SEED_000})
    assert config.worker == WorkerConfig(
        use_skip_data_by_global_norm=True,
        monitor_config=MonitorConfig(
            monitor_on=True,
            check_for_global_norm=False,
            global_norm_spike_threshold=3.0,
            global_norm_spike_count_threshold=10,
        ),
    )


def test_seed_000_defaults():
    """Without the keys, skipping is off, the monitor has seed 000's defaults (threshold 3.0, count 10) and the
    adaptive spike rule is on (6 sigma over the last 128 normal steps)."""
    config = parse_config({"script": "t.py"})
    assert config.worker.use_skip_data_by_global_norm is False
    assert config.worker.monitor_config == MonitorConfig(
        monitor_on=True,
        check_for_global_norm=False,
        global_norm_spike_threshold=3.0,
        global_norm_spike_count_threshold=10,
    )
    assert config.worker.adaptive_spike == AdaptiveConfig(
        enabled=True, sigmas=6.0, window=128, min_samples=64, include_loss=False
    )


def test_partial_monitor_config_keeps_other_defaults():
    """A `monitor_config` naming one key keeps the defaults of the others; an integer threshold becomes a float."""
    config = parse_config({"script": "t.py", "worker": {"monitor_config": {"global_norm_spike_threshold": 5}}})
    assert config.worker.monitor_config == MonitorConfig(global_norm_spike_threshold=5.0)
    assert isinstance(config.worker.monitor_config.global_norm_spike_threshold, float)


def test_adaptive_spike_keys_parse():
    """The `adaptive_spike` keys parse into the AdaptiveConfig."""
    raw = {"enabled": True, "sigmas": 4, "window": 32, "min_samples": 16, "include_loss": True}
    config = parse_config({"script": "t.py", "worker": {"adaptive_spike": raw}})
    assert config.worker.adaptive_spike == AdaptiveConfig(
        enabled=True, sigmas=4.0, window=32, min_samples=16, include_loss=True
    )


def test_unknown_monitor_config_key_refused_by_dotted_name():
    """An unknown key inside `monitor_config` is refused by its full dotted name."""
    message = refusal({"worker": {"monitor_config": {"xxx": 1}}})
    assert "unknown key 'worker.monitor_config.xxx'" in message


def test_misspelt_monitor_config_key_refused_with_suggestion():
    """A misspelt `monitor_config` key is refused with the close known key suggested."""
    message = refusal({"worker": {"monitor_config": {"global_norm_spike_treshold": 2.0}}})
    assert (
        "unknown key 'worker.monitor_config.global_norm_spike_treshold' (did you mean "
        "'global_norm_spike_threshold'?)" in message
    )


def test_wrong_type_in_monitor_config_refused_by_dotted_name():
    """A fractional count threshold is refused by its dotted name as not an integer."""
    message = refusal({"worker": {"monitor_config": {"global_norm_spike_count_threshold": 2.5}}})
    assert "'worker.monitor_config.global_norm_spike_count_threshold' must be an integer, got 2.5" in message


def test_monitor_config_not_a_mapping_refused():
    """A scalar given for `monitor_config` is refused naming the section."""
    message = refusal({"worker": {"monitor_config": True}})
    assert "worker.monitor_config must be a mapping of keys to values, got True" in message


@pytest.mark.parametrize(
    ("section", "raw", "expected"),
    [
        (
            "worker",
            {"monitor_config": {"global_norm_spike_threshold": 0}},
            "'worker.monitor_config.global_norm_spike_threshold' must be more than 0, got 0",
        ),
        (
            "worker",
            {"monitor_config": {"global_norm_spike_threshold": -1.5}},
            "'worker.monitor_config.global_norm_spike_threshold' must be more than 0, got -1.5",
        ),
        (
            "worker",
            {"monitor_config": {"global_norm_spike_count_threshold": 0}},
            "'worker.monitor_config.global_norm_spike_count_threshold' must be a positive integer, got 0",
        ),
        ("worker", {"adaptive_spike": {"sigmas": 0}}, "'worker.adaptive_spike.sigmas' must be more than 0, got 0"),
        ("worker", {"adaptive_spike": {"window": 1}}, "'worker.adaptive_spike.window' must be at least 2, got 1"),
        (
            "worker",
            {"adaptive_spike": {"min_samples": 1}},
            "'worker.adaptive_spike.min_samples' must be at least 2, got 1",
        ),
        ("anomaly", {"rollback_steps": -1}, "'anomaly.rollback_steps' must be 0 or more, got -1"),
        ("anomaly", {"skip_after_steps": -1}, "'anomaly.skip_after_steps' must be 0 or more, got -1"),
        ("anomaly", {"max_tries": 0}, "'anomaly.max_tries' must be at least 1, got 0"),
        ("anomaly", {"widen_factor": 0.5}, "'anomaly.widen_factor' must be at least 1, got 0.5"),
    ],
)
def test_out_of_bounds_anomaly_value_refused(section, raw, expected):
    """A value outside its bounds is refused naming the dotted key, the bound and the value."""
    assert expected in refusal({section: raw})


@pytest.mark.parametrize(
    ("section", "raw"),
    [
        ("worker", {"monitor_config": {"global_norm_spike_threshold": 0.001, "global_norm_spike_count_threshold": 1}}),
        ("worker", {"adaptive_spike": {"sigmas": 0.5, "window": 2, "min_samples": 2}}),
        ("anomaly", {"rollback_steps": 0, "skip_after_steps": 0, "max_tries": 1, "widen_factor": 1}),
    ],
)
def test_smallest_allowed_anomaly_values_accepted(section, raw):
    """The smallest values inside the bounds are accepted."""
    parse_config({"script": "t.py", section: raw})


# ---- the anomaly: section ---------------------------------------------------------------------


def test_anomaly_section_parsed_into_policy():
    """The `anomaly:` keys become the AnomalyPolicy the core's Policy carries."""
    config = parse_config(
        {
            "script": "t.py",
            "anomaly": {"rollback_steps": 50, "skip_after_steps": 300, "max_tries": 2, "widen_factor": 3},
        }
    )
    expected = AnomalyPolicy(rollback_steps=50, skip_after_steps=300, max_tries=2, widen_factor=3.0)
    assert config.anomaly == expected
    assert config.policy().anomaly == expected


def test_anomaly_section_defaults():
    """Without an `anomaly:` section the policy has its defaults."""
    config = parse_config({"script": "t.py"})
    assert config.anomaly == AnomalyPolicy(rollback_steps=100, skip_after_steps=200, max_tries=3, widen_factor=2.0)
    assert config.policy().anomaly == config.anomaly


def test_unknown_anomaly_key_refused_with_suggestion():
    """A misspelt `anomaly:` key is refused by its dotted name with the close known key suggested."""
    message = refusal({"anomaly": {"max_try": 2}})
    assert "unknown key 'anomaly.max_try' (did you mean 'max_tries'?)" in message


# ---- worker config through the environment ----------------------------------------------------


def test_worker_config_round_trips_nested_sections(monkeypatch):
    """A WorkerConfig with non-default nested sections comes back equal from `to_env` / `from_env`."""
    config = WorkerConfig(
        save_checkpoint_steps=7,
        use_skip_data_by_global_norm=True,
        monitor_config=MonitorConfig(
            monitor_on=False,
            check_for_global_norm=True,
            global_norm_spike_threshold=2.5,
            global_norm_spike_count_threshold=4,
        ),
        adaptive_spike=AdaptiveConfig(enabled=True, sigmas=3.0, window=16, min_samples=8, include_loss=True),
    )
    monkeypatch.setenv(ENV_WORKER_CONFIG, config.to_env())
    assert WorkerConfig.from_env() == config


def test_worker_config_to_env_nests_sections_as_objects():
    """`to_env` writes the nested sections as JSON objects under their seed names."""
    raw = json.loads(WorkerConfig(use_skip_data_by_global_norm=True).to_env())
    assert raw["use_skip_data_by_global_norm"] is True
    assert raw["monitor_config"] == {
        "monitor_on": True,
        "check_for_global_norm": False,
        "global_norm_spike_threshold": 3.0,
        "global_norm_spike_count_threshold": 10,
    }
    assert raw["adaptive_spike"] == {
        "enabled": True,
        "sigmas": 6.0,
        "window": 128,
        "min_samples": 64,
        "include_loss": False,
    }


def test_worker_config_from_env_ignores_unknown_nested_keys(monkeypatch):
    """Unknown keys inside a nested section are ignored; the known ones are kept and the rest default."""
    raw = {
        "use_skip_data_by_global_norm": True,
        "monitor_config": {"global_norm_spike_count_threshold": 3, "future_knob": 1},
        "adaptive_spike": {"enabled": True, "future_knob": "x"},
    }
    monkeypatch.setenv(ENV_WORKER_CONFIG, json.dumps(raw))
    assert WorkerConfig.from_env() == WorkerConfig(
        use_skip_data_by_global_norm=True,
        monitor_config=MonitorConfig(global_norm_spike_count_threshold=3),
        adaptive_spike=AdaptiveConfig(enabled=True),
    )


def test_parsed_seed_000_config_reaches_the_worker(monkeypatch):
    """The `worker:` section a job config parses into is what a rank reads back from its environment."""
    worker = parse_config({"script": "t.py", "worker": SEED_000}).worker
    monkeypatch.setenv(ENV_WORKER_CONFIG, worker.to_env())
    assert WorkerConfig.from_env() == worker


def test_adaptive_window_smaller_than_min_samples_refused():
    """An enabled adaptive rule whose window (32) cannot hold min_samples (default 64) is refused by name."""
    message = refusal({"worker": {"adaptive_spike": {"enabled": True, "window": 32}}})
    assert "worker.adaptive_spike" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("false", False), ("demo_rank_0-40.ckpt", "demo_rank_0-40.ckpt"), ("'40'", "40")],
)
def test_resume_training_takes_a_flag_or_a_checkpoint_name(tmp_path, value, expected):
    """Seed 001's `resume_training` is true, false, or the name (or step) of the checkpoint to resume from."""
    path = tmp_path / "job.yaml"
    path.write_text(f"script: t.py\nworker: {{resume_training: {value}}}\n")
    assert load_config(path).worker.resume_training == expected


def test_resume_training_with_a_name_that_is_no_checkpoint_is_refused(tmp_path):
    """A `resume_training` string that names no checkpoint is refused by key, with what would do."""
    path = tmp_path / "job.yaml"
    path.write_text("script: t.py\nworker: {resume_training: latest}\n")
    with pytest.raises(ConfigError, match=r"'worker.resume_training' must be true, false, or a checkpoint name"):
        load_config(path)


@pytest.mark.parametrize(
    ("name", "step"),
    [("demo_rank_0-40.ckpt", 40), ("x_rank_3-7.json", 7), ("12", 12), ("latest", None), ("demo-40.ckpt", None)],
)
def test_parse_checkpoint_name(name, step):
    """A rank's checkpoint file name or a bare step number give the step; anything else gives None."""
    assert parse_checkpoint_name(name) == step


# ---- feature_value_check (seed 002) --------------------------------------------------------------


def test_feature_value_check_section_parses(tmp_path):
    """The `feature_value_check` section parses from YAML into the FeatureValueConfig, integers becoming floats."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "script: t.py\nworker:\n  feature_value_check: {level: 2, upper_thresh1: 5000, upper_thresh2: 50,\n"
        "    sigma_thresh1: 900, sigma_thresh2: 30, min_steps: 10, layers: [blocks.0.attn, Dropout]}\n"
    )
    assert load_config(path).worker.feature_value_check == FeatureValueConfig(
        level=2,
        upper_thresh1=5000.0,
        upper_thresh2=50.0,
        sigma_thresh1=900.0,
        sigma_thresh2=30.0,
        min_steps=10,
        layers=["blocks.0.attn", "Dropout"],
    )


def test_feature_value_check_defaults_to_level_1_with_seed_002_thresholds():
    """Without the section: level 1 (log only), seed 002's thresholds, 100 minimum steps, norm layers only."""
    assert parse_config({"script": "t.py"}).worker.feature_value_check == FeatureValueConfig(
        level=1, upper_thresh1=1e6, upper_thresh2=1e4, sigma_thresh1=1e5, sigma_thresh2=5e3, min_steps=100, layers=[]
    )


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"level": 4}, "'worker.feature_value_check.level' must be 0, 1, 2 or 3"),
        ({"level": True}, "'worker.feature_value_check.level' must be an integer"),
        ({"upper_thresh2": 2}, "'worker.feature_value_check.upper_thresh2' must be at least 3"),
        ({"sigma_thresh1": 1}, "'worker.feature_value_check.sigma_thresh1' must be at least 3"),
        ({"min_steps": -1}, "'worker.feature_value_check.min_steps' must be 0 or more"),
        ({"layers": "norm"}, "'worker.feature_value_check.layers' must be a list"),
        (
            {"upper_thresh1": 100, "upper_thresh2": 100},
            "'worker.feature_value_check.upper_thresh1' (100) must be greater",
        ),
        ({"sigma_thresh2": 200000}, "'worker.feature_value_check.sigma_thresh1' (100000) must be greater"),
        ({"levle": 2}, "unknown key 'worker.feature_value_check.levle' (did you mean 'level'?)"),
    ],
)
def test_bad_feature_value_check_refused_by_key(section, expected):
    """Out-of-range levels and thresholds, L1 not above L2, and unknown keys are refused by their dotted name."""
    assert expected in refusal({"worker": {"feature_value_check": section}})


def test_feature_value_check_travels_to_the_worker(monkeypatch):
    """The section survives the supervisor-to-rank hand-over through TRAINWARDEN_WORKER_CONFIG."""
    worker = parse_config({"script": "t.py", "worker": {"feature_value_check": {"level": 3, "layers": ["x"]}}}).worker
    monkeypatch.setenv(ENV_WORKER_CONFIG, worker.to_env())
    assert WorkerConfig.from_env().feature_value_check == FeatureValueConfig(level=3, layers=["x"])


# ---- weights_only ------------------------------------------------------------------------------


def test_weights_only_defaults_to_true_and_false_reaches_the_worker(monkeypatch):
    """`worker.weights_only` is true unless the config says false, and a false one is what the rank reads back."""
    assert parse_config({"script": "t.py"}).worker.weights_only is True
    worker = parse_config({"script": "t.py", "worker": {"weights_only": False}}).worker
    monkeypatch.setenv(ENV_WORKER_CONFIG, worker.to_env())
    assert WorkerConfig.from_env().weights_only is False


def test_weights_only_that_is_not_a_boolean_is_refused():
    """A `weights_only` given as the string 'false' is refused by key rather than read as true."""
    assert refusal({"worker": {"weights_only": "false"}}) == (
        "job.yaml: 'worker.weights_only' must be true or false, got 'false'"
    )

"""Seed 002's feature-value rule on plain values: L1 faults, L2 warnings, the jump, the history, the env vars."""

from __future__ import annotations

import math

import pytest

from worker.feature_rule import FeatureValueConfig, History, judge, with_env

DEFAULTS = FeatureValueConfig()
SHORT = FeatureValueConfig(min_steps=3)


def history_of(*values: float) -> History:
    """A history that has recorded `values` in order."""
    history = History()
    for value in values:
        history.record(value)
    return history


def test_defaults_are_seed_002s():
    """Level 1 (log only), thresholds 1000000/10000 and 100000/5000, and MindSpore's 100 minimum steps."""
    assert (DEFAULTS.level, DEFAULTS.upper_thresh1, DEFAULTS.upper_thresh2) == (1, 1_000_000.0, 10_000.0)
    assert (DEFAULTS.sigma_thresh1, DEFAULTS.sigma_thresh2, DEFAULTS.min_steps) == (100_000.0, 5_000.0, 100)


def test_normal_value_is_normal():
    """A value under both absolute thresholds, with no jump to judge, is normal and gives no reasons."""
    finding = judge(0.5, history_of(0.4, 0.6), DEFAULTS)
    assert (finding.verdict, finding.reasons, finding.jump) == ("normal", (), None)


@pytest.mark.parametrize("val", [math.nan, math.inf, -math.inf])
def test_non_finite_is_a_fault_from_the_first_check(val):
    """NaN and Inf are L1 faults even with no history at all."""
    finding = judge(val, History(), DEFAULTS)
    assert (finding.verdict, finding.reasons) == ("fault", ("non_finite",))


def test_above_upper_thresh1_is_a_fault_before_min_steps():
    """The absolute L1 threshold applies from the first check, without waiting for min_steps."""
    finding = judge(1_000_001.0, History(), DEFAULTS)
    assert (finding.verdict, finding.reasons) == ("fault", ("above_upper_thresh1",))


def test_between_the_absolute_thresholds_is_a_warning():
    """Above upper_thresh2 and at most upper_thresh1 is an L2 warning."""
    finding = judge(1_000_000.0, History(), DEFAULTS)
    assert (finding.verdict, finding.reasons) == ("warning", ("above_upper_thresh2",))
    assert judge(10_000.0, History(), DEFAULTS).verdict == "normal"  # strictly above


def test_jump_is_rise_over_the_history_spread():
    """jump = (val - pre_val) / (max_val - min_val)."""
    finding = judge(3.0, history_of(1.0, 2.0, 1.5), SHORT)
    assert finding.jump == pytest.approx((3.0 - 1.5) / (2.0 - 1.0))


def test_jump_is_not_judged_before_min_steps():
    """With fewer than min_steps values seen, even an enormous relative rise is no finding."""
    history = history_of(1.0, 1.001)
    finding = judge(9_000.0, history, SHORT)
    assert (finding.verdict, finding.jump) == ("normal", None)
    history.record(1.0)
    assert judge(9_000.0, history, SHORT).reasons == ("jump_above_sigma_thresh1",)  # the third value enables it


def test_jump_above_sigma_thresh1_is_a_fault_and_above_sigma_thresh2_a_warning():
    """A rise of more than sigma_thresh1 spreads is L1; more than sigma_thresh2 (only) is L2."""
    history = history_of(1.0, 1.001, 1.0)  # spread 0.001
    assert judge(1.0 + 0.001 * 100_001, history, SHORT).reasons == ("jump_above_sigma_thresh1",)
    assert judge(1.0 + 0.001 * 5_001, history, SHORT).reasons == ("jump_above_sigma_thresh2",)
    assert judge(1.0 + 0.001 * 4_999, history, SHORT).verdict == "normal"


def test_a_fall_is_no_jump():
    """Only rises count: a value falling far below its history is normal."""
    finding = judge(0.0, history_of(1.0, 1.001, 1.0), SHORT)
    assert finding.verdict == "normal" and finding.jump < 0


def test_flat_history_has_no_jump():
    """A history without spread (an unused layer's zeros) has no jump, so it cannot divide by zero."""
    finding = judge(5.0, history_of(0.0, 0.0, 0.0), SHORT)
    assert (finding.verdict, finding.jump) == ("normal", None)


def test_both_l1_reasons_are_named():
    """A value above upper_thresh1 that also jumps carries both reasons."""
    finding = judge(2_000_000.0, history_of(1.0, 1.001, 1.0), SHORT)
    assert finding.reasons == ("above_upper_thresh1", "jump_above_sigma_thresh1")


def test_judge_leaves_history_and_finding_keeps_the_before_state():
    """judge() changes nothing; the finding holds the history as it was (the seed's pre_val, min_val, max_val)."""
    history = history_of(1.0, 3.0, 2.0)
    finding = judge(math.nan, history, DEFAULTS)
    assert history == History(checks=3, pre_val=2.0, min_val=1.0, max_val=3.0)
    assert finding.history == history and finding.history is not history


def test_non_finite_values_move_only_pre_val():
    """After a NaN the history's pre_val is NaN, min/max keep the finite values, and the jump is undefined."""
    history = history_of(1.0, 3.0, math.nan)
    assert (history.checks, history.min_val, history.max_val) == (3, 1.0, 3.0)
    assert math.isnan(history.pre_val)
    assert history.jump(5.0) is None


def test_env_overrides_yaml():
    """TRAINWARDEN_ASD_* replace the YAML values, with seed 002's 'L1,L2' pair format."""
    env = {
        "TRAINWARDEN_ASD_ENABLE": "3",
        "TRAINWARDEN_ASD_UPPER_THRESH": "500,20",
        "TRAINWARDEN_ASD_SIGMA_THRESH": " 1000, 50 ",
        "TRAINWARDEN_ASD_MIN_STEPS": "7",
        "TRAINWARDEN_ASD_LAYERS": "blocks.0.attn, head",
    }
    config, problems = with_env(FeatureValueConfig(level=1, layers=["x"]), env)
    assert problems == []
    assert config == FeatureValueConfig(
        level=3,
        upper_thresh1=500.0,
        upper_thresh2=20.0,
        sigma_thresh1=1000.0,
        sigma_thresh2=50.0,
        min_steps=7,
        layers=["blocks.0.attn", "head"],
    )


def test_unset_or_empty_env_keeps_yaml():
    """Without the variables (or with empty ones) the config is unchanged."""
    config = FeatureValueConfig(level=2, min_steps=5)
    assert with_env(config, {"TRAINWARDEN_ASD_ENABLE": ""}) == (config, [])


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("TRAINWARDEN_ASD_ENABLE", "4", "must be 0, 1, 2 or 3"),
        ("TRAINWARDEN_ASD_ENABLE", "on", "must be 0, 1, 2 or 3"),
        ("TRAINWARDEN_ASD_UPPER_THRESH", "1000000", "must be two numbers"),
        ("TRAINWARDEN_ASD_UPPER_THRESH", "10,1000", "needs L1 > L2 >= 3"),
        ("TRAINWARDEN_ASD_SIGMA_THRESH", "100,2", "needs L1 > L2 >= 3"),
        ("TRAINWARDEN_ASD_SIGMA_THRESH", "a,b", "must be two numbers"),
        ("TRAINWARDEN_ASD_MIN_STEPS", "-1", "must be an integer"),
    ],
)
def test_invalid_env_is_ignored_and_named(name, value, why):
    """An invalid variable leaves the YAML value in force and is described by name, value and reason."""
    config = FeatureValueConfig(level=2)
    kept, problems = with_env(config, {name: value})
    assert kept == config
    assert len(problems) == 1 and problems[0].startswith(f"{name}={value!r} ignored: ") and why in problems[0]

"""Hang detection's pure functions: percentile, calibrated and per-phase timeouts, beat deadlines, the gap window."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.core.hangs import (
    Calibration,
    HangPolicy,
    beat_deadline,
    calibrated_train_timeout,
    percentile,
    phase_timeout,
    with_gaps,
)

NOW = 1000.0
ON = Calibration(enabled=True, multiplier=10.0, percentile=99.0, floor_s=30.0, min_samples=3)
POLICY = HangPolicy()
CALIBRATING = HangPolicy(calibration=ON)
GAPS = (5.0, 6.0, 8.0)  # calibrated train timeout under ON: 10 * 8 = 80 s


def deadline(
    policy: HangPolicy = POLICY,
    *,
    phase: str | None = "train",
    last_beat: float | None = NOW + 10,
    expect_beat: bool = True,
    gaps: tuple[float, ...] = (),
) -> float | None:
    """`beat_deadline` for an attempt launched at NOW, with keyword defaults for the usual case."""
    return beat_deadline(policy, phase=phase, last_beat=last_beat, launched_at=NOW, expect_beat=expect_beat, gaps=gaps)


# ---- percentile -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pct", "expected"),
    [(0, 15.0), (5, 15.0), (30, 20.0), (40, 20.0), (50, 35.0), (100, 50.0)],
)
def test_percentile_nearest_rank_of_five(pct, expected):
    """Nearest-rank percentiles of 15, 20, 35, 40, 50 are the textbook values."""
    assert percentile((15.0, 20.0, 35.0, 40.0, 50.0), pct) == expected


@pytest.mark.parametrize(("pct", "expected"), [(25, 7.0), (50, 8.0), (75, 15.0), (100, 20.0)])
def test_percentile_nearest_rank_of_ten_unsorted(pct, expected):
    """Nearest-rank percentiles of an unsorted sample equal those of the sorted one."""
    assert percentile((20.0, 8.0, 3.0, 16.0, 6.0, 8.0, 15.0, 13.0, 7.0, 10.0), pct) == expected


def test_percentile_of_one_value_is_that_value():
    """Any percentile of a single sample is that sample."""
    assert [percentile((4.5,), pct) for pct in (0, 50, 99, 100)] == [4.5, 4.5, 4.5, 4.5]


def test_percentile_99_of_hundred_is_the_99th():
    """p99 of 1..100 is 99, and p100 is the maximum."""
    values = tuple(float(v) for v in range(1, 101))
    assert (percentile(values, 99), percentile(values, 100)) == (99.0, 100.0)


def test_percentile_exact_rank_is_not_rounded_up_by_float_error():
    """p7 of 1..100 is the 7th value, not the 8th."""
    assert percentile(tuple(float(v) for v in range(1, 101)), 7) == 7.0


# ---- calibrated train timeout -----------------------------------------------------------------


def test_calibrated_timeout_none_when_disabled():
    """With calibration disabled, no timeout is learned however many gaps there are."""
    assert calibrated_train_timeout((5.0,) * 100, Calibration()) is None


def test_calibrated_timeout_none_below_min_samples():
    """With fewer than min_samples gaps, no timeout is learned yet."""
    assert calibrated_train_timeout((5.0, 6.0), ON) is None


def test_calibrated_timeout_at_min_samples_is_multiplier_times_percentile():
    """At exactly min_samples gaps, the timeout is multiplier * the percentile of the gaps."""
    assert calibrated_train_timeout(GAPS, ON) == 80.0


def test_calibrated_timeout_uses_configured_percentile():
    """The configured percentile picks the sample: p50 of 5, 6, 8 is 6."""
    assert calibrated_train_timeout(GAPS, replace(ON, percentile=50.0)) == 60.0


def test_calibrated_timeout_floor_for_fast_steps():
    """A 0.2 s step gives the floor, not a 2 s hair-trigger."""
    assert calibrated_train_timeout((0.2,) * 20, ON) == 30.0


# ---- phase timeout ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        ("startup", 900.0),
        ("train", 300.0),
        ("save", 1800.0),
        ("eval", 1800.0),
        ("done", 900.0),
        ("shuffle_shards", 900.0),
    ],
)
def test_phase_timeout_defaults(phase, expected):
    """Default timeouts per phase; a phase not configured gets default_timeout_s."""
    assert phase_timeout(POLICY, phase, ()) == expected


def test_phase_timeout_unknown_phase_gets_default_timeout():
    """An unconfigured phase gets the configured default_timeout_s."""
    assert phase_timeout(replace(POLICY, default_timeout_s=777.0), "shuffle_shards", ()) == 777.0


def test_phase_timeout_configured_mapping_keeps_other_defaults():
    """Naming some phases overrides or adds those and keeps the defaults of the others."""
    policy = HangPolicy(phase_timeouts_s={"train": 60.0, "checkpoint": 120.0}, default_timeout_s=500.0)
    assert [phase_timeout(policy, p, ()) for p in ("train", "checkpoint", "save", "eval", "startup", "other")] == [
        60.0,
        120.0,
        1800.0,
        1800.0,
        900.0,
        500.0,
    ]


def test_phase_timeout_train_uses_calibration_once_learned():
    """The `train` timeout is the calibrated one once enough gaps are seen, the configured one before."""
    assert phase_timeout(CALIBRATING, "train", GAPS[:2]) == 300.0
    assert phase_timeout(CALIBRATING, "train", GAPS) == 80.0


def test_phase_timeout_calibration_only_for_train():
    """Calibration never changes the timeout of another phase."""
    assert phase_timeout(CALIBRATING, "save", GAPS) == 1800.0


def test_default_phase_timeouts_not_shared_between_policies():
    """Each HangPolicy gets its own default phase mapping."""
    first, second = HangPolicy(), HangPolicy()
    assert first.phase_timeouts_s == second.phase_timeouts_s
    assert first.phase_timeouts_s is not second.phase_timeouts_s


# ---- beat deadline ----------------------------------------------------------------------------


def test_beat_deadline_after_beat_is_beat_plus_phase_timeout():
    """After a heartbeat, the deadline is the time it was seen plus its phase's timeout."""
    assert deadline(phase="train") == NOW + 10 + 300
    assert deadline(phase="save") == NOW + 10 + 1800


def test_beat_deadline_uses_calibrated_train_timeout():
    """After a `train` heartbeat, a learned timeout sets the deadline."""
    assert deadline(CALIBRATING, gaps=GAPS) == NOW + 10 + 80


def test_beat_deadline_before_first_beat_when_expected():
    """Before the first heartbeat, when one is expected, the deadline is launch + first_heartbeat_s."""
    assert deadline(phase=None, last_beat=None) == NOW + 900
    assert deadline(replace(POLICY, first_heartbeat_s=60.0), phase=None, last_beat=None) == NOW + 60


def test_beat_deadline_before_first_beat_when_not_expected_is_none():
    """Before the first heartbeat, when none is expected yet, there is no deadline."""
    assert deadline(phase=None, last_beat=None, expect_beat=False) is None


def test_beat_deadline_without_phase_counts_from_launch():
    """A beat time with no phase is treated as no beat: the first-heartbeat rule applies."""
    assert deadline(phase=None, last_beat=NOW + 10) == NOW + 900
    assert deadline(phase="train", last_beat=None) == NOW + 900


def test_beat_deadline_after_beat_ignores_expect_beat():
    """Once a rank has beaten, its deadline applies whether or not a first beat was expected."""
    assert deadline(expect_beat=False) == NOW + 10 + 300


@pytest.mark.parametrize(
    ("phase", "last_beat", "expect_beat"),
    [(None, None, True), (None, None, False), ("train", NOW + 10, True), ("save", NOW + 10, False)],
)
def test_beat_deadline_off_is_always_none(phase, last_beat, expect_beat):
    """With heartbeat `off` there is never a deadline."""
    policy = replace(POLICY, heartbeat="off")
    assert deadline(policy, phase=phase, last_beat=last_beat, expect_beat=expect_beat) is None


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_beat_deadline_same_in_auto_and_required(mode):
    """`auto` and `required` differ only in whether a first beat is expected, which the caller decides."""
    policy = replace(POLICY, heartbeat=mode)
    assert deadline(policy) == NOW + 10 + 300
    assert deadline(policy, phase=None, last_beat=None) == NOW + 900


# ---- gap window -------------------------------------------------------------------------------


def test_with_gaps_appends_newest_last():
    """New gaps are appended after the older ones, in their order."""
    assert with_gaps((1.0, 2.0), [3.0, 4.0], 512) == (1.0, 2.0, 3.0, 4.0)


def test_with_gaps_drops_oldest_beyond_window():
    """Beyond the window, the oldest gaps are dropped."""
    assert with_gaps((1.0, 2.0, 3.0), [4.0], 3) == (2.0, 3.0, 4.0)
    assert with_gaps((1.0, 2.0, 3.0), [4.0, 5.0], 1) == (5.0,)


def test_with_gaps_to_empty_and_none_new():
    """The first gap starts the sample; no new gap leaves it as it was."""
    assert with_gaps((), [0.5], 512) == (0.5,)
    assert with_gaps((1.0,), [], 512) == (1.0,)

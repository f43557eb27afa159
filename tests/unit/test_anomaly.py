"""The pure anomaly detector: seed 000's fixed threshold, NaN/Inf, adaptive spikes and the consecutive count."""

from __future__ import annotations

import math

import pytest

from worker.anomaly import AdaptiveConfig, AnomalyDetector, Verdict

# History [1.0, 3.0] has mean 2 and population sigma 1, so with 2 sigmas the spike bound is exactly 4.0.
ADAPTIVE = AdaptiveConfig(enabled=True, sigmas=2.0, window=2, min_samples=2)


def with_history(
    norms: list[float],
    *,
    threshold: float | None = None,
    adaptive: AdaptiveConfig = ADAPTIVE,
    losses: list[float] | None = None,
) -> AnomalyDetector:
    """A detector that recorded one normal step per norm (losses default to 1.0), steps 1, 2, ..."""
    detector = AnomalyDetector(threshold, adaptive)
    for step, (norm, loss) in enumerate(zip(norms, losses or [1.0] * len(norms), strict=True), start=1):
        detector.record(step, skipped=False, loss=loss, grad_norm=norm)
    return detector


# ---- fixed threshold (seed 000) ---------------------------------------------------------------


def test_norm_above_threshold_is_flagged():
    """A global norm above the threshold is an anomaly for that one reason."""
    verdict = AnomalyDetector(3.0).judge(loss=0.5, grad_norm=44.313248)
    assert verdict == Verdict(("global_norm_above_threshold",))
    assert verdict.anomalous is True


def test_norm_equal_to_threshold_is_normal():
    """A global norm exactly at the threshold is not above it, so the step is normal."""
    verdict = AnomalyDetector(3.0).judge(loss=0.5, grad_norm=3.0)
    assert verdict == Verdict(())
    assert verdict.anomalous is False


def test_norm_just_below_threshold_is_normal():
    """A global norm below the threshold is normal."""
    assert AnomalyDetector(3.0).judge(loss=0.5, grad_norm=2.999) == Verdict(())


def test_no_threshold_never_flags_by_norm():
    """Without a fixed threshold (None) even a huge finite norm is normal."""
    assert AnomalyDetector(None).judge(loss=0.5, grad_norm=1e30) == Verdict(())


# ---- NaN / Inf --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss", "grad_norm"),
    [(math.nan, 1.0), (math.inf, 1.0), (-math.inf, 1.0), (0.5, math.nan), (0.5, math.inf), (math.nan, math.inf)],
)
@pytest.mark.parametrize("threshold", [None, 3.0])
def test_non_finite_loss_or_norm_is_flagged_even_without_threshold(loss, grad_norm, threshold):
    """A NaN or infinite loss or gradient norm is a `non_finite` anomaly, with or without a threshold."""
    assert AnomalyDetector(threshold).judge(loss=loss, grad_norm=grad_norm) == Verdict(("non_finite",))


def test_non_finite_is_not_judged_against_adaptive_history():
    """A non-finite step gets only the `non_finite` reason, even with an adaptive history in place."""
    detector = with_history([1.0, 3.0], threshold=3.0)
    assert detector.judge(loss=1.0, grad_norm=math.inf) == Verdict(("non_finite",))


# ---- adaptive spikes --------------------------------------------------------------------------


def test_adaptive_does_not_flag_before_min_samples():
    """With fewer normal steps than `min_samples` in the history, no value is a spike."""
    detector = with_history([1.0, 3.0], adaptive=AdaptiveConfig(enabled=True, sigmas=2.0, window=8, min_samples=3))
    assert detector.judge(loss=1.0, grad_norm=1e6) == Verdict(())


def test_adaptive_flags_above_mean_plus_k_sigma():
    """Once `min_samples` are in, a norm above mean + k sigma of the window is a `global_norm_spike`."""
    assert with_history([1.0, 3.0]).judge(loss=1.0, grad_norm=4.001) == Verdict(("global_norm_spike",))


def test_adaptive_does_not_flag_at_or_below_mean_plus_k_sigma():
    """A norm exactly at mean + k sigma, or below it, is normal."""
    detector = with_history([1.0, 3.0])
    assert detector.judge(loss=1.0, grad_norm=4.0) == Verdict(())
    assert detector.judge(loss=1.0, grad_norm=3.5) == Verdict(())


def test_adaptive_disabled_never_flags():
    """With adaptive detection off (the default), a norm far above its history is normal."""
    detector = with_history([1.0, 3.0], adaptive=AdaptiveConfig())
    assert detector.judge(loss=1e6, grad_norm=1e6) == Verdict(())


def test_adaptive_window_keeps_only_newest_normal_values():
    """Only the newest `window` normal norms form the history: an old large value no longer raises the bound."""
    detector = with_history([100.0, 1.0, 3.0])
    assert detector.judge(loss=1.0, grad_norm=5.0) == Verdict(("global_norm_spike",))


def test_skipped_steps_do_not_enter_history():
    """A skipped step's norm is not added to the history, so it neither raises the bound nor counts toward it."""
    detector = with_history([1.0, 3.0])
    detector.record(3, skipped=True, loss=1.0, grad_norm=1000.0)
    assert detector.judge(loss=1.0, grad_norm=5.0) == Verdict(("global_norm_spike",))
    short = with_history([1.0], adaptive=ADAPTIVE)
    short.record(2, skipped=True, loss=1.0, grad_norm=3.0)
    assert short.judge(loss=1.0, grad_norm=1e6) == Verdict(())


def test_threshold_and_adaptive_spike_both_reported():
    """A norm above both the fixed threshold and the adaptive bound carries both reasons, threshold first."""
    detector = with_history([1.0, 3.0], threshold=3.0)
    assert detector.judge(loss=1.0, grad_norm=10.0) == Verdict(("global_norm_above_threshold", "global_norm_spike"))


def test_include_loss_flags_loss_spike():
    """With `include_loss`, a loss above mean + k sigma of the recent losses is a `loss_spike`."""
    adaptive = AdaptiveConfig(enabled=True, sigmas=2.0, window=2, min_samples=2, include_loss=True)
    detector = with_history([1.0, 1.0], adaptive=adaptive, losses=[1.0, 3.0])
    assert detector.judge(loss=4.001, grad_norm=1.0) == Verdict(("loss_spike",))
    assert detector.judge(loss=4.0, grad_norm=1.0) == Verdict(())


def test_loss_spike_ignored_without_include_loss():
    """Without `include_loss`, a loss far above its history is normal."""
    detector = with_history([1.0, 1.0], losses=[1.0, 3.0])
    assert detector.judge(loss=1e6, grad_norm=1.0) == Verdict(())


def test_judge_changes_no_state():
    """Judging a step leaves the count, the first anomaly step and the history as they were."""
    detector = with_history([1.0, 3.0], threshold=3.0)
    detector.judge(loss=math.nan, grad_norm=1e6)
    assert (detector.consecutive, detector.first_anomaly_step) == (0, None)
    assert detector.judge(loss=1.0, grad_norm=4.001) == Verdict(("global_norm_above_threshold", "global_norm_spike"))


# ---- the consecutive count --------------------------------------------------------------------


def test_record_skip_counts_and_sets_first_anomaly_step():
    """The first skip of a streak counts 1 and remembers its step."""
    detector = AnomalyDetector(3.0)
    detector.record(7, skipped=True, loss=1.0, grad_norm=44.0)
    assert (detector.consecutive, detector.first_anomaly_step) == (1, 7)


def test_record_consecutive_skips_grow_count_and_keep_first_step():
    """Further skips grow the count while the first anomaly step stays at the streak's start."""
    detector = AnomalyDetector(3.0)
    for step in (7, 7, 8):
        detector.record(step, skipped=True, loss=1.0, grad_norm=44.0)
    assert (detector.consecutive, detector.first_anomaly_step) == (3, 7)


def test_record_normal_step_resets_count_and_first_step():
    """A normal step ends the streak: the count goes to 0 and the first anomaly step is cleared."""
    detector = AnomalyDetector(3.0)
    detector.record(7, skipped=True, loss=1.0, grad_norm=44.0)
    detector.record(7, skipped=True, loss=1.0, grad_norm=44.0)
    detector.record(7, skipped=False, loss=1.0, grad_norm=1.0)
    assert (detector.consecutive, detector.first_anomaly_step) == (0, None)


def test_new_streak_after_reset_remembers_its_own_first_step():
    """After a reset, the next streak's first anomaly step is that streak's first skipped step."""
    detector = AnomalyDetector(3.0)
    detector.record(7, skipped=True, loss=1.0, grad_norm=44.0)
    detector.record(7, skipped=False, loss=1.0, grad_norm=1.0)
    detector.record(12, skipped=True, loss=1.0, grad_norm=44.0)
    assert (detector.consecutive, detector.first_anomaly_step) == (1, 12)

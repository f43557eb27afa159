"""Anomaly detection for one training step, pure: thresholds, NaN/Inf, adaptive spikes, the consecutive count.

Seed 000 semantics: a step whose gradient global norm exceeds `global_norm_spike_threshold` is skipped
and counts as an anomaly; a normal step resets the count; reaching `global_norm_spike_count_threshold`
aborts training. A non-finite loss or gradient norm is always an anomaly. The adaptive rule flags a
value more than `sigmas` standard deviations above the mean of the last `window` normal steps, once
`min_samples` are collected (OLMo-core's 6 sigma over 128 steps, 64 minimum).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["AdaptiveConfig", "AnomalyDetector", "MonitorConfig", "Verdict"]


@dataclass(frozen=True)
class MonitorConfig:
    """Seed 000's `monitor_config`."""

    monitor_on: bool = True
    check_for_global_norm: bool = False  # seed 000's fault-recovery switch; accepted, has no effect here
    global_norm_spike_threshold: float = 3.0
    global_norm_spike_count_threshold: int = 10


@dataclass(frozen=True)
class AdaptiveConfig:
    """Flag steps far above their own recent history instead of (or besides) a fixed threshold."""

    enabled: bool = True  # model-independent, unlike a fixed threshold; its history is saved with each checkpoint
    sigmas: float = 6.0
    window: int = 128
    min_samples: int = 64
    include_loss: bool = False


@dataclass(frozen=True)
class Verdict:
    """What one step looked like locally: why it is anomalous (empty: it is normal)."""

    reasons: tuple[str, ...] = ()

    @property
    def anomalous(self) -> bool:
        return bool(self.reasons)


@dataclass
class AnomalyDetector:
    """Judges steps and keeps the consecutive-anomaly count and the recent history of normal steps."""

    threshold: float | None  # None: no fixed global-norm threshold
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    consecutive: int = 0
    first_anomaly_step: int | None = None
    _norms: deque[float] = field(default_factory=deque)
    _losses: deque[float] = field(default_factory=deque)

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        """Local verdict for a step (no state changes; call `record` with the job-wide decision)."""
        reasons = []
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            reasons.append("non_finite")
        else:
            if self.threshold is not None and grad_norm > self.threshold:
                reasons.append("global_norm_above_threshold")
            if self.adaptive.enabled and _spike(self._norms, grad_norm, self.adaptive):
                reasons.append("global_norm_spike")
            if self.adaptive.enabled and self.adaptive.include_loss and _spike(self._losses, loss, self.adaptive):
                reasons.append("loss_spike")
        return Verdict(tuple(reasons))

    def record(self, step: int, *, skipped: bool, loss: float, grad_norm: float) -> None:
        """Count a skipped step or reset on a normal one; only normal steps enter the history."""
        if skipped:
            self.consecutive += 1
            if self.first_anomaly_step is None:
                self.first_anomaly_step = step
            return
        self.consecutive = 0
        self.first_anomaly_step = None
        for history, value in ((self._norms, grad_norm), (self._losses, loss)):
            history.append(value)
            while len(history) > self.adaptive.window:
                history.popleft()

    def state_dict(self) -> dict[str, list[float]]:
        """The normal steps' history, for a checkpoint: a resumed run judges its first steps as it would have."""
        return {"norms": list(self._norms), "losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        """Put back `state_dict`'s history (the newest `window` values, should the window have shrunk)."""
        self._norms = deque(float(v) for v in state["norms"][-self.adaptive.window :])
        self._losses = deque(float(v) for v in state["losses"][-self.adaptive.window :])


def _spike(history: deque[float], value: float, cfg: AdaptiveConfig) -> bool:
    if len(history) < cfg.min_samples:
        return False
    mean = sum(history) / len(history)
    # Plain floats: statistics.pstdev is exact (fractions) and ~10x slower, on every step.
    std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
    return value > mean + cfg.sigmas * std

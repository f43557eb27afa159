"""Hang detection, pure: per-phase heartbeat deadlines and a step timeout calibrated from observed gaps.

Each rank has a deadline on the supervisor's own monotonic clock:
- before its first heartbeat of an attempt: launch time + `first_heartbeat_s` (when a beat is expected);
- after that: time the supervisor saw its newest heartbeat + the timeout of the phase that beat named.
The job is hung once every running rank is past its deadline (see `supervisor.core.hang_deadline`).

Calibration (optional) learns the `train` timeout from the gaps between consecutive `train`
heartbeats of all ranks (pooled, kept across relaunches):
    timeout = max(floor_s, multiplier * percentile(gaps, percentile))   once min_samples gaps are seen,
and the configured `train` timeout until then. The floor keeps a fast step from making a hair-trigger.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "HEARTBEAT_MODES",
    "SAVE_PHASE",
    "TRAIN_PHASE",
    "Calibration",
    "HangPolicy",
    "beat_deadline",
    "calibrated_train_timeout",
    "percentile",
    "phase_timeout",
    "with_gaps",
]

TRAIN_PHASE = "train"
SAVE_PHASE = "save"
HEARTBEAT_MODES = ("auto", "required", "off")

DEFAULT_PHASE_TIMEOUTS_S: Mapping[str, float] = {"startup": 900.0, "train": 300.0, "save": 1800.0, "eval": 1800.0}


@dataclass(frozen=True)
class Calibration:
    """How the `train` timeout is learned from observed heartbeat gaps."""

    enabled: bool = False
    multiplier: float = 10.0
    percentile: float = 99.0
    floor_s: float = 30.0
    min_samples: int = 20
    window: int = 512  # newest gaps kept


@dataclass(frozen=True)
class HangPolicy:
    """Heartbeat expectations and timeouts.

    `heartbeat`: `required` expects a first beat from every rank; `auto` expects it once any rank of the
    run has beaten (so scripts without the worker library are never killed for silence); `off` disables
    hang detection.
    """

    heartbeat: str = "auto"
    first_heartbeat_s: float = 900.0
    phase_timeouts_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PHASE_TIMEOUTS_S))
    default_timeout_s: float = 900.0  # phases not named above (custom phases, "done")
    calibration: Calibration = field(default_factory=Calibration)
    stacks_timeout_s: float = 15.0  # how long stack collection may take before the kill goes ahead
    flight_recorder: int = 2000  # collectives PyTorch's flight recorder keeps per rank (TORCH_FR_BUFFER_SIZE); 0: off

    def __post_init__(self) -> None:
        # Naming some phases keeps the defaults of the others.
        object.__setattr__(self, "phase_timeouts_s", {**DEFAULT_PHASE_TIMEOUTS_S, **self.phase_timeouts_s})


def percentile(values: tuple[float, ...], pct: float) -> float:
    """Nearest-rank percentile of a non-empty sequence."""
    ordered = sorted(values)
    index = max(0, math.ceil(pct * len(ordered) / 100) - 1)  # pct * n first: 0.07 * 100 is not 7.0
    return ordered[min(index, len(ordered) - 1)]


def calibrated_train_timeout(gaps: tuple[float, ...], cal: Calibration) -> float | None:
    """The learned `train` timeout, or None while calibration is off or has too few samples."""
    if not cal.enabled or len(gaps) < cal.min_samples:
        return None
    return max(cal.floor_s, cal.multiplier * percentile(gaps, cal.percentile))


def phase_timeout(policy: HangPolicy, phase: str, gaps: tuple[float, ...]) -> float:
    """Seconds a rank may stay silent in `phase`."""
    if phase == TRAIN_PHASE:
        learned = calibrated_train_timeout(gaps, policy.calibration)
        if learned is not None:
            return learned
    return policy.phase_timeouts_s.get(phase, policy.default_timeout_s)


def beat_deadline(
    policy: HangPolicy,
    *,
    phase: str | None,
    last_beat: float | None,
    launched_at: float,
    expect_beat: bool,
    gaps: tuple[float, ...],
) -> float | None:
    """Monotonic time by which a rank must show a new heartbeat; None when it has no deadline."""
    if policy.heartbeat == "off":
        return None
    if last_beat is None or phase is None:
        return launched_at + policy.first_heartbeat_s if expect_beat else None
    return last_beat + phase_timeout(policy, phase, gaps)


def with_gaps(gaps: tuple[float, ...], new: list[float], window: int) -> tuple[float, ...]:
    """`gaps` plus new samples, keeping only the newest `window`."""
    return (*gaps, *new)[-window:] if new else gaps

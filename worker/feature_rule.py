"""Feature-value checks against silent data corruption, pure: seed 002's L1/L2 rule on one value's history.

The value is the L2 norm of a normalisation layer's activation gradient in one step (MindSpore's
default check point). With `pre_val`, `min_val`, `max_val` the layer's previous, smallest and largest
finite values and `checks` the number of values judged before this one:

- **L1 fault** when the value is NaN/Inf, or `val > upper_thresh1`, or (once `checks >= min_steps`)
  `jump > sigma_thresh1`;
- **L2 warning** otherwise when `val > upper_thresh2`, or (once `checks >= min_steps`) `jump > sigma_thresh2`;

where `jump = (val - pre_val) / (max_val - min_val)`: a rise measured in units of the history's spread
(Ascend's tuning advice reads the relative threshold as `(val - pre_val) / (max - min)`). A history
without spread (`max_val == min_val`) or with a non-finite `pre_val` has no jump. As MindSpore's
SilentCheck updates `sfda`, every value enters the history whatever the verdict; NaN/Inf move only `pre_val`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "ENV_ASD_ENABLE",
    "ENV_ASD_LAYERS",
    "ENV_ASD_MIN_STEPS",
    "ENV_ASD_SIGMA_THRESH",
    "ENV_ASD_UPPER_THRESH",
    "LEVELS",
    "FeatureValueConfig",
    "Finding",
    "History",
    "judge",
    "with_env",
]

# Named after seed 002's NPU_ASD_ENABLE, NPU_ASD_UPPER_THRESH and NPU_ASD_SIGMA_THRESH; they override the YAML.
ENV_ASD_ENABLE = "TRAINWARDEN_ASD_ENABLE"
ENV_ASD_UPPER_THRESH = "TRAINWARDEN_ASD_UPPER_THRESH"
ENV_ASD_SIGMA_THRESH = "TRAINWARDEN_ASD_SIGMA_THRESH"
ENV_ASD_MIN_STEPS = "TRAINWARDEN_ASD_MIN_STEPS"
ENV_ASD_LAYERS = "TRAINWARDEN_ASD_LAYERS"

LEVELS = {0: "off", 1: "log", 2: "log and abort", 3: "log, abort, and log normal values"}
THRESH_MIN = 3.0  # the smallest threshold seed 002's NPU_ASD_*_THRESH accept


@dataclass(frozen=True)
class FeatureValueConfig:
    """The `worker.feature_value_check` section; defaults are seed 002's thresholds and MindSpore's 100 steps."""

    level: int = 1  # 0 off, 1 log, 2 log and abort (exit 65), 3 as 2 plus every normal value logged
    upper_thresh1: float = 1_000_000.0  # absolute L1 threshold (NPU_ASD_UPPER_THRESH's first element)
    upper_thresh2: float = 10_000.0  # absolute L2 threshold
    sigma_thresh1: float = 100_000.0  # relative L1 threshold (NPU_ASD_SIGMA_THRESH's first element)
    sigma_thresh2: float = 5_000.0  # relative L2 threshold
    min_steps: int = 100  # values a layer must have seen before its jumps are judged (MindSpore's c_min_steps)
    layers: list[str] = field(default_factory=list)  # more modules to check, by qualified name or class name

    @property
    def aborts(self) -> bool:
        return self.level >= 2

    def thresholds(self) -> dict[str, Any]:
        """The rule's parameters, as every feature-value event carries them (like the seed's log line)."""
        return {
            "min_steps": self.min_steps,
            "upper_thresh1": self.upper_thresh1,
            "upper_thresh2": self.upper_thresh2,
            "sigma_thresh1": self.sigma_thresh1,
            "sigma_thresh2": self.sigma_thresh2,
            "detect_level": self.level,
        }


@dataclass
class History:
    """One check point's past: seed 002's `pre_val`, `min_val`, `max_val` and the count of values judged."""

    checks: int = 0
    pre_val: float | None = None
    min_val: float | None = None
    max_val: float | None = None

    def jump(self, val: float) -> float | None:
        """How far `val` rose above the previous value, in units of the history's spread; None if undefined."""
        if self.pre_val is None or self.min_val is None or self.max_val is None or not math.isfinite(self.pre_val):
            return None
        spread = self.max_val - self.min_val
        return (val - self.pre_val) / spread if spread > 0 else None

    def record(self, val: float) -> None:
        self.checks += 1
        self.pre_val = val
        if math.isfinite(val):
            self.min_val = val if self.min_val is None else min(self.min_val, val)
            self.max_val = val if self.max_val is None else max(self.max_val, val)


@dataclass(frozen=True)
class Finding:
    """The verdict on one value: `fault` (L1), `warning` (L2) or `normal`, why, and the history it was judged on."""

    verdict: str
    reasons: tuple[str, ...]
    val: float
    jump: float | None
    history: History


def judge(val: float, history: History, config: FeatureValueConfig) -> Finding:
    """Judge `val` against `history` (which is left unchanged; call `history.record(val)` afterwards)."""
    before = replace(history)
    if not math.isfinite(val):
        return Finding("fault", ("non_finite",), val, None, before)
    jump = history.jump(val) if history.checks >= config.min_steps else None
    l1 = _exceeded(val, jump, config.upper_thresh1, config.sigma_thresh1, level=1)
    if l1:
        return Finding("fault", l1, val, jump, before)
    l2 = _exceeded(val, jump, config.upper_thresh2, config.sigma_thresh2, level=2)
    return Finding("warning" if l2 else "normal", l2, val, jump, before)


def _exceeded(val: float, jump: float | None, upper: float, sigma: float, *, level: int) -> tuple[str, ...]:
    reasons = []
    if val > upper:
        reasons.append(f"above_upper_thresh{level}")
    if jump is not None and jump > sigma:
        reasons.append(f"jump_above_sigma_thresh{level}")
    return tuple(reasons)


def with_env(config: FeatureValueConfig, env: Mapping[str, str]) -> tuple[FeatureValueConfig, list[str]]:
    """`config` with the TRAINWARDEN_ASD_* variables applied; an invalid one is ignored and described."""
    changes: dict[str, Any] = {}
    problems = []
    for name, parse in (
        (ENV_ASD_ENABLE, _parse_level),
        (ENV_ASD_UPPER_THRESH, _parse_pair("upper_thresh")),
        (ENV_ASD_SIGMA_THRESH, _parse_pair("sigma_thresh")),
        (ENV_ASD_MIN_STEPS, _parse_min_steps),
        (ENV_ASD_LAYERS, _parse_layers),
    ):
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            changes.update(parse(raw.strip()))
        except ValueError as exc:
            problems.append(f"{name}={raw!r} ignored: {exc}")
    return replace(config, **changes), problems


def _parse_level(raw: str) -> dict[str, Any]:
    if raw not in ("0", "1", "2", "3"):
        raise ValueError("must be 0, 1, 2 or 3")
    return {"level": int(raw)}


def _parse_pair(prefix: str) -> Any:
    def parse(raw: str) -> dict[str, Any]:
        items = raw.split(",")
        try:
            first, second = (float(item) for item in items)
        except ValueError:
            raise ValueError("must be two numbers, 'L1,L2'") from None
        if not (THRESH_MIN <= second < first and math.isfinite(first)):
            raise ValueError(f"needs L1 > L2 >= {THRESH_MIN:g}")
        return {f"{prefix}1": first, f"{prefix}2": second}

    return parse


def _parse_min_steps(raw: str) -> dict[str, Any]:
    if not raw.isdigit():
        raise ValueError("must be an integer, 0 or more")
    return {"min_steps": int(raw)}


def _parse_layers(raw: str) -> dict[str, Any]:
    return {"layers": [name.strip() for name in raw.split(",") if name.strip()]}

"""Job config: load a YAML file into frozen dataclasses, refusing unknown keys and wrong types by name."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from supervisor.core import Policy
from supervisor.hangs import HEARTBEAT_MODES, HangPolicy
from supervisor.rollback import AnomalyPolicy
from worker.contract import RunLayout, WorkerConfig, parse_checkpoint_name

__all__ = ["ConfigError", "JobConfig", "RestartConfig", "StopConfig", "load_config", "parse_config"]


class ConfigError(Exception):
    """The job config is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class RestartConfig:
    """When and how fast crashed ranks are relaunched."""

    max_restarts: int = 3
    backoff_initial_s: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 60.0


@dataclass(frozen=True)
class StopConfig:
    """Graceful stops (a checkpoint at an agreed step, then exit) and how ranks are killed when that fails."""

    stop_file_path: str | None = None  # seed 004; default RUN_DIR/stop
    timeout_s: float = 300.0  # a graceful stop (SIGTERM, SIGINT, an empty stop file) may take this long
    kill_grace_s: float = 10.0  # then SIGTERM to each rank's process group, and SIGKILL after this grace
    sigkill_wait_s: float = 5.0


@dataclass(frozen=True)
class JobConfig:
    """One training job: what to run, on how many ranks, and how to keep it alive."""

    script: str | None = None  # a Python script, run with the supervisor's interpreter (like torchrun)
    command: list[str] | None = None  # or any command line
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    run_dir: str = "runs/default"
    master_addr: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    restart: RestartConfig = field(default_factory=RestartConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    hang: HangPolicy = field(default_factory=HangPolicy)
    anomaly: AnomalyPolicy = field(default_factory=AnomalyPolicy)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def stop_file(self, layout: RunLayout) -> Path:
        """Where stop requests are written: `stop.stop_file_path` (relative to the working dir) or RUN_DIR/stop."""
        path = self.stop.stop_file_path
        return layout.default_stop_file if path is None else Path(path).resolve()

    def policy(self) -> Policy:
        return Policy(
            nproc=self.nproc_per_node,
            max_restarts=self.restart.max_restarts,
            backoff_initial_s=self.restart.backoff_initial_s,
            backoff_factor=self.restart.backoff_factor,
            backoff_max_s=self.restart.backoff_max_s,
            kill_grace_s=self.stop.kill_grace_s,
            sigkill_wait_s=self.stop.sigkill_wait_s,
            stop_timeout_s=self.stop.timeout_s,
            hang=self.hang,
            anomaly=self.anomaly,
        )


# Bounds checked after types: (section path, key) -> (predicate, what it must be).
_BOUNDS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "nproc_per_node": (lambda v: v >= 1, "at least 1"),
    "restart.max_restarts": (lambda v: v >= 0, "0 or more"),
    "restart.backoff_initial_s": (lambda v: v >= 0, "0 or more"),
    "restart.backoff_factor": (lambda v: v >= 1, "at least 1"),
    "restart.backoff_max_s": (lambda v: v >= 0, "0 or more"),
    "stop.kill_grace_s": (lambda v: v >= 0, "0 or more"),
    "stop.sigkill_wait_s": (lambda v: v > 0, "more than 0"),
    "stop.timeout_s": (lambda v: v > 0, "more than 0"),
    "stop.stop_file_path": (lambda v: v != "", "a path"),
    "hang.heartbeat": (lambda v: v in HEARTBEAT_MODES, f"one of {', '.join(HEARTBEAT_MODES)}"),
    "hang.first_heartbeat_s": (lambda v: v > 0, "more than 0"),
    "hang.phase_timeouts_s": (lambda v: all(t > 0 for t in v.values()), "a mapping of phases to seconds > 0"),
    "hang.default_timeout_s": (lambda v: v > 0, "more than 0"),
    "hang.stacks_timeout_s": (lambda v: v >= 0, "0 or more"),
    "hang.calibration.multiplier": (lambda v: v >= 1, "at least 1"),
    "hang.calibration.percentile": (lambda v: 0 < v <= 100, "in (0, 100]"),
    "hang.calibration.floor_s": (lambda v: v > 0, "more than 0"),
    "hang.calibration.min_samples": (lambda v: v >= 1, "at least 1"),
    "hang.calibration.window": (lambda v: v >= 1, "at least 1"),
    "anomaly.rollback_steps": (lambda v: v >= 0, "0 or more"),
    "anomaly.skip_after_steps": (lambda v: v >= 0, "0 or more"),
    "anomaly.max_tries": (lambda v: v >= 1, "at least 1"),
    "anomaly.widen_factor": (lambda v: v >= 1, "at least 1"),
    "worker.monitor_config.global_norm_spike_threshold": (lambda v: v > 0, "more than 0"),
    "worker.monitor_config.global_norm_spike_count_threshold": (lambda v: v >= 1, "a positive integer"),
    "worker.adaptive_spike.sigmas": (lambda v: v > 0, "more than 0"),
    "worker.adaptive_spike.window": (lambda v: v >= 2, "at least 2"),
    "worker.adaptive_spike.min_samples": (lambda v: v >= 2, "at least 2"),
    "worker.data_skip_steps": (lambda v: v >= 0, "0 or more"),
    "worker.feature_value_check.level": (lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3"),
    "worker.feature_value_check.upper_thresh1": (lambda v: v >= 3, "at least 3 (as seed 002)"),
    "worker.feature_value_check.upper_thresh2": (lambda v: v >= 3, "at least 3 (as seed 002)"),
    "worker.feature_value_check.sigma_thresh1": (lambda v: v >= 3, "at least 3 (as seed 002)"),
    "worker.feature_value_check.sigma_thresh2": (lambda v: v >= 3, "at least 3 (as seed 002)"),
    "worker.feature_value_check.min_steps": (lambda v: v >= 0, "0 or more"),
    "worker.keep_checkpoint_max": (lambda v: v >= 0, "0 or more"),
    "worker.no_usable_checkpoint": (lambda v: v in ("scratch", "refuse"), "scratch or refuse"),
    "worker.resume_training": (lambda v: isinstance(v, bool) or parse_checkpoint_name(v) is not None,
                               "true, false, or a checkpoint name such as demo_rank_0-40.ckpt or 40"),
    "worker.save_checkpoint_steps": (lambda v: v >= 0, "0 or more"),
    "worker.snapshot_steps": (lambda v: v >= 0, "0 or more"),
    "worker.load_checkpoint": (lambda v: Path(v).is_dir(), "an existing directory (another run's checkpoint/ folder)"),
    "worker.heartbeat_interval_s": (lambda v: v > 0, "more than 0"),
    "worker.prefix": (lambda v: v != "" and "/" not in v, "a non-empty name without '/'"),
}


def load_config(path: str | Path) -> JobConfig:
    """Read and validate a job config file; raises ConfigError naming the file and the key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(raw, source=str(path))


def parse_config(raw: Any, *, source: str = "<config>") -> JobConfig:
    """Validate an already-parsed YAML document into a JobConfig."""
    if raw is None:
        raw = {}
    config = _build(JobConfig, raw, source, prefix="")
    if (config.script is None) == (config.command is None):
        raise ConfigError(f"{source}: give exactly one of 'script' (a Python file) or 'command' (a list)")
    if config.command is not None and not config.command:
        raise ConfigError(f"{source}: 'command' must not be empty")
    adaptive = config.worker.adaptive_spike
    if adaptive.enabled and adaptive.window < adaptive.min_samples:  # the rule could never fire
        raise ConfigError(f"{source}: 'worker.adaptive_spike.window' ({adaptive.window}) must be at least "
                          f"'worker.adaptive_spike.min_samples' ({adaptive.min_samples})")
    _check_feature_value_pairs(config.worker.feature_value_check, source)
    return config


def _check_feature_value_pairs(check: Any, source: str) -> None:
    """Seed 002's threshold pairs: the L1 (fault) threshold must lie above the L2 (warning) one."""
    for pair in ("upper_thresh", "sigma_thresh"):
        first, second = getattr(check, f"{pair}1"), getattr(check, f"{pair}2")
        if first <= second:
            raise ConfigError(f"{source}: 'worker.feature_value_check.{pair}1' ({first:g}) must be greater than "
                              f"'worker.feature_value_check.{pair}2' ({second:g})")


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, got {_kind(raw)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{source}: unknown key '{name}'{_suggest(str(key), known)}")
        values[key] = _check(hints[key], value, source, name)
        bound = _BOUNDS.get(name)
        if bound and values[key] is not None and not bound[0](values[key]):
            raise ConfigError(f"{source}: '{name}' must be {bound[1]}, got {value!r}")
    return cls(**values)


def _check(hint: Any, value: Any, source: str, name: str) -> Any:
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in params:
            return None
        options = [p for p in params if p is not type(None)]
        for inner in options[:-1]:  # `bool | str`: the first type that fits wins
            try:
                return _check(inner, value, source, name)
            except ConfigError:
                continue
        return _check(options[-1], value, source, name)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, source, prefix=f"{name}.")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: '{name}' must be a list of strings, got {_kind(value)}")
        return [_string(item, source, f"{name}[{i}]") for i, item in enumerate(value)]
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{name}' must be a mapping, got {_kind(value)}")
        if params[1] is str:
            return {str(k): _string(v, source, f"{name}.{k}") for k, v in value.items()}
        return {str(k): _check_scalar(params[1], v, source, f"{name}.{k}") for k, v in value.items()}
    return _check_scalar(hint, value, source, name)


def _check_scalar(hint: Any, value: Any, source: str, name: str) -> Any:
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
    raise ConfigError(f"{source}: '{name}' must be {wanted}, got {_kind(value)}")


def _string(value: Any, source: str, name: str) -> str:
    """A string, or a number YAML read as one (`"--steps", 600`); nothing else."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{source}: '{name}' must be a string, got {_kind(value)}")


def _kind(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return repr(value)


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(known))})"

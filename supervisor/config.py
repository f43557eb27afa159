"""Job config: load a YAML file into frozen dataclasses, refusing unknown keys and wrong types by name.

`--set KEY=VALUE` overrides are set into the parsed document before validation, so they are checked exactly like
the file; an error they cause names them instead of the file.

Loading is total: whatever the file holds (a FIFO, binary junk, an alias bomb, NaN, 10^400, a NUL
byte), the result is a JobConfig whose numbers are finite and bounded, or a one-line ConfigError.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shutil
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import yaml

from supervisor.core import Policy
from supervisor.core.hangs import HEARTBEAT_MODES, HangPolicy
from supervisor.core.rollback import AnomalyPolicy
from worker.contract import RunLayout, WorkerConfig
from worker.files import read_bytes
from worker.store import parse_checkpoint_name

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_NPROC",
    "MAX_NUMBER",
    "MAX_SECONDS",
    "ConfigError",
    "JobConfig",
    "LedgerRules",
    "MetricsConfig",
    "RestartConfig",
    "SlurmConfig",
    "StopConfig",
    "StragglersConfig",
    "apply_overrides",
    "check_launchable",
    "load_config",
    "parse_config",
]

MAX_CONFIG_BYTES = 1 << 20  # a job config is a few hundred bytes; also the cap on its alias-expanded size
MAX_DEPTH = 32  # a job config nests 4 levels; deeper flow nesting only makes the YAML scanner crawl
MAX_NUMBER = 2**53  # every int and float: beyond it floats stop counting exactly and products may overflow
MAX_SECONDS = 10**7  # every `*_s` value (~116 days): deadlines and queue timeouts stay far from overflow
MAX_NPROC = 1024  # ranks on one machine: a typo like 1000000000 must not fork-bomb the node
MAX_NODES = 4096
DEVICES = ("cpu", "cuda")  # what each rank computes on (`device`)
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built in: a 1 MiB file in 0.3 s, not 3 s


class ConfigError(Exception):
    """The job config is invalid; the message names the file and the key (or the script that is missing)."""


@dataclass(frozen=True)
class RestartConfig:
    """When and how fast crashed ranks are relaunched."""

    max_restarts: int = 3
    crash_loop_attempts: int = 3  # stop early after this many failed attempts in a row alike or without progress
    backoff_initial_s: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 60.0
    # A failed rank's survivors stay and run the training function again (worker.run); the failed rank is replaced.
    in_place: bool = True
    in_place_timeout_s: float = 30.0  # survivors not unwound by then: every rank is relaunched


@dataclass(frozen=True)
class StopConfig:
    """Graceful stops (a checkpoint at an agreed step, then exit) and how ranks are killed when that fails."""

    stop_file_path: str | None = None  # seed 004; default RUN_DIR/stop
    timeout_s: float = 300.0  # a graceful stop (SIGTERM, SIGINT, an empty stop file) may take this long
    kill_grace_s: float = 10.0  # then SIGTERM to each rank's process group, and SIGKILL after this grace
    sigkill_wait_s: float = 5.0


class LedgerRules(TypedDict):
    """When the node ledger excludes a node (`SlurmConfig.ledger_rules`)."""

    max_failures: int
    window_s: float
    cooldown_s: float
    max_strikes: int
    strike_window_s: float


@dataclass(frozen=True)
class SlurmConfig:
    """Multi-node runs in a Slurm allocation: how fast a silent node is given up, and when a node is excluded."""

    node_timeout_s: float = 10.0  # a node agent silent this long is lost (its node died or is cut off)
    max_node_failures: int = 2  # a node charged this often within node_failure_window_s is not used again
    node_failure_window_s: float = 3600.0
    node_cooldown_s: float = 600.0  # a node lost while Slurm still calls it healthy (a blip) rests this long
    # A node whose GPUs re-runs found corrupting results transiently this often within sdc_strike_window_s is not
    # used again (like Ascend's 3 feature-value alarms in 480 minutes); a persistent verdict excludes it at once.
    max_sdc_strikes: int = 3
    sdc_strike_window_s: float = 28800.0
    srun_args: list[str] = field(default_factory=list)  # extra options for the agents' `srun` (e.g. --gpus-per-node)
    # With no spare left, go on with fewer nodes, down to this many, rather than exit 75 (null: `nodes`, never
    # shrink). Below `nodes` needs sharded checkpoints (worker.checkpoint_format: dcp), which reshard on load.
    min_nodes: int | None = None
    # Before the job's time limit (its end time, read from Slurm), save at an agreed step and exit 75 this long
    # ahead: the batch script's `#SBATCH --signal=B:USR1@N` lead when it has one, else this.
    time_limit_margin_s: float = 300.0
    # While the Slurm controller does not answer, what needs it (a new step, a resubmission) waits for it this long
    # before the run ends (exit 75); the ranks already running go on meanwhile.
    controller_wait_s: float = 300.0
    # The memory tier across nodes: each node's newest snapshot is copied to a partner node at most this fast, so that
    # training traffic comes first (MB a second; 0: as fast as the network goes).
    peer_copy_mb_s: float = 200.0

    @property
    def ledger_rules(self) -> LedgerRules:
        """The node ledger's keyword arguments (`Ledger.excluded`, `Ledger.rows`)."""
        return {
            "max_failures": self.max_node_failures,
            "window_s": self.node_failure_window_s,
            "cooldown_s": self.node_cooldown_s,
            "max_strikes": self.max_sdc_strikes,
            "strike_window_s": self.sdc_strike_window_s,
        }


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics of the run, both opt-in: an HTTP endpoint and a textfile for node_exporter."""

    port: int | None = None  # serve /metrics on this port (0: any free one, named in the journal)
    address: str = "127.0.0.1"  # where the endpoint listens: this machine only unless the operator says otherwise
    textfile: str | None = None  # also write the metrics to this .prom file (relative to the working dir)


@dataclass(frozen=True)
class StragglersConfig:
    """Slow ranks: one whose compute per step stays this much above its peers' median this long is flagged."""

    enabled: bool = True
    margin: float = 0.2  # 0.2: 20 % slower than the median of the other ranks
    sustain_s: float = 30.0  # slower (or back in line) continuously this long before it is flagged (or cleared)


@dataclass(frozen=True)
class StandbyConfig:
    """Warm standby ranks: a process per local rank with Python started and torch imported, used at a relaunch."""

    enabled: bool = True  # only for `script:` jobs on one machine (a `command:` or a multi-node job starts cold)
    keep_warm: bool = True  # one waits per rank while the run trains; false: started at each relaunch decision only
    fork_server: bool = True  # the first launch's ranks and kept-warm standbys are forked from one that imported once
    prewarm_imports: list[str] | None = None  # what a standby imports; None: torch and the script's installed imports


@dataclass(frozen=True)
class JobConfig:
    """One training job: what to run, on how many ranks, and how to keep it alive."""

    script: str | None = None  # a Python script, run with the supervisor's interpreter (like torchrun)
    command: list[str] | None = None  # or any command line
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    device: str = "cpu"  # cuda: every rank uses a GPU, so each node must show nproc_per_node of them before a launch
    nodes: int = 1  # more than 1: inside a Slurm allocation, one node agent per node
    spare_nodes: int = 0  # allocated nodes held back to replace a failed one
    run_dir: str = "runs/default"
    master_addr: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    restart: RestartConfig = field(default_factory=RestartConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    hang: HangPolicy = field(default_factory=HangPolicy)
    anomaly: AnomalyPolicy = field(default_factory=AnomalyPolicy)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    standby: StandbyConfig = field(default_factory=StandbyConfig)

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def min_nodes(self) -> int:
        """The fewest nodes an attempt may run on (`slurm.min_nodes`, by default all of `nodes`)."""
        return self.nodes if self.slurm.min_nodes is None else self.slurm.min_nodes

    def stop_file(self, layout: RunLayout) -> Path:
        """Where stop requests are written: `stop.stop_file_path` (relative to the working dir) or RUN_DIR/stop."""
        path = self.stop.stop_file_path
        return layout.default_stop_file if path is None else Path(path).resolve()

    @property
    def multi_node(self) -> bool:
        """Ranks on more than one node (or spares to move to): a Slurm run of node agents."""
        return self.nodes > 1 or self.spare_nodes > 0

    @property
    def in_place(self) -> str | None:
        """Why a failed rank's survivors cannot recover in place; None when they can (worker.run decides the rest)."""
        if not self.restart.in_place:
            return "restart.in_place is false"
        return None

    def policy(self) -> Policy:
        return Policy(
            nproc=self.world_size,
            max_restarts=self.restart.max_restarts,
            backoff_initial_s=self.restart.backoff_initial_s,
            backoff_factor=self.restart.backoff_factor,
            backoff_max_s=self.restart.backoff_max_s,
            kill_grace_s=self.stop.kill_grace_s,
            sigkill_wait_s=self.stop.sigkill_wait_s,
            stop_timeout_s=self.stop.timeout_s,
            hang=self.hang,
            anomaly=self.anomaly,
            crash_loop_attempts=self.restart.crash_loop_attempts,
            in_place=self.in_place is None,
            in_place_off=self.in_place or "",
            in_place_timeout_s=self.restart.in_place_timeout_s,
            can_move=self.multi_node,  # a multi-node run relaunches on the nodes the ledger leaves it
        )


# Bounds checked after types: (section path, key) -> (predicate, what it must be). Every number is also
# finite and at most MAX_NUMBER in size, every `*_s` value at most MAX_SECONDS, and no string holds NUL.
_BOUNDS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "nproc_per_node": (lambda v: 1 <= v <= MAX_NPROC, f"between 1 and {MAX_NPROC}"),
    "device": (lambda v: v in DEVICES, " or ".join(DEVICES)),
    "nodes": (lambda v: 1 <= v <= MAX_NODES, f"between 1 and {MAX_NODES}"),
    "spare_nodes": (lambda v: 0 <= v <= MAX_NODES, f"between 0 and {MAX_NODES}"),
    "slurm.node_timeout_s": (lambda v: v >= 2, "at least 2 (node agents report every second)"),
    "slurm.max_node_failures": (lambda v: v >= 1, "at least 1"),
    "slurm.node_failure_window_s": (lambda v: v > 0, "more than 0"),
    "slurm.max_sdc_strikes": (lambda v: v >= 1, "at least 1"),
    "slurm.sdc_strike_window_s": (lambda v: v > 0, "more than 0"),
    "slurm.node_cooldown_s": (lambda v: v >= 0, "0 or more"),
    "slurm.time_limit_margin_s": (lambda v: v >= 0, "0 or more"),
    "slurm.controller_wait_s": (lambda v: v >= 0, "0 or more"),
    "slurm.peer_copy_mb_s": (lambda v: v >= 0, "0 or more"),
    "stragglers.margin": (lambda v: v > 0, "more than 0"),
    "stragglers.sustain_s": (lambda v: v >= 0, "0 or more"),
    "standby.prewarm_imports": (
        lambda v: all(_MODULE.fullmatch(name) for name in v),
        "a list of module names such as torch or torch.nn",
    ),
    "env": (lambda v: all(k and "=" not in k for k in v), "a mapping of variable names (non-empty, no '=')"),
    "restart.max_restarts": (lambda v: v >= 0, "0 or more"),
    "restart.crash_loop_attempts": (lambda v: v == 0 or v >= 2, "0 (off) or at least 2"),
    "restart.backoff_initial_s": (lambda v: v >= 0, "0 or more"),
    "restart.backoff_factor": (lambda v: v >= 1, "at least 1"),
    "restart.backoff_max_s": (lambda v: v >= 0, "0 or more"),
    "restart.in_place_timeout_s": (lambda v: v > 0, "more than 0"),
    "stop.kill_grace_s": (lambda v: v >= 0, "0 or more"),
    "stop.sigkill_wait_s": (lambda v: v > 0, "more than 0"),
    "stop.timeout_s": (lambda v: v > 0, "more than 0"),
    "stop.stop_file_path": (lambda v: v != "", "a path"),
    "hang.heartbeat": (lambda v: v in HEARTBEAT_MODES, f"one of {', '.join(HEARTBEAT_MODES)}"),
    "hang.first_heartbeat_s": (lambda v: v > 0, "more than 0"),
    "hang.phase_timeouts_s": (lambda v: all(t > 0 for t in v.values()), "a mapping of phases to seconds > 0"),
    "hang.default_timeout_s": (lambda v: v > 0, "more than 0"),
    "hang.stacks_timeout_s": (lambda v: v >= 0, "0 or more"),
    "hang.flight_recorder": (lambda v: 0 <= v <= 1_000_000, "between 0 (off) and 1000000 collectives"),
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
    "worker.checkpoint_format": (lambda v: v in ("auto", "files", "dcp"), "auto, files or dcp"),
    "worker.resume_training": (
        lambda v: isinstance(v, bool) or _step_of(v) is not None,
        "true, false, or a checkpoint name such as demo_rank_0-40.ckpt or 40",
    ),
    "worker.save_checkpoint_steps": (lambda v: v >= 0, "0 or more"),
    "worker.save_checkpoint_interval_s": (lambda v: v >= 0, "0 or more"),
    "worker.snapshot_steps": (lambda v: v == "auto" or (isinstance(v, int) and v >= 0), "0 or more, or auto"),
    "worker.snapshot_max_bytes": (lambda v: v >= 0, "0 or more (0: free memory decides)"),
    "worker.persist_mb_s": (lambda v: v >= 0, "0 or more (0: no limit)"),
    "worker.verify_resume": (lambda v: v >= 0, "0 or more"),
    "worker.load_checkpoint": (lambda v: Path(v).is_dir(), "an existing directory (another run's checkpoint/ folder)"),
    "worker.heartbeat_interval_s": (lambda v: v > 0, "more than 0"),
    "worker.prefix": (lambda v: v != "" and "/" not in v, "a non-empty name without '/'"),
    "metrics.port": (lambda v: 0 <= v <= 65535, "between 0 (any free port) and 65535"),
    "metrics.address": (lambda v: v != "", "an address to listen on, such as 127.0.0.1 or 0.0.0.0"),
    "metrics.textfile": (
        lambda v: v.endswith(".prom") and Path(v).name != ".prom",
        "a path ending in .prom (node_exporter's textfile collector reads only those)",
    ),
}


def _step_of(name: str) -> int | None:
    """The step a checkpoint name means, if it is one within MAX_NUMBER (a 5000-digit step is not)."""
    step = parse_checkpoint_name(name) if len(name) <= 255 else None  # 255: the longest file name
    return step if step is not None and step <= MAX_NUMBER else None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read and validate a job config file, with `--set KEY=VALUE` overrides applied to it first; raises
    ConfigError naming the file (or the override) and the key."""
    path = Path(path)
    try:
        data = read_bytes(path, MAX_CONFIG_BYTES, follow_symlinks=True)  # a symlinked config is fine, a FIFO not
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_config(_parse_yaml(text, str(path)), source=str(path), overrides=overrides)


def apply_overrides(raw: Any, overrides: Sequence[str]) -> Any:
    """The parsed document with each `KEY=VALUE` set in turn (KEY a dotted path, VALUE a YAML value), missing
    sections created; the input is not changed. ConfigError naming the override for a malformed one."""
    if not overrides or not (raw is None or isinstance(raw, dict)):
        return raw  # a document that is no mapping: parse_config says so, naming the file
    document = {} if raw is None else raw
    for text in overrides:
        parts, value = _parse_override(text)
        document = _set_path(document, parts, value, text, above=())
    return document


def _parse_override(text: str) -> tuple[list[str], Any]:
    """KEY=VALUE as (the key's parts, the value parsed as YAML: `100`, `true`, `[a, b]`, `{x: 1}`, `null`)."""
    key, equals, value = text.partition("=")
    if not equals:
        raise ConfigError(f"--set {_brief(text)}: not KEY=VALUE (e.g. --set worker.save_checkpoint_steps=100)")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {_brief(text)}: KEY must be a dotted path of names (e.g. restart.max_restarts)")
    if len(parts) > MAX_DEPTH:
        raise ConfigError(f"--set {_brief(text)}: KEY is nested more than {MAX_DEPTH} levels deep")
    return parts, _parse_yaml(value, f"--set {_brief(text)}")


def _set_path(node: dict[str, Any], parts: list[str], value: Any, text: str, above: tuple[str, ...]) -> dict[str, Any]:
    """A copy of `node` (at path `above`) with `value` at `parts`; an absent or empty section on the way is created."""
    head, *rest = parts
    copy = dict(node)
    if not rest:
        copy[head] = value
        return copy
    child = node.get(head)
    if child is not None and not isinstance(child, dict):
        where = ".".join(map(_key, (*above, head)))
        raise ConfigError(f"--set {_brief(text)}: '{where}' is {_kind(child)} in the config, not a section")
    copy[head] = _set_path(child or {}, rest, value, text, (*above, head))
    return copy


def _parse_yaml(text: str, source: str) -> Any:
    """The YAML document in `text`, after checking its shape; ConfigError for anything the parser refuses."""
    try:
        _check_shape(text, source)
        return _safe_load(text)
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):  # a newer libyaml's scanner refuses deep nesting before we see it
            raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
        raise ConfigError(f"{source}: not valid YAML: {_one_line(exc)}") from None
    except Exception as exc:  # PyYAML's constructors raise ValueError, AttributeError... on odd tagged scalars
        raise ConfigError(f"{source}: not valid YAML: {_brief(str(exc) or type(exc).__name__)}") from None


class _UniqueKeyLoader(_LOADER):  # type: ignore[misc, valid-type]  # a base chosen at import, which mypy cannot check
    """The safe loader, refusing a key given twice in one mapping (YAML would keep the last one silently);
    a key merged in with `<<: *anchor` may still be overridden."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{_brief(key.value)}'", key.start_mark
                    )
                seen.add(key.value)
        return super().construct_mapping(node, deep)


def _safe_load(text: str) -> Any:
    """yaml.safe_load, through libyaml when it is built in (plain Python types only, no tags that run code)."""
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _check_shape(text: str, source: str) -> None:
    """Refuse, from the event stream alone, a document nested deeper than MAX_DEPTH or whose aliases
    expand it beyond MAX_CONFIG_BYTES (a "billion laughs": PyYAML shares aliased nodes, but anything
    walking the result would not), or an alias inside its own anchor (a cycle)."""
    sizes: dict[str, int] = {}  # anchor -> expanded size of its node
    stack: list[tuple[str | None, int]] = [(None, 0)]  # open collections: (anchor, expanded size so far)
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(stack) > MAX_DEPTH:  # stops the scanner before deep nesting gets slow
                raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep")
            stack.append((event.anchor, 1))
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, size = stack.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1 + len(event.value)
        elif isinstance(event, yaml.AliasEvent):
            alias = event.anchor
            assert alias is not None  # an alias always names its anchor (types-PyYAML types NodeEvent's as optional)
            if any(open_anchor == alias for open_anchor, _ in stack):
                raise ConfigError(f"{source}: alias *{_brief(alias)} refers to a node that contains it")
            anchor, size = None, sizes.get(alias, 1)  # an undefined alias: the loader says so
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        parent, total = stack[-1]
        stack[-1] = (parent, total + size)
        if total + size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: aliases expand the document beyond {MAX_CONFIG_BYTES} bytes")


def _one_line(exc: yaml.YAMLError) -> str:
    """The parser's complaint and where, on one line (its own message spans several, with a snippet)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        where = f" (line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1})" if exc.problem_mark else ""
        return _brief(" ".join(filter(None, [exc.context, exc.problem])) + where)
    return _brief(" ".join(str(exc).split()))


def parse_config(raw: Any, *, source: str = "<config>", overrides: Sequence[str] = ()) -> JobConfig:
    """Validate an already-parsed YAML document, with `KEY=VALUE` overrides applied first, into a JobConfig.

    An error about a key an override set (or a section holding it, or a mapping it set part of) names the
    override (`--set KEY=VALUE: ...`) instead of `source`.
    """
    raw = apply_overrides(raw, overrides)
    if raw is None:
        raw = {}
    blame = {text.partition("=")[0].strip(): f"--set {_brief(text)}" for text in overrides}
    config: JobConfig = _build(JobConfig, raw, source, prefix="", blame=blame)
    if (config.script is None) == (config.command is None):
        raise ConfigError(
            f"{_blamed(('script', 'command'), blame, source)}: give exactly one of 'script' "
            f"(a Python file) or 'command' (a list)"
        )
    if config.command is not None and not config.command:
        raise ConfigError(f"{_blamed(('command',), blame, source)}: 'command' must not be empty")
    adaptive = config.worker.adaptive_spike
    if adaptive.enabled and adaptive.window < adaptive.min_samples:  # the rule could never fire
        keys = [f"worker.adaptive_spike.{key}" for key in ("enabled", "window", "min_samples")]
        raise ConfigError(
            f"{_blamed(keys, blame, source)}: 'worker.adaptive_spike.window' ({adaptive.window}) "
            f"must be at least 'worker.adaptive_spike.min_samples' ({adaptive.min_samples})"
        )
    _check_feature_value_pairs(config.worker.feature_value_check, source, blame)
    _check_min_nodes(config, source, blame)
    return config


def _check_min_nodes(config: JobConfig, source: str, blame: Mapping[str, str]) -> None:
    """A run may shrink only to a node count it has, and only with checkpoints that reshard."""
    minimum = config.slurm.min_nodes
    if minimum is None:
        return
    if not 1 <= minimum <= config.nodes:
        raise ConfigError(
            f"{_blamed(('slurm.min_nodes', 'nodes'), blame, source)}: 'slurm.min_nodes' ({minimum}) "
            f"must be between 1 and 'nodes' ({config.nodes})"
        )
    if minimum < config.nodes and config.worker.checkpoint_format != "dcp":
        keys = ("slurm.min_nodes", "worker.checkpoint_format")
        raise ConfigError(
            f"{_blamed(keys, blame, source)}: 'slurm.min_nodes' below 'nodes' needs "
            f"'worker.checkpoint_format: dcp' (per-rank checkpoints cannot change world size)"
        )


def _blamed(names: Iterable[str], blame: Mapping[str, str], source: str, *, whole: bool = True) -> str:
    """Who to name for an error about `names`: the last override that set one of them or a section holding it
    (or, for a `whole` value such as a mapping, part of it); else `source`, the file."""

    def touches(key: str, name: str) -> bool:
        return key == name or name.startswith(f"{key}.") or (whole and key.startswith(f"{name}."))

    hits = [text for key, text in blame.items() if any(touches(key, name) for name in names)]
    return hits[-1] if hits else source


def check_launchable(config: JobConfig, cwd: Path | None = None) -> JobConfig:
    """The config with its script made absolute, once the script (or the command's program) is known to
    exist; ConfigError saying what is missing otherwise, so that it fails once instead of every restart.

    Relative paths are taken from `cwd` (default: the working directory), as `python script.py` does.
    """
    try:
        cwd = Path.cwd() if cwd is None else cwd
    except OSError as exc:  # deleted under us: nothing relative can be found
        raise ConfigError(f"the working directory is unusable: {exc.strerror or exc}") from None
    if config.script is not None:
        script = cwd / config.script  # an absolute script stays as it is
        _check_file(script, config.script, cwd, executable=False)
        return dataclasses.replace(config, script=str(script))
    assert config.command is not None
    program = config.command[0]
    if "/" in program:
        _check_file(cwd / program, program, cwd, executable=True)
    elif shutil.which(program, path=config.env.get("PATH", os.environ.get("PATH", os.defpath))) is None:
        raise ConfigError(f"{program} not found on PATH")  # the ranks' PATH: `env:` may set it
    return config


def _check_file(path: Path, given: str, cwd: Path, *, executable: bool) -> None:
    note = "" if Path(given).is_absolute() else f" (relative paths are taken from the working directory {cwd})"
    try:
        is_file = path.is_file()
    except OSError:  # a name too long, a directory we may not search: not launchable either
        is_file = False
    if not is_file:
        problem = "is not a regular file" if os.path.exists(path) else "not found"
        raise ConfigError(f"{given} {problem}{note}")
    if not os.access(path, os.X_OK if executable else os.R_OK):
        raise ConfigError(f"{given} is not {'executable' if executable else 'readable'}{note}")


def _check_feature_value_pairs(check: Any, source: str, blame: Mapping[str, str]) -> None:
    """Seed 002's threshold pairs: the L1 (fault) threshold must lie above the L2 (warning) one."""
    for pair in ("upper_thresh", "sigma_thresh"):
        first, second = getattr(check, f"{pair}1"), getattr(check, f"{pair}2")
        if first <= second:
            keys = [f"worker.feature_value_check.{pair}{level}" for level in (1, 2)]
            raise ConfigError(
                f"{_blamed(keys, blame, source)}: '{keys[0]}' ({first:g}) must be greater than '{keys[1]}' ({second:g})"
            )


def _build(cls: type, raw: Any, source: str, prefix: str, blame: Mapping[str, str]) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, got {_kind(raw)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        name = f"{prefix}{_key(key)}"
        section = key in known and dataclasses.is_dataclass(hints[key])  # its keys are judged one by one
        who = _blamed((name,), blame, source, whole=not section)
        if key not in known:
            raise ConfigError(f"{who}: unknown key '{name}'{_suggest(_key(key), known)}")
        values[key] = _check(hints[key], value, who, name, blame)
        bound = _BOUNDS.get(name)
        if bound and values[key] is not None and not _satisfies(bound[0], values[key]):
            raise ConfigError(f"{who}: '{name}' must be {bound[1]}, got {_brief(repr(value))}")
    return cls(**values)


def _satisfies(predicate: typing.Callable[[Any], bool], value: Any) -> bool:
    try:
        return predicate(value)
    except (OSError, ValueError):  # a path too long to stat, digits int() will not convert: not a valid value
        return False


def _check(hint: Any, value: Any, source: str, name: str, blame: Mapping[str, str]) -> Any:
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in params:
            return None
        options = [p for p in params if p is not type(None)]
        for inner in options[:-1]:  # `bool | str`: the first type that fits wins
            try:
                return _check(inner, value, source, name, blame)
            except ConfigError:
                continue
        try:
            return _check(options[-1], value, source, name, blame)
        except ConfigError:
            if len(options) < 2 or name not in _BOUNDS or any(type(value) is option for option in options):
                raise
            # No type fits: its bound says what it may be (`0 or more, or auto`), truer than "must be a string".
            raise ConfigError(f"{source}: '{name}' must be {_BOUNDS[name][1]}, got {_kind(value)}") from None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, source, prefix=f"{name}.", blame=blame)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: '{name}' must be a list of strings, got {_kind(value)}")
        return [_string(item, source, f"{name}[{i}]") for i, item in enumerate(value)]
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{name}' must be a mapping, got {_kind(value)}")
        for k in value:
            if not isinstance(k, str):  # YAML reads `1:` or `null:` as a number or None, not a name
                raise ConfigError(f"{source}: '{name}' keys must be strings, got {_kind(k)}")
            _text(k, source, f"{name} key {_key(k)}")
        if params[1] is str:
            return {k: _string(v, source, f"{name}.{_key(k)}") for k, v in value.items()}
        return {k: _check_scalar(params[1], v, source, f"{name}.{_key(k)}") for k, v in value.items()}
    return _check_scalar(hint, value, source, name)


def _check_scalar(hint: Any, value: Any, source: str, name: str) -> Any:
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return _number(value, source, name)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(_number(value, source, name))
    if hint is str and isinstance(value, str):
        return _text(value, source, name)
    wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
    raise ConfigError(f"{source}: '{name}' must be {wanted}, got {_kind(value)}")


def _number(value: int | float, source: str, name: str) -> int | float:
    """A finite number within MAX_NUMBER, and within MAX_SECONDS for a `*_s` key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: '{name}' must be a finite number, got {value!r}")
    if abs(value) > MAX_NUMBER:
        raise ConfigError(f"{source}: '{name}' must be at most 2**53 in size, got {_kind(value)}")
    if value > MAX_SECONDS and any(part.endswith("_s") for part in name.split(".")):
        raise ConfigError(f"{source}: '{name}' must be at most {MAX_SECONDS} seconds, got {value!r}")
    return value


def _text(value: str, source: str, name: str) -> str:
    """A string a command line, environment or path can hold: no NUL, no lone surrogate."""
    if "\0" in value:  # Popen and open() raise ValueError on it
        raise ConfigError(f"{source}: '{name}' must not contain a NUL character, got {_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # YAML's "\ud800" escape: not text any OS call accepts
        raise ConfigError(f"{source}: '{name}' must be valid Unicode text, got {_kind(value)}") from None
    return value


def _string(value: Any, source: str, name: str) -> str:
    """A string, or a number YAML read as one (`"--steps", 600`); nothing else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(_number(value, source, name))
    if isinstance(value, str):
        return _text(value, source, name)
    raise ConfigError(f"{source}: '{name}' must be a string, got {_kind(value)}")


def _kind(value: Any) -> str:
    """A value as an error message shows it: short, on one line, never a huge repr."""
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"  # repr() of 10^5000 raises ValueError
    if value is None or isinstance(value, (bool, int, float, str)):
        return _brief(repr(value))
    return f"a {type(value).__name__}"  # a date, bytes or a set: YAML tags no key takes


def _key(key: Any) -> str:
    """A key as part of a dotted name: itself if plain, else escaped and shortened."""
    if isinstance(key, str) and key.isprintable() and len(key) <= 80:
        return key
    return _brief(repr(key)[1:-1]) if isinstance(key, str) else _kind(key)


def _brief(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(known))})"

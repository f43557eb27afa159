"""The contract between supervisor and worker: environment, exit codes, run-dir layout, atomic files.

Both halves import this module; it must never import torch (the supervisor stays small).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from worker.anomaly import AdaptiveConfig, MonitorConfig
from worker.feature_rule import FeatureValueConfig
from worker.manifest import MANIFEST
from worker.store import (
    MEMORY_LABEL,
    STEP_NAME,
    CheckpointStore,
    newest_complete,
    parse_checkpoint_name,
    parse_sharded_name,
)

__all__ = [
    "CHECKPOINT_WRITER_GROUP",
    "ENV_ATTEMPT",
    "ENV_FAILURES",
    "ENV_IN_PLACE",
    "ENV_JOIN_AFTER",
    "ENV_MEMORY_DIR",
    "ENV_RESUME_DIR",
    "ENV_RESUME_STEP",
    "ENV_RUN_DIR",
    "ENV_SKIP_TO_BATCH",
    "ENV_WORKER_CONFIG",
    "MANIFEST",
    "MEMORY_LABEL",
    "EXIT_ANOMALY",
    "EXIT_BAD_DEVICE",
    "EXIT_CHECKPOINT_REFUSED",
    "EXIT_CONFIG",
    "EXIT_CRASH_LOOP",
    "EXIT_FAILED",
    "EXIT_REQUEUE",
    "EXIT_SAVE_LOST",
    "STACK_DUMP_SIGNAL",
    "UNWIND_SIGNAL",
    "RunLayout",
    "StopOrder",
    "WorkerConfig",
    "CheckpointStore",
    "named_store",
    "newest_complete",
    "resume_stores",
    "failures_env",
    "parse_checkpoint_name",
    "parse_failures",
    "parse_sharded_name",
    "RECOVERING_PHASE",
]

# Set by the supervisor for every rank (besides torchrun's RANK, WORLD_SIZE, MASTER_ADDR, ...).
ENV_RUN_DIR = "TRAINWARDEN_RUN_DIR"
ENV_ATTEMPT = "TRAINWARDEN_ATTEMPT"
# Step of the checkpoint to resume from; empty means "start from scratch".
ENV_RESUME_STEP = "TRAINWARDEN_RESUME_STEP"
# The checkpoint store to resume from (this run's, a snapshot slot, or worker.load_checkpoint's directory).
ENV_RESUME_DIR = "TRAINWARDEN_RESUME_DIR"
# JSON object: the `worker:` section of the job config.
ENV_WORKER_CONFIG = "TRAINWARDEN_WORKER_CONFIG"
# After an anomaly abort: a resumed rank whose data position is below this batch index jumps to it.
ENV_SKIP_TO_BATCH = "TRAINWARDEN_SKIP_TO_BATCH"
# The memory tier (worker.memory): this run's directory in host shared memory on the rank's node, created by the
# supervisor (or the node's agent); unset or empty: no memory tier, snapshots go to the disk slots.
ENV_MEMORY_DIR = "TRAINWARDEN_MEMORY_DIR"
# "N/SECONDS": the run's failures so far and the wall time they happened over, for `snapshot_steps: auto`
# (worker.cadence); unset or empty: none known (a plain torchrun).
ENV_FAILURES = "TRAINWARDEN_FAILURES"
# "1": a rank that runs its training function through `worker.run` recovers in place (worker.recovery): when a peer
# fails, it stays, and runs the function again for the next attempt; unset: it ends with its attempt, as under torchrun.
ENV_IN_PLACE = "TRAINWARDEN_IN_PLACE"
# Attempt N: this process replaces a rank that failed in it, started while the survivors unwind; like them it waits
# for the next attempt's variables (worker.recovery) before it runs its training function.
ENV_JOIN_AFTER = "TRAINWARDEN_JOIN_AFTER"
# The heartbeat phase of a rank that unwound from a failed attempt and waits for the next one (worker.recovery).
RECOVERING_PHASE = "recovering"

# The supervisor asks a rank leader for its Python stacks with this signal (faulthandler dumps them).
STACK_DUMP_SIGNAL = signal.SIGUSR2
# The supervisor tells a rank that recovers in place that its attempt failed (worker.recovery): it leaves its
# training function now rather than at its next collective. A real-time signal: no library claims it.
UNWIND_SIGNAL = signal.SIGRTMIN + 6
# The description (`group_desc`) of the sharded checkpointer's own process group: the flight recorder names each
# entry's group with it, so the hang analyzer judges a background save's collectives apart from training's.
CHECKPOINT_WRITER_GROUP = "trainwarden_checkpoint_writer"

# Exit codes, the same words for supervisor and ranks (docs/exit-codes.md). 0 is done or stopped on request.
# 65, 66 and 78 are sysexits' EX_DATAERR, EX_NOINPUT and EX_CONFIG, which operators and systemd know.
EXIT_FAILED = 1  # retryable: restarts exhausted, a rank could not be stopped (supervisor); a crash (rank)
EXIT_ANOMALY = 65  # rank: aborted on anomalies (relaunch past the bad data); supervisor: rollbacks exhausted
EXIT_CHECKPOINT_REFUSED = 66  # rank: its resume checkpoint is unsafe to load (sysexits EX_NOINPUT): use an older one
# rank (sysexits EX_UNAVAILABLE): re-running a step found a rank's device corrupting its results, persistently
# (worker.rerun); every rank leaves at that step, and the supervisor relaunches without that node or GPU.
EXIT_BAD_DEVICE = 69
EXIT_CONFIG = 78  # the job config (supervisor) or the rank's settings are invalid: retrying cannot help
# Supervisor only (sysexits EX_SOFTWARE): attempts failed the same way, or made no progress, N times in a row.
EXIT_CRASH_LOOP = 70
# Supervisor only (sysexits EX_IOERR): stopped on request, but a rank went down inside a checkpoint save, so the
# newest checkpoint is older than the stop (a rerun resumes from it); never the 0 of a clean stop.
EXIT_SAVE_LOST = 74
# Supervisor only (sysexits EX_TEMPFAIL): requeue me, the job is fine. Stopped for Slurm's time-limit warning
# (SIGUSR1) with the save done, or too few healthy nodes left in the allocation (the bad ones named).
EXIT_REQUEUE = 75

SNAPSHOT_DIR = "snapshot"  # checkpoint/snapshot/{0,1}/rank_R/... and, in memory, MEMORY/snapshot/{0,1}/...
SNAPSHOT_SLOTS = (0, 1)
PERSIST_DIR = "persist"  # MEMORY/persist/STEP/...: a snapshot pinned (hard links) until it is copied to disk


@dataclass(frozen=True)
class WorkerConfig:
    """The `worker:` section of a job config; the supervisor hands it to every rank as JSON."""

    save_checkpoint_steps: int = 0  # seed 001; 0: save by time instead (save_checkpoint_interval_s)
    # Without a step count, every rank saves at the first step at least this long after the last save (all ranks
    # agree on the step); 0 here and 0 steps: no checkpoints at all, which the rank says loudly at start
    save_checkpoint_interval_s: float = 600.0
    prefix: str = "ckpt"  # seed 001's checkpoint file prefix
    # "files": one torch.save file per rank; "dcp": sharded (torch.distributed.checkpoint), resumable at another
    # world size; "auto": dcp when the model holds DTensors (FSDP2, tensor parallel), else files
    checkpoint_format: str = "auto"
    async_save: bool = True  # dcp: the loop pays only the staging copy; the write runs in a background thread
    keep_checkpoint_max: int = 0  # seed 001; the supervisor deletes older complete checkpoints; 0 keeps all
    # seed 004's oss_snapshot_freq: also save into two alternating snapshot slots, in memory where the supervisor
    # gave a memory directory (worker.memory), else on disk; "auto": in memory only, the interval following measured
    # costs and the failure rate (worker.cadence); 0: off
    snapshot_steps: int | str = "auto"
    snapshot_max_bytes: int = 0  # the memory tier's bound per node (both slots and a pin); 0: free memory decides
    persist_mb_s: float = 0.0  # the pace of the supervisor's copies of pinned snapshots to disk (MB/s); 0: no limit
    load_checkpoint: str | None = None  # seed 001: another run's checkpoint directory to resume from as well
    # seed 001: true resumes from the newest usable checkpoint; a checkpoint name (or step) resumes from that one,
    # healthy or not; without a supervisor the worker itself resumes from the newest complete checkpoint
    resume_training: bool | str = True
    no_usable_checkpoint: str = "scratch"  # when checkpoints exist but none is usable: "scratch" or "refuse"
    # torch.load(weights_only=True): tensors and plain data only. False also unpickles your own objects in data_state,
    # and runs whatever code a crafted checkpoint file in the run dir holds
    weights_only: bool = True
    ignore_data_skip: bool = False  # seed 001: after resuming, read the (new) dataset from its beginning
    data_skip_steps: int | None = None  # seed 001: after resuming, start the (new) dataset at this batch
    use_checkpoint_health_monitor: bool = False  # seed 000: tag each checkpoint healthy or not
    embedding_local_norm_threshold: float = 1.0  # seed 000's default
    embedding_param: str | None = None  # which parameter is "the embedding"; default: the first nn.Embedding
    heartbeat_interval_s: float = 0.5
    # A replay check for test runs: after each save, the next N batches' losses are kept; a run resumed from it must
    # repeat them bit for bit, else it says `resume_inexact` (worker.verify); 0: off
    verify_resume: int = 0
    use_skip_data_by_global_norm: bool = False  # seed 000: skip steps whose global norm exceeds the threshold
    monitor_config: MonitorConfig = field(default_factory=MonitorConfig)  # seed 000
    adaptive_spike: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    feature_value_check: FeatureValueConfig = field(default_factory=FeatureValueConfig)  # seed 002
    # Per-rank fingerprints from before DDP's reduction, naming a rank that stands out, and re-runs of steps that
    # alarm (worker.fingerprint, worker.rerun); off: DDP's own reduction, and every alarm skips its step
    fingerprints: bool = True

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> WorkerConfig:
        """The config the supervisor passed, or defaults; unknown keys are ignored for forward compatibility."""
        config: WorkerConfig = _from_dict(cls, json.loads(os.environ.get(ENV_WORKER_CONFIG) or "{}"))
        return config


def _from_dict(cls: Any, raw: dict[str, Any]) -> Any:
    """A (nested) dataclass from a JSON object, skipping keys it does not know."""
    values = {}
    for f in fields(cls):
        if f.name in raw:
            nested = f.default_factory if is_dataclass(f.default_factory) else None
            values[f.name] = _from_dict(nested, raw[f.name]) if nested else raw[f.name]
    return cls(**values)


@dataclass(frozen=True)
class StopOrder:
    """Save a checkpoint at `step` on every rank, then exit (`exit`) or go on; `id` tells orders apart."""

    id: int
    step: int
    exit: bool

    @classmethod
    def from_json(cls, raw: Any) -> StopOrder:
        """Raises KeyError, TypeError or ValueError for anything but a whole order."""
        return cls(id=int(raw["id"]), step=int(raw["step"]), exit=bool(raw["exit"]))


@dataclass(frozen=True)
class RunLayout:
    """Where every file of one run lives; the only place that knows the run-dir layout."""

    root: Path
    memory: Path | None = None  # this node's memory directory of the run (worker.memory); None: no memory tier

    @property
    def lock_file(self) -> Path:
        return self.root / "supervisor" / "lock"

    @property
    def pids_file(self) -> Path:
        """Rank processes (pid and start time) of the running attempt, for a successor to clean up."""
        return self.root / "supervisor" / "pids.json"

    @property
    def state_file(self) -> Path:
        return self.root / "supervisor" / "state.json"

    @property
    def journal(self) -> Path:
        return self.root / "supervisor" / "events.jsonl"

    @property
    def node_ledger(self) -> Path:
        """Multi-node runs: the nodes that failed this run, and when (a requeued job refuses the bad ones)."""
        return self.root / "supervisor" / "nodes.json"

    @property
    def stop_order(self) -> Path:
        """The supervisor's order to every rank: save at a step, then exit or continue (ranks poll it)."""
        return self.root / "supervisor" / "stop_order.json"

    @property
    def recovery(self) -> Path:
        """The supervisor's word to ranks that recover in place (worker.recovery): which attempt unwinds, and the
        next attempt's number and environment (ranks poll it)."""
        return self.root / "supervisor" / "recovery.json"

    @property
    def default_stop_file(self) -> Path:
        """Where people write stop requests unless the config says otherwise (seed 004's stop file)."""
        return self.root / "stop"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoint"

    def rank_dir(self, rank: int) -> Path:
        return self.root / "ranks" / f"rank_{rank}"

    def heartbeat(self, rank: int) -> Path:
        return self.rank_dir(rank) / "heartbeat.json"

    def rank_events(self, rank: int) -> Path:
        return self.rank_dir(rank) / "events.jsonl"

    def skip_list(self, rank: int) -> Path:
        """The batches a re-run judged the data's, skipped again after a resume (worker.skip_list)."""
        return self.rank_dir(rank) / "skip_list.json"

    def trajectory(self, rank: int) -> Path:
        """The losses after the newest saves, for `worker.verify_resume` (worker.verify)."""
        return self.rank_dir(rank) / "trajectory.json"

    def stack_dump(self, rank: int, attempt: int) -> Path:
        """faulthandler's dump of every thread, written by the rank itself on STACK_DUMP_SIGNAL."""
        return self.rank_dir(rank) / f"stacks_attempt_{attempt}.txt"

    def flight_dump(self, rank: int, attempt: int) -> Path:
        """The rank's flight recorder (JSON), written by a helper thread when its stacks are dumped (worker.flight)."""
        return self.rank_dir(rank) / f"flight_recorder_attempt_{attempt}.json"

    def pyspy_dump(self, rank: int, attempt: int) -> Path:
        """`py-spy dump` of the rank, taken from outside by the supervisor."""
        return self.rank_dir(rank) / f"pyspy_attempt_{attempt}.txt"

    def attempt_log(self, attempt: int, rank: int, stream: str) -> Path:
        return self.root / "logs" / f"attempt_{attempt}" / f"rank_{rank}.{stream}"

    @property
    def checkpoints(self) -> CheckpointStore:
        """The run's regular checkpoints (seed 001)."""
        return CheckpointStore(self.checkpoint_dir)

    def snapshot_slot(self, slot: int) -> CheckpointStore:
        """One of the two alternating snapshot slots (seed 004); the older one is overwritten next."""
        return CheckpointStore(
            self.checkpoint_dir / SNAPSHOT_DIR / str(slot), label=f"snapshot slot {slot}", base=self.checkpoint_dir
        )

    def memory_slot(self, slot: int) -> CheckpointStore:
        """One of the two alternating snapshot slots in memory; the older one is overwritten next."""
        assert self.memory is not None
        return CheckpointStore(self.memory / SNAPSHOT_DIR / str(slot), label=MEMORY_LABEL, base=self.memory)

    def memory_pin(self, step: int) -> CheckpointStore:
        """The snapshot of `step` pinned for persisting: hard links to its files, kept until it is on disk."""
        assert self.memory is not None
        return CheckpointStore(self.memory / PERSIST_DIR / str(step), label=MEMORY_LABEL, base=self.memory)

    def memory_pins(self) -> list[int]:
        """Steps with a pinned snapshot (complete or not), oldest first."""
        if self.memory is None:
            return []
        try:
            names = os.listdir(self.memory / PERSIST_DIR)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(name) for name in names if STEP_NAME.fullmatch(name))

    def memory_stores(self) -> list[CheckpointStore]:
        """The memory tier's stores: both slots and every pinned snapshot (none without a memory directory)."""
        if self.memory is None:
            return []
        return [*(self.memory_slot(slot) for slot in SNAPSHOT_SLOTS), *map(self.memory_pin, self.memory_pins())]

    def checkpoint_stores(self) -> list[CheckpointStore]:
        """Every place of this run a resume may come from: regular checkpoints first, then the memory tier, then
        the snapshot slots on disk."""
        return [self.checkpoints, *self.memory_stores(), *(self.snapshot_slot(slot) for slot in SNAPSHOT_SLOTS)]


def failures_env(failures: int, wall_s: float) -> str:
    """ENV_FAILURES's value: `failures` over `wall_s` seconds of the run."""
    return f"{max(0, failures)}/{max(0.0, wall_s):.1f}"


def parse_failures(text: str) -> tuple[int, float] | None:
    """(failures, wall seconds) from ENV_FAILURES's value; None when it is empty or not `N/SECONDS`."""
    count, slash, seconds = text.strip()[:64].partition("/")
    try:
        failures, wall_s = int(count), float(seconds)
    except ValueError:
        return None
    if not slash or failures < 0 or not 0 <= wall_s < float("inf"):
        return None
    return failures, wall_s


def resume_stores(layout: RunLayout, config: WorkerConfig) -> list[CheckpointStore]:
    """Where a resume may come from: this run's checkpoints and snapshots, then `load_checkpoint`'s directory."""
    own = layout.checkpoint_stores()
    return own if not config.load_checkpoint else [*own, load_checkpoint_store(config.load_checkpoint)]


def named_store(layout: RunLayout, config: WorkerConfig) -> CheckpointStore:
    """Where `resume_training: <name>` looks: `load_checkpoint`'s directory if given, else this run's."""
    return load_checkpoint_store(config.load_checkpoint) if config.load_checkpoint else layout.checkpoints


def load_checkpoint_store(directory: str) -> CheckpointStore:
    return CheckpointStore(Path(directory), label=f"load_checkpoint {directory}")

"""The checkpoint store, in one place: where checkpoints lie, and what makes one complete, intact, healthy and
resumable. The worker (saving, resuming without a supervisor), the supervisor's resume choice, rotation and
`health_ckpts.json`, `status`, the persister, the node agents and `trainwarden export` all ask here. Torch-free.

A store is one directory of checkpoints (`CheckpointStore`): the run's `checkpoint/`, a snapshot slot on disk, a
memory slot or pin (worker.memory; labelled `memory`), another run's directory (`load_checkpoint`). Each tier is a
list of stores (`RunLayout.checkpoint_stores`), and every store holds checkpoints of the same kinds. A kind is how a
checkpoint of one step lies in a store, and each answers the same few questions (`Kind`):

- per-rank files (`PER_RANK`, seed 001's layout): `rank_R/PREFIX_rank_R-STEP.ckpt`, then its completion record
  `PREFIX_rank_R-STEP.json` (size, CRC-32, health, world size); complete once every rank has both; resumable only
  by the world size that wrote it;
- a checkpoint directory with a manifest (`DIRECTORY`): the worker library's sharded (DCP) `PREFIX-STEP.dcp/`, or a
  framework's (Lightning, the Hugging Face Trainer) `PREFIX-STEP/`; complete once its manifest (worker.manifest),
  written last, exists; checked by the manifest, every file it lists by size and checksum; any world size.

A candidate is passed over, with the reason, when a rank lacks its file or record, a file's size or checksum
differs from its record (truncated, corrupted), a rank tagged its part unhealthy, or another world size wrote it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from worker.files import file_crc32, is_plain_dir, is_plain_file, read_json
from worker.manifest import MANIFEST, manifest_problem, read_manifest

__all__ = [
    "DIRECTORY",
    "MEMORY_LABEL",
    "PER_RANK",
    "STEP_NAME",
    "CheckpointStore",
    "Choice",
    "Kind",
    "WorldSizeMismatch",
    "choose_explicit",
    "choose_resume",
    "completed_at",
    "health_entries",
    "kind_of",
    "newest_complete",
    "parse_checkpoint_name",
    "parse_sharded_name",
    "passed_over_event",
    "prefixes",
    "rank_0_steps",
    "read_record",
    "world_size_mismatch",
    "world_sizes",
]

MEMORY_LABEL = "memory"  # how logs, status and `resume_source` name the memory tier
LEGACY_MAX_RANKS = 1024  # records from before they named their world size: rank dirs counted up to this many

# ASCII digits, at most 18: any name that matches gives a rank and step that fit 64 bits.
_CKPT_NAME = re.compile(r"^(?P<prefix>.+)_rank_(?P<rank>\d{1,18})-(?P<step>\d{1,18})\.(?P<kind>ckpt|json)$", re.ASCII)
STEP_NAME = re.compile(r"\d{1,18}", re.ASCII)
# A checkpoint directory: one per step, complete once its manifest exists (worker.manifest). `.dcp`: a sharded
# checkpoint of the worker library's; no suffix: a framework's (Lightning, the Hugging Face Trainer's checkpoint-S).
_SHARDED_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d{1,18})(?P<dcp>\.dcp)?$", re.ASCII)


@dataclass(frozen=True)
class CheckpointStore:
    """A directory of checkpoints: per-rank files laid out as seed 001's (`rank_R/PREFIX_rank_R-STEP.ckpt`, its
    completion record `PREFIX_rank_R-STEP.json`, written after the file, and `rank_R/meta.json`) and checkpoint
    directories (`PREFIX-STEP.dcp/`, a framework's `PREFIX-STEP/`)."""

    root: Path
    label: str = "checkpoint"  # how logs and status name checkpoints from here
    base: Path | None = None  # writes follow no symlink below this (default `root`): the run's checkpoint/ dir

    @property
    def write_root(self) -> Path:
        return self.root if self.base is None else self.base

    def rank_dir(self, rank: int) -> Path:
        return self.root / f"rank_{rank}"

    def file(self, rank: int, step: int, prefix: str) -> Path:
        return self.rank_dir(rank) / f"{prefix}_rank_{rank}-{step}.ckpt"

    def record(self, rank: int, step: int, prefix: str) -> Path:
        """The completion record of a rank's checkpoint: size, checksum, health; written after the file."""
        return self.rank_dir(rank) / f"{prefix}_rank_{rank}-{step}.json"

    def meta(self, rank: int) -> Path:
        return self.rank_dir(rank) / "meta.json"

    def sharded_dir(self, step: int, prefix: str) -> Path:
        """The checkpoint directory of `step`: a sharded (DCP) one (every rank's shard, its own state and, written
        last, the manifest), or a framework's (`framework_dir`) if only that exists."""
        sharded = self.root / f"{prefix}-{step}.dcp"
        framework = self.framework_dir(step, prefix)
        return framework if not is_plain_dir(sharded) and is_plain_dir(framework) else sharded

    def framework_dir(self, step: int, prefix: str) -> Path:
        """A framework's checkpoint of `step` (worker.integrations): its own files, our records, the manifest."""
        return self.root / f"{prefix}-{step}"

    def sharded_steps(self, prefix: str, kind: str = "complete") -> set[int]:
        """Steps with a checkpoint directory (sharded or a framework's) holding its manifest (`kind="complete"`), or
        any (`"any"`)."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return set()
        steps = set()
        for name in names:
            match = _SHARDED_NAME.match(name)
            if match and match["prefix"] == prefix and (kind == "any" or is_plain_file(self.root / name / MANIFEST)):
                steps.add(int(match["step"]))
        return steps

    def is_sharded(self, step: int, prefix: str) -> bool:
        """Whether the checkpoint of `step` here is a directory (sharded or a framework's), complete or not."""
        return is_plain_dir(self.sharded_dir(step, prefix))

    def owns(self, name: str, rank: int, prefix: str) -> bool:
        """Whether `name` in `rank_dir(rank)` is one of our files: a checkpoint, its record or meta.json."""
        match = _CKPT_NAME.match(name)
        return name == "meta.json" or bool(match and match["prefix"] == prefix and int(match["rank"]) == rank)

    def steps(self, rank: int, prefix: str, kind: str = "complete") -> set[int]:
        """Steps for which `rank` has a checkpoint file and its completion record (`kind="complete"`),
        or either of them (`kind="any"`); stray files and other prefixes are ignored."""
        try:
            names = os.listdir(self.rank_dir(rank))
        except (FileNotFoundError, NotADirectoryError):
            return set()
        found: dict[int, set[str]] = {}
        for name in names:
            match = _CKPT_NAME.match(name)
            if match and self.owns(name, rank, prefix):
                found.setdefault(int(match["step"]), set()).add(match["kind"])
        return {step for step, kinds in found.items() if kind == "any" or kinds == {"ckpt", "json"}}

    def complete_steps(self, world_size: int, prefix: str) -> list[int]:
        """Steps, oldest first, complete here in any kind: per-rank files with their records on every rank, or a
        checkpoint directory with its manifest (any world size: it reshards on load)."""
        return sorted(PER_RANK.steps(self, world_size, prefix) | DIRECTORY.steps(self, world_size, prefix))


# ---- kinds: how a checkpoint of one step lies in a store ----------------------------------------------------------


class Kind(Protocol):
    """What every kind of checkpoint answers about the one of `step` in `store`."""

    def steps(self, store: CheckpointStore, world_size: int, prefix: str, *, complete: bool = True) -> set[int]:
        """Steps held here in this kind: complete only, or any trace of one (a save in flight, a torn one)."""

    def problem(
        self, store: CheckpointStore, step: int, world_size: int, prefix: str, *, require_healthy: bool
    ) -> str | None:
        """Why it must not be resumed by `world_size` ranks (None: it may), every file checked."""

    def health(self, store: CheckpointStore, step: int, world_size: int, prefix: str) -> dict[str, Any]:
        """Its `health_ckpts.json` entry (seed 000): healthy (0) only if every rank's part is."""

    def written_by(self, store: CheckpointStore, step: int, prefix: str) -> int | None:
        """How many ranks wrote it, where that binds a resume (None: unknown, or any world size resumes it)."""

    def completed_at(self, store: CheckpointStore, step: int, world_size: int, prefix: str) -> float | None:
        """When it became complete (wall clock): its last-written file's modification time."""


class _PerRank:
    """Each rank's file and completion record."""

    def steps(self, store: CheckpointStore, world_size: int, prefix: str, *, complete: bool = True) -> set[int]:
        per_rank = [store.steps(rank, prefix, kind="complete" if complete else "any") for rank in range(world_size)]
        if not per_rank:
            return set()
        return set.intersection(*per_rank) if complete else set.union(*per_rank)

    def problem(
        self, store: CheckpointStore, step: int, world_size: int, prefix: str, *, require_healthy: bool
    ) -> str | None:
        for rank in range(world_size):
            try:
                record = read_record(store, rank, step, prefix)
            except FileNotFoundError:
                return f"incomplete: rank {rank} has no completion record"
            except (OSError, ValueError) as exc:
                return f"unreadable completion record on rank {rank}: {exc}"
            written = _declared_world_size(record)
            if written is not None and written != world_size:  # checked before the checksum: no big read for nothing
                return f"written by {written} ranks (rank {rank}'s record says); this run has {world_size}"
            if rank == 0 and written is None and step in store.steps(world_size, prefix):  # a record from before
                return (
                    f"written by more than {world_size} ranks (rank {world_size} has it too); this run has {world_size}"
                )
            try:
                size, crc = file_crc32(store.file(rank, step, prefix), limit=record["size"])
            except FileNotFoundError:
                return f"incomplete: rank {rank} has no checkpoint file"
            except OSError as exc:
                return f"unreadable checkpoint file on rank {rank}: {exc}"
            if size != record["size"]:
                return f"truncated on rank {rank}: {size} bytes, {record['size']} written"
            if crc != record["crc32"]:
                return f"corrupted on rank {rank}: checksum differs from the one written"
            if require_healthy and record.get("is_health", 0) != 0:
                return f"unhealthy on rank {rank}: {_health_reasons(record)}"
        return None

    def health(self, store: CheckpointStore, step: int, world_size: int, prefix: str) -> dict[str, Any]:
        unhealthy = []
        for rank in range(world_size):
            try:
                if read_record(store, rank, step, prefix).get("is_health", 0) != 0:
                    unhealthy.append(rank)
            except (OSError, ValueError):
                unhealthy.append(rank)
        name = store.file(0, step, prefix).name
        return {"is_health": int(bool(unhealthy)), "ckpt_name": name, "step": step, "unhealthy_ranks": unhealthy}

    def written_by(self, store: CheckpointStore, step: int, prefix: str) -> int | None:
        """What rank 0's completion record says, or (older records) how many rank dirs in a row hold the step."""
        try:
            declared = _declared_world_size(read_record(store, 0, step, prefix))
        except (OSError, ValueError):
            return None
        if declared is not None:
            return declared
        ranks = range(1, LEGACY_MAX_RANKS + 2)
        return next(n for n in ranks if n > LEGACY_MAX_RANKS or step not in store.steps(n, prefix))

    def completed_at(self, store: CheckpointStore, step: int, world_size: int, prefix: str) -> float | None:
        try:
            return max(
                os.stat(store.record(rank, step, prefix), follow_symlinks=False).st_mtime for rank in range(world_size)
            )
        except (OSError, ValueError):  # ValueError: world_size 0 (no ranks, no time)
            return None


class _Directory:
    """A checkpoint directory (sharded, or a framework's), complete once its manifest exists."""

    def steps(self, store: CheckpointStore, world_size: int, prefix: str, *, complete: bool = True) -> set[int]:
        return store.sharded_steps(prefix, kind="complete" if complete else "any")

    def problem(
        self, store: CheckpointStore, step: int, world_size: int, prefix: str, *, require_healthy: bool
    ) -> str | None:
        return manifest_problem(store.sharded_dir(step, prefix), step, require_healthy=require_healthy)

    def health(self, store: CheckpointStore, step: int, world_size: int, prefix: str) -> dict[str, Any]:
        directory = store.sharded_dir(step, prefix)
        try:
            manifest = read_manifest(directory, step, format=None)
            unhealthy = [r.get("rank") for r in manifest["ranks"] if r.get("is_health", 0) != 0]
            healthy = manifest.get("is_health", 0) == 0 and not unhealthy
        except (OSError, ValueError):
            unhealthy, healthy = [], False
        return {"is_health": int(not healthy), "ckpt_name": directory.name, "step": step, "unhealthy_ranks": unhealthy}

    def written_by(self, store: CheckpointStore, step: int, prefix: str) -> int | None:
        return None  # it reshards on load: any world size resumes it

    def completed_at(self, store: CheckpointStore, step: int, world_size: int, prefix: str) -> float | None:
        try:
            return os.stat(store.sharded_dir(step, prefix) / MANIFEST, follow_symlinks=False).st_mtime
        except OSError:
            return None


PER_RANK: Kind = _PerRank()
DIRECTORY: Kind = _Directory()


def kind_of(store: CheckpointStore, step: int, prefix: str) -> Kind:
    """The kind of `step`'s checkpoint in `store`: a directory where one exists (complete or not), else per-rank."""
    return DIRECTORY if store.is_sharded(step, prefix) else PER_RANK


# ---- what a resume, rotation, status and export ask -------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The step to resume from (None: start from scratch), where it is, and the newer candidates passed over."""

    step: int | None
    passed_over: tuple[tuple[int, str], ...]
    store: CheckpointStore | None = None


def choose_explicit(store: CheckpointStore, world_size: int, prefix: str, step: int) -> Choice:
    """The checkpoint a person named: used if complete and intact, healthy or not (as in seed 001)."""
    problem = kind_of(store, step, prefix).problem(store, step, world_size, prefix, require_healthy=False)
    return Choice(step, (), store) if problem is None else Choice(None, ((step, problem),))


def choose_resume(
    stores: list[CheckpointStore],
    world_size: int,
    prefix: str,
    *,
    at_most: int | None = None,
    require_healthy: bool = True,
    refused: Mapping[int, str] | None = None,
) -> Choice:
    """Check candidates of every store newest first (regular checkpoints first on equal steps); the first
    with no problem wins. `refused` steps (a rank would not load them) are passed over with their reason.
    Reasons for candidates outside the first store name their store."""
    refused = refused or {}
    candidates = sorted(
        ((step, i) for i, store in enumerate(stores) for step in _any_steps(store, world_size, prefix)),
        key=lambda candidate: (-candidate[0], candidate[1]),
    )
    passed: list[tuple[int, str]] = []
    for step, i in candidates:
        store = stores[i]
        if at_most is not None and step > at_most:
            problem: str | None = f"after the rollback point (step {at_most})"
        elif step in refused:
            problem = refused[step]
        else:
            kind = kind_of(store, step, prefix)
            problem = kind.problem(store, step, world_size, prefix, require_healthy=require_healthy)
        if problem is None:
            return Choice(step, tuple(passed), store)
        passed.append((step, problem if i == 0 else f"{store.label}: {problem}"))
    return Choice(None, tuple(passed))


def passed_over_event(reason: str) -> str:
    """The journal event for a candidate `choose_resume` passed over: `snapshot_passed_over` for the memory tier's
    (their reasons start with the store's label), else `checkpoint_passed_over`."""
    return "snapshot_passed_over" if reason.startswith(f"{MEMORY_LABEL}: ") else "checkpoint_passed_over"


def _any_steps(store: CheckpointStore, world_size: int, prefix: str) -> set[int]:
    return PER_RANK.steps(store, world_size, prefix, complete=False) | DIRECTORY.steps(
        store, world_size, prefix, complete=False
    )


def newest_complete(stores: list[CheckpointStore], world_size: int, prefix: str) -> tuple[CheckpointStore, int] | None:
    """The newest checkpoint complete on every rank (unverified), regular ones first on equal steps."""
    found = [(step, -i, store) for i, store in enumerate(stores) for step in store.complete_steps(world_size, prefix)]
    if not found:
        return None
    step, _, store = max(found, key=lambda f: f[:2])
    return store, step


def read_record(store: CheckpointStore, rank: int, step: int, prefix: str) -> dict[str, Any]:
    """A completion record, checked for the fields resume relies on; OSError or ValueError naming the problem."""
    record = read_json(store.record(rank, step, prefix))
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if type(record.get("size")) is not int or record["size"] < 0:
        raise ValueError(f"'size' is {str(record.get('size'))[:40]!r}, not a byte count")
    if not isinstance(record.get("crc32"), str):
        raise ValueError(f"'crc32' is {str(record.get('crc32'))[:40]!r}, not a checksum")
    return record


def completed_at(store: CheckpointStore, world_size: int, prefix: str, step: int) -> float | None:
    """When the checkpoint of `step` became complete (wall clock); None when that cannot be looked at."""
    return kind_of(store, step, prefix).completed_at(store, step, world_size, prefix)


def health_entries(store: CheckpointStore, world_size: int, prefix: str, steps: list[int]) -> list[dict[str, Any]]:
    """Seed 000 entries for complete checkpoints: healthy (0) only if every rank's part is."""
    return [kind_of(store, step, prefix).health(store, step, world_size, prefix) for step in steps]


def world_sizes(store: CheckpointStore, steps: Iterable[int], prefix: str) -> dict[int, int | None]:
    """How many ranks wrote each step's checkpoint (None where rank 0's record cannot be read); checkpoint
    directories are left out: any world size resumes them."""
    return {
        step: PER_RANK.written_by(store, step, prefix) for step in steps if kind_of(store, step, prefix) is PER_RANK
    }


@dataclass(frozen=True)
class WorldSizeMismatch:
    """The newest checkpoint of the resume stores was written by `written_by` ranks, and none by this run's
    `world_size`: resuming would restore only some ranks' state (or silently start over)."""

    store: CheckpointStore
    step: int
    written_by: int
    world_size: int

    def message(self) -> str:
        return (
            f"the checkpoints in {self.store.root} were written by {self.written_by} ranks (newest: step "
            f"{self.step}), but this job runs {self.world_size} (nproc_per_node: {self.world_size}); "
            f"use a new --run-dir (this one stays as it is), or set worker.resume_training: false to start "
            f"from scratch here"
        )


def world_size_mismatch(stores: list[CheckpointStore], world_size: int, prefix: str) -> WorldSizeMismatch | None:
    """Why resuming must be refused: the stores hold checkpoints, but none written by `world_size` ranks (then
    the newest of them); None when one was (resume picks it, passing over the others with their reason)."""
    if any(store.sharded_steps(prefix) for store in stores):
        return None  # a sharded checkpoint resumes at this world size (and choose_resume prefers the newest usable)
    found = [
        (step, -i, size)
        for i, store in enumerate(stores)
        for step, size in world_sizes(store, store.steps(0, prefix), prefix).items()
    ]
    if any(size == world_size for *_, size in found):
        return None
    others = [(step, i, size) for step, i, size in found if size is not None]
    if not others:
        return None
    step, negative_index, size = max(others)
    return WorldSizeMismatch(stores[-negative_index], step, size, world_size)


def prefixes(store: CheckpointStore) -> set[str]:
    """The prefixes rank 0 has complete checkpoints of here, in any kind."""
    found = set()
    for name in _names(store.rank_dir(0)):
        match = _CKPT_NAME.match(name)
        if match and match["rank"] == "0" and store.steps(0, match["prefix"]):
            found.add(match["prefix"])
    for name in _names(store.root):
        sharded = parse_sharded_name(name)
        if sharded and store.sharded_steps(sharded[0]):
            found.add(sharded[0])
    return found


def rank_0_steps(store: CheckpointStore, prefix: str) -> set[int]:
    """Steps rank 0 has complete: its per-rank files, or a checkpoint directory's manifest."""
    return store.steps(0, prefix) | store.sharded_steps(prefix)


def parse_sharded_name(name: str) -> tuple[str, int] | None:
    """(prefix, step) of a checkpoint directory's name (sharded or a framework's), or None."""
    match = _SHARDED_NAME.match(name)
    return (match["prefix"], int(match["step"])) if match else None


def parse_checkpoint_name(name: str) -> int | None:
    """The step a checkpoint name means: a rank's file name (`demo_rank_0-40.ckpt`) or the step itself."""
    match = _CKPT_NAME.match(name.strip())
    if match:
        return int(match["step"])
    return int(name) if STEP_NAME.fullmatch(name.strip()) else None


def _declared_world_size(record: dict[str, Any]) -> int | None:
    """The world size a completion record says wrote it; None for records from before they said so."""
    written = record.get("world_size")
    return written if type(written) is int and 1 <= written <= 1 << 20 else None


def _health_reasons(record: dict[str, Any]) -> str:
    reasons = record.get("health_reasons")
    if not isinstance(reasons, list) or not reasons:
        return "tagged unhealthy"
    return ", ".join(str(reason)[:200] for reason in reasons[:10])


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []

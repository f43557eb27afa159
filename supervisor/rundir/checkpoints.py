"""Where to resume: the newest checkpoint that is complete, intact and healthy on every rank.

Each rank writes its checkpoint file, then a completion record (size, CRC-32 checksum, health) next to
it. A candidate is passed over, with the reason logged, when a rank lacks either, when a file's size or
checksum differs from its record (truncated, corrupted), or when a rank tagged its part unhealthy.
`health_ckpts.json` (seed 000's format, `is_health` 0 = healthy) lists every complete checkpoint.

Per-rank checkpoints can only be resumed by a run with the same number of ranks: each completion record names
the world size that wrote it (older records do not; then the rank dirs holding the step tell). Those of another
world size are never resumed, rotated or listed. A sharded checkpoint (`PREFIX-STEP.dcp/`, worker.manifest) is
one directory for all ranks, complete once its manifest exists, and resumes at any world size: it is checked by its
manifest, every file it lists by size and checksum.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.config import MAX_NPROC
from worker.contract import MANIFEST, MEMORY_LABEL, SNAPSHOT_DIR, CheckpointStore, RunLayout, parse_sharded_name
from worker.files import atomic_write_json, file_crc32, is_plain_dir, is_plain_file, read_json
from worker.manifest import is_our_file, manifest_problem, read_manifest

__all__ = [
    "Choice",
    "Junk",
    "WorldSizeMismatch",
    "choose_explicit",
    "choose_resume",
    "completed_at",
    "file_crc32",
    "read_record",
    "find_junk",
    "health_entries",
    "passed_over_event",
    "rotation",
    "world_size_mismatch",
    "world_sizes",
    "write_health_file",
]

# What worker.files.atomic_write names its temporaries: `.NAME.XXXXXXXX.tmp`.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$")


@dataclass(frozen=True)
class Choice:
    """The step to resume from (None: start from scratch), where it is, and the newer candidates passed over."""

    step: int | None
    passed_over: tuple[tuple[int, str], ...]
    store: CheckpointStore | None = None


def choose_explicit(store: CheckpointStore, world_size: int, prefix: str, step: int) -> Choice:
    """The checkpoint a person named: used if complete and intact, healthy or not (as in seed 001)."""
    problem = _problem(store, world_size, prefix, step, require_healthy=False)
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
            problem = _problem(store, world_size, prefix, step, require_healthy)
        if problem is None:
            return Choice(step, tuple(passed), store)
        passed.append((step, problem if i == 0 else f"{store.label}: {problem}"))
    return Choice(None, tuple(passed))


def passed_over_event(reason: str) -> str:
    """The journal event for a candidate `choose_resume` passed over: `snapshot_passed_over` for the memory tier's
    (their reasons start with the store's label), else `checkpoint_passed_over`."""
    return "snapshot_passed_over" if reason.startswith(f"{MEMORY_LABEL}: ") else "checkpoint_passed_over"


def _any_steps(store: CheckpointStore, world_size: int, prefix: str) -> set[int]:
    per_rank = (store.steps(rank, prefix, kind="any") for rank in range(world_size))
    return set().union(store.sharded_steps(prefix, kind="any"), *per_rank)


def _problem(store: CheckpointStore, world_size: int, prefix: str, step: int, require_healthy: bool) -> str | None:
    if store.is_sharded(step, prefix):
        return manifest_problem(store.sharded_dir(step, prefix), step, require_healthy=require_healthy)
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
            return f"written by more than {world_size} ranks (rank {world_size} has it too); this run has {world_size}"
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
    """When the checkpoint of `step` became complete (wall clock): its newest completion record's modification time;
    None when a record cannot be looked at."""
    try:
        if store.is_sharded(step, prefix):
            return os.stat(store.sharded_dir(step, prefix) / MANIFEST, follow_symlinks=False).st_mtime
        return max(
            os.stat(store.record(rank, step, prefix), follow_symlinks=False).st_mtime for rank in range(world_size)
        )
    except (OSError, ValueError):  # ValueError: world_size 0 (no ranks, no time)
        return None


def _declared_world_size(record: dict[str, Any]) -> int | None:
    """The world size a completion record says wrote it; None for records from before they said so."""
    written = record.get("world_size")
    return written if type(written) is int and 1 <= written <= MAX_NPROC else None


def world_sizes(store: CheckpointStore, steps: Iterable[int], prefix: str) -> dict[int, int | None]:
    """How many ranks wrote each step's checkpoint: what rank 0's completion record says, or (older records) how
    many rank dirs in a row hold the step complete; None where rank 0's record cannot be read. Sharded checkpoints
    are left out: any world size resumes them."""
    held: dict[int, set[int]] = {}

    def holds(rank: int, step: int) -> bool:
        if rank not in held:
            held[rank] = store.steps(rank, prefix)
        return step in held[rank]

    sizes: dict[int, int | None] = {}
    for step in steps:
        if store.is_sharded(step, prefix):
            continue
        try:
            sizes[step] = _declared_world_size(read_record(store, 0, step, prefix))
        except (OSError, ValueError):
            sizes[step] = None
            continue
        if sizes[step] is None:
            sizes[step] = next(n for n in range(1, MAX_NPROC + 2) if n > MAX_NPROC or not holds(n, step))
    return sizes


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


def _health_reasons(record: dict[str, Any]) -> str:
    reasons = record.get("health_reasons")
    if not isinstance(reasons, list) or not reasons:
        return "tagged unhealthy"
    return ", ".join(str(reason)[:200] for reason in reasons[:10])


def health_entries(store: CheckpointStore, world_size: int, prefix: str, steps: list[int]) -> list[dict[str, Any]]:
    """Seed 000 entries for complete checkpoints: healthy (0) only if every rank's part is."""
    entries = []
    for step in steps:
        if store.is_sharded(step, prefix):
            entries.append(_sharded_health(store, prefix, step))
            continue
        unhealthy = []
        for rank in range(world_size):
            try:
                if read_record(store, rank, step, prefix).get("is_health", 0) != 0:
                    unhealthy.append(rank)
            except (OSError, ValueError):
                unhealthy.append(rank)
        entries.append(
            {
                "is_health": int(bool(unhealthy)),
                "ckpt_name": store.file(0, step, prefix).name,
                "step": step,
                "unhealthy_ranks": unhealthy,
            }
        )
    return entries


def _sharded_health(store: CheckpointStore, prefix: str, step: int) -> dict[str, Any]:
    directory = store.sharded_dir(step, prefix)
    try:
        manifest = read_manifest(directory, step, format=None)
        unhealthy = [r.get("rank") for r in manifest["ranks"] if r.get("is_health", 0) != 0]
        healthy = manifest.get("is_health", 0) == 0 and not unhealthy
    except (OSError, ValueError):
        unhealthy, healthy = [], False
    return {"is_health": int(not healthy), "ckpt_name": directory.name, "step": step, "unhealthy_ranks": unhealthy}


def write_health_file(layout: RunLayout, entries: list[dict[str, Any]], *, durable: bool = True) -> None:
    atomic_write_json(layout.root / "health_ckpts.json", entries, root=layout.root, durable=durable)


def rotation(complete: list[int], healthy: set[int], *, keep_max: int, protected: set[int]) -> list[int]:
    """Complete checkpoints to delete so at most `keep_max` remain besides the ones that must stay.

    Never deleted: the newest `keep_max`, the newest healthy one, and `protected` (being resumed from).
    Incomplete checkpoints (possibly being written) are not in `complete` and never touched.
    """
    if keep_max <= 0:
        return []
    keep = set(sorted(complete)[-keep_max:]) | protected
    healthy_complete = [s for s in complete if s in healthy]
    if healthy_complete:
        keep.add(max(healthy_complete))
    return sorted(s for s in complete if s not in keep)


@dataclass(frozen=True)
class Junk:
    """What in the checkpoint directory is not a checkpoint of this run."""

    torn: tuple[Path, ...]  # our own temporaries, left by a save that was killed: provably ours and incomplete
    foreign: tuple[Path, ...]  # anything else: reported, never deleted


def find_junk(layout: RunLayout, world_size: int, prefix: str) -> Junk:
    """Sort out the checkpoint directory; call only while no rank runs (a temporary may be a save in flight)."""
    torn: list[Path] = []
    foreign: list[Path] = []
    expected = {f"rank_{rank}" for rank in range(world_size)}
    for store in layout.checkpoint_stores():
        for entry in _entries(store.root):
            sharded = parse_sharded_name(entry.name)
            if entry.name in expected and is_plain_dir(entry):
                _sort_rank_dir(store, int(entry.name.removeprefix("rank_")), prefix, torn, foreign)
            elif sharded and sharded[0] == prefix and is_plain_dir(entry):
                _sort_sharded_dir(entry, torn, foreign)
            elif not (store == layout.checkpoints and entry.name == SNAPSHOT_DIR):
                foreign.append(entry)
    return Junk(tuple(torn), tuple(foreign))


def _sort_sharded_dir(directory: Path, torn: list[Path], foreign: list[Path]) -> None:
    """Without its manifest, a sharded directory holding only our files is a torn save (all of it goes); names
    neither ours nor listed in its manifest (a framework's files) are reported either way."""
    try:
        listed = {name.split("/")[0] for name in read_manifest(directory, format=None)["files"]}
    except (OSError, ValueError):
        listed = set()
    strangers = [
        entry
        for entry in _entries(directory)
        if not (is_our_file(entry.name) and is_plain_file(entry) or entry.name in listed)
    ]
    foreign.extend(strangers)
    if not strangers and not is_plain_file(directory / MANIFEST):
        torn.append(directory)


def _sort_rank_dir(store: CheckpointStore, rank: int, prefix: str, torn: list[Path], foreign: list[Path]) -> None:
    for entry in _entries(store.rank_dir(rank)):
        temporary = _TEMPORARY.match(entry.name)
        if temporary and store.owns(temporary["name"], rank, prefix) and is_plain_file(entry):
            torn.append(entry)
        elif not store.owns(entry.name, rank, prefix):
            foreign.append(entry)


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory / name for name in os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []

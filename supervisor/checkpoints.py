"""Where to resume: the newest checkpoint that is complete, intact and healthy on every rank.

Each rank writes its checkpoint file, then a completion record (size, CRC-32 checksum, health) next to
it. A candidate is passed over, with the reason logged, when a rank lacks either, when a file's size or
checksum differs from its record (truncated, corrupted), or when a rank tagged its part unhealthy.
`health_ckpts.json` (seed 000's format, `is_health` 0 = healthy) lists every complete checkpoint.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from worker.contract import RunLayout, atomic_write_json, checkpoint_steps, read_json

__all__ = [
    "Choice",
    "choose_explicit",
    "choose_resume",
    "file_crc32",
    "health_entries",
    "rotation",
    "write_health_file",
]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Choice:
    """The step to resume from (None: start from scratch) and the newer candidates passed over, with why."""

    step: int | None
    passed_over: tuple[tuple[int, str], ...]


def choose_explicit(layout: RunLayout, world_size: int, prefix: str, step: int) -> Choice:
    """The checkpoint a person named: used if complete and intact, healthy or not (as in seed 001)."""
    problem = _problem(layout, world_size, prefix, step, require_healthy=False)
    return Choice(step, ()) if problem is None else Choice(None, ((step, problem),))


def choose_resume(layout: RunLayout, world_size: int, prefix: str, *, at_most: int | None = None,
                  require_healthy: bool = True) -> Choice:
    """Check candidates newest first; the first with no problem wins."""
    candidates = set().union(*(checkpoint_steps(layout, r, prefix, kind="any") for r in range(world_size)))
    passed = []
    for step in sorted(candidates, reverse=True):
        if at_most is not None and step > at_most:
            passed.append((step, f"after the rollback point (step {at_most})"))
            continue
        problem = _problem(layout, world_size, prefix, step, require_healthy)
        if problem is None:
            return Choice(step, tuple(passed))
        passed.append((step, problem))
    return Choice(None, tuple(passed))


def _problem(layout: RunLayout, world_size: int, prefix: str, step: int, require_healthy: bool) -> str | None:
    for rank in range(world_size):
        path = layout.checkpoint_file(rank, step, prefix)
        try:
            record = read_json(layout.checkpoint_record(rank, step, prefix))
        except FileNotFoundError:
            return f"incomplete: rank {rank} has no completion record"
        except (OSError, ValueError) as exc:
            return f"unreadable completion record on rank {rank}: {exc}"
        if not path.exists():
            return f"incomplete: rank {rank} has no checkpoint file"
        size = path.stat().st_size
        if size != record.get("size"):
            return f"truncated on rank {rank}: {size} bytes, {record.get('size')} written"
        if file_crc32(path) != record.get("crc32"):
            return f"corrupted on rank {rank}: checksum differs from the one written"
        if require_healthy and record.get("is_health", 0) != 0:
            return f"unhealthy on rank {rank}: {', '.join(record.get('health_reasons') or ['tagged unhealthy'])}"
    return None


def file_crc32(path: Any) -> str:
    """The CRC-32 of a file, as the worker's HashingWriter writes it."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def health_entries(layout: RunLayout, world_size: int, prefix: str, steps: list[int]) -> list[dict[str, Any]]:
    """Seed 000 entries for complete checkpoints: healthy (0) only if every rank's part is."""
    entries = []
    for step in steps:
        unhealthy = []
        for rank in range(world_size):
            try:
                if read_json(layout.checkpoint_record(rank, step, prefix)).get("is_health", 0) != 0:
                    unhealthy.append(rank)
            except (OSError, ValueError):
                unhealthy.append(rank)
        entries.append({"is_health": int(bool(unhealthy)), "ckpt_name": layout.checkpoint_file(0, step, prefix).name,
                        "step": step, "unhealthy_ranks": unhealthy})
    return entries


def write_health_file(layout: RunLayout, entries: list[dict[str, Any]]) -> None:
    atomic_write_json(layout.root / "health_ckpts.json", entries)


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

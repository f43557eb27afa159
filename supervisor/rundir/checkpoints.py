"""The run dir's checkpoint housekeeping: `health_ckpts.json` (seed 000's format, `is_health` 0 = healthy, every
complete checkpoint of the run's world size), rotation, and junk in the checkpoint directory.

What makes a checkpoint complete, intact, healthy and resumable, and the resume choice, are worker.store's: one place
for the worker, the supervisor, the node agents and `trainwarden export`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.contract import SNAPSHOT_DIR, RunLayout
from worker.files import atomic_write_json, is_plain_dir, is_plain_file
from worker.manifest import MANIFEST, is_our_file, read_manifest
from worker.store import CheckpointStore, parse_sharded_name

__all__ = ["Junk", "find_junk", "rotation", "write_health_file"]

# What worker.files.atomic_write names its temporaries: `.NAME.XXXXXXXX.tmp`.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$")


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

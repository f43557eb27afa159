"""A rank's side of the memory tier: which slot a snapshot goes to, pinning one for the supervisor to persist, and
whether snapshots fit in the node's memory at all. Torch-free (the Warden writes the snapshots themselves).

A pin is a set of hard links in `MEMORY/persist/STEP/`: instant, no copy, and a later snapshot into the same slot
(atomic renames: new inodes) leaves the pinned files as they were until the supervisor has copied them to disk.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from worker.files import ensure_dir, is_plain_file, read_bytes, unlink_quietly
from worker.manifest import MANIFEST, remove_sharded
from worker.store import CheckpointStore

__all__ = [
    "MEMORY_HEADROOM",
    "MEMORY_COPIES",
    "memory_room",
    "pin_files",
    "pin_sharded",
    "snapshot_room_problem",
    "unpin_files",
    "unpin_sharded",
]

MEMORY_COPIES = 3  # what one rank may hold at once: two slots and one pin not yet on disk
MEMORY_HEADROOM = 0.9  # never plan to fill the last tenth of free memory: the training itself needs some
_MEMINFO = Path("/proc/meminfo")


def _link(source: Path, target: Path) -> None:
    """Hard-link `source` (never through a symlink) as `target`, replacing what was there."""
    unlink_quietly(target)
    os.link(source, target, follow_symlinks=False)


def pin_files(slot: CheckpointStore, pin: CheckpointStore, *, rank: int, step: int, prefix: str) -> None:
    """Pin this rank's snapshot of `step` from `slot`: the checkpoint file first, then its record, then meta.json,
    so that a pin with a record is whole."""
    ensure_dir(pin.write_root, pin.rank_dir(rank))
    for source, target in (
        (slot.file(rank, step, prefix), pin.file(rank, step, prefix)),
        (slot.record(rank, step, prefix), pin.record(rank, step, prefix)),
        (slot.meta(rank), pin.meta(rank)),
    ):
        _link(source, target)


def unpin_files(pin: CheckpointStore, *, rank: int, step: int, prefix: str) -> None:
    """Drop this rank's pin of `step` (its record first: a kill leaves junk, not a lie), and its folders once empty."""
    for path in (pin.record(rank, step, prefix), pin.file(rank, step, prefix), pin.meta(rank)):
        unlink_quietly(path)
    for folder in (pin.rank_dir(rank), pin.root):
        with contextlib.suppress(OSError):  # not empty: another rank's pin, or files not ours, stay
            os.rmdir(folder)


def unpin_sharded(pin: CheckpointStore, *, step: int, prefix: str) -> None:
    """Drop a sharded pin of `step` (rank 0's job): the manifest first, as remove_sharded does, then its folder."""
    remove_sharded(pin.root / pin.sharded_dir(step, prefix).name)
    with contextlib.suppress(OSError):  # not empty: files not ours stay
        os.rmdir(pin.root)


def pin_sharded(slot: CheckpointStore, pin: CheckpointStore, *, step: int, prefix: str) -> None:
    """Pin a complete sharded snapshot (rank 0's job, once its manifest exists): every file of its directory,
    the manifest last."""
    source, target = slot.sharded_dir(step, prefix), pin.root / slot.sharded_dir(step, prefix).name
    ensure_dir(pin.write_root, target)
    names = sorted(name for name in os.listdir(source) if name != MANIFEST and is_plain_file(source / name))
    for name in [*names, MANIFEST]:
        _link(source / name, target / name)


def memory_room(directory: Path, meminfo: Path = _MEMINFO) -> tuple[int, str]:
    """The bytes snapshots may take on this node, and what limits them: the free space of the memory directory's
    filesystem, or the kernel's MemAvailable (a tmpfs page is RAM), whichever is smaller."""
    info = os.statvfs(directory)
    free = info.f_bavail * info.f_frsize
    available = _mem_available(meminfo)
    if available is not None and available < free:
        return available, "MemAvailable"
    return free, f"{directory} free"


def _mem_available(meminfo: Path) -> int | None:
    try:
        text = read_bytes(meminfo, 1 << 16).decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if name == "MemAvailable" and fields and fields[0].isdigit():
            return int(fields[0]) * 1024  # /proc/meminfo counts in kB
    return None


def snapshot_room_problem(
    rank_bytes: int, local_ranks: int, room: tuple[int, str], max_bytes: int = 0, headroom: float = MEMORY_HEADROOM
) -> str | None:
    """Why snapshots of `rank_bytes` per rank, for `local_ranks` ranks on the node, do not fit in `room` (bytes and
    what limits them: `memory_room`) or the configured bound `max_bytes` (per node; 0: none), or None if they do."""
    need = MEMORY_COPIES * rank_bytes * local_ranks
    needs = (
        f"snapshots need {MEMORY_COPIES} x {_size(rank_bytes)} x {local_ranks} rank(s) = {_size(need)} "
        "(two slots and a pin per rank)"
    )
    free, limit = room
    if need > free * headroom:
        return f"{needs}; {_size(free)} available ({limit}), at most {headroom:.0%} of it used"
    if max_bytes > 0 and need > max_bytes:
        return f"{needs}; worker.snapshot_max_bytes is {_size(max_bytes)}"
    return None


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"

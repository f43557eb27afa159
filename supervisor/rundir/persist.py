"""Disk checkpoints from the memory tier: the supervisor copies each complete pinned snapshot to the checkpoint store.

A rank due for a disk save snapshots that step into its memory slot and pins it (hard links in
`MEMORY/persist/STEP/`, worker.memory); it never writes to disk itself. The persister, a thread of the supervisor
(torch-free: a snapshot is already bytes), takes the newest pin complete on every rank, copies each file to the
checkpoint store while checking its size and CRC-32 against its record (or, sharded, the manifest's entry), writes
it atomically and durably, each record after its file, `meta.json` per rank, a sharded checkpoint's manifest last,
then removes the pin. Older pins are superseded by a newer complete one. A copy that fails its check leaves nothing
on disk and is journaled with why. A rank killed meanwhile loses nothing: the pin's inodes stay until copied.

Nothing read from the memory directory is unpickled, followed through a link or read past the size its record
gives; writes stay inside the run's checkpoint directory.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from supervisor.rundir.throttle import MB, Throttle
from worker.contract import RunLayout
from worker.files import (
    MAX_JSON_BYTES,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    is_plain_dir,
    is_plain_file,
    open_regular,
    parse_json,
    read_bytes,
    unlink_quietly,
)
from worker.manifest import MANIFEST, rank_record_name, read_manifest, remove_sharded
from worker.store import (
    CheckpointStore,
    completed_at,
    newest_complete,
    parse_checkpoint_name,
    parse_sharded_name,
    read_record,
)

__all__ = ["CopyFailed", "Persister", "complete_for", "memory_status", "newest_memory_snapshot", "persist_snapshot"]

POLL_INTERVAL_S = 0.1  # how often the persister looks for new pins: one listing, so that none is superseded
_CHUNK = 1 << 20

# What worker.files.atomic_write names its temporaries: `.NAME.XXXXXXXX.tmp`.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$")


class CopyFailed(Exception):
    """A file of the snapshot is missing, unreadable, or not what its record says (size, checksum)."""


@dataclass(frozen=True)
class Persisted:
    """What one copy wrote: bytes and seconds."""

    step: int
    bytes: int
    seconds: float


def persist_snapshot(
    source: CheckpointStore,
    dest: CheckpointStore,
    step: int,
    ranks: Sequence[int],
    prefix: str,
    *,
    throttle: Throttle | None = None,
) -> int:
    """Copy the snapshot of `step` from `source` (a pin or a memory slot) to `dest`, checked while copied, for
    `ranks` (every rank on one machine, a node's own on Slurm), paced by `throttle` (None: at full speed); the bytes
    written. CopyFailed (what was copied of it is removed again) when a file is not what its record says."""
    throttle = throttle or Throttle(0)
    try:
        if source.is_sharded(step, prefix):
            return _copy_sharded(source.sharded_dir(step, prefix), dest, step, prefix, throttle)
        return _copy_per_rank(source, dest, step, ranks, prefix, throttle)
    except CopyFailed:
        _remove_copy(dest, step, ranks, prefix)
        raise


def _copy_per_rank(
    source: CheckpointStore, dest: CheckpointStore, step: int, ranks: Sequence[int], prefix: str, throttle: Throttle
) -> int:
    total = 0
    for rank in ranks:
        try:
            record = read_record(source, rank, step, prefix)
        except (OSError, ValueError) as exc:
            raise CopyFailed(f"rank {rank}'s completion record: {exc}") from None
        path = dest.file(rank, step, prefix)
        total += _copy_checked(source.file(rank, step, prefix), path, record, dest.write_root, f"rank {rank}", throttle)
        atomic_write_json(dest.record(rank, step, prefix), record, root=dest.write_root)  # after its file
        meta = {"last_epoch": 0, "last_step": step, "last_ckpt_file": path.name}  # as worker.checkpoint writes it
        atomic_write_json(dest.meta(rank), meta, root=dest.write_root)
    return total


def _copy_sharded(directory: Path, dest: CheckpointStore, step: int, prefix: str, throttle: Throttle) -> int:
    try:
        manifest = read_manifest(directory, step)  # checked: every listed name is a plain one of ours
        manifest_bytes = read_bytes(directory / MANIFEST, MAX_JSON_BYTES)  # copied as it is, once checked equal
        if parse_json(manifest_bytes) != manifest:
            raise ValueError("it changed while being read")
    except (OSError, ValueError) as exc:
        raise CopyFailed(f"manifest: {exc}") from None
    target = dest.root / directory.name
    if is_plain_dir(target) and not is_plain_file(target / MANIFEST):
        remove_sharded(target)  # a copy a killed persister left torn: its temporaries would outlive this copy
    total = 0
    for name, entry in sorted(manifest["files"].items()):
        whose = f"rank {entry.get('rank')}"
        total += _copy_checked(directory / name, target / name, entry, dest.write_root, whose, throttle)
    # Each rank's record too, as a sharded save leaves it (the manifest holds what resume checks).
    for rank in range(manifest["world_size"]):
        try:
            record = read_bytes(directory / rank_record_name(rank), MAX_JSON_BYTES)
        except OSError:
            continue
        atomic_write_bytes(target / rank_record_name(rank), record, root=dest.write_root)
    atomic_write_bytes(target / MANIFEST, manifest_bytes, root=dest.write_root)  # last
    return total + len(manifest_bytes)


def _copy_checked(
    source: Path, target: Path, expected: dict[str, Any], root: Path, whose: str, throttle: Throttle
) -> int:
    """Stream `source` into `target` atomically, reading at most one byte past the expected size, each chunk paced
    by `throttle`; CopyFailed (nothing renamed into place) when size or CRC-32 differ."""
    try:
        fd = open_regular(source)
    except OSError as exc:
        raise CopyFailed(f"{whose}'s {source.name}: {exc.strerror or exc}") from None

    def write(out: IO[bytes]) -> None:
        size, crc = 0, 0
        while chunk := os.read(fd, min(_CHUNK, expected["size"] + 1 - size)):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            out.write(chunk)
            throttle.sent(len(chunk))
        if size != expected["size"]:
            raise CopyFailed(f"{whose}'s {source.name}: {size} bytes, {expected['size']} written")
        if f"{crc:08x}" != expected["crc32"]:
            raise CopyFailed(f"{whose}'s {source.name}: checksum differs from the one written")

    try:
        atomic_write(target, write, root=root)
    finally:
        os.close(fd)
    return int(expected["size"])


def _remove_copy(dest: CheckpointStore, step: int, ranks: Sequence[int], prefix: str) -> None:
    """Undo a failed copy: records first, so a kill in between leaves junk, not a checkpoint that lies."""
    if dest.is_sharded(step, prefix):
        remove_sharded(dest.sharded_dir(step, prefix))
        return
    for rank in ranks:
        unlink_quietly(dest.record(rank, step, prefix))
        unlink_quietly(dest.file(rank, step, prefix))


def complete_for(store: CheckpointStore, step: int, ranks: Sequence[int], prefix: str) -> bool:
    """Whether `store` holds `step` for every one of `ranks` (file and record), or as a sharded directory with its
    manifest."""
    return step in store.sharded_steps(prefix) or all(step in store.steps(rank, prefix) for rank in ranks)


def _remove_pin(pin: CheckpointStore) -> None:
    shutil.rmtree(pin.root, ignore_errors=True)  # rmtree follows no symlink inside; the inodes go with the last link


class Persister:
    """Copies complete pins to the run's checkpoints in a thread of its own; `in_flight` tells the supervisor's junk
    removal which temporaries in the checkpoint directory are a copy under way."""

    def __init__(
        self,
        layout: RunLayout,
        world_size: int,
        prefix: str,
        log: Any,
        ranks: Sequence[int] | None = None,
        *,
        persist_mb_s: float = 0.0,
    ) -> None:
        self.layout = layout
        self.world_size = world_size
        self.ranks = tuple(range(world_size)) if ranks is None else tuple(ranks)  # whose files this one copies
        self.prefix = prefix
        self.log = log
        self.bytes_per_s = persist_mb_s * MB  # worker.persist_mb_s: each copy's pace while ranks train; 0: none
        self._busy: set[int] = set()  # steps being copied now
        self._lock = threading.Lock()  # one pass at a time (the thread, the end-of-run persist)
        self._busy_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainwarden-persister", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Let the copy under way finish (at full speed from now: no rank trains any more), then end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                self.persist_pins()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive a bad pass; the journal says why
                self.log.error("persister_failed", error=repr(exc)[:500])

    def persist_pins(self) -> list[Persisted]:
        """One pass: the newest complete pin copied (older pins superseded), newest first; what was persisted."""
        with self._lock:
            done: list[Persisted] = []
            newest: int | None = None
            for step in reversed(self.layout.memory_pins()):
                pin = self.layout.memory_pin(step)
                if newest is not None:
                    _remove_pin(pin)
                    self.log.info("snapshot_pin_superseded", step=step, by=newest)
                elif complete_for(pin, step, self.ranks, self.prefix):
                    newest = step
                    copied = self._persist(pin, step)
                    done += [copied] if copied else []
                    _remove_pin(pin)
            return done

    def persist_newest(self) -> Persisted | None:
        """At the run's end: the newest complete memory snapshot (slots or pins) copied when it is newer than the
        newest complete disk checkpoint; None when there is nothing newer (or it failed its check)."""
        with self._lock:
            found = newest_memory_snapshot(self.layout, self.world_size, self.prefix)
            on_disk = self.layout.checkpoints.complete_steps(self.world_size, self.prefix)
            if found is None or (on_disk and on_disk[-1] >= found[1]):
                return None
            return self._persist(*found)

    def _persist(self, source: CheckpointStore, step: int) -> Persisted | None:
        if complete_for(self.layout.checkpoints, step, self.ranks, self.prefix):
            return None  # already there (a predecessor copied it and died before removing the pin)
        started = time.monotonic()
        with self._busy_lock:
            self._busy.add(step)
        try:
            throttle = Throttle(self.bytes_per_s, wait=self._stop.wait)  # a stop lifts the limit
            written = persist_snapshot(
                source, self.layout.checkpoints, step, self.ranks, self.prefix, throttle=throttle
            )
        except (CopyFailed, OSError) as exc:
            self.log.error("persist_failed", step=step, reason=str(exc)[:500], source=str(source.root))
            return None
        finally:
            with self._busy_lock:
                self._busy.discard(step)
        done = Persisted(step, written, round(time.monotonic() - started, 3))
        self.log.info("snapshot_persisted", step=step, bytes=done.bytes, seconds=done.seconds)
        return done

    def in_flight(self, path: Path) -> bool:
        """Whether `path` (what junk removal found torn or foreign in the checkpoint store) may be a copy under way:
        a temporary or sharded directory of a step being copied, or a rank's meta.json while any copy runs."""
        with self._busy_lock:
            busy = set(self._busy)
        if not busy:
            return False
        temporary = _TEMPORARY.match(path.name)
        name = temporary["name"] if temporary else path.name
        if name == "meta.json":
            return True
        step = parse_checkpoint_name(name)
        sharded = parse_sharded_name(name) or parse_sharded_name(path.parent.name)
        return step in busy or (sharded is not None and sharded[1] in busy)


def newest_memory_snapshot(layout: RunLayout, world_size: int, prefix: str) -> tuple[CheckpointStore, int] | None:
    """The newest snapshot complete on every rank in the memory tier (slots and pins), unverified; None without one."""
    try:
        return newest_complete(layout.memory_stores(), world_size, prefix)
    except (OSError, ValueError):
        return None


def memory_status(
    layout: RunLayout, found: tuple[CheckpointStore, int] | None, world_size: int, prefix: str, now_wall: float
) -> dict[str, Any] | None:
    """`status`'s memory block: the directory, the newest complete snapshot (`found` by `newest_memory_snapshot`:
    step, age), bytes held there (each inode once: pins are hard links) and pins waiting to be persisted; None
    without a memory tier."""
    if layout.memory is None:
        return None
    at = None if found is None else completed_at(found[0], world_size, prefix, found[1])
    return {
        "dir": str(layout.memory),
        "snapshot_step": None if found is None else found[1],
        "snapshot_age_s": None if at is None else round(max(0.0, now_wall - at), 3),
        "bytes": bytes_held(layout.memory),
        "pins_waiting": len(layout.memory_pins()),
    }


def bytes_held(directory: Path, *, max_entries: int = 100_000) -> int:
    """The size of the regular files under `directory`, each inode once, never through a symlink (bounded)."""
    seen: set[tuple[int, int]] = set()
    total, stack, looked = 0, [directory], 0
    while stack and looked < max_entries:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            looked += 1
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                stack.append(Path(entry.path))
            elif stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_size
    return total

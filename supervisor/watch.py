"""Heartbeat files and the stop file: a watchdog observer turns file-system events into hints; reading the
files is the truth."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.events import (
    EVENT_TYPE_CLOSED,
    EVENT_TYPE_CREATED,
    EVENT_TYPE_DELETED,
    EVENT_TYPE_MODIFIED,
    EVENT_TYPE_MOVED,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from supervisor.core import HeartbeatSeen
from worker.contract import RunLayout
from worker.files import ensure_dir, read_json

__all__ = ["HeartbeatChanged", "HeartbeatUnreadable", "HeartbeatWatcher", "StopFileChanged", "StopFileWatcher",
           "read_heartbeat"]


@dataclass(frozen=True)
class HeartbeatChanged:
    """A hint that a rank's heartbeat file may hold a new record (events can be coalesced or lost)."""

    rank: int


@dataclass(frozen=True)
class StopFileChanged:
    """A hint that the stop file was written, replaced or removed."""


_WRITE_EVENTS = {EVENT_TYPE_MOVED, EVENT_TYPE_CREATED, EVENT_TYPE_MODIFIED, EVENT_TYPE_CLOSED, EVENT_TYPE_DELETED}


class _Handler(FileSystemEventHandler):
    def __init__(self, hints: dict[str, object], post: Callable[[object], None]) -> None:
        self._hints = hints  # path -> the hint to post when it is written
        self._post = post

    def on_any_event(self, event: FileSystemEvent) -> None:
        # Only writes count: our own reads raise open/close events, which would feed back forever.
        if event.event_type not in _WRITE_EVENTS:
            return
        # Writers rename a temporary file onto the watched name, so the destination path matters.
        hint = self._hints.get(str(event.dest_path or event.src_path))
        if hint is not None:
            self._post(hint)


class _Watcher:
    """A watchdog observer thread posting hints for writes to watched paths."""

    def __init__(self) -> None:
        self._observer = Observer()
        self._observer.daemon = True

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        if self._observer.is_alive():
            self._observer.stop()
            self._observer.join(timeout=5)


class HeartbeatWatcher(_Watcher):
    """Watches `ranks/` under the run dir, posting HeartbeatChanged hints from the observer thread."""

    def __init__(self, layout: RunLayout, nproc: int, post: Callable[[object], None]) -> None:
        super().__init__()
        for rank in range(nproc):
            ensure_dir(layout.root, layout.rank_dir(rank))
        beats = {str(layout.heartbeat(rank)): HeartbeatChanged(rank) for rank in range(nproc)}
        self._observer.schedule(_Handler(beats, post), str(layout.root / "ranks"), recursive=True)


class StopFileWatcher(_Watcher):
    """Watches the stop file's directory when it exists (elsewhere the main loop's once-a-second look is all
    there is), posting StopFileChanged hints."""

    def __init__(self, stop_file: Path, post: Callable[[object], None]) -> None:
        super().__init__()
        if stop_file.parent.is_dir():
            stop = {str(stop_file): StopFileChanged()}
            self._observer.schedule(_Handler(stop, post), str(stop_file.parent), recursive=False)


MAX_HEARTBEAT_BYTES = 4096  # a record is about 150 bytes
MAX_PHASE_CHARS = 64
MAX_PROGRESS = 2**53  # any number a heartbeat reports: beyond it, it is garbage
MAX_ANOMALY_KINDS = 16  # the worker knows six


class HeartbeatUnreadable(Exception):
    """A heartbeat file exists but does not hold a valid record."""


def read_heartbeat(path: Path, rank: int) -> HeartbeatSeen | None:
    """The record in `rank`'s heartbeat file, None when there is none yet; HeartbeatUnreadable for garbage
    (a FIFO, symlink or directory in its place, strict-JSON errors, wrong types, another rank's record)."""
    try:
        record = read_json(path, MAX_HEARTBEAT_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise HeartbeatUnreadable(f"{path}: {exc}") from None
    if not isinstance(record, dict):
        raise HeartbeatUnreadable(f"{path}: not a JSON object")
    try:
        seen = HeartbeatSeen(
            attempt=_count(record, "attempt"),
            rank=_count(record, "rank"),
            seq=_count(record, "seq"),
            step=_count(record, "step"),
            phase=_phase(record.get("phase")),
            step_time_s=_positive_or_none(record.get("step_time_s")),
            **progress_fields(record),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HeartbeatUnreadable(f"{path}: missing or bad field {exc}") from None
    if seen.rank != rank:  # a record copied from, or forged for, another rank
        raise HeartbeatUnreadable(f"{path}: holds rank {seen.rank}'s heartbeat, not rank {rank}'s")
    return seen


def _count(record: dict[str, Any], key: str) -> int:
    value = record[key]
    if type(value) is not int or value < 0:
        raise ValueError(f"{key!r}: {value!r} is not a count")
    return value


def _phase(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PHASE_CHARS or not value.isprintable():
        raise ValueError(f"'phase': {str(value)[:40]!r} is not a phase name")
    return value


def progress_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A heartbeat's optional progress fields, each None unless it is a sane number (the file is untrusted)."""
    total = record.get("total_steps")
    return {"loss": _finite_or_none(record.get("loss")), "compute_s": _positive_or_none(record.get("compute_s")),
            "total_steps": total if _is_count(total) and total > 0 else None,
            "save_s": _nonnegative_or_none(record.get("save_s")),
            "last_save_s": _nonnegative_or_none(record.get("last_save_s")),
            "skipped": record.get("skipped") if _is_count(record.get("skipped")) else None,
            "anomalies": _anomaly_counts(record.get("anomalies"))}


def _anomaly_counts(value: object) -> tuple[tuple[str, int], ...] | None:
    """(kind, count) pairs from a mapping (the file) or a list of pairs (an agent's forward); None for garbage."""
    pairs = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
    if pairs is None:
        return None
    try:
        counts = tuple((kind, count) for kind, count in pairs)
    except (TypeError, ValueError):
        return None
    sane = len(counts) <= MAX_ANOMALY_KINDS and all(
        isinstance(kind, str) and 0 < len(kind) <= MAX_PHASE_CHARS and kind.isprintable() and _is_count(count)
        for kind, count in counts)
    return tuple(sorted(counts)) if sane else None


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_PROGRESS


def _nonnegative_or_none(value: object) -> float | None:
    number = _finite_or_none(value)
    return number if number is not None and number >= 0 else None


def _finite_or_none(value: object) -> float | None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if number and math.isfinite(value) and abs(value) <= MAX_PROGRESS else None


def _positive_or_none(value: object) -> float | None:
    number = _finite_or_none(value)
    return number if number is not None and number > 0 else None

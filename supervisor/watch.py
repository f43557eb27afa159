"""Heartbeat files and the stop file: a watchdog observer turns file-system events into hints; reading the
files is the truth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
from worker.contract import RunLayout, read_json

__all__ = ["HeartbeatChanged", "HeartbeatUnreadable", "HeartbeatWatcher", "StopFileChanged", "read_heartbeat"]


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


class HeartbeatWatcher:
    """Watches `ranks/` under the run dir, and the stop file's directory when it exists, posting
    HeartbeatChanged and StopFileChanged hints from the observer thread."""

    def __init__(self, layout: RunLayout, nproc: int, post: Callable[[object], None], stop_file: Path) -> None:
        for rank in range(nproc):
            layout.rank_dir(rank).mkdir(parents=True, exist_ok=True)
        self._observer = Observer()
        self._observer.daemon = True
        beats = {str(layout.heartbeat(rank)): HeartbeatChanged(rank) for rank in range(nproc)}
        self._observer.schedule(_Handler(beats, post), str(layout.root / "ranks"), recursive=True)
        if stop_file.parent.is_dir():  # elsewhere the main loop's once-a-second look is all there is
            stop = {str(stop_file): StopFileChanged()}
            self._observer.schedule(_Handler(stop, post), str(stop_file.parent), recursive=False)

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)


class HeartbeatUnreadable(Exception):
    """A heartbeat file exists but does not hold a valid record."""


def read_heartbeat(path: Path) -> HeartbeatSeen | None:
    """The record in a heartbeat file, None when there is none yet; HeartbeatUnreadable for garbage."""
    try:
        record = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise HeartbeatUnreadable(f"{path}: {exc}") from None
    try:
        return HeartbeatSeen(
            attempt=int(record["attempt"]),
            rank=int(record["rank"]),
            seq=int(record["seq"]),
            step=int(record["step"]),
            phase=str(record["phase"]),
            step_time_s=_positive_or_none(record.get("step_time_s")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HeartbeatUnreadable(f"{path}: missing or bad field {exc}") from None


def _positive_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None

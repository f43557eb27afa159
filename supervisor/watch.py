"""Heartbeat files: a watchdog observer turns file-system events into hints; reading them is the truth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import (
    EVENT_TYPE_CLOSED,
    EVENT_TYPE_CREATED,
    EVENT_TYPE_MODIFIED,
    EVENT_TYPE_MOVED,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from supervisor.core import HeartbeatSeen
from worker.contract import RunLayout, read_json

__all__ = ["HeartbeatChanged", "HeartbeatUnreadable", "HeartbeatWatcher", "read_heartbeat"]


@dataclass(frozen=True)
class HeartbeatChanged:
    """A hint that a rank's heartbeat file may hold a new record (events can be coalesced or lost)."""

    rank: int


_WRITE_EVENTS = {EVENT_TYPE_MOVED, EVENT_TYPE_CREATED, EVENT_TYPE_MODIFIED, EVENT_TYPE_CLOSED}


class _Handler(FileSystemEventHandler):
    def __init__(self, layout: RunLayout, nproc: int, post: Callable[[object], None]) -> None:
        self._paths = {str(layout.heartbeat(rank)): rank for rank in range(nproc)}
        self._post = post

    def on_any_event(self, event: FileSystemEvent) -> None:
        # Only writes count: our own reads raise open/close events, which would feed back forever.
        if event.event_type not in _WRITE_EVENTS:
            return
        # The worker renames a temporary file onto heartbeat.json, so the destination path matters.
        rank = self._paths.get(str(event.dest_path or event.src_path))
        if rank is not None:
            self._post(HeartbeatChanged(rank))


class HeartbeatWatcher:
    """Watches `ranks/` under the run dir and posts HeartbeatChanged hints from the observer thread."""

    def __init__(self, layout: RunLayout, nproc: int, post: Callable[[object], None]) -> None:
        for rank in range(nproc):
            layout.rank_dir(rank).mkdir(parents=True, exist_ok=True)
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.schedule(_Handler(layout, nproc, post), str(layout.root / "ranks"), recursive=True)

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
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HeartbeatUnreadable(f"{path}: missing or bad field {exc}") from None

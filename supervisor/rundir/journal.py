"""The supervisor's JSON-lines journal: every event goes to the run dir and to stderr (systemd's journal).

The file is rotated by size (`events.jsonl` -> `events.1.jsonl` -> ... `events.{JOURNALS_KEPT}.jsonl`, the oldest
dropped), so a run of months or of thousands of nodes keeps a bounded journal; nothing `status`, goodput or the
metrics report depends on it (they live in the state file), and `trainwarden plot` reads every file kept."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Protocol, cast, runtime_checkable

import structlog

from worker.files import open_append, open_dir

__all__ = ["JOURNALS_KEPT", "MAX_JOURNAL_BYTES", "Journal", "append_event", "journal_files", "open_journal"]

MAX_JOURNAL_BYTES = 64 << 20  # a journal file is rotated beyond this; a thousand-node attempt writes about 1 MiB
JOURNALS_KEPT = 4  # rotated files besides the current one


_JSON = structlog.processors.JSONRenderer(default=str)


def _json_line(event_dict: dict[str, Any]) -> str:
    # str: the renderer's serializer is json.dumps (its type says str | bytes, for serializers such as orjson's)
    return cast(str, _JSON(None, "", event_dict)) + "\n"


@runtime_checkable
class EventSink(Protocol):
    """Renders each event for people (`supervisor.observe.console.Console`): given the event, not its JSON line."""

    def event(self, event_dict: dict[str, Any]) -> None: ...


class _TeeLogger:
    """A structlog logger that writes each event, whole, as a JSON line to the journal file and to `echo`
    (a stream gets the same JSON line; an EventSink, the console, renders it for people); it rotates the file
    when it is full."""

    def __init__(self, path: Path, root: Path, echo: IO[str] | EventSink | None, max_bytes: int) -> None:
        self._path, self._root, self._max_bytes = path, root, max_bytes
        self.file = _open(path, root)
        self._echo = echo
        self._lock = threading.Lock()

    def msg(self, **event_dict: Any) -> None:
        line = _json_line(dict(event_dict))
        with self._lock:
            streams = [self.file] if not self._echo or isinstance(self._echo, EventSink) else [self.file, self._echo]
            for stream in streams:
                try:
                    stream.write(line)
                    stream.flush()
                except (OSError, ValueError):  # a closed terminal must not take the supervisor down
                    pass
            if self.file.tell() > self._max_bytes:
                self._rotate()
        if isinstance(self._echo, EventSink):
            self._echo.event(event_dict)

    info = warning = error = critical = debug = msg

    def _rotate(self) -> None:
        """Shift the rotated files one up (the oldest goes), the current one to `.1`, and start a new one; a failure
        leaves the journal growing rather than losing an event."""
        name = self._path.name
        try:
            folder = open_dir(self._root, self._path.parent)  # renamed within it: no symlink on the way is followed
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_rotated(name, JOURNALS_KEPT), dir_fd=folder)
                for number in range(JOURNALS_KEPT - 1, 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(
                            _rotated(name, number), _rotated(name, number + 1), src_dir_fd=folder, dst_dir_fd=folder
                        )
                os.rename(name, _rotated(name, 1), src_dir_fd=folder, dst_dir_fd=folder)
            finally:
                os.close(folder)
            fresh = _open(self._path, self._root)
        except OSError:
            return
        self.file.close()
        self.file = fresh


class Journal:
    """Bound structlog logger plus the file it owns."""

    def __init__(self, logger: Any, tee: _TeeLogger) -> None:
        self.log = logger
        self._tee = tee

    def close(self) -> None:
        self._tee.file.close()


def open_journal(
    path: Path, *, root: Path, echo: IO[str] | EventSink | None = sys.stderr, max_bytes: int = MAX_JOURNAL_BYTES
) -> Journal:
    """Open (append) the journal at `path` inside the run dir `root`, following no symlink; `echo` also
    receives every event (a stream as the same JSON line, an EventSink such as the console rendered for people)."""
    tee = _TeeLogger(path, root, echo, max_bytes)
    logger = structlog.wrap_logger(
        tee,
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
            lambda _logger, _name, event_dict: event_dict,  # handed whole to _TeeLogger.msg, which renders
        ],
    )
    return Journal(logger, tee)


def journal_files(path: Path) -> list[Path]:
    """The journal's files that exist, oldest first: the rotated ones, then the current one."""
    candidates = [path.with_name(_rotated(path.name, number)) for number in range(JOURNALS_KEPT, 0, -1)] + [path]
    return [candidate for candidate in candidates if os.path.lexists(candidate)]


def _rotated(name: str, number: int) -> str:
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.{number}{dot}{suffix}"  # events.1.jsonl


def _open(path: Path, root: Path) -> IO[str]:
    return os.fdopen(open_append(path, root=root), "a", encoding="utf-8")


def append_event(path: Path, *, root: Path, event: str, level: str = "info", **fields: Any) -> None:
    """One event written to the journal by a process other than the supervisor (a node agent), in the
    supervisor's format: one line in one write, so lines of several writers never interleave (O_APPEND)."""
    time = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    line = _json_line({"event": event, **fields, "level": level, "time": time})
    fd = open_append(path, root=root)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
